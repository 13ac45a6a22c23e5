#!/usr/bin/env bash
# Device run 14 (qwen3_5-small carried), issue #5 on the H200: the CPU study's two best self-speculative settings on qwen vs stock
# eager and stock static+compile, bf16, gate first, eager verify and static/graph verify.
source scripts/h200_env.sh
M=../models/qwen3_5-small
python3 - <<'PY'
import os
from hf_hybrid_spec import AssistantConfig as A
o = os.environ["OUT"] + "/cfg"
A(drafter="layerskip", exit_layer=7, max_depth=1).save_pretrained(o + "/ls7k1")
A(drafter="self_ssm", max_depth=1).save_pretrained(o + "/ssmk1")
PY
D=""; for c in ls7k1 ssmk1; do D="$D config:$OUT/cfg/$c"; done
timeout -k 5 150 python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters $D --compiled --stock-static \
    --num-prompts 2 --prompt-tokens 400 --max-new-tokens 128 --allow-mismatch --out $OUT/selfspec_bf16 \
    > $OUT/selfspec_bf16.log 2>&1; echo rc=$?
grep -v "^\[trans\|Loading weights\|falling back" $OUT/selfspec_bf16.log | tail -n 13 | cut -c1-400
rm -rf $OUT/cfg
