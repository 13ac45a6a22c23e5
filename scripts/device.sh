#!/usr/bin/env bash
# The one device runner, on the lent GPU machine: `bash scripts/device.sh SUITE` after `bash scripts/device_prepare.sh
# FIXTURE [BASE_REF]` here (carry [".carry"]). Each suite is the commands behind one section of docs/benchmarks.md.
#
#   kernels   the GPU kernel tests at real sizes, then the tree kernels launched from Python and inside CUDA graphs
#   e2e       one request end to end: stock eager, stock static+compile, AssistantConfig() as it comes (compile="auto"),
#             suffix, EAGLE (and the MTP head where one is committed) with CUDA graphs (+graphs) and the fused verify
#             (+fused)
#   base      the same benchmark (suffix and EAGLE) with the code of an earlier commit in .carry/base: run right after
#             e2e on the same machine for an A/B of the two versions
#   trie      the suffix tries' host cost per token, the Python and the C trie side by side
#   fuzz      tests/fuzz_exactness.py's cases on the GPU, FUZZ_SECONDS per target (FUZZ_TARGETS, FUZZ_START)
#   launch    what a tree op costs the host when launched from Python (the eager path), and the eager loop end to end
#             (SKIP_E2E=1: the tree ops alone; WITH_BASE=1: an A/B of the launch costs against .carry/base)
#   hvd       Hybrid Verified Decoding on the agentic workload suite
#   mtp       train the fixture's MTP head (it ships none; recipes/train_mtp.py), then MTP chain / tree vs EAGLE vs
#             suffix with CUDA graphs in one run (MTP_STAGES="train eval" by default; MTP_MINUTES of training;
#             MTP_EVAL_ARGS=--compile-drafter to fuse the drafters' passes)
#   batch     batched speculation against stock batched decoding at B = 1..64 (the fixture; BATCH_MODEL=random:... for a
#             random-weight model with the acceptance-controlled drafter; BATCH_SIZES, BATCH_DRAFTERS to choose, BATCH_ARGS
#             more bench flags, e.g. "--profile 64"; BATCH_STAGES="gate" or "bench" for one of the two)
#   serve     agentic sessions under Poisson arrivals: stock static AR one request at a time vs our continuous batching
#             without and with speculation (and without prefix reuse); SERVE_RATES sessions per second, SERVE_ARGS
#             more bench flags (e.g. "--prefill chunked"; "--methods stock cb cb-unfused cb+spec cb+spec-unfused" for
#             the fused verify forward, the default on a GPU, against the unfused runner in one run)
#   cluster   replicas on Ray Serve (benchmarks/cluster_bench.py, after `bash scripts/device_prepare.sh cluster`): on
#             the machine's CPUs with replicas of one core each (one replica, two with affinity routing, two in turn),
#             and on its GPU (hf-hybrid-spec-serve alone against one replica); the fixture's config and tokenizer with
#             random weights (seed 0: its text is noise, its costs the fixture's). CLUSTER_STAGES="cpu gpu" by
#             default, but each stage fills a device call: run CLUSTER_STAGES=cpu and =gpu as two calls (on one core a
#             replica's run of 24 sessions took ~3.5 min, so the CPU stage runs 16 sessions of 24 new tokens; three
#             runs of 160 s each in one call did not get past their deployment: give a call one run, CPU_RUNS=affinity);
#             CPU_RUNS the CPU stage's runs (each its own process), CPU_ARGS / GPU_ARGS more bench flags,
#             CPU_SECONDS (per CPU run) / GPU_SECONDS the bounds
#   (batch and serve: WITH_BASE=1 runs the same bench again with the code of .carry/base, after
#    `bash scripts/device_prepare.sh FIXTURE BASE_REF`: an A/B of two commits within one lease)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
E2E="--dtype bfloat16 --stock-static --skip-gate --allow-mismatch --num-prompts 8 --prompt-tokens 400 --max-new-tokens 128"
case "${1:-}" in
  kernels)
    run 400 kernel_tests python3 -m pytest -q tests/kernels/test_kernels_gpu.py tests/kernels/test_tree_attention.py
    run 300 tree_kernels python3 benchmarks/tree_kernels.py --cuda-graph --ops gdn mamba2 --batch 1 8 --nodes 16 64 \
        --out "$OUT/kbench" ;;
  e2e)
    # The fixture's trained MTP head too, where one is committed (checkpoints/mtp/FIXTURE).
    MTPD=(); [ -f "checkpoints/mtp/$FIX/mtp.safetensors" ] && MTPD=("mtp:checkpoints/mtp/$FIX/mtp.safetensors")
    TAILN=${TAILN:-16} run 560 e2e python3 benchmarks/bench.py --model "$M" --drafters default suffix "eagle:$D" "${MTPD[@]}" \
        --compiled-only --compile-verify $E2E --out "$OUT/e2e" ;;
  base)
    [ -d .carry/base ] || { echo "no .carry/base: bash scripts/device_prepare.sh FIXTURE BASE_REF"; exit 2; }
    echo "base: $(cat .carry/base/REF)"
    # Before the benchmarks moved out of the package, the bench was a module of it.
    if [ -f .carry/base/benchmarks/bench.py ]; then B=(python3 "$PWD/.carry/base/benchmarks/bench.py"); else B=(python3 -m hf_hybrid_spec.bench); fi
    TAILN=14 base 560 e2e_base "${B[@]}" --model "$M" --drafters suffix "eagle:$D" --compiled-only --compile-verify \
        $E2E --out "$OUT/e2e_base" ;;
  trie)
    # The suffix tries' host cost per token on this machine's CPU, Python and C side by side: tokens fed per call as a
    # serving step commits them (8) and as a prompt goes in (256).
    for c in 8 256; do TAILN=5 run 200 "trie_build_$c" python3 benchmarks/suffix_trie_build.py --tokenizer "$M" \
        --chunk "$c"; done ;;
  fuzz)
    # The differential fuzzer's cases on the GPU (its graphs, kernels, pinned copies), each target for FUZZ_SECONDS
    # (the cases that ran count; a failing case prints its seed).
    for t in ${FUZZ_TARGETS:-serving generate}; do
      TAILN=12 run "${FUZZ_SECONDS:-120}" "fuzz_$t" python3 tests/fuzz_exactness.py --target "$t" --device cuda \
          --start "${FUZZ_START:-0}" --cases 1000
    done ;;
  launch)
    LC=(--launch-costs --ops gdn mamba2 --batch 1 8 --nodes 16 64)
    TAILN=12 run 200 launch_costs python3 benchmarks/tree_kernels.py "${LC[@]}"
    # WITH_BASE=1: this bench again on the package of .carry/base, then on ours once more (base between two runs of
    # ours, so that the host's drift shows).
    if [[ -n "${WITH_BASE:-}" && -d .carry/base ]]; then
      echo "base: $(cat .carry/base/REF)"
      TAILN=12 base 200 launch_costs_base python3 "$PWD/benchmarks/tree_kernels.py" "${LC[@]}"
      TAILN=12 run 200 launch_costs_again python3 benchmarks/tree_kernels.py "${LC[@]}"
    fi
    [[ -n "${SKIP_E2E:-}" ]] || TAILN=6 run 200 e2e_eager python3 benchmarks/bench.py --model "$M" --drafters suffix \
        $E2E --out "$OUT/e2e_eager" ;;
  hvd)
    TAILN=30 run 560 hvd python3 benchmarks/hvd_bench.py --model "$M" --eagle "$D" --compile --compile-drafter \
        --compile-verify --dtype bfloat16 --workload code_edit tool_calls agent_loop --methods suffix eagle threshold \
        hvd --sessions-per-workload 6 --repeats 3 --max-minutes 8 --out "$OUT/hvd" ;;
  batch)
    # First the exactness of the captured graphs (B = 1 and 3, both prefills; the pipelined step's sampling on the
    # fixture), in fp32 on a tiny model (the gate fails
    # on any differing row; SKIP_GATE=1 to skip it): prompts of three chunks of the chunked prefill, which queues chunk
    # after chunk without a read (the host staging must not be rewritten under a queued copy; its own test first).
    # GATE_MODEL (e.g. the fixture, "$M"), GATE_SIZES and GATE_DRAFTERS to choose. BATCH_STAGES="gate bench" by
    # default: gate and bench together can outrun one device call, so run BATCH_STAGES=gate and =bench as two calls.
    GD=${GATE_DRAFTERS:-suffix suffix:eager eagle eagle:fused acceptance:0.8 eagle:fused+eager acceptance:0.8+eager}
    if [[ -z "${SKIP_GATE:-}" && " ${BATCH_STAGES:-gate bench} " == *" gate "* ]]; then
      TAILN=2 run 60 staging_test python3 -P -m pytest -q tests/engine/test_staging.py
      # The pipelined step's sampling in its captured passes against the general step (the fixture, fp32, EAGLE).
      TAILN=2 run 240 sampling_gate python3 -P -m pytest -q tests/engine/test_pipeline.py -k on_a_gpu
      TAILN=4 run 540 batch_gate python3 benchmarks/batch_bench.py --model "${GATE_MODEL:-tiny:qwen3_5_text}" \
          --batch-sizes ${GATE_SIZES:-1 3} --drafters $GD --prompt-tokens 160 --max-new-tokens 48 --no-stock-static
      # Processors that read the ids (the repetition penalty, with min_new_tokens) in the captured passes: the
      # pipelined step's per-row tokens seen, the serving engine's plain steps.
      TAILN=4 run 240 penalty_gate python3 benchmarks/batch_bench.py --model "${GATE_MODEL:-tiny:qwen3_5_text}" \
          --batch-sizes 3 8 --drafters suffix eagle serve serve:plain --prompt-tokens 160 --max-new-tokens 48 \
          --no-stock-static --preset penalty
    fi
    [[ " ${BATCH_STAGES:-gate bench} " == *" bench "* ]] || exit 0
    BM=${BATCH_MODEL:-$M}
    if [[ "$BM" == random:* ]]; then BD="acceptance:0.6 acceptance:0.8"; else BD="suffix acceptance:0.8"; fi
    BB=(--model "$BM" --batch-sizes ${BATCH_SIZES:-1 4 8 16 32 64} --dtype bfloat16
        --prompt-tokens 256 --max-new-tokens 128 --allow-mismatch ${BATCH_ARGS:-})
    # WITH_BASE=only: the base alone (a second call of the same A/B).
    [[ "${WITH_BASE:-}" == only ]] || TAILN=${TAILN:-16} CUTC=400 run "${BATCH_SECONDS:-480}" "batch_${BM//[:\/.]/_}" \
        python3 benchmarks/batch_bench.py "${BB[@]}" --drafters ${BATCH_DRAFTERS:-$BD} --out "$OUT/${BATCH_OUT:-batch}"
    # WITH_BASE=1: the same bench with the code of .carry/base right after (an A/B within one lease); BASE_DRAFTERS
    # for methods the base has (default: the same).
    if [[ -n "${WITH_BASE:-}" && -d .carry/base ]]; then
      echo "base: $(cat .carry/base/REF)"
      TAILN=${TAILN:-16} CUTC=400 base "${BATCH_SECONDS:-480}" batch_base python3 \
          "$PWD/.carry/base/benchmarks/batch_bench.py" "${BB[@]}" --drafters ${BASE_DRAFTERS:-${BATCH_DRAFTERS:-$BD}} \
          --out "$OUT/batch_base"
    fi ;;
  serve)
    # The serving engine's captured graphs first, in fp32 on the fixture: every gate reply of every CB method (lanes
    # included) identical to plain generate. SERVE_STAGES="gate bench" by default (each stage fits one device call).
    [[ " ${SERVE_STAGES:-gate bench} " == *" gate "* ]] && TAILN=4 run 330 serve_gate python3 benchmarks/serve_bench.py \
        --model "$M" --dtype float32 --sessions 4 --rates 8 --methods cb+spec --max-new-tokens 32 \
        --max-total-tokens 1280 --gate 4 ${SERVE_ARGS:-}
    SB=(--model "$M" --dtype bfloat16 --rates ${SERVE_RATES:-1 4 16} --max-new-tokens 128 --max-slots 16
        --max-total-tokens 1280 --allow-mismatch --max-seconds 45 ${SERVE_ARGS:-})
    [[ " ${SERVE_STAGES:-gate bench} " == *" bench "* ]] && TAILN=${TAILN:-18} CUTC=400 run "${SERVE_SECONDS:-540}" \
        serve python3 benchmarks/serve_bench.py "${SB[@]}" --out "$OUT/serve"
    # WITH_BASE=1: the same bench with the code of .carry/base right after (an A/B within one lease).
    if [[ " ${SERVE_STAGES:-gate bench} " == *" bench "* && -n "${WITH_BASE:-}" && -d .carry/base ]]; then
      echo "base: $(cat .carry/base/REF)"
      TAILN=${TAILN:-18} CUTC=400 base "${SERVE_SECONDS:-540}" serve_base python3 \
          "$PWD/.carry/base/benchmarks/serve_bench.py" "${SB[@]}" --out "$OUT/serve_base"
    fi
    true ;;
  mtp)
    # The trained checkpoint stays in out/mtp (ignored, kept on a warm machine between calls); its MTP shard comes back.
    if [[ " ${MTP_STAGES:-train eval} " == *" train "* ]]; then
      TAILN=3 run $(( ${MTP_MINUTES:-4} * 60 + 150 )) mtp_train python3 recipes/train_mtp.py --target "$M" \
          --output_dir out/mtp --max_minutes "${MTP_MINUTES:-4}" --max_steps "${MTP_STEPS:-4000}" --batch_size 16 \
          --seq_len 512 --eval_prompts 8
      cp out/mtp/checkpoint/mtp.safetensors out/mtp/mtp_eval.json out/mtp/train_log.jsonl "$OUT/" 2>/dev/null
    fi
    if [[ " ${MTP_STAGES:-train eval} " == *" eval "* ]]; then
      # Without a trained checkpoint here (a fresh machine), the committed head: checkpoints/mtp/FIXTURE.
      if [ -d out/mtp/checkpoint ]; then MT=(--model out/mtp/checkpoint); else
        MT=(--model "$M" --mtp-weights "checkpoints/mtp/$FIX/mtp.safetensors"); fi
      TAILN=34 CUTC=200 run 560 mtp_eval python3 recipes/eval_eagle.py "${MT[@]}" --drafter "$D" \
          --mtp --compile ${MTP_EVAL_ARGS:-} --dtype bfloat16 --num-prompts 8 --max-new-tokens 128 --allow-mismatch \
          --out "$OUT/mtp_eval"
    fi ;;
  cluster)
    [ -f .carry/cluster/ray_site.tar.xz ] || { echo "no .carry/cluster: bash scripts/device_prepare.sh cluster"; exit 2; }
    mkdir -p /tmp/site && tar -xJf .carry/cluster/ray_site.tar.xz -C /tmp/site
    export RAY_USAGE_STATS_ENABLED=0
    nproc; python3 -c "import ray; print('ray', ray.__version__)"
    python3 - <<'PY'
