#!/usr/bin/env bash
# Device run 52 (qwen3_5-small carried): the parallel projections of the fused verify forward (fusion.parallel_linears:
# the gated-delta mixer's qkv / z / b / a and the MLPs' gate / up on side streams, parallel branches of the graph).
# (1) GPU tests: side streams eagerly and in a captured graph; the fused path's greedy identity under CUDA graphs on
# both families (now with the parallel MLP forwards); the recurrence test with its reference on the host.
# (2) same-process A/B on the 2B Qwen3.5 shape: fused verify with vs without them, per bucket, against the floor
# (run 48: 2.93 ms = 3.2x at 8 nodes). (3) qwen3_5-small end to end, fused (now parallel) vs plain vs stock.
source scripts/h200_env.sh
M=../models/qwen3_5-small
export CUTC=300
TAILN=6 run 130 gpu_tests python3 -m pytest -q tests/test_fusion.py tests/test_kernels.py \
    -k "side_streams or cuda_graphs or chain_is_the_recurrence" -p no:cacheprovider
TAILN=12 run 200 ab_2b python3 scripts/ab_parallel_linears.py --model random:qwen3_5-2b --tokenizer $M
TAILN=14 run 120 qwen_fused python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters suffix \
    --compiled-only --compile-verify --stock-static --skip-gate --num-prompts 4 --prompt-tokens 400 \
    --max-new-tokens 128 --allow-mismatch --bucket-sweep --out $OUT/qwen_fused
