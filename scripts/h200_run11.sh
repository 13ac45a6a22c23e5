#!/usr/bin/env bash
# Device run 11 (nvidia-h200-x2, falcon_h1-small carried), issue #7: the multi-device tests, then speculative decoding with the target split
# over two GPUs (device_map, pipeline placement) vs stock greedy on the same split, gate first; a trained
# Falcon-H1 fixture (the layers in halves) and ~2B random Qwen3.5- and Falcon-H1-shaped models.
source scripts/h200_env.sh
M=../models/falcon_h1-small
export TAILN=7
export CUTC=600
run 170 tests python3 -m pytest -q -p no:cacheprovider tests/test_multi_device.py
B="python3 -m hf_hybrid_spec.bench --dtype bfloat16 --drafters suffix --prompt-tokens 400 --max-new-tokens 128"
run 120 falcon_split $B --model $M --device-map cuda:0,cuda:1 --num-prompts 3 --out $OUT/falcon_split
run 110 qwen2b_split $B --model random:qwen3_5-2b --tokenizer $M --device-map cuda:0,cuda:1 --num-prompts 2 \
    --out $OUT/qwen2b_split
run 110 falcon2b_split $B --model random:falcon_h1-1.5b --tokenizer $M --device-map cuda:0,cuda:1 --num-prompts 2 \
    --out $OUT/falcon2b_split
