#!/usr/bin/env bash
# Device run 18 (qwen3_5-small carried), issue #8 after moving the per-step bookkeeping to the host (stopping
# checks, drafter feeds, tree layout; one device sync per step): (1) the static-path tests on the GPU; (2) where a
# step's time goes now; (3) suffix / ngram + graphs vs stock eager and stock static+compile (run 17's command).
source scripts/h200_env.sh
M=../models/qwen3_5-small
export CUTC=400
TAILN=3 run 150 tests python3 -m pytest -q -x tests/test_static.py -p no:cacheprovider -k cuda_graphs
TAILN=3 run 150 profile python3 scripts/profile_step.py --model $M --dtype bfloat16 --compile --rows 30
TAILN=7 run 200 qwen_graphs python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters suffix ngram \
    --compiled-only --stock-static --skip-gate --num-prompts 8 --prompt-tokens 400 --max-new-tokens 128 \
    --allow-mismatch --bucket-sweep --out $OUT/qwen_graphs
