#!/usr/bin/env bash
# Device run 34 (next session; any fixture carried, only the kernels run): issue #3 timed as the static runner runs the
# kernels, inside CUDA graphs. At B = 1 the do_bench rows of run 4 look launch-bound (ours and branch-by-branch both
# ~42 us at N = 16 and flat in N for ours), which is where Mamba-2 missed the 4x target (3.07x).
source scripts/h200_env.sh
export CUTC=400
TAILN=60 run 400 kbench_graph python3 -m hf_hybrid_spec.kernels.bench_tree_kernels --cuda-graph --ops gdn mamba2 \
    --nodes 16 64 128 --out $OUT/kbench_graph
