#!/usr/bin/env bash
# Device run 17 (qwen3_5-small + its EAGLE drafter carried): after run 16's fixes (host-side cache drafts, HVD
# probes within a time budget): (1) issue #8 qwen, suffix / ngram + graphs vs stock eager and stock
# static+compile; (2) issue #6 HVD with graph verification; (3) issue #8, the ~2B random model side by side.
source scripts/h200_env.sh
M=../models/qwen3_5-small
TAILN=7 run 170 qwen_graphs python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters suffix ngram \
    --compiled-only --stock-static --skip-gate --num-prompts 8 --prompt-tokens 400 --max-new-tokens 128 \
    --allow-mismatch --bucket-sweep --out $OUT/qwen_graphs
TAILN=8 run 230 hvd_qwen python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle ../drafters/qwen3_5-small-eagle3 \
    --compile --dtype bfloat16 --gate-sessions 1 --sessions-per-workload 2 --max-minutes 3.2 --allow-mismatch \
    --out $OUT/hvd_qwen
TAILN=9 run 150 r2b python3 -m hf_hybrid_spec.bench --model random:qwen3_5-2b --tokenizer $M --dtype bfloat16 \
    --drafters suffix --compiled-only --skip-gate --stock-static --bucket-sweep --num-prompts 2 --prompt-tokens 400 \
    --max-new-tokens 64 --allow-mismatch --out $OUT/r2b
