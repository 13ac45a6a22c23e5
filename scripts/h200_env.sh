# Sourced at the start of every device command (from the repo root there): wheels, PYTHONPATH, fixtures.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/.carry/src
export HF_HYBRID_SPEC_FIXTURES=$PWD/.carry/models
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
cd .carry/src
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
