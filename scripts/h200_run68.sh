#!/usr/bin/env bash
# Device run 68 (qwen3_5-small carried): run 66 again on commit 98d679f's catch-up timing (the catch-up timed with
# the draft after it). Run 67's rest split found no extra per-call time in HVD on tool_calls (suffix / hvd per call:
# median 1.009 over 36 calls), so this asks whether run 66's tool_calls 0.935 repeats.
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=38 run 420 hvd_ab python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile --compile-drafter \
    --compile-verify --dtype bfloat16 --workload agent_loop code_edit tool_calls --methods suffix eagle hvd oracle \
    --gate-sessions 1 --sessions-per-workload 6 --repeats 3 --max-minutes 5.6 --allow-mismatch --out $OUT/ab_qwen
