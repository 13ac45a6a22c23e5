#!/usr/bin/env bash
# Prepare the cluster runs on the lent machine (scripts/device_cluster.sh): Ray Serve and the dependencies its image
# lacks, for its Python 3.12, unpacked, trimmed (Java jars, RLlib, Tune, Train, Data, LLM, the dashboard's web
# client) and compressed in the git-ignored .carry_cluster/, with the fixture's config and tokenizer. Ray's wheel
# alone is 79 MB and a call carries at most 64 MiB, the tracked files included: no room for the fixture's weights,
# so the runs use the fixture's architecture with random weights (made on the machine).
# Usage: bash scripts/device_cluster_prepare.sh [FIXTURE]   (default qwen3_5-small); then carry [".carry_cluster"].
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
FIX=${1:-qwen3_5-small}
grep -qx "/.carry_cluster/" .git/info/exclude || echo "/.carry_cluster/" >> .git/info/exclude
work=$(mktemp -d)
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d "$work/whl" ray==2.60.0 fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn \
    jsonschema jsonschema-specifications referencing rpds-py aiohttp-cors colorful watchfiles mmh3 aiorwlock \
    opencensus opencensus-context smart_open virtualenv distlib platformdirs opentelemetry-api opentelemetry-sdk \
    opentelemetry-proto opentelemetry-exporter-prometheus opentelemetry-semantic-conventions grpcio-reflection \
    google-api-core googleapis-common-protos proto-plus google-auth cachetools pyasn1 pyasn1-modules rsa \
    importlib-metadata 2>&1 | grep -v WARN || true
mkdir -p "$work/site"
for w in "$work"/whl/*.whl; do unzip -qo "$w" -d "$work/site"; done
rm -rf "$work"/site/ray/{jars,rllib,tune,train,data,llm} "$work/site/ray/dashboard/client/build"
rm -rf .carry_cluster && mkdir -p .carry_cluster/fixture
(cd "$work/site" && tar -cf - . | xz -T0 -6 > "$OLDPWD/.carry_cluster/ray_site.tar.xz")
cp ../shared/models/"$FIX"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json} \
    .carry_cluster/fixture/
rm -rf "$work"
du -sh .carry_cluster
