#!/usr/bin/env bash
# Device run 49 (falcon_h1-small carried, unused): the gated-delta kernel tests compiled on the GPU after V tiles of at
# least 32 (run 48 faulted on B1-N64-HV2-K32-V16 in fp32, a 16-wide tile at BT = 64, as the Mamba-2 kernel once did).
source scripts/h200_env.sh
export CUTC=300
TAILN=6 run 150 kernel_tests python3 -m pytest -q tests/test_kernels.py tests/test_kernels_gpu.py -k gated_delta \
    -p no:cacheprovider
