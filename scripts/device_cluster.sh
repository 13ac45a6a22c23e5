#!/usr/bin/env bash
# Replicas on Ray Serve on the lent machine (after bash scripts/device_cluster_prepare.sh; carry .carry_cluster):
# benchmarks/cluster_bench.py on its CPUs (replicas of one core each: one replica, two with affinity routing, two in
# turn) and on its GPU (hf-hybrid-spec-serve alone against the cluster with one replica). The model: the fixture's
# config and tokenizer with random weights (seed 0; see the prepare script), so its text is noise but its costs are
# the fixture's. CLUSTER_STAGES="cpu gpu" by default; CPU_ARGS / GPU_ARGS add to each bench's arguments.
set -uo pipefail
mkdir -p /tmp/site && tar -xJf .carry_cluster/ray_site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
nproc; nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import ray, torch, transformers; print('ray', ray.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
python3 - <<'PY'
import shutil, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
config = AutoConfig.from_pretrained(".carry_cluster/fixture")
AutoModelForCausalLM.from_config(config).save_pretrained("/tmp/cluster_model")
for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f".carry_cluster/fixture/{name}", "/tmp/cluster_model")
PY
M=/tmp/cluster_model
bench() { local t=$1 name=$2; shift 2; echo "=== $name"; timeout -k 10 "$t" python3 benchmarks/cluster_bench.py \
    --model $M "$@" --out "$OUT/$name" > "$OUT/$name.log" 2>&1; echo "rc=$?"; grep -a "^|" "$OUT/$name.log";
    grep -a "Error\|error" "$OUT/$name.log" | grep -v "^|" | tail -5 | cut -c1-300; }
S=" ${CLUSTER_STAGES:-cpu gpu} "
[[ "$S" == *" cpu "* ]] && bench "${CPU_SECONDS:-330}" cpu --device cpu --dtype float32 --replica-cpus 1 \
    --sessions 24 --rates 2 --max-new-tokens 32 --runs 1 affinity round_robin ${CPU_ARGS:-}
[[ "$S" == *" gpu "* ]] && bench "${GPU_SECONDS:-240}" gpu --device cuda --dtype bfloat16 --sessions 48 --rates 16 \
    --max-new-tokens 64 --runs server 1 ${GPU_ARGS:-}
exit 0
