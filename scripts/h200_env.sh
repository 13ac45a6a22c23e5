# Sourced at the start of every device command (from the repo root there): wheels, PYTHONPATH, fixtures.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/.carry/src
export HF_HYBRID_SPEC_FIXTURES=$PWD/.carry/models
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
for f in .carry/models/*.tar.xz; do [ -e "$f" ] && tar -xJf "$f" -C .carry/models; done
cd .carry/src
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
# run SECONDS NAME CMD...: CMD under a timeout, its output in $OUT/NAME.log, rc and the log's last $TAILN lines
# (default 8, cut to $CUTC characters, default 300) shown.
run() { local t=$1 name=$2; shift 2; echo "=== $name"; timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?";
        grep -v "^\[trans\|Loading weights\|falling back" "$OUT/$name.log" | tail -n "${TAILN:-8}" | cut -c1-"${CUTC:-300}"; }
