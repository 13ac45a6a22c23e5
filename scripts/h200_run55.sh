#!/usr/bin/env bash
# Device run 55 (next session; qwen3_5-small carried): what run 54 left open. (1) GPU tests of the tree attention at
# the runner level (greedy identity with the kernel in the captured verify forward) and of the routed model forward
# (run 54 ran its model on the CPU); (2) the 2B A/B/C again with every variant's logits against an fp32 copy's plain
# forward (run 54: the kernel variant's bf16 logits differed from the others' by up to 2.2, which flat random
# logits would explain: this settles it); (3) qwen3_5-small end to end with the tree attention in the fused verify.
source scripts/h200_env.sh
M=../models/qwen3_5-small
export CUTC=300
TAILN=4 run 120 gpu_tests python3 -m pytest -q tests/test_tree_attention.py -p no:cacheprovider
TAILN=10 run 240 ab_2b python3 scripts/ab_parallel_linears.py --model random:qwen3_5-2b --tokenizer $M --rounds 5 \
    --fp32-reference
TAILN=14 run 160 qwen_fused python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters suffix \
    --compiled-only --compile-verify --stock-static --skip-gate --num-prompts 8 --prompt-tokens 400 \
    --max-new-tokens 128 --allow-mismatch --bucket-sweep --out $OUT/qwen_fused
