#!/usr/bin/env bash
# Device run 12 (nvidia-h200-x2, falcon_h1-small carried for its tokenizer, the same as qwen3_5-small's):
# (1) is the bf16 gate failure of the random ~1.4B Falcon-H1-shaped model split over 2 GPUs rounding or a bug?
#     the same gate in fp32; (2) the ~2B Qwen3.5-shaped model split over 2 GPUs, shorter; (3) run 9 on cuda:0.
source scripts/h200_env.sh
M=../models/falcon_h1-small
export TAILN=6
export CUTC=700
B="python3 -m hf_hybrid_spec.bench --drafters suffix --prompt-tokens 400 --max-new-tokens 64 --num-prompts 2 --tokenizer $M"
run 150 falcon2b_split_fp32 $B --model random:falcon_h1-1.5b --dtype float32 --device-map cuda:0,cuda:1 \
    --out $OUT/falcon2b_split_fp32
run 170 qwen2b_split $B --model random:qwen3_5-2b --dtype bfloat16 --device-map cuda:0,cuda:1 --allow-mismatch \
    --out $OUT/qwen2b_split
# (3) run 9: graph replay after stock static+compile in the same process (the cuBLAS-workspace fix), one GPU.
CUDA_VISIBLE_DEVICES=0 run 170 r2b_fix python3 -m hf_hybrid_spec.bench --model random:qwen3_5-2b --tokenizer $M \
    --dtype bfloat16 --drafters suffix --compiled-only --skip-gate --stock-static --bucket-sweep --num-prompts 2 \
    --prompt-tokens 400 --max-new-tokens 64 --allow-mismatch --out $OUT/r2b_fix
