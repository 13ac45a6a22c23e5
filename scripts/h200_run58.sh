#!/usr/bin/env bash
# Device run 58 (qwen3_5-small carried): run 56's HVD command again with room to finish. On run 56's machine setup
# and the gate took ~190 s, and the 270 s limit cut the timing at 7 of 12 sessions (--max-minutes counts from the
# start and stops between sessions, so the limit must exceed it by a session and the report). Then the GPU tests
# run 56's 80 s did not reach (both families' committed hidden states through the one-launch history rows).
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=42 run 420 hvd_fused_verify python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile \
    --compile-drafter --compile-verify --dtype bfloat16 --gate-sessions 1 --sessions-per-workload 3 --repeats 3 \
    --max-minutes 6.3 --allow-mismatch --out $OUT/hvd_qwen
TAILN=4 run 125 gpu_tests python3 -m pytest -q tests/test_static.py \
    -k "committed_tokens_hidden or eagle_drafts_match" -p no:cacheprovider
