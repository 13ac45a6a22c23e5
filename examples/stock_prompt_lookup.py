"""Stock prompt lookup on a hybrid model, beside the same kwargs after `hf_hybrid_spec.enable(model)`.

    python examples/stock_prompt_lookup.py                    # the qwen3_5-small fixture in fp32 when present
    python examples/stock_prompt_lookup.py --model tiny       # a random-init Qwen3.5-shaped model from a config

transformers up to 5.24 refuses `generate(prompt_lookup_num_tokens=...)` on Qwen3.5 ("not supported with stateful
models"). 5.25 runs it, but after a rejected draft it rolls back only the convolution states: the gated-delta
recurrent state keeps the rejected tokens (transformers issue #49036), so the output drifts from plain greedy
`generate`. After `enable(model)` the same kwargs run our n-gram drafter, which rebuilds the recurrent state of the
accepted path only: token for token plain greedy.

Prompts: windows of the sources of an installed package the fixtures never saw (networkx, a dependency of torch),
else the package's built-in code prompts. Everything runs in fp32 on the CPU, so a difference is not a near-tie of
low precision. Prints a table and a JSON line last; exits 1 if the enabled model ever differs from plain greedy.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from hf_hybrid_spec.cli import argument_parser


@dataclass
class Row:
    prompt: int
    prompt_tokens: int
    stock: str  # "identical", "differs at token K", or "refused: ..."
    enabled: str  # "identical" or "differs at token K"


def held_out_prompts(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """Windows of `tokens` tokens from networkx's sources (outside the fixtures' training data), else the built-in
    code prompts."""
    try:
        import networkx
    except ImportError:
        from hf_hybrid_spec.prompts import code_prompts

        return [tokenizer(text).input_ids for text in code_prompts(count)]
    files = sorted(Path(networkx.__file__).parent.rglob("*.py"))
    files = [f for f in files if "tests" not in f.parts and f.stat().st_size > 4000]
    out = []
    for path in files[:: max(1, len(files) // count)][:count]:
        ids = tokenizer(path.read_text(encoding="utf-8")).input_ids
        start = len(ids) // 3
        out.append(ids[start : start + tokens])
    return out


def first_difference(a: list[int], b: list[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"differs at token {i + 1}"
    return "identical" if len(a) == len(b) else f"differs in length ({len(a)} vs {len(b)})"


def compare(model, prompts: list[list[int]], new_tokens: int, lookup: int) -> list[Row]:
    """Plain greedy, stock prompt lookup, and prompt lookup after `enable` (on a copy of the call), per prompt."""
    import torch

    import hf_hybrid_spec

    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
              pad_token_id=0)
    rows = []
    for i, ids in enumerate(prompts):
        x = torch.tensor([ids])
        plain = model.generate(x, **kw)[0, len(ids):].tolist()
        try:
            stock = first_difference(model.generate(x, prompt_lookup_num_tokens=lookup, **kw)[0, len(ids):].tolist(),
                                     plain)
        except ValueError as err:
            stock = f"refused: {str(err).splitlines()[0][:60]}"
        rows.append(Row(i, len(ids), stock, ""))
    hf_hybrid_spec.enable(model)
    for row, ids in zip(rows, prompts):
        x = torch.tensor([ids])
        plain = model.generate(x, **kw)[0, len(ids):].tolist()
        ours = model.generate(x, prompt_lookup_num_tokens=lookup, **kw)[0, len(ids):].tolist()
        row.enabled = first_difference(ours, plain)
    return rows


def load(name: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_hybrid_spec.testing import fixture_path, tiny_model

    path = fixture_path("qwen3_5-small") if name == "fixture" else None
    if path is None:
        if name == "fixture":
            print("fixture ../shared/models/qwen3_5-small not found: a random-init Qwen3.5-shaped model instead")
        model = tiny_model("qwen3_5_text", vocab_size=96)
        return model, None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(path)


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--model", choices=["fixture", "tiny"], default="fixture")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--lookup", type=int, default=8, help="prompt_lookup_num_tokens")
    args = parser.parse_args(argv)

    import torch
    import transformers

    model, tokenizer = load(args.model)
    if tokenizer is None:
        gen = torch.Generator().manual_seed(0)
        # A short motif repeated with variations: n-gram matches, and drafts that are partly rejected.
        prompts = [(torch.randint(3, 96, (6,), generator=gen).tolist() * 8)[: args.prompt_tokens // 4]
                   for _ in range(args.prompts)]
    else:
        prompts = held_out_prompts(tokenizer, args.prompts, args.prompt_tokens)
    rows = compare(model, prompts, args.new_tokens, args.lookup)
    print(f"transformers {transformers.__version__}, {args.model}, fp32, greedy, {args.new_tokens} new tokens, "
          f"prompt_lookup_num_tokens={args.lookup}")
    print(f"{'prompt':>6} {'tokens':>6}  {'stock prompt lookup':<40} {'after enable(model)'}")
    for r in rows:
        print(f"{r.prompt:>6} {r.prompt_tokens:>6}  {r.stock:<40} {r.enabled}")
    exact = all(r.enabled == "identical" for r in rows)
    print(json.dumps({"transformers": transformers.__version__, "model": args.model,
                      "stock_differs": sum(r.stock.startswith("differs") for r in rows),
                      "stock_refused": sum(r.stock.startswith("refused") for r in rows),
                      "enabled_identical": sum(r.enabled == "identical" for r in rows), "prompts": len(rows),
                      "rows": [asdict(r) for r in rows]}))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
