#!/usr/bin/env bash
# Device run 64 (qwen3_5-small carried): HVD against the single drafters only, on the agentic workloads, with every
# held-out session (6 per workload: twice runs 58-62's calls), after quick_cache weighs the probe budget itself
# (commit ec78977). Runs 62-63 measured HVD and suffix-only identical in drafts but moving by +-10% per call on a slow
# host; the question is the paired ratio to within ~2%.
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=34 run 340 hvd_ab python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile --compile-drafter \
    --compile-verify --dtype bfloat16 --workload agent_loop code_edit tool_calls --methods suffix eagle hvd \
    --gate-sessions 1 --sessions-per-workload 6 --repeats 3 --max-minutes 4.8 --allow-mismatch --out $OUT/ab_qwen
