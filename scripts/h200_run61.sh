#!/usr/bin/env bash
# Device run 61 (falcon_h1-small carried): run 59 again after the HVD fast path (commit 631abdf), as run 60 for
# qwen: same command as run 59.
source scripts/h200_env.sh
F=falcon_h1-small; M=../models/$F; E=../../examples/drafters/$F-eagle3
export CUTC=300
TAILN=42 run 318 hvd_fused_verify python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile \
    --compile-drafter --compile-verify --dtype bfloat16 --gate-sessions 1 --sessions-per-workload 3 --repeats 3 \
    --max-minutes 4.5 --allow-mismatch --out $OUT/hvd_falcon