import shutil, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(".carry/cluster/fixture")).save_pretrained("/tmp/cluster_model")
for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f".carry/cluster/fixture/{name}", "/tmp/cluster_model")
PY
    S=" ${CLUSTER_STAGES:-cpu gpu} "
    # Each CPU run in a process of its own (a fresh Ray): on the lent machine the next application of one process
    # was not up 100 s after the last was deleted (on the dev machine it came up in 13 s idle, 80 s under load).
    if [[ "$S" == *" cpu "* ]]; then
      # fla left in /tmp/site by a fixture call on the same warm machine: transformers 5.17 binds its kernels at
      # import whatever the device, so a CPU replica's prefill launched Triton on CPU tensors and every replica
      # failed to start (the deployment never came up).
      rm -rf /tmp/site/fla /tmp/site/fla_core* /tmp/site/flash_linear_attention*
      for r in ${CPU_RUNS:-1 affinity round_robin}; do
        TAILN=4 run "${CPU_SECONDS:-540}" "cluster_cpu_$r" python3 benchmarks/cluster_bench.py \
            --model /tmp/cluster_model --device cpu --dtype float32 --replica-cpus 1 --sessions 16 --rates 2 \
            --max-new-tokens 24 --runs "$r" ${CPU_ARGS:-} --out "$OUT/cluster_cpu_$r"
        # Ray Serve's own logs (the controller's and each replica's): why a deployment did not come up.
        tar -czf "$OUT/cluster_cpu_${r}_serve_logs.tgz" -C /tmp/ray/session_latest/logs serve 2>/dev/null
        # A run cut by its bound leaves its Ray behind, holding the CPUs.
        python3 -c "import sys; from ray.scripts.scripts import main; sys.argv = ['ray', 'stop', '--force']; main()" \
            > /dev/null 2>&1
      done
    fi
    [[ "$S" == *" gpu "* ]] && TAILN=8 run "${GPU_SECONDS:-540}" cluster_gpu python3 benchmarks/cluster_bench.py \
        --model /tmp/cluster_model --device cuda --dtype bfloat16 --sessions 48 --rates 16 --max-new-tokens 64 \
        --runs server 1 ${GPU_ARGS:-} --out "$OUT/cluster_gpu"
    true ;;
  *)
    echo "usage: bash scripts/device.sh kernels|e2e|base|trie|fuzz|launch|hvd|mtp|batch|serve|cluster"; exit 2 ;;
esac
