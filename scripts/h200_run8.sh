#!/usr/bin/env bash
# Device run 8 (falcon_h1-small carried): graphs-path suffix and ngram vs stock eager and static+compile.
source scripts/h200_env.sh
M=../models/falcon_h1-small
timeout -k 5 230 python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters suffix ngram --compiled-only \
    --stock-static --skip-gate --bucket-sweep --num-prompts 6 --prompt-tokens 400 --max-new-tokens 128 \
    --allow-mismatch --out $OUT/falcon_graphs > $OUT/falcon_graphs.log 2>&1; echo rc=$?
grep -v "^\[trans" $OUT/falcon_graphs.log | tail -n 14 | cut -c1-400
