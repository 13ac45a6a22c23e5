#!/usr/bin/env bash
# Device run 22 (qwen3_5-small carried): issue #6 HVD again after cutting its per-step host work (predictor on the
# host in numpy, one-pass tree shape); the table now splits each method's step into draft / verify / rest.
source scripts/h200_env.sh
M=../models/qwen3_5-small
export CUTC=300
TAILN=40 run 330 hvd_qwen python3 -m hf_hybrid_spec.hvd.bench --model $M \
    --eagle ../../examples/drafters/qwen3_5-small-eagle3 --compile --dtype bfloat16 --gate-sessions 1 \
    --sessions-per-workload 3 --repeats 3 --max-minutes 4.2 --allow-mismatch --out $OUT/hvd_qwen
