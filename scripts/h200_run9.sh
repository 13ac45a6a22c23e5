#!/usr/bin/env bash
# Device run 9: the ~2B graph-replay crash after stock static+compile, with the cuBLAS-workspace fix.
source scripts/h200_env.sh > /dev/null 2>&1
M=../models/qwen3_5-small
timeout -k 5 140 python3 -m hf_hybrid_spec.bench --model random:qwen3_5-2b --tokenizer $M --dtype bfloat16 --drafters suffix \
    --compiled-only --skip-gate --stock-static --bucket-sweep --num-prompts 2 --prompt-tokens 400 --max-new-tokens 64 \
    --allow-mismatch --out $OUT/r2b_fix > $OUT/r2b_fix.log 2>&1; echo rc=$?
grep -v "^\[trans" $OUT/r2b_fix.log | tail -n 12 | cut -c1-300
