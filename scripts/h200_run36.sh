#!/usr/bin/env bash
# Device run 36 (falcon_h1-small carried): issue #6 HVD on falcon_h1-small after the verify forward stopped handing
# hidden states to the host (run 31's command).
source scripts/h200_env.sh
M=../models/falcon_h1-small; E=../../examples/drafters/falcon_h1-small-eagle3
export CUTC=400
TAILN=40 run 300 hvd_falcon python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile --dtype bfloat16 \
    --gate-sessions 1 --sessions-per-workload 3 --repeats 3 --max-minutes 3.4 --allow-mismatch --out $OUT/hvd_falcon
