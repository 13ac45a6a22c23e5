#!/usr/bin/env bash
# Device run 3 (qwen3_5-small carried; its H200-trained EAGLE drafter in the working tree): tree-kernel
# benchmark, every drafter vs stock eager and stock static+compile, and the ~2B Qwen3.5-shaped random model.
source scripts/h200_env.sh
M=../models/qwen3_5-small; D=../../examples/drafters/qwen3_5-small-eagle3
run() { local t=$1 name=$2; shift 2; echo "=== $name"; timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"; tail -n 24 "$OUT/$name.log"; }
run 185 kbench python3 -m hf_hybrid_spec.kernels.bench_tree_kernels --ops gdn mamba2 --nodes 16 64 128 --out $OUT/kbench
run 190 qwen_bf16 python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters suffix ngram eagle:$D \
    eagle:$D:chain layerskip:4 --compiled --stock-static --skip-gate --num-prompts 4 --prompt-tokens 400 \
    --max-new-tokens 128 --allow-mismatch --out $OUT/qwen_bf16
run 165 random2b python3 -m hf_hybrid_spec.bench --model random:qwen3_5-2b --dtype bfloat16 --drafters suffix \
    --compiled --stock-static --skip-gate --num-prompts 2 --prompt-tokens 400 --max-new-tokens 128 \
    --allow-mismatch --out $OUT/random2b
