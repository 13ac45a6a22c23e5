"""The end-to-end benchmark's plumbing on a tiny model (numbers are meaningless here; the device runs give them)."""

import bench
import pytest
import torch


@pytest.mark.slow
def test_bench_times_plain_and_fused_graph_rows_behind_a_passing_gate():
    summary = bench.run(["--model", "tiny:qwen3_5_text", "--device", "cpu", "--dtype", "float32",
                          "--drafters", "suffix", "--compiled-only", "--compile-verify", "--num-prompts", "2",
                          "--prompt-tokens", "24", "--max-new-tokens", "10"])
    assert summary["gate"] == "pass" and not any(summary["gate_mismatches"].values())
    assert set(summary["methods"]) == {"suffix+graphs", "suffix+graphs+fused"}
    for row in summary["methods"].values():
        assert row["target_forwards"] > 0 and row["mismatches"] == 0 and row["graph_captures_while_timed"] == 0
    assert summary["verify_ms_by_bucket"] == {} and summary["fused_verify_ms_by_bucket"] == {}  # no sweep asked


def test_balanced_order_puts_each_method_first_and_after_each_other_equally_often():
    from collections import Counter

    for n in range(1, 7):
        methods = [f"m{i}" for i in range(n)]
        period = n if n % 2 == 0 else 2 * n
        orders = [bench.balanced_order(methods, i) for i in range(period)]
        assert all(sorted(o) == methods for o in orders)
        if n < 2:
            continue
        # Each position holds each method equally often over a period (the first one runs right after stock).
        for pos in range(n):
            assert set(Counter(o[pos] for o in orders).values()) == {period // n}
        # Each ordered pair is adjacent equally often: no method always follows the same one (a rotation fails this).
        pairs = Counter((o[i], o[i + 1]) for o in orders for i in range(n - 1))
        assert len(pairs) == n * (n - 1) and set(pairs.values()) == {period // n}
        # The design repeats with its period.
        assert bench.balanced_order(methods, period + 1) == orders[1]
    rotation = [["a", "b", "c", "d"][i:] + ["a", "b", "c", "d"][:i] for i in range(4)]
    assert len(Counter((o[i], o[i + 1]) for o in rotation for i in range(3))) == 4  # the confound it replaces


def test_tree_kernel_bench_dry_run_exits_zero_with_a_json_line_last(capsys):
    """The kernel bench's CPU smoke test: the gate, every op's rows (the conv op has no branch baseline) and the JSON
    line last; exit status 0."""
    import json

    import tree_kernels

    assert tree_kernels.main(["--dry-run"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert summary["bench"] == "tree_kernels" and summary["dry_run"] is True


def test_tree_kernel_host_work_times_the_launchers_and_puts_the_kernels_back(capsys):
    """`--host-work` (no GPU): a row per op, B and N with the launchers' host time, the JSON line last, and the Triton
    kernels it stubbed out are the real ones again afterwards."""
    import json

    pytest.importorskip("triton", reason="the launchers are Triton's: pip install -e '.[triton]'")
    import tree_kernels
    from hf_hybrid_spec.kernels.gated_delta_rule import triton_tree as gdn_t
    from hf_hybrid_spec.kernels.mamba2 import triton_tree as m2_t

    def kernels():
        return (gdn_t.tree_gated_delta_rule_fwd_kernel, gdn_t.commit_gated_delta_rule_kernel,
                m2_t.tree_mamba2_fwd_kernel, m2_t.commit_mamba2_kernel)

    before = kernels()
    assert tree_kernels.main(["--host-work", "--ops", "gdn", "mamba2", "--batch", "1", "--nodes", "16"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["bench"] == "tree_kernels_host_work"
    assert [(r["op"], r["B"], r["N"]) for r in summary["rows"]] == [("gdn", 1, 16), ("mamba2", 1, 16)]
    assert all(r["launcher_us"] > 0 and r["commit_launcher_us"] > 0 for r in summary["rows"])
    assert kernels() == before


@pytest.mark.slow
def test_serve_bench_dry_run_runs_every_method_behind_its_gate(tmp_path, capsys):
    """The serving bench's plumbing on a tiny target with a tokenizer: the gate, every method at one rate, the JSON
    line last (its numbers mean nothing here)."""
    import json

    import serve_bench
    from helpers import tiny_target_with_tokenizer

    tiny_target_with_tokenizer(tmp_path / "target")
    result = serve_bench.main(["--model", str(tmp_path / "target"), "--dtype", "float32", "--device", "cpu",
                               "--dry-run", "--max-total-tokens", "2048", "--max-slots", "4", "--rates", "64",
                               "--prefill", "eager", "chunked", "--out", str(tmp_path / "out")])
    # A high rate: every session arrives at once, so the runs take their compute time and no idle wait for arrivals.
    labels = ["stock"] + [f"{m}/{mode}" for m in serve_bench.DEFAULT_METHODS[1:] for mode in ("eager", "chunked")]
    assert set(result["gate"]) == set(labels[1:]) and set(result["gate"].values()) == {1.0}
    assert [r["method"] for r in result["rows"]] == labels
    assert all(r["complete"] and r["failed"] == 0 for r in result["rows"])
    assert (tmp_path / "out" / "serve.png").exists()
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bench"] == "serve"


def test_serve_bench_fault_runs_answer_every_injected_fault_and_lose_nothing(tmp_path):
    """`--fault-every 2`: every second request fails in its own stopping criterion; each fault comes back as an error
    and its call is sent again, so the faulty run completes every call, identical in tokens to the clean one. One of
    the two sessions samples (`--sampling-share 0.5`): requests of both kinds in the same steps."""
    import serve_bench
    from helpers import tiny_target_with_tokenizer

    tiny_target_with_tokenizer(tmp_path / "target")
    result = serve_bench.main(["--model", str(tmp_path / "target"), "--dtype", "float32", "--device", "cpu",
                               "--dry-run", "--max-total-tokens", "2048", "--max-slots", "4", "--rates", "64",
                               "--methods", "cb+spec", "--fault-every", "2", "--no-warm-pass",
                               "--sampling-share", "0.5"])
    assert result["sampled_sessions"] == 1
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"cb+spec", "cb+spec+faults"}
    clean, faulty = rows["cb+spec"], rows["cb+spec+faults"]
    assert clean["faults"] == 0 and faulty["faults"] >= clean["calls"] // 2
    assert faulty["complete"] and faulty["failed"] == 0 and faulty["unanswered"] == 0
    assert faulty["engine"]["failed"] == faulty["faults"]


def test_serve_bench_unfused_methods_are_their_base_method_on_the_unfused_runner(monkeypatch):
    """`cb-unfused` / `cb+spec-unfused` build the engine of `cb` / `cb+spec` with `compile_verify=False`; the others
    keep "auto" (unless --unfused)."""
    import argparse

    import serve_bench

    built = {}
    monkeypatch.setattr(serve_bench, "ContinuousBatchingManager",
                        lambda model, config, serving, gen: (config.compile_verify, serving.speculation,
                                                             serving.prefix_cache_bytes > 0, serving.lanes))
    args = argparse.Namespace(max_slots=4, max_total_tokens=256, prefix_cache_mb=8, prefill_chunk=16,
                              unfused=False)
    for method in serve_bench.METHODS[1:]:
        built[method] = serve_bench.make_manager(None, method, "chunked", args, None)
    assert built["cb-unfused"] == (False,) + built["cb"][1:] and built["cb"][0] == "auto"
    assert built["cb+spec-unfused"] == (False,) + built["cb+spec"][1:] and built["cb+spec"] == ("auto", True, True, 1)
    assert built["cb+spec-lanes2"][3] == 2 and built["cb+spec-noreuse"][2] is False
    args.unfused = True
    assert serve_bench.make_manager(None, "cb+spec", "chunked", args, None)[0] is False


def test_serve_host_bench_runs_the_engine_without_the_model_and_exits_zero():
    """The serving host-cost bench on the fixture, in a process of its own (it patches the batched runner), with the
    budget's synthetic cost model: a JSON line last with the steps it took and every request's tokens; exit status
    0."""
    import json
    import os
    import subprocess
    import sys

    from helpers import IN_CI
    from hf_hybrid_spec.testing import fixture_path

    if fixture_path("qwen3_5-small") is None:
        message = "fixture model qwen3_5-small not found (expected in ../shared/models)"
        if IN_CI:
            pytest.fail(message + " and CI=true: the fixtures must be present in CI")
        pytest.skip(message)
    script = os.path.join(os.path.dirname(bench.__file__), "serve_host.py")
    run = subprocess.run([sys.executable, script, "--requests", "4", "--slots", "2", "--prompt-tokens", "64",
                          "--max-new-tokens", "12", "--repeats", "1", "--budget"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["tokens"] == 4 * 12 and result["steps"] > 0 and result["host_ms_per_step"] > 0


def test_batch_bench_runs_left_padded_source_prompts_behind_a_passing_gate():
    """`batch_bench.py --prompt-source sympy` on the fixture: windows of an installed package's source files of varied
    lengths (seeded, the same every run), left-padded as a tokenizer pads a batch; every row identical to stock greedy
    in fp32 with the model's eos on and `min_new_tokens` (`--preset min-new`)."""
    import batch_bench
    from helpers import load_fixture

    from hf_hybrid_spec.testing import fixture_path

    model, tokenizer = load_fixture("qwen3_5-small")
    first = batch_bench.source_prompts(tokenizer, "sympy", 3, 40, 70, "cpu")
    again = batch_bench.source_prompts(tokenizer, "sympy", 3, 40, 70, "cpu")
    lengths = [p.shape[1] for p in first]
    assert all(40 <= n <= 70 for n in lengths) and len(set(lengths)) > 1
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    ids, mask = batch_bench.batch_of(first, 3, 0)
    assert ids.shape == (3, max(lengths)) and mask.sum(-1).tolist() == lengths and mask[:, -1].all()
    result = batch_bench.run(["--model", str(fixture_path("qwen3_5-small")), "--device", "cpu", "--dtype", "float32",
                              "--batch-sizes", "3", "--drafters", "suffix", "--prompt-source", "sympy",
                              "--prompt-tokens", "40", "--prompt-tokens-max", "70", "--max-new-tokens", "8",
                              "--preset", "min-new", "--no-stock-static"])
    assert result["mismatches"] == [] and result["rows"][0]["suffix.identical_rows"] == 1.0
