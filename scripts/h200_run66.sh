#!/usr/bin/env bash
# Device run 66 (qwen3_5-small carried): run 64 with the oracle, after the cost model prices the model drafter's
# accept / catch-up before each of its drafts (commit 976e1a1). Run 64: HVD probed on 3 of 208 agent_loop steps and
# lost 4% (its probes cost about twice their price); the oracle trailed suffix-only in every earlier run.
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=38 run 345 hvd_ab python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile --compile-drafter \
    --compile-verify --dtype bfloat16 --workload agent_loop code_edit tool_calls --methods suffix eagle hvd oracle \
    --gate-sessions 1 --sessions-per-workload 6 --repeats 3 --max-minutes 4.9 --allow-mismatch --out $OUT/ab_qwen
