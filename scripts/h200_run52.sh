#!/usr/bin/env bash
# Device run 52 (qwen3_5-small carried): (1) qwen3_5-small with the skinny GEMM in the fused verify vs cuBLAS vs stock
# static+compile (run 46: fused 0.55 ms/token = 3.15x); (2) HVD with compile_verify + compile_drafter and the paired
# 90% intervals against the better single drafter (run 44 had no intervals).
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=16 run 150 qwen_gemm python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters suffix \
    --compiled-only --compile-verify --stock-static --skip-gate --num-prompts 8 --prompt-tokens 400 \
    --max-new-tokens 128 --allow-mismatch --bucket-sweep --out $OUT/qwen_gemm
TAILN=40 run 340 hvd_fused_verify python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile \
    --compile-drafter --compile-verify --dtype bfloat16 --gate-sessions 1 --sessions-per-workload 3 --repeats 3 \
    --max-minutes 2.5 --allow-mismatch --out $OUT/hvd_qwen
