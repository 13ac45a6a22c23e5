#!/usr/bin/env bash
# Device run 7 (qwen3_5-small carried for its tokenizer): is the ~2B graph-replay illegal access tied to stock
# static+compile (inductor's CUDA graphs) running in the same process? The same 2B run without, then with it.
source scripts/h200_env.sh
M=../models/qwen3_5-small
run() { local t=$1 name=$2; shift 2; echo "=== $name"; timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; echo "rc=$rc"; tail -n ${TAIL:-12} "$OUT/$name.log" | cut -c1-300; return $rc; }
B2="--model random:qwen3_5-2b --tokenizer $M --dtype bfloat16 --drafters suffix --compiled-only --skip-gate --prompt-tokens 400 --max-new-tokens 128 --allow-mismatch"
run 190 r2b_nostatic python3 -m hf_hybrid_spec.bench $B2 --bucket-sweep --num-prompts 3 --out $OUT/r2b_nostatic
TAIL=6 run 150 r2b_static python3 -m hf_hybrid_spec.bench $B2 --stock-static --num-prompts 1 --out $OUT/r2b_static
