#!/usr/bin/env bash
# Device run 21 (qwen3_5-small carried; its EAGLE drafter is tracked): (1) the GPU tests of the EAGLE drafter's CUDA
# graphs and of the static runner after its capture moved into graphs.capture; (2) EAGLE draft cost, eager vs graphs;
# (3) issue #6 HVD with the fixed bench (runners sized before timing, median of 3 runs per call).
source scripts/h200_env.sh
M=../models/qwen3_5-small
export CUTC=300
TAILN=3 run 150 graph_tests python3 -m pytest -q -x tests/test_eagle.py tests/test_static.py -p no:cacheprovider -k cuda_graphs
TAILN=7 run 90 eagle_timing python3 scripts/time_eagle_draft.py --model $M \
    --drafter ../../examples/drafters/qwen3_5-small-eagle3 --dtype bfloat16 --num-prompts 3 --max-new-tokens 64
TAILN=12 run 290 hvd_qwen python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle ../../examples/drafters/qwen3_5-small-eagle3 \
    --compile --dtype bfloat16 --gate-sessions 1 --sessions-per-workload 2 --repeats 3 --max-minutes 2.5 \
    --allow-mismatch --out $OUT/hvd_qwen
