#!/usr/bin/env bash
# Device run 15 (qwen3_5-small carried): (1) issue #5 on the H200, qwen half: the CPU study's settings
# (layerskip E=7 k=1, self_ssm k=1) + graph verify vs stock eager and stock static+compile; (2) issue #8, the ~2B
# Qwen3.5-shaped random model side by side with stock static+compile (prompts of exactly 400 tokens, so stock
# compiles once), bucket sweep; (3) where a 2B step's GPU time goes.
source scripts/h200_env.sh
M=../models/qwen3_5-small
python3 - <<'PY'
import os
from hf_hybrid_spec import AssistantConfig as A
o = os.environ["OUT"] + "/cfg"
A(drafter="layerskip", exit_layer=7, max_depth=1).save_pretrained(o + "/ls7k1")
A(drafter="self_ssm", max_depth=1).save_pretrained(o + "/ssmk1")
PY
run 200 selfspec_qwen python3 -m hf_hybrid_spec.bench --model $M --dtype bfloat16 --drafters config:$OUT/cfg/ls7k1 \
    config:$OUT/cfg/ssmk1 --compiled --stock-static --num-prompts 4 --prompt-tokens 400 --max-new-tokens 128 \
    --allow-mismatch --out $OUT/selfspec_qwen
run 200 r2b python3 -m hf_hybrid_spec.bench --model random:qwen3_5-2b --tokenizer $M --dtype bfloat16 --drafters suffix \
    --compiled-only --skip-gate --stock-static --bucket-sweep --num-prompts 3 --prompt-tokens 400 --max-new-tokens 64 \
    --allow-mismatch --out $OUT/r2b
TAILN=3 run 120 profile_2b python3 scripts/profile_step.py --model random:qwen3_5-2b --tokenizer $M --dtype bfloat16 \
    --compile --max-new-tokens 24 --rows 40
rm -rf $OUT/cfg
