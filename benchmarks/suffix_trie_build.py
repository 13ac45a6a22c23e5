"""Host time of the suffix drafter's tries per committed token: appended to the request's trie (`extend_many`) and
followed through the process-wide one (`follow_many`), for the Python trie (`SuffixTrie`) and the C one
(`NativeSuffixTrie`, where a compiler could build it) side by side.

What a request's trie costs as its prompt goes in (`begin`, a serving engine's `prefeed`) and as tokens are committed
(`accept`, `catch_up` in a batch's plain runs): on the H200 machine's host this growth is part of every speculative
serving step and, at large batches, of every plain step. The texts are the agentic workload suite's
(`benchmarks/workloads.json`: prompts, tool results, replies), tokenized with the fixture's tokenizer; each text builds
a trie of its own at the drafter's default depth (`max_match_length` 32 + `max_depth` 8); for `follow`, the texts after
the first `--trie-texts` (default: half) are followed through one trie holding those (the process-wide cache's work
per token when `global_cache=True`, the default; later calls of a session extend earlier ones, so more texts in the
trie means longer matches). Tokens go in `--chunk` at a time (default 8: about what a serving step commits per row; a
prompt goes in 256 at a time), the unit the drafter feeds them in.

A correctness gate first (each trie's counts against every substring counted directly, on a few texts), then the best
of `--repeats` timings, and a JSON line last.

    python benchmarks/suffix_trie_build.py --tokenizer ../shared/models/qwen3_5-small
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

from hf_hybrid_spec.cli import argument_parser
from hf_hybrid_spec.drafters.suffix import NativeSuffixTrie, SuffixTrie
from hf_hybrid_spec.drafters.suffix_native import native_available


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


def build(kind: type, tokens: list[int], depth: int, chunk: int):
    trie, active = kind(depth), []
    for i in range(0, len(tokens), chunk):
        active = trie.extend_many(active, tokens[i : i + chunk])
    return trie


def gate(kind: type, sequences: list[list[int]], depth: int) -> None:
    """Every substring's count in the trie equals its count in the text (walked from the root)."""
    for tokens in sequences:
        trie = build(kind, tokens, depth, 7)
        expected = Counter(tuple(tokens[i:j]) for i in range(len(tokens))
                           for j in range(i + 1, min(i + depth, len(tokens)) + 1))
        for sub, count in expected.items():
            node = 0
            for k, t in enumerate(sub):
                node = next(child for token, child in trie.children(node, k) if token == t)
            if trie.count(node) != count:
                raise SystemExit(f"gate failed ({kind.__name__}): a substring of {len(sub)} tokens counted "
                                 f"{trie.count(node)}, expected {count}")


def timings(kind: type, sequences: list[list[int]], args) -> tuple[float, float]:
    """Best seconds over `--repeats` to build every text's trie, and to follow the later texts through one trie."""
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        for s in sequences:
            build(kind, s, args.depth, args.chunk)
        best = min(best, time.perf_counter() - start)
    shared = kind(args.depth)
    half = len(sequences) // 2 if args.trie_texts is None else min(args.trie_texts, len(sequences) - 1)
    for s in sequences[:half]:
        shared.insert(s)
    best_follow = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        for s in sequences[half:]:
            active: list[int] = []
            for i in range(0, len(s), args.chunk):
                active = shared.follow_many(active, s[i : i + args.chunk])
        best_follow = min(best_follow, time.perf_counter() - start)
    return best, best_follow


def main(argv: list[str] | None = None) -> dict:
    parser = argument_parser(__doc__)
    parser.add_argument("--tokenizer", default=str(Path(__file__).resolve().parents[2] / "shared/models/qwen3_5-small"),
                        help="a tokenizer folder (default: the qwen3_5-small fixture's)")
    parser.add_argument("--suite", default=str(Path(__file__).with_name("workloads.json")))
    parser.add_argument("--texts", type=int, default=200, help="texts at most")
    parser.add_argument("--depth", type=int, default=40, help="trie depth (max_match_length + max_depth)")
    parser.add_argument("--trie-texts", type=int, default=None, help="texts in the followed trie (default: half)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=8, help="tokens fed per call (a serving step's commit per row)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    sequences = [tokenizer(t).input_ids for t in texts_of(Path(args.suite), args.texts)]
    kinds = [SuffixTrie] + ([NativeSuffixTrie] if native_available() else [])
    for kind in kinds:
        gate(kind, sequences[:3], args.depth)
    tokens = sum(len(s) for s in sequences)
    half = len(sequences) // 2 if args.trie_texts is None else min(args.trie_texts, len(sequences) - 1)
    followed = sum(len(s) for s in sequences[half:])
    result = {"bench": "suffix_trie_build", "texts": len(sequences), "tokens": tokens, "depth": args.depth,
              "chunk": args.chunk}
    print(f"| trie | texts | tokens | depth | extend us / token | follow us / token (best of {args.repeats}) |\n"
          f"| --- | ---: | ---: | ---: | ---: | ---: |")
    for kind in kinds:
        build_s, follow_s = timings(kind, sequences, args)
        name = "native" if kind is NativeSuffixTrie else "python"
        result[f"{name}_extend_us_per_token"] = 1e6 * build_s / tokens
        result[f"{name}_follow_us_per_token"] = 1e6 * follow_s / followed
        print(f"| {kind.__name__} | {len(sequences)} | {tokens} | {args.depth} | {1e6 * build_s / tokens:.2f} | "
              f"{1e6 * follow_s / followed:.2f} |")
    if len(kinds) == 1:
        print("(no C compiler here: the native trie was not built)")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
