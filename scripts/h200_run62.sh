#!/usr/bin/env bash
# Device run 62 (qwen3_5-small carried): run 60 again after the fast path moved its settle into Drafter.overlap
# (commit after 631abdf: in run 60 HVD still drafted +0.03 ms per forward over suffix-only with identical
# decisions; run 60 host was noisy, 90% intervals of +-10%).
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=42 run 420 hvd_fused_verify python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile \
    --compile-drafter --compile-verify --dtype bfloat16 --gate-sessions 1 --sessions-per-workload 3 --repeats 3 \
    --max-minutes 6.3 --allow-mismatch --out $OUT/hvd_qwen
