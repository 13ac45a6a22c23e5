#!/usr/bin/env bash
# Device run 10 (nvidia-h200-x2, qwen3_5-small carried), issue #7: identity with the target split over two GPUs,
# and the EAGLE-3 recipe on 1 GPU vs 2 GPUs (DDP) vs 2 GPUs with the frozen target sharded (FSDP2), same data.
source scripts/h200_env.sh
F=qwen3_5-small; M=../models/$F
python3 -c "import torch; print('gpus', torch.cuda.device_count())"; env | grep -E "NCCL_NVLS|MULTICAST|NVSHMEM_DISABLE"
export TAILN=8
export CUTC=400
run 200 tests python3 -m pytest -q -x -p no:cacheprovider tests/test_multi_device.py
# Global batch 32 in every run: 32 on one GPU, 16 per GPU on two.
C="--config recipes/configs/eagle3_h200.yaml --target $M --num_prompts 1024 --heldout_prompts 8 --max_steps 120
   --warmup_steps 10 --max_minutes 3 --save_every 1000 --log_every 10"
run 120 regen python3 recipes/train_eagle3.py $C --output_dir $OUT/one --stages regenerate
mkdir -p $OUT/two $OUT/shard && cp -r $OUT/one/data $OUT/two/ && cp -r $OUT/one/data $OUT/shard/
L="accelerate launch --multi_gpu --num_processes 2 --mixed_precision bf16"
run 100 train_1gpu python3 recipes/train_eagle3.py $C --output_dir $OUT/one --stages train --batch_size 32
run 100 train_2gpu $L recipes/train_eagle3.py $C --output_dir $OUT/two --stages train --batch_size 16
run 100 train_2gpu_shard $L recipes/train_eagle3.py $C --output_dir $OUT/shard --stages train --batch_size 16 \
    --shard_target true
for d in one two shard; do rm -rf $OUT/$d/data $OUT/$d/checkpoints $OUT/$d/drafter/*.safetensors; done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
logs = {d: [json.loads(l) for l in open(f"{out}/{d}/train_log.jsonl")] for d in ("one", "two", "shard")}
for d, rows in logs.items():
    a, b = rows[0], rows[-1]  # steady state: from the first logged step (compilation behind it) to the last
    print(d, "loss", [r["loss"] for r in rows], "steps", b["step"],
          "tokens/s", round((b["tokens"] - a["tokens"]) / max(b["seconds"] - a["seconds"], 1e-9)))
PY
