#!/usr/bin/env bash
# Device run 71 (falcon_h1-small carried): run 70's agentic part in the balanced method order (commit after run 70),
# short (the session's last device minutes): does falcon code_edit's 0.955 (identical drafts, HVD always run right
# after the threshold policy) repeat when no method has a fixed predecessor? The gate ran in runs 69-70 on the same
# drafting code; the order change leaves outputs alone, so it is skipped here.
source scripts/h200_env.sh
F=falcon_h1-small; M=../models/$F; E=../../examples/drafters/$F-eagle3
export CUTC=300
TAILN=30 run 290 hvd_balanced python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile \
    --compile-drafter --compile-verify --dtype bfloat16 --skip-gate --workload code_edit tool_calls agent_loop \
    --methods suffix eagle threshold hvd --sessions-per-workload 6 --repeats 3 --max-minutes 4.1 --out $OUT/hvd_falcon
