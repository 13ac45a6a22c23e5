#!/usr/bin/env bash
# Device run 70 (falcon_h1-small carried): the whole suite (plain_code too) with every method (threshold too) on
# the current code, as the issue asks for one run; run 61's command with up to 6 held-out sessions per workload.
source scripts/h200_env.sh
F=falcon_h1-small; M=../models/$F; E=../../examples/drafters/$F-eagle3
export CUTC=300
TAILN=44 run 540 hvd_suite python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile \
    --compile-drafter --compile-verify --dtype bfloat16 --gate-sessions 1 --sessions-per-workload 6 --repeats 3 \
    --max-minutes 6 --allow-mismatch --out $OUT/hvd_falcon
