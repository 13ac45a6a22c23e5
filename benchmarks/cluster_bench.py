"""Benchmark: agentic sessions against the OpenAI endpoint of replicas on Ray Serve (`serving.cluster`), over HTTP.

    python benchmarks/cluster_bench.py --model ../shared/models/qwen3_5-small --dtype float32 --device cpu \
        --replica-cpus 1 --rates 2 --sessions 24 --out out/cluster
    python benchmarks/cluster_bench.py --model tiny:qwen3_5_text ... --dry-run      # (a checkpoint with a tokenizer)

The sessions and their arrivals are serve_bench.py's (`benchmarks/workloads.json`, Poisson arrivals; call i + 1 sent
when call i returns, its prompt call i's prompt, reply and next text as token ids: the server's `return_token_ids`
gives the reply's ids, so a follow-up extends the last call token for token). Every call streams (TTFT is its first
token's arrival at the client) with the model's eos on, greedy. Runs, each a fresh deployment on one local Ray
instance (replicas of `--replica-cpus` cores; `--replica-gpus` on a GPU machine):

- `server`: `hf-hybrid-spec-serve` alone (the single-process server, no Ray) on the same device;
- `1 replica`: the cluster with one replica (what Ray Serve's ingress and routing cost);
- `N replicas affinity` / `N replicas round_robin` (`--replicas`, default 2): follow-ups routed to the replica that
  holds their prefix, or the replicas in turn.

First a correctness gate on the first deployment: greedy replies to `--gate` prompts against plain `generate` (exact
in fp32). Per run: TTFT p50 / p99 and TTFT of follow-up calls (ms), TPOT p50, committed tokens/s, prompt tokens
reused from the prefix stores. A table and a JSON line last.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from pathlib import Path

import torch
from bench import load_model
from serve_bench import Call, arrivals, session_pieces, summarize
from tqdm.auto import tqdm
from transformers.utils import logging
from workloads import load_suite

from hf_hybrid_spec.cli import argument_parser

logger = logging.get_logger(__name__)


async def _call(http, url: str, prompt: list[int], max_new: int) -> tuple[list[int], float | None, float | None, int,
                                                                         str | None]:
    """One streaming completion: (the reply's token ids, first and last token's arrival, cached prompt tokens, the
    error or None)."""
    body = {"prompt": prompt, "max_tokens": max_new, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    ids, first, last, cached = [], None, None, 0
    async with http.post(url + "/v1/completions", json=body) as answer:
        if answer.status != 200:
            return ids, first, last, cached, f"HTTP {answer.status}: {await answer.text()}"
        async for raw in answer.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return ids, first, last, cached, event["error"]["message"]
            if event.get("usage"):
                cached = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            for choice in event.get("choices", []):
                if choice.get("token_ids"):
                    last = time.perf_counter()
                    first = first or last
                    ids += choice["token_ids"]
    return ids, first, last, cached, None


async def run_http(url: str, pieces, times: list[float], max_new: int, deadline: float, bar) -> list[Call]:
    """The sessions arriving at `times` against the endpoint at `url` (see the module docstring)."""
    import aiohttp

    calls: list[Call] = []
    start = time.perf_counter()

    async def session(http, s: int) -> None:
        await asyncio.sleep(max(0.0, times[s] - (time.perf_counter() - start)))
        prompt = list(pieces[s][0])
        for call in range(len(pieces[s])):
            sent = time.perf_counter()
            ids, first, last, cached, error = await _call(http, url, prompt, max_new)
            bar.update(1)
            if error is not None or first is None:
                logger.warning("session %d call %d failed: %s", s, call, error or "no tokens")
                calls.append(Call(s, call, sent, float("nan"), float("nan"), -1, len(prompt)))
                return
            calls.append(Call(s, call, sent, first, last, len(ids), len(prompt), cached))
            if call + 1 < len(pieces[s]):
                prompt = prompt + ids + list(pieces[s][call + 1])

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=deadline)) as http:
        tasks = [asyncio.create_task(session(http, s)) for s in range(len(pieces))]
        done, pending = await asyncio.wait(tasks, timeout=deadline)
        for task in pending:
            task.cancel()
    return calls


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, serving) -> tuple[str, callable]:
    """`hf-hybrid-spec-serve` in a process of its own, as a user runs it (`--replica-cpus` torch threads on a CPU):
    (its URL, a function that stops it)."""
    import os
    import subprocess
    import urllib.request

    port = _free_port()
    command = [sys.executable, "-m", "hf_hybrid_spec.serving.cli", "--model", args.model, "--port", str(port),
               "--dtype", args.dtype, "--device", args.device, "--max-slots", str(serving.max_slots),
               "--max-total-tokens", str(serving.max_total_tokens)]
    if args.assistant_config:
        command += ["--assistant-config", args.assistant_config]
    threads = str(max(1, int(args.replica_cpus)))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                if answer.status == 200:
                    break
        except OSError:
            if process.poll() is not None or time.time() > deadline:
                raise SystemExit(f"hf-hybrid-spec-serve did not start: {' '.join(command)}") from None
            time.sleep(0.5)

    def stop():
        process.terminate()
        process.wait(60)

    return url, stop


def start_cluster(args, serving, replicas: int, routing: str, port: int) -> tuple[str, callable]:
    """The application on `replicas` replicas behind Serve's proxy on `port` (the same for every run: Serve stays up
    between runs, each run deletes its application; shutting Serve down and starting it again in one process left
    the next application waiting on a controller that was being killed)."""
    from ray import serve

    from hf_hybrid_spec.serving.cluster import APP_NAME, serve_cluster

    url = serve_cluster(args.model, args.assistant_config, serving, replicas=replicas, routing=routing,
                        port=port, dtype=args.dtype, device=args.device, replica_cpus=args.replica_cpus,
                        replica_gpus=args.replica_gpus)

    def stop():
        serve.delete(APP_NAME)

    return url, stop


def gate(url: str, model, pieces, count: int, max_new: int) -> float:
    """The share of `count` first calls whose greedy reply (over HTTP) is plain generate's."""
    same = 0
    for s in range(min(count, len(pieces))):
        prompt = list(pieces[s][0])
        ids, _, _, _, error = asyncio.run(_gate_call(url, prompt, max_new))
        out = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=max_new,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device))
        same += error is None and ids == out[0, len(prompt):].tolist()
    return same / max(1, min(count, len(pieces)))


