#!/usr/bin/env bash
# Device run 60 (qwen3_5-small carried): run 58's HVD command again after the HVD fast path (commit 631abdf: the
# learned policy decides "the cache draft wins at any payoff" from a memo before a Step is built; settle without
# dicts; declined probes rechecked every 4 steps). Question: does qwen code_edit (0.981, 0.968-0.992 in run 58) close?
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=42 run 420 hvd_fused_verify python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile \
    --compile-drafter --compile-verify --dtype bfloat16 --gate-sessions 1 --sessions-per-workload 3 --repeats 3 \
    --max-minutes 6.3 --allow-mismatch --out $OUT/hvd_qwen
