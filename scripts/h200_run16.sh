#!/usr/bin/env bash
# Device run 16 (qwen3_5-small + its EAGLE drafter carried): after the commit graph (run 14), the garbage-collector-
# free suffix trie and the bench's stock static+compile warmed after our routing: (1) CUDA-graph tests on the GPU;
# (2) issue #8, suffix / ngram + graphs vs stock eager and stock static+compile, prompts of exactly 400 tokens;
# (3) issue #6, HVD on the H200 with graph verification (`--compile`), held-out sessions.
source scripts/h200_env.sh
M=../models/qwen3_5-small
TAILN=3 run 90 tests python3 -m pytest -q -x tests/test_static.py -k cuda_graphs -p no:cacheprovider
TAILN=6 run 170 qwen_graphs python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters suffix ngram \
    --compiled-only --stock-static --skip-gate --num-prompts 8 --prompt-tokens 400 --max-new-tokens 128 \
    --allow-mismatch --bucket-sweep --out $OUT/qwen_graphs
TAILN=22 run 300 hvd_qwen python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle ../drafters/qwen3_5-small-eagle3 \
    --compile --dtype bfloat16 --gate-sessions 1 --sessions-per-workload 3 --max-minutes 4.3 --allow-mismatch \
    --out $OUT/hvd_qwen
