"""The end-to-end benchmark's plumbing on a tiny model (numbers are meaningless here; the device runs give them)."""

from hf_hybrid_spec import bench


def test_bench_times_plain_and_fused_graph_rows_behind_a_passing_gate():
    summary = bench.main(["--model", "tiny:qwen3_5_text", "--device", "cpu", "--dtype", "float32",
                          "--drafters", "suffix", "--compiled-only", "--compile-verify", "--num-prompts", "2",
                          "--prompt-tokens", "24", "--max-new-tokens", "10"])
    assert summary["gate"] == "pass" and not any(summary["gate_mismatches"].values())
    assert set(summary["methods"]) == {"suffix+graphs", "suffix+graphs+fused"}
    for row in summary["methods"].values():
        assert row["target_forwards"] > 0 and row["mismatches"] == 0 and row["graph_captures_while_timed"] == 0
    assert summary["verify_ms_by_bucket"] == {} and summary["fused_verify_ms_by_bucket"] == {}  # no sweep asked
