#!/usr/bin/env bash
# Device run 23 (falcon_h1-small carried): (1) issue #4: train its EAGLE-3 drafter on the H200 (the committed one was
# trained on the CPU); (2) issue #6 HVD on falcon_h1-small with the fixed bench, with the new drafter (the committed
# one if training failed).
source scripts/h200_env.sh
F=falcon_h1-small; M=../models/$F
export CUTC=400
TAILN=6 run 270 train_eagle python3 recipes/train_eagle3.py --config recipes/configs/eagle3_h200.yaml --target $M \
    --output_dir $OUT/$F-eagle3 --stages regenerate train save --max_minutes 2.5
rm -rf $OUT/$F-eagle3/checkpoints $OUT/$F-eagle3/data $OUT/$F-eagle3/drafter
E=$OUT/$F-eagle3/hub; [ -f $E/config.json ] || E=../../examples/drafters/$F-eagle3
echo "drafter: $E"
TAILN=40 run 290 hvd_falcon python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile --dtype bfloat16 \
    --gate-sessions 1 --sessions-per-workload 3 --repeats 3 --max-minutes 3.4 --allow-mismatch --out $OUT/hvd_falcon
