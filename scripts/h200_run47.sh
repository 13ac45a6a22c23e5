#!/usr/bin/env bash
# Device run 47 (falcon_h1-small carried): (1) the GPU tests of compile_verify (run 46's 140 s slot ended inside the
# Inductor compiles); (2) falcon_h1-small, plain graphs vs fused graphs vs stock static+compile, same run; (3) a kernel
# profile of the fused 8-node verify of the ~2B random model (what is left between 3.3x and the 3x floor target).
source scripts/h200_env.sh
M=../models/falcon_h1-small
export CUTC=300
TAILN=4 run 170 fusion_cuda_tests python3 -m pytest -q tests/test_fusion.py -k cuda -p no:cacheprovider
TAILN=12 run 170 falcon_fused python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters suffix \
    --compiled-only --compile-verify --stock-static --skip-gate --num-prompts 8 --prompt-tokens 400 \
    --max-new-tokens 128 --allow-mismatch --bucket-sweep --out $OUT/falcon_fused
TAILN=30 CUTC=130 run 150 r2b_profile python3 scripts/profile_verify.py --model random:qwen3_5-2b --tokenizer $M --fuse \
    --rows 26
