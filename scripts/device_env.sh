# Sourced by scripts/device.sh on the GPU machine (from the repository root): wheels, the package importable from
# the working tree, the fixture unpacked, and `run`, which runs one step under a timeout with its log in $OUT.
ls .carry/whl/*.whl > /dev/null 2>&1 && \
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks
export HF_HYBRID_SPEC_FIXTURES=$PWD/.carry/models
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
for f in .carry/models/*.tar.xz; do [ -e "$f" ] && tar -xJf "$f" -C .carry/models; done
FIX=$(cat .carry/fixture 2>/dev/null || echo qwen3_5-small)
M=$PWD/.carry/models/$FIX
D=$PWD/checkpoints/drafters/$FIX-eagle3
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
# run SECONDS NAME CMD...: CMD under a timeout, its output in $OUT/NAME.log, rc and the log's last $TAILN lines
# (default 8, cut to $CUTC characters, default 300) shown.
run() { local t=$1 name=$2; shift 2; echo "=== $name"; timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?";
        grep -v "^\[trans\|Loading weights\|falling back" "$OUT/$name.log" | tail -n "${TAILN:-8}" | cut -c1-"${CUTC:-300}"; }
# base NAME SECONDS CMD...: the same CMD with the package of .carry/base (its benchmarks/ first on the path).
base() { local t=$1 name=$2; shift 2;
         rm -rf /tmp/basepkg && mkdir -p /tmp/basepkg && cp -r .carry/base/hf_hybrid_spec /tmp/basepkg/;
         # Commits before the kernels moved into the package kept them in a top-level kernels/ folder.
         [ -d .carry/base/kernels ] && cp -r .carry/base/kernels /tmp/basepkg/hf_hybrid_spec/kernels;
         # From /tmp: `python -m` puts the working directory first on the path, and this one holds the new package.
         (cd /tmp && PYTHONPATH=/tmp/site:/tmp/basepkg:$OLDPWD/.carry/base/benchmarks run "$t" "$name" "$@"); }
