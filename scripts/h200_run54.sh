#!/usr/bin/env bash
# Device run 54 (qwen3_5-small carried), the session's last device minutes: (1) GPU tests of the tree-attention
# kernel (bf16 included: the interpreter cannot check it) and the parallel projections; (2) same-process A/B/C of
# the 2B Qwen3.5 shape's fused verify: as before / + parallel projections / + tree attention; (3) HVD with
# compile_verify + compile_drafter and the paired intervals (run 53 timed nothing: --max-minutes counts from the
# start, and setup took it all).
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=4 run 70 gpu_tests python3 -m pytest -q tests/test_tree_attention.py tests/test_fusion.py tests/test_kernels.py \
    -k "tree_attention or routed_attention or kernel_applies or side_streams or chain_is_the_recurrence" \
    -p no:cacheprovider
TAILN=9 run 200 ab_2b python3 scripts/ab_parallel_linears.py --model random:qwen3_5-2b --tokenizer $M --rounds 5
TAILN=42 run 270 hvd_fused_verify python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile \
    --compile-drafter --compile-verify --dtype bfloat16 --gate-sessions 1 --sessions-per-workload 3 --repeats 3 \
    --max-minutes 4.2 --allow-mismatch --out $OUT/hvd_qwen
