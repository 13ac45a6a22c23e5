#!/usr/bin/env bash
# Device run 20 (qwen3_5-small carried; its EAGLE drafter is tracked): the EAGLE drafter with static storage and
# CUDA-graph tree expansion (compile=True), and the runner's capture through graphs.capture. (1) the GPU tests of
# both; (2) draft cost per step, eager vs graphs.
source scripts/h200_env.sh
export CUTC=300
TAILN=3 run 150 graph_tests python3 -m pytest -q -x tests/test_eagle.py tests/test_static.py -p no:cacheprovider -k cuda_graphs
TAILN=7 run 110 eagle_timing python3 scripts/time_eagle_draft.py --model ../models/qwen3_5-small \
    --drafter ../../examples/drafters/qwen3_5-small-eagle3 --dtype bfloat16 --num-prompts 3 --max-new-tokens 64
