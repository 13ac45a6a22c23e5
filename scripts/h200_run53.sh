#!/usr/bin/env bash
# Device run 53 (qwen3_5-small carried): HVD on the H200 with compile_verify (now with the parallel projections) and
# compile_drafter, and the paired 90% intervals of HVD against the better single drafter (run 44 had none).
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=45 run 330 hvd_fused_verify python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile \
    --compile-drafter --compile-verify --dtype bfloat16 --gate-sessions 1 --sessions-per-workload 3 --repeats 3 \
    --max-minutes 2.5 --allow-mismatch --out $OUT/hvd_qwen
