"""Host time of the suffix drafter's tries per committed token: appended to the request's trie (`SuffixTrie.extend`)
and followed through the process-wide one (`SuffixTrie.follow`).

What a request's trie costs as its prompt goes in (`begin`, a serving engine's `prefeed`) and as tokens are committed
(`accept`, `catch_up` in a batch's plain runs): on the H200 machine's host this growth is part of every speculative
serving step and, at large batches, of every plain step. The texts are the agentic workload suite's
(`benchmarks/workloads.json`: prompts, tool results, replies), tokenized with the fixture's tokenizer; each text builds
a trie of its own at the drafter's default depth (`max_match_length` 32 + `max_depth` 8); for `follow`, the texts after
the first `--trie-texts` (default: half) are followed token by token through one trie holding those (the process-wide
cache's work per token when `global_cache=True`, the default; later calls of a session extend earlier ones, so more
texts in the trie means longer matches).

A correctness gate first (the compact trie's counts against every substring counted directly, on a few texts), then
the best of `--repeats` timings, and a JSON line last.

    python benchmarks/suffix_trie_build.py --tokenizer ../shared/models/qwen3_5-small
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from hf_hybrid_spec.drafters.suffix import SuffixTrie


def texts_of(suite: Path, limit: int) -> list[str]:
    """The suite's strings longer than 200 characters (prompts, tool results, replies), in file order."""
    found: list[str] = []

    def walk(node) -> None:
        if isinstance(node, str) and len(node) > 200:
            found.append(node)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(suite.read_text()))
    return found[:limit]


def build(tokens: list[int], depth: int) -> SuffixTrie:
    trie, active = SuffixTrie(depth), []
    for t in tokens:
        active = trie.extend(active, t)
    return trie


def gate(sequences: list[list[int]], depth: int) -> None:
    """Every substring's count in the trie equals its count in the text (walked from the root)."""
    for tokens in sequences:
        trie = build(tokens, depth)
        expected = Counter(tuple(tokens[i:j]) for i in range(len(tokens))
                           for j in range(i + 1, min(i + depth, len(tokens)) + 1))
        for sub, count in expected.items():
            node = 0
            for k, t in enumerate(sub):
                node = next(child for token, child in trie.children(node, k) if token == t)
            if trie.count(node) != count:
                raise SystemExit(f"gate failed: a substring of {len(sub)} tokens counted {trie.count(node)}, "
                                 f"expected {count}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=str(Path(__file__).resolve().parents[2] / "shared/models/qwen3_5-small"),
                        help="a tokenizer folder (default: the qwen3_5-small fixture's)")
    parser.add_argument("--suite", default=str(Path(__file__).with_name("workloads.json")))
    parser.add_argument("--texts", type=int, default=200, help="texts at most")
    parser.add_argument("--depth", type=int, default=40, help="trie depth (max_match_length + max_depth)")
    parser.add_argument("--trie-texts", type=int, default=None, help="texts in the followed trie (default: half)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    sequences = [tokenizer(t).input_ids for t in texts_of(Path(args.suite), args.texts)]
    gate(sequences[:3], args.depth)
    tokens = sum(len(s) for s in sequences)
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        for s in sequences:
            build(s, args.depth)
        best = min(best, time.perf_counter() - start)
    shared = SuffixTrie(args.depth)
    half = len(sequences) // 2 if args.trie_texts is None else min(args.trie_texts, len(sequences) - 1)
    for s in sequences[:half]:
        shared.insert(s)
    followed = sum(len(s) for s in sequences[half:])
    best_follow = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        for s in sequences[half:]:
            active: list[int] = []
            for t in s:
                active = shared.follow(active, t)
        best_follow = min(best_follow, time.perf_counter() - start)
    result = {"bench": "suffix_trie_build", "texts": len(sequences), "tokens": tokens, "depth": args.depth,
              "extend_us_per_token": 1e6 * best / tokens, "follow_us_per_token": 1e6 * best_follow / followed}
    print(f"| texts | tokens | depth | extend us / token | follow us / token (best of {args.repeats}) |\n"
          f"| ---: | ---: | ---: | ---: | ---: |\n| {len(sequences)} | {tokens} | {args.depth} | "
          f"{result['extend_us_per_token']:.2f} | {result['follow_us_per_token']:.2f} |")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
