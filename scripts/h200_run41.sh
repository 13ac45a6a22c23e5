#!/usr/bin/env bash
# Device run 41 (falcon_h1-small carried): issue #4 on falcon, as run 39 did for qwen. Continue the committed
# tied-head drafter (run 37: 454 steps on 3,072 window prompts) on 6,144 fresh prompts, half of them ending right after
# a function's docstring, 440 steps (falcon trains at ~3.1 steps/s). Training only (the device time left is short): the fp32 evaluation runs on the CPU.
source scripts/h200_env.sh
F=falcon_h1-small; M=../models/$F
export CUTC=400
TAILN=8 run 330 train_more python3 recipes/train_eagle3.py --config recipes/configs/eagle3_h200.yaml --target $M \
    --output_dir $OUT/$F-eagle3-more --stages regenerate train save --init_from ../../examples/drafters/$F-eagle3 \
    --num_prompts 6144 --docstring_prompts 0.5 --seed 1 --regen_batch_size 1024 --max_steps 440 --warmup_steps 20 \
    --max_minutes 2.6
rm -rf $OUT/$F-eagle3-more/checkpoints $OUT/$F-eagle3-more/data $OUT/$F-eagle3-more/drafter