async def _gate_call(url: str, prompt: list[int], max_new: int):
    import aiohttp

    async with aiohttp.ClientSession() as http:
        return await _call(http, url, prompt, max_new)


def main(argv: list[str] | None = None) -> dict:
    parser = argument_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint path with its tokenizer")
    parser.add_argument("--assistant-config", default=None, help="an AssistantConfig as JSON (default: its defaults)")
    parser.add_argument("--suite", default=str(Path(__file__).with_name("workloads.json")))
    parser.add_argument("--split", default="heldout", help="heldout, train or any")
    parser.add_argument("--sessions", type=int, default=24, help="sessions per run")
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0], help="sessions per second")
    parser.add_argument("--runs", nargs="+", default=["server", "1", "affinity", "round_robin"],
                        choices=["server", "1", "affinity", "round_robin", "power_of_two"],
                        help="what to run: the single-process server, one replica, or --replicas replicas routed so")
    parser.add_argument("--replicas", type=int, default=2, help="replicas of the routed runs")
    parser.add_argument("--replica-cpus", type=float, default=1.0, help="cores per replica (and torch threads)")
    parser.add_argument("--replica-gpus", type=float, default=None, help="GPUs per replica (default: 1 if any)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-slots", type=int, default=16)
    parser.add_argument("--max-total-tokens", type=int, default=4096)
    parser.add_argument("--max-seconds", type=float, default=300.0, help="bound on each run")
    parser.add_argument("--gate", type=int, default=4, help="prompts in the correctness gate")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="folder for the JSON")
    parser.add_argument("--dry-run", action="store_true", help="2 sessions, one rate, small bounds (a smoke test)")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.sessions, args.rates, args.max_new_tokens, args.max_seconds, args.gate = 2, args.rates[:1], 8, 120.0, 1

    import ray

    from hf_hybrid_spec.cli import resolve_device
    from hf_hybrid_spec.serving import ServingConfig

    args.device = resolve_device(args.device)
    model, tokenizer = load_model(args.model, getattr(torch, args.dtype), args.device)
    suite = load_suite(args.suite)
    sessions = suite.select(split=None if args.split == "any" else args.split, interleave=True)[: args.sessions]
    pieces = session_pieces(tokenizer, sessions)
    total_calls = sum(len(p) for p in pieces)
    serving = ServingConfig(max_slots=args.max_slots, max_total_tokens=args.max_total_tokens)
    ray.init(include_dashboard=False, log_to_driver=False)
    port = _free_port()
    rows, shares = [], {}
    cols = ("run", "rate", "calls", "failed", "ttft_p50", "ttft_p99", "follow_ttft_p50", "tpot_p50", "tokens_per_s",
            "reused_tokens", "prompt_tokens")

    def line(values) -> str:
        return "| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in values) + " |"

    def result() -> dict:
        return {"bench": "cluster", "model": args.model, "dtype": args.dtype, "device": args.device,
                "replica_cpus": args.replica_cpus, "sessions": len(pieces), "calls": total_calls,
                "max_new_tokens": args.max_new_tokens, "max_slots": args.max_slots, "gate": shares, "rows": rows}

    def save() -> None:  # after every run: a run that hangs past the caller's bound keeps the ones before it
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "cluster.json").write_text(json.dumps(result()) + "\n")

    for run in args.runs:
        replicas = 1 if run in ("server", "1") else args.replicas
        label = "server" if run == "server" else f"{replicas} replica{'s' if replicas > 1 else ''}" + (
            f" {run}" if run not in ("server", "1") else "")
        url, stop = (start_server(args, serving) if run == "server"
                     else start_cluster(args, serving, replicas, "affinity" if run == "1" else run, port))
        try:
            shares[label] = gate(url, model, pieces, args.gate, args.max_new_tokens)
            for rate in args.rates:
                # Untimed: a few first calls per replica (first-call costs, the budget's calibration), on prompts of
                # the same lengths that no session shares a prefix with (the prefix stores must start cold).
                few = [[list(reversed(p[0]))] for p in pieces[: 4 * replicas]]
                warm = tqdm(total=len(few), desc=f"{label} warm", unit="call", leave=False)
                asyncio.run(run_http(url, few, [0.0] * len(few), args.max_new_tokens, args.max_seconds, warm))
                warm.close()
                bar = tqdm(total=total_calls, desc=f"{label} @ {rate}/s", unit="call", leave=False)
                calls = asyncio.run(run_http(url, pieces, arrivals(len(pieces), rate, args.seed),
                                             args.max_new_tokens, args.max_seconds, bar))
                bar.close()
                summary = summarize(calls)
                rows.append({"run": label, "rate": rate, **summary, "complete": summary["calls"] == total_calls})
                print(f"{label} @ {rate}/s: " + line(rows[-1][c] for c in cols), flush=True)
                save()
        finally:
            stop()
    print(line(cols))
    print("|" + " --- |" * len(cols))
    for r in rows:
        print(line(r[c] for c in cols))
    print(json.dumps(result()))
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    return result()


if __name__ == "__main__":
    main()
    sys.exit(0)
