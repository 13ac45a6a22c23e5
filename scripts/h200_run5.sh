#!/usr/bin/env bash
# Device run 5 (qwen3_5-small and its EAGLE drafter carried): every drafter, eager and with graphs, vs stock
# eager and stock static+compile; then the fp32 identity gate at the ~2B shapes.
source scripts/h200_env.sh
M=../models/qwen3_5-small; D=../../examples/drafters/qwen3_5-small-eagle3
run() { local t=$1 name=$2; shift 2; echo "=== $name"; timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"; tail -n ${TAIL:-30} "$OUT/$name.log"; }
run 400 qwen_bf16 python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters suffix ngram eagle:$D \
    eagle:$D:chain --compiled --stock-static --skip-gate --num-prompts 6 --prompt-tokens 400 \
    --max-new-tokens 128 --allow-mismatch --out $OUT/qwen_bf16
TAIL=8 run 150 gate2b_fp32 python3 -m hf_hybrid_spec.bench --model random:qwen3_5-2b --dtype float32 --drafters suffix \
    --compiled --num-prompts 1 --prompt-tokens 400 --max-new-tokens 48 --allow-mismatch --out $OUT/gate2b_fp32
