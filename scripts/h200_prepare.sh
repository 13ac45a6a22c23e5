#!/usr/bin/env bash
# Prepare a device run on the lent H200: a clean export of HEAD, the fla wheels and one fixture in the
# git-ignored .carry/ (a call carries at most 64 MiB: one ~50 MB fixture at a time).
# Usage: bash scripts/h200_prepare.sh qwen3_5-small|falcon_h1-small
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
bash ../shared/tools/device-prep.sh "$1" > /dev/null
rm -rf .carry/src && mkdir -p .carry/src
git archive HEAD | tar -x -C .carry/src
# The committed EAGLE checkpoints (~9 MB each) would not fit next to a fixture in one call.
rm -rf .carry/src/examples/drafters  # the checkpoints travel only when a run needs them (64 MiB per call)
# hf_hybrid_spec.kernels is the top-level kernels/ folder (package-dir mapping); without installing, a link does it.
ln -sfn ../kernels .carry/src/hf_hybrid_spec/kernels
du -sh .carry
