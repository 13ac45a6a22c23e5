#!/usr/bin/env bash
# Device run 44 (next session; qwen3_5-small carried): HVD with the fused EAGLE passes (compile_drafter): with the
# model draft at ~1.25 instead of ~2.1 ms, do the model and merged options (and the oracle) beat suffix-only on the
# agentic workloads? The warm-up's compiles take ~2 min before anything is timed.
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=40 run 560 hvd_fused python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile --compile-drafter \
    --dtype bfloat16 --gate-sessions 1 --sessions-per-workload 3 --repeats 3 --max-minutes 3.5 --allow-mismatch \
    --out $OUT/hvd_qwen
