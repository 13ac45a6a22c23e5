#!/usr/bin/env bash
# Device run 57 (falcon_h1-small carried): Falcon-H1 has attention in every layer, so the tree-attention kernel should
# matter most there (run 51: the 1.4B Falcon-H1 shape's fused 8-node verify at 6.4x its floor). (1) falcon_h1-small
# end to end with the whole fused verify; (2) the 1.4B shape's A/B/C (fused / + parallel projections / + tree
# attention) with the fp32 reference; (3) the runner-level tree-attention GPU tests run 55 ran out of time for.
source scripts/h200_env.sh
M=../models/falcon_h1-small
export CUTC=300
TAILN=12 run 170 falcon_fused python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters suffix \
    --compiled-only --compile-verify --stock-static --skip-gate --num-prompts 8 --prompt-tokens 400 \
    --max-new-tokens 128 --allow-mismatch --bucket-sweep --out $OUT/falcon_fused
TAILN=10 run 200 ab_1b4 python3 scripts/ab_parallel_linears.py --model random:falcon_h1-1.5b --tokenizer $M --rounds 3 \
    --fp32-reference
TAILN=4 run 170 gpu_tests python3 -m pytest -q tests/test_tree_attention.py -k "compile_verify or routed_attention" \
    -p no:cacheprovider
