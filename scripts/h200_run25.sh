#!/usr/bin/env bash
# Device run 25 (falcon_h1-small carried): probe of the slow EAGLE steps in run 24's eval_eagle --compile.
source scripts/h200_env.sh
TAILN=14 CUTC=200 run 150 probe python3 scripts/probe_eagle_eval.py ../models/falcon_h1-small ../../examples/drafters/falcon_h1-small-eagle3
