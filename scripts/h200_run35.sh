#!/usr/bin/env bash
# Device run 35 (qwen3_5-small carried): (1) issue #3, the kernel bench timed as CUDA-graph replays (the static
# runner's way of running the kernels; run 4's do_bench rows at B = 1 looked launch-bound, Mamba-2 3.07x vs 4x);
# (2) the GPU variant of the hidden-state history test; (3) issue #6 HVD on qwen3_5-small after the verify forward
# stopped handing hidden states to the host (run 30's command).
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=400
TAILN=40 run 170 kbench_graph python3 -m hf_hybrid_spec.kernels.bench_tree_kernels --cuda-graph --ops mamba2 gdn \
    --batch 1 8 32 --nodes 16 64 --out $OUT/kbench_graph
TAILN=3 run 100 history_test python3 -m pytest -q tests/test_static.py -p no:cacheprovider \
    -k "committed_tokens_hidden_states or cuda_graphs"
TAILN=40 run 270 hvd_qwen python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile --dtype bfloat16 \
    --gate-sessions 1 --sessions-per-workload 3 --repeats 3 --max-minutes 3.0 --allow-mismatch --out $OUT/hvd_qwen
