#!/usr/bin/env bash
# Device run 6 (qwen3_5-small and its EAGLE drafter carried): graphs-path drafters vs stock static+compile
# with the runner cache fixed (run 5 recaptured graphs on every drafter switch), per-bucket verify forwards;
# then the ~2B Qwen3.5-shaped random model on code prompts (the fixture's tokenizer), blocking launches on a crash.
source scripts/h200_env.sh
M=../models/qwen3_5-small; D=../../examples/drafters/qwen3_5-small-eagle3
run() { local t=$1 name=$2; shift 2; echo "=== $name"; timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; echo "rc=$rc"; tail -n ${TAIL:-16} "$OUT/$name.log"; return $rc; }
run 230 qwen_graphs python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters suffix ngram eagle:$D \
    --compiled-only --stock-static --skip-gate --bucket-sweep --num-prompts 8 --prompt-tokens 400 \
    --max-new-tokens 128 --allow-mismatch --out $OUT/qwen_graphs
B2="--model random:qwen3_5-2b --tokenizer $M --dtype bfloat16 --drafters suffix --compiled-only --stock-static --skip-gate --prompt-tokens 400 --max-new-tokens 128 --allow-mismatch"
run 200 random2b python3 -m hf_hybrid_spec.bench $B2 --bucket-sweep --num-prompts 3 --out $OUT/random2b || \
  CUDA_LAUNCH_BLOCKING=1 TAIL=40 run 120 random2b_blocking python3 -m hf_hybrid_spec.bench $B2 --num-prompts 1
