#!/usr/bin/env bash
# Device run 19 (qwen3_5-small carried; the EAGLE drafter is tracked). Between 18 and this one, two ad-hoc probes
# (scripts/diag_tiny_falcon.py) found the tiny Falcon-H1 static-path fault: the fp32 tree Mamba-2 kernel with 16-wide
# P tiles at BT = 64. (1) the GPU static-path tests, both families; (2) that probe again in fp32; (3) issue #8 qwen
# after the faster suffix trie insertion; (4) issue #6 HVD with graph verification (run 17's command).
source scripts/h200_env.sh
M=../models/qwen3_5-small
export CUTC=300
TAILN=2 run 150 tests python3 -m pytest -q -x tests/test_static.py -p no:cacheprovider -k cuda_graphs
TAILN=2 run 60 tiny_falcon_fp32 python3 scripts/diag_tiny_falcon.py fp32
TAILN=7 run 170 qwen_graphs python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters suffix ngram \
    --compiled-only --stock-static --skip-gate --num-prompts 8 --prompt-tokens 400 --max-new-tokens 128 \
    --allow-mismatch --out $OUT/qwen_graphs
TAILN=8 run 185 hvd_qwen python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle ../../examples/drafters/qwen3_5-small-eagle3 \
    --compile --dtype bfloat16 --gate-sessions 1 --sessions-per-workload 2 --max-minutes 2.4 --allow-mismatch \
    --out $OUT/hvd_qwen
