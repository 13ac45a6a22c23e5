#!/usr/bin/env bash
# Device run 56 (qwen3_5-small carried). (1) GPU tests of the one-launch history rows kernel (compiled, and inside the
# captured commit graph: the committed tokens' hidden states handed to drafters, EAGLE graph drafting); (2) HVD as in
# run 54 (same command), after this session's cuts to its per-step cost (host lists, no depth walk, lazy history
# slices, one launch for the history rows); (3) the 2B A/B/C again with the fp32 reference that crashed in run 55
# (the deep copy ran the original bf16 model's mixers: fixed), 3 rounds to fit.
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=4 run 80 gpu_tests python3 -m pytest -q tests/test_host_step.py tests/test_static.py \
    -k "gather_rows or committed_tokens_hidden or eagle_drafts_match" -p no:cacheprovider
TAILN=42 run 270 hvd_fused_verify python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile \
    --compile-drafter --compile-verify --dtype bfloat16 --gate-sessions 1 --sessions-per-workload 3 --repeats 3 \
    --max-minutes 4.2 --allow-mismatch --out $OUT/hvd_qwen
TAILN=10 run 200 ab_2b python3 scripts/ab_parallel_linears.py --model random:qwen3_5-2b --tokenizer $M --rounds 3 \
    --fp32-reference
