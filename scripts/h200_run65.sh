#!/usr/bin/env bash
# Device run 65 (falcon_h1-small carried): run 64 on falcon_h1-small.
source scripts/h200_env.sh
M=../models/falcon_h1-small; E=../../examples/drafters/falcon_h1-small-eagle3
export CUTC=300
TAILN=34 run 340 hvd_ab python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile --compile-drafter \
    --compile-verify --dtype bfloat16 --workload agent_loop code_edit tool_calls --methods suffix eagle hvd \
    --gate-sessions 1 --sessions-per-workload 6 --repeats 3 --max-minutes 4.8 --allow-mismatch --out $OUT/ab_falcon
