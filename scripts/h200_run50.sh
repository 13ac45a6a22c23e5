#!/usr/bin/env bash
# Ran at commit b9495a4 (its kernels/gemm and scripts/gemm_skinny_bench.py were reverted after this run: the kernel
# tied cuBLAS per shape and made the fused verify slower; see docs/benchmarks.md, run 50).
# Device run 50 (qwen3_5-small carried): the skinny GEMM (kernels/gemm) on the GPU. (1) its tests and the real-size
# kernel tests (not run since the gated-delta kernel's node strides and V tiles); (2) cuBLAS vs our kernel per weight
# shape of the 2B Qwen3.5 shape (sweep of launch configurations); (3) the 2B shape end to end: fused verify with the
# skinny GEMM vs with cuBLAS vs stock static+compile, per bucket against the weight floor (run 48: 2.93 ms = 3.2x).
source scripts/h200_env.sh
M=../models/qwen3_5-small
export CUTC=300
TAILN=6 run 130 gpu_tests python3 -m pytest -q tests/test_skinny_gemm.py tests/test_kernels_gpu.py tests/test_kernels.py \
    -p no:cacheprovider
TAILN=30 run 170 gemm_sweep python3 scripts/gemm_skinny_bench.py --models qwen2b --rows 9 33 --out $OUT/gemm
TAILN=22 run 270 r2b_gemm python3 -m hf_hybrid_spec.bench --model random:qwen3_5-2b --tokenizer $M --dtype bfloat16 \
    --drafters suffix --compiled-only --compile-verify --skip-gate --stock-static --bucket-sweep --num-prompts 2 \
    --prompt-tokens 400 --max-new-tokens 64 --allow-mismatch --out $OUT/r2b
