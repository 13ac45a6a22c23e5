#!/usr/bin/env bash
# Device run 26 (falcon_h1-small carried): run 24's eval_eagle --compile at small size, with the step split, to find
# where its slow EAGLE steps go (run 25's probe timed them fast outside eval_eagle).
source scripts/h200_env.sh
TAILN=8 CUTC=200 run 100 eval python3 recipes/eval_eagle.py --model ../models/falcon_h1-small \
    --drafter ../../examples/drafters/falcon_h1-small-eagle3 --prompt-sets code --num-prompts 3 --max-new-tokens 64 \
    --dtype bfloat16 --compile --allow-mismatch
