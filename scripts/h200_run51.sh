#!/usr/bin/env bash
# Device run 51 (next session; falcon_h1-small carried): the Mamba-2 launcher now reads x / B / C / dt through their
# node strides (no copies of the mixer's split views; interpreter-tested only when written). (1) the kernel tests
# compiled on the GPU; (2) falcon_h1-small plain vs fused graphs vs stock static+compile, as run 47 (verify replay
# there: 1.60 plain / 1.32 fused ms at 8 nodes); (3) the ~1.4B Falcon-H1-shaped random model, same comparison; (4) the
# EAGLE graph test with the fused passes for falcon_h1 (run 50 takes qwen3_5's).
source scripts/h200_env.sh
M=../models/falcon_h1-small
export CUTC=300
TAILN=3 run 100 kernel_tests python3 -m pytest -q tests/test_kernels.py -k "mamba2 or node_strided" \
    -p no:cacheprovider
TAILN=12 run 160 falcon_fused python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters suffix \
    --compiled-only --compile-verify --stock-static --skip-gate --num-prompts 8 --prompt-tokens 400 \
    --max-new-tokens 128 --allow-mismatch --bucket-sweep --out $OUT/falcon_fused
TAILN=14 run 200 r15b_fused python3 -m hf_hybrid_spec.bench --model random:falcon_h1-1.5b --tokenizer $M \
    --dtype bfloat16 --drafters suffix --compiled-only --compile-verify --skip-gate --stock-static --bucket-sweep \
    --num-prompts 2 --prompt-tokens 400 --max-new-tokens 64 --allow-mismatch
TAILN=4 run 120 eagle_graph_tests python3 -m pytest -q tests/test_eagle.py -k "cuda_graphs_eagle and falcon_h1" \
    -p no:cacheprovider
