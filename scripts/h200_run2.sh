#!/usr/bin/env bash
# Device run 2 (qwen3_5-small carried): train the EAGLE-3 drafter on the H200, then time every drafter against
# stock eager and stock static+compile in one process (bf16, 400-token prompts, 128 new tokens).
source scripts/h200_env.sh
F=qwen3_5-small; M=../models/$F
run() { local t=$1 name=$2; shift 2; echo "=== $name"; timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"; tail -n 16 "$OUT/$name.log"; }
run 330 train_eagle python3 recipes/train_eagle3.py --config recipes/configs/eagle3_h200.yaml --target $M \
    --output_dir $OUT/$F-eagle3 --stages regenerate train save --max_minutes 3
rm -rf $OUT/$F-eagle3/checkpoints $OUT/$F-eagle3/data $OUT/$F-eagle3/drafter
run 215 qwen_bf16 python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters suffix ngram \
    eagle:$OUT/$F-eagle3/hub eagle:$OUT/$F-eagle3/hub:chain layerskip:4 --compiled --stock-static \
    --num-prompts 6 --prompt-tokens 400 --max-new-tokens 128 --allow-mismatch --out $OUT/qwen_bf16
tar czf $OUT/triton_cache.tgz -C ~/.triton cache 2>/dev/null; ls -la $OUT
