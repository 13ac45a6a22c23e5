#!/usr/bin/env bash
# Device run 1 (qwen3_5-small carried): end-to-end speed of speculative vs stock (eager and static+compile),
# fp32 identity on the GPU, the ~2B Qwen3.5-shaped random model, and the tree-kernel benchmark.
source scripts/h200_env.sh
M=../models/qwen3_5-small
run() { local t=$1 name=$2; shift 2; echo "=== $name"; timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"; tail -n 14 "$OUT/$name.log"; }
run 75  gate_fp32   python3 -m hf_hybrid_spec.bench --model $M --dtype float32 --drafters suffix ngram --compiled --num-prompts 4 --max-new-tokens 64 --allow-mismatch --out $OUT/gate_fp32
run 190 qwen_bf16   python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters suffix ngram --compiled --stock-static --num-prompts 8 --prompt-tokens 400 --max-new-tokens 128 --allow-mismatch --skip-gate --out $OUT/qwen_bf16
run 170 random2b    python3 -m hf_hybrid_spec.bench --model random:qwen3_5-2b --dtype bfloat16 --drafters suffix --compiled --stock-static --num-prompts 3 --prompt-tokens 400 --max-new-tokens 128 --allow-mismatch --skip-gate --out $OUT/random2b
run 130 kbench      python3 -m hf_hybrid_spec.kernels.bench_tree_kernels --ops gdn mamba2 --out $OUT/kbench
