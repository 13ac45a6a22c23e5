#!/usr/bin/env bash
# Device run 42 (falcon_h1-small carried): run 41 died regenerating (falcon's torch Mamba-2 prefill at 1,024 prompts per
# batch asked for 128 GiB). The same at the config's 512 per batch, fitted to the 350 s of device time left: 4,096
# prompts (half docstring-ended), 300 more steps on the committed tied drafter. Training only; fp32 eval on the CPU.
source scripts/h200_env.sh
F=falcon_h1-small; M=../models/$F
export CUTC=400
TAILN=8 run 290 train_more python3 recipes/train_eagle3.py --config recipes/configs/eagle3_h200.yaml --target $M \
    --output_dir $OUT/$F-eagle3-more --stages regenerate train save --init_from ../../examples/drafters/$F-eagle3 \
    --num_prompts 4096 --docstring_prompts 0.5 --seed 1 --regen_batch_size 512 --max_steps 300 --warmup_steps 20 \
    --max_minutes 1.8
rm -rf $OUT/$F-eagle3-more/checkpoints $OUT/$F-eagle3-more/data $OUT/$F-eagle3-more/drafter
