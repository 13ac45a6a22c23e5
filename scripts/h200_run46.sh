#!/usr/bin/env bash
# Device run 46 (qwen3_5-small carried): compile_verify, the target's norms / MLPs / gate math fused by Inductor inside
# the captured verify forward (issue #8). (1) its GPU tests; (2) qwen3_5-small, plain graphs vs fused graphs vs stock
# static+compile, same run, with the verify bucket sweep of both runners; (3) the same on the ~2B Qwen3.5-shaped random
# model (weight floor target: the verify forward within 3x of the weight-bytes floor).
source scripts/h200_env.sh
M=../models/qwen3_5-small
export CUTC=300
TAILN=3 run 140 fusion_tests python3 -m pytest -q tests/test_fusion.py -p no:cacheprovider
TAILN=12 run 170 qwen_fused python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters suffix \
    --compiled-only --compile-verify --stock-static --skip-gate --num-prompts 8 --prompt-tokens 400 \
    --max-new-tokens 128 --allow-mismatch --bucket-sweep --out $OUT/qwen_fused
TAILN=14 run 240 r2b_fused python3 -m hf_hybrid_spec.bench --model random:qwen3_5-2b --tokenizer $M --dtype bfloat16 \
    --drafters suffix --compiled-only --compile-verify --skip-gate --stock-static --bucket-sweep --num-prompts 2 \
    --prompt-tokens 400 --max-new-tokens 64 --allow-mismatch --out $OUT/r2b
