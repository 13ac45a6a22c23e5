#!/usr/bin/env bash
# Device run 69 (falcon_h1-small carried): run 68 on falcon_h1-small (replaces run 65, which never ran: the same
# bench with the oracle and run 68's time slot).
source scripts/h200_env.sh
M=../models/falcon_h1-small; E=../../examples/drafters/falcon_h1-small-eagle3
export CUTC=300
TAILN=38 run 420 hvd_ab python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile --compile-drafter \
    --compile-verify --dtype bfloat16 --workload agent_loop code_edit tool_calls --methods suffix eagle hvd oracle \
    --gate-sessions 1 --sessions-per-workload 6 --repeats 3 --max-minutes 5.6 --allow-mismatch --out $OUT/ab_falcon
