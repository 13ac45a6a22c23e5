#!/usr/bin/env bash
# Device run 67 (qwen3_5-small carried): where HVD's extra "rest" on tool_calls goes (runs 62-66: +0.10-0.16 ms per
# forward with suffix-only's drafts): prefill, begin / accept / end, draft, verify, other, for suffix-only,
# suffix-only with a model drafter's hidden-state plumbing, and HVD. Static path with CUDA graphs, no Inductor
# (its compiles would not fit the slot left).
source scripts/h200_env.sh
M=../models/qwen3_5-small
TAILN=12 run 190 rest_split python3 ../../scripts/hvd_rest_split.py --model $M --eagle ../../examples/drafters/qwen3_5-small-eagle3 --compile --dtype bfloat16 \
    --workload tool_calls --sessions 4 --repeats 3
