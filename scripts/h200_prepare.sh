#!/usr/bin/env bash
# Prepare a device run on the lent H200: a clean export of HEAD, the fla wheels and one fixture in the
# git-ignored .carry/ (a call carries at most 64 MiB, tracked files included: one fixture at a time).
# Usage: bash scripts/h200_prepare.sh qwen3_5-small|falcon_h1-small
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
bash ../shared/tools/device-prep.sh "$1" > /dev/null
# The tracked tree travels too (~20 MB with the committed drafters): the fixture goes compressed (49 -> ~35 MB) and
# h200_env.sh unpacks it there.
(cd .carry/models && tar -cf - "$1" | xz -T0 -6 > "$1.tar.xz" && rm -rf "$1")
rm -rf .carry/src && mkdir -p .carry/src
git archive HEAD | tar -x -C .carry/src
# The committed EAGLE checkpoints travel as tracked files: the scripts read them from the repo root (../../examples).
rm -rf .carry/src/examples/drafters
# hf_hybrid_spec.kernels is the top-level kernels/ folder (package-dir mapping); without installing, a link does it.
ln -sfn ../kernels .carry/src/hf_hybrid_spec/kernels
du -sh .carry
