#!/usr/bin/env bash
# Device run 4 (qwen3_5-small carried, no EAGLE checkpoints): the ~2B illegal-access diagnosis and the
# tree-kernel benchmark with room for its correctness gate (~3 min of Triton compiles) and the timings.
source scripts/h200_env.sh
run() { local t=$1 name=$2; shift 2; echo "=== $name"; timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"; tail -n ${TAIL:-40} "$OUT/$name.log"; }
TAIL=60 run 200 diag2b python3 ../../scripts/diag_2b.py
run 330 kbench python3 -m hf_hybrid_spec.kernels.bench_tree_kernels --ops gdn mamba2 --nodes 16 64 128 --out $OUT/kbench
