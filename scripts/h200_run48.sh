#!/usr/bin/env bash
# Device run 48 (falcon_h1-small carried, for its tokenizer): (1) the gated-delta tree kernel reading q/k/v through a
# node stride (no copies of the mixer's split views), compiled, against the references; (2) the ~2B random model
# again, plain vs fused graphs vs stock static+compile, after that change (run 47's profile: 130 copy kernels per
# forward, 54 of them these); (3) the GPU tests of the EAGLE graphs with the fused passes (run 40's and 43's slots
# were too short).
source scripts/h200_env.sh
M=../models/falcon_h1-small
export CUTC=300
TAILN=3 run 90 kernel_tests python3 -m pytest -q tests/test_kernels.py tests/test_kernels_gpu.py -k gated_delta \
    -p no:cacheprovider
TAILN=14 run 220 r2b_fused python3 -m hf_hybrid_spec.bench --model random:qwen3_5-2b --tokenizer $M --dtype bfloat16 \
    --drafters suffix --compiled-only --compile-verify --skip-gate --stock-static --bucket-sweep --num-prompts 2 \
    --prompt-tokens 400 --max-new-tokens 64 --allow-mismatch
TAILN=4 run 200 eagle_graph_tests python3 -m pytest -q tests/test_eagle.py -k "cuda_graphs_eagle or fused" \
    -p no:cacheprovider
