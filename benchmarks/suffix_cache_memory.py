"""Memory of the suffix drafter's process-wide cache over many calls: bytes per cached token, and RSS over calls.

Simulates a server: `--calls` requests, each a prompt drawn from real text (Python sources found offline in this
interpreter's site-packages, tokenized with the fixture tokenizer when present, else as bytes) and an "output" that
continues it, fed through `SuffixDrafter.begin / accept / end` with no model (the cache is all that is measured). A
correctness gate first (the compact trie against substring counts computed directly), then a table every
`--every` calls, a PNG of RSS and cache size over calls (`--out`), and a JSON line last.

    python benchmarks/suffix_cache_memory.py --calls 1000 --max-cached-tokens 2000000 --out bench_out
"""

from __future__ import annotations

import json
import logging
import os
import random
import resource
import sys
import time
from collections import Counter
from pathlib import Path

from hf_hybrid_spec.cli import argument_parser

logger = logging.getLogger("suffix_cache_memory")
EXCLUDED = ("networkx", "sympy", "pandas")  # kept out of the fixtures' training data: never tuned against


def rss_bytes() -> int:
    """Resident set size now (Linux /proc), or the peak where /proc is absent."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def corpus_tokens(limit: int) -> list[int]:
    """Token ids of Python sources from site-packages (up to `limit` tokens)."""
    import site

    roots = [Path(p) for p in site.getsitepackages()]
    files = sorted(f for r in roots for f in r.glob("*/*.py") if not any(x in f.parts for x in EXCLUDED))
    text_parts, size = [], 0
    for f in files:
        try:
            text_parts.append(f.read_text(errors="ignore"))
        except OSError:
            continue
        size += len(text_parts[-1])
        if size > limit * 4:
            break
    text = "".join(text_parts)
    fixture = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "qwen3_5-small"
    if (fixture / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(fixture)(text).input_ids
    else:
        ids = list(text.encode())
    return ids[:limit]


def gate(seed: int = 0) -> None:
    """The compact trie holds exactly the substring counts of what was inserted (and removed)."""
    from hf_hybrid_spec.drafters.suffix import SuffixTrie

    rng = random.Random(seed)
    for _ in range(50):
        depth = rng.randint(1, 6)
        seqs = [[rng.randrange(4) for _ in range(rng.randint(0, 25))] for _ in range(3)]
        trie = SuffixTrie(depth)
        ids = [trie.insert(s) for s in seqs]
        trie.remove(ids[0])
        expected = Counter(tuple(s[i:j]) for s in seqs[1:] for i in range(len(s))
                           for j in range(i + 1, min(len(s), i + depth) + 1))
        table, stack = {}, [((), 0)]
        while stack:
            path, ref = stack.pop()
            if path:
                table[path] = trie.count(ref)
            stack += [(path + (t,), c) for t, c in trie.children(ref, len(path))]
        if table != dict(expected):
            raise SystemExit("gate FAILED: the trie's counts differ from the substrings' counts")
    logger.info("gate PASS: trie counts equal direct substring counts on 50 random cases")


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--output-tokens", type=int, default=500)
    parser.add_argument("--max-cached-tokens", type=int, default=2_000_000)
    parser.add_argument("--max-cached-outputs", type=int, default=256)
    parser.add_argument("--every", type=int, default=100, help="print a row every this many calls")
    parser.add_argument("--out", default=None, help="folder for the PNG (none: no plot)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import torch

    import hf_hybrid_spec as H
    from hf_hybrid_spec.tree import VerifyResult

    gate(args.seed)
    span = args.prompt_tokens + args.output_tokens
    tokens = corpus_tokens(max(200_000, 4 * span))
    rng = random.Random(args.seed)
    H.clear_global_suffix_cache()
    rows, start_rss = [], rss_bytes()
    started = time.perf_counter()
    try:
        from tqdm import tqdm

        calls = tqdm(range(args.calls), desc="calls", disable=None)
    except ImportError:
        calls = range(args.calls)
    for call in calls:
        at = rng.randrange(0, len(tokens) - span)
        prompt = torch.tensor([tokens[at : at + args.prompt_tokens]])
        output = tokens[at + args.prompt_tokens : at + span]
        drafter = H.SuffixDrafter(cache_key=("memory-bench",), max_cached_outputs=args.max_cached_outputs,
                                  max_cached_tokens=args.max_cached_tokens)
        drafter.begin(prompt)
        ids = torch.cat([prompt, torch.tensor([output])], dim=1)
        drafter.accept(ids, VerifyResult(path=[0], tokens=torch.tensor(output), score_nodes=[0], token_list=output))
        drafter.end(ids)
        if (call + 1) % args.every == 0 or call + 1 == args.calls:
            cache = drafter.global_cache
            rows.append(dict(calls=call + 1, cached_tokens=cache.num_tokens, trie_nodes=cache.trie.num_nodes,
                             cache_bytes=cache.nbytes(), rss_growth=rss_bytes() - start_rss))
    seconds = time.perf_counter() - started
    print(f"{'calls':>6} {'cached tokens':>14} {'trie nodes':>11} {'cache MB':>9} {'B/token':>8} {'RSS +MB':>8}")
    for r in rows:
        print(f"{r['calls']:>6} {r['cached_tokens']:>14,} {r['trie_nodes']:>11,} {r['cache_bytes'] / 2**20:>9.1f} "
              f"{r['cache_bytes'] / max(1, r['cached_tokens']):>8.1f} {r['rss_growth'] / 2**20:>8.1f}")
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        os.makedirs(args.out, exist_ok=True)
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = [r["calls"] for r in rows]
        ax.plot(xs, [r["rss_growth"] / 2**20 for r in rows], marker="o", label="RSS growth (MB)")
        ax.plot(xs, [r["cache_bytes"] / 2**20 for r in rows], marker="s", label="cache estimate (MB)")
        ax.set_xlabel("calls")
        ax.set_ylabel("MB")
        ax.legend(loc="lower right")
        ax.set_title(f"suffix cache, budget {args.max_cached_tokens:,} tokens")
        fig.tight_layout()
        path = os.path.join(args.out, "suffix_cache_memory.png")
        fig.savefig(path, dpi=120)
        logger.info("wrote %s", path)
    last = rows[-1]
    print(json.dumps(dict(bench="suffix_cache_memory", calls=args.calls, seconds=round(seconds, 2),
                          us_per_token=round(1e6 * seconds / (args.calls * span), 2),
                          bytes_per_cached_token=round(last["cache_bytes"] / max(1, last["cached_tokens"]), 1),
                          cached_tokens=last["cached_tokens"], rss_growth_mb=round(last["rss_growth"] / 2**20, 1),
                          max_cached_tokens=args.max_cached_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
