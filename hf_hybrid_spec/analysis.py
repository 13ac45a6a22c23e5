"""Which self-speculative draft fits a model: ablation perplexity and measured acceptance.

    python -m hf_hybrid_spec.analysis --model ../shared/models/falcon_h1-small --out analysis_out

For one model and one text set this

1. builds every self-speculative draft kind that applies: `self_ssm` with each attention-suppression variant
   that fits the family (`hf_hybrid_spec.config.SSM_VARIANTS`) and `layerskip` at every exit layer E;
2. measures perplexity of the full model and of each ablation (the same restricted forward the drafter runs,
   over whole text chunks), and their ratio;
3. runs greedy speculative decoding with each draft as a chain of k = 1..4 tokens on prompts cut from the
   text set, after a correctness gate (every output must equal plain greedy `generate`), and reports the
   acceptance alpha(k) = accepted draft tokens / drafted tokens at draft length k (the definition of the
   component-aware self-speculation paper, arXiv 2605.01106), the mean accepted length and the wall-clock
   speedup over plain greedy (timed side by side, prompt by prompt, in the same process);
4. prints a table, writes a PNG (alpha against k; perplexity ratio against alpha) and results.json, prints a
   recommendation (the draft kind, exit layer and k with the best measured speedup) and a JSON line last.

Default text set: the built-in code prompts (`hf_hybrid_spec.prompts`, written for this project) plus the
Python sources of an installed package (`--package`, default `trl`, pinned by the project's dependencies).
networkx, sympy and pandas are refused: they are held out of the fixtures' training data for evaluation.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from .config import AssistantConfig
from .drafters.self_spec import restriction
from .generate import speculative_generate
from .models import get_adapter
from .prompts import code_prompts

__all__ = ["DraftKind", "KindResult", "AnalysisReport", "draft_kinds", "text_set", "perplexity", "analyze", "main"]

# Held out of the fixtures' training data for evaluation; never tuned against.
HELD_OUT_PACKAGES = ("networkx", "sympy", "pandas")


@dataclass
class DraftKind:
    """One self-speculative draft.

    Attributes:
        label: "self_ssm:<variant>" or "layerskip:E=<exit layer>".
        fields: the `AssistantConfig` fields that select it (drafter, ssm_variant, ssm_scale, exit_layer).
    """

    label: str
    fields: dict

    def assistant_config(self, k: int) -> AssistantConfig:
        """A chain of exactly k draft tokens."""
        return AssistantConfig(**self.fields, max_depth=k, max_draft_tokens=k, draft_top_k=1)

    def restricted(self, model: nn.Module) -> Callable:
        return restriction(model, self.fields["drafter"], ssm_variant=self.fields.get("ssm_variant", "zero_attention"),
                           ssm_scale=self.fields.get("ssm_scale", 1.5), exit_layer=self.fields.get("exit_layer"))


@dataclass
class KindResult:
    """Measurements of one draft kind.

    Attributes:
        perplexity: of the ablated model (the draft run as a language model) on the text chunks.
        ppl_ratio: perplexity / full-model perplexity.
        alpha: k -> accepted draft tokens / drafted tokens with chains of k.
        mean_accepted_length: k -> tokens committed per target forward (bonus included).
        speedup: k -> plain greedy seconds / speculative seconds over the same prompts (same run).
    """

    label: str
    fields: dict
    perplexity: float
    ppl_ratio: float
    alpha: dict[int, float] = field(default_factory=dict)
    mean_accepted_length: dict[int, float] = field(default_factory=dict)
    speedup: dict[int, float] = field(default_factory=dict)


@dataclass
class AnalysisReport:
    """Everything `analyze` measured.

    Attributes:
        full_perplexity: the unmodified model's perplexity on the same chunks.
        plain_seconds: plain greedy `generate` time over all prompts (the speedup baseline).
        gate_mismatches: speculative outputs that differed from plain greedy (must be 0).
        recommendation: best measured setting: {"label", "fields", "k", "speedup", "alpha", "mean_accepted_length"}.
        rank_agreement: Spearman correlation between -log(ppl ratio) and alpha at each k over the draft kinds
            (1.0: the perplexity ratio orders the drafts exactly as acceptance does); None with < 3 kinds.
    """

    model: str
    kind: str
    num_layers: int
    full_perplexity: float
    plain_seconds: float
    prompts: int
    new_tokens: int
    ks: list[int]
    results: list[KindResult]
    gate_mismatches: int
    recommendation: dict | None
    rank_agreement: dict[int, float | None]


# ---------------------------------------------------------------------- what to measure
def draft_kinds(model: nn.Module, exit_layers: list[int] | None = None,
                ssm_scales: tuple[float, ...] = (1.5,)) -> list[DraftKind]:
    """Every self-speculative draft that applies to `model`: the attention-suppression variants of its layout
    ("rescale_ssm" once per scale in `ssm_scales`) and layerskip at each E in `exit_layers` (default: all)."""
    adapter = get_adapter(model)
    kinds = []
    variants = {"parallel": ("zero_attention", "rescale_ssm"), "sequential": ("zero_attention", "skip_layer")}
    for variant in variants.get(adapter.kind, ()):
        if variant == "rescale_ssm":
            for scale in ssm_scales:
                fields = dict(drafter="self_ssm", ssm_variant=variant, ssm_scale=scale)
                kinds.append(DraftKind(f"self_ssm:{variant}x{scale:g}", fields))
        else:
            kinds.append(DraftKind(f"self_ssm:{variant}", dict(drafter="self_ssm", ssm_variant=variant)))
    num_layers = len(adapter.decoder_layers(model))
    for e in exit_layers or range(1, num_layers):
        if not 1 <= e < num_layers:
            raise ValueError(f"exit layer {e} is outside [1, {num_layers - 1}] for this {num_layers}-layer model")
        kinds.append(DraftKind(f"layerskip:E={e}", dict(drafter="layerskip", exit_layer=e)))
    return kinds


def text_set(package: str | None = "trl", with_prompts: bool = True, max_files: int = 200) -> list[str]:
    """The built-in code prompts plus the .py files of an installed `package` (sorted by path)."""
    texts = list(code_prompts()) if with_prompts else []
    if package:
        if package.split(".")[0] in HELD_OUT_PACKAGES:
            raise ValueError(f"{package} is held out of the fixtures' training data for evaluation; "
                             "do not analyse or tune against it")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"package {package!r} is not installed (or is a single module): pick another --package")
        root = Path(next(iter(spec.submodule_search_locations)))
        files = sorted(root.rglob("*.py"))[:max_files]
        texts += [f.read_text(encoding="utf-8", errors="replace") for f in files]
    if not texts:
        raise ValueError("the text set is empty")
    return texts


def token_stream(texts: list[str], tokenizer, eos_token_id: int | None) -> torch.Tensor:
    """All texts tokenized and joined with eos: [T] int64."""
    parts = []
    for text in texts:
        parts.append(torch.tensor(tokenizer(text).input_ids, dtype=torch.long))
        if eos_token_id is not None:
            parts.append(torch.tensor([eos_token_id]))
    return torch.cat(parts)


def evenly_spaced_windows(stream: torch.Tensor, count: int, length: int) -> list[torch.Tensor]:
    """`count` windows [1, length] at evenly spaced offsets of `stream` (deterministic)."""
    if stream.numel() < length + 1:
        raise ValueError(f"the text set has {stream.numel()} tokens, fewer than one window of {length}")
    last = stream.numel() - length
    starts = [round(i * last / max(1, count - 1)) for i in range(count)] if count > 1 else [0]
    return [stream[s : s + length].view(1, -1) for s in starts]


@torch.no_grad()
def perplexity(model: nn.Module, chunks: list[torch.Tensor], restricted: Callable | None = None) -> float:
    """exp(mean next-token NLL) over `chunks` ([1, T] each), under `restricted()` when given."""
    total, count = 0.0, 0
    for chunk in chunks:
        chunk = chunk.to(model.device)
        if restricted is None:
            logits = model(input_ids=chunk, use_cache=False).logits
        else:
            with restricted():
                logits = model(input_ids=chunk, use_cache=False).logits
        nll = torch.nn.functional.cross_entropy(logits[0, :-1].float(), chunk[0, 1:], reduction="sum")
        total += float(nll)
        count += chunk.shape[1] - 1
    return math.exp(total / count)


def _spearman(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3:
        return None

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for t in range(i, j + 1):
                r[order[t]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    sy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return None if sx == 0 or sy == 0 else cov / (sx * sy)


# ---------------------------------------------------------------------- the study
def analyze(model: nn.Module, prompts: list[torch.Tensor], chunks: list[torch.Tensor], kinds: list[DraftKind],
            ks: tuple[int, ...] = (1, 2, 3, 4), new_tokens: int = 48, name: str = "model",
            progress: bool = True) -> AnalysisReport:
    """Perplexity of each ablation on `chunks` and acceptance / speedup of each draft on `prompts` ([1, L] each)."""
    adapter = get_adapter(model)
    device = model.device
    gen = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None)
    full_ppl = perplexity(model, chunks)
    results = []
    for kind in tqdm(kinds, desc="perplexity", disable=not progress):
        ppl = perplexity(model, chunks, kind.restricted(model))
        results.append(KindResult(kind.label, kind.fields, ppl, ppl / full_ppl))

    # Warm up each path once so first-call costs do not land in one method's time.
    warm = prompts[0].to(device)
    model.generate(warm, **dict(gen, max_new_tokens=4, min_new_tokens=4))
    for kind in kinds:
        model.generate(warm, custom_generate=speculative_generate, assistant_config=kind.assistant_config(ks[0]),
                       **dict(gen, max_new_tokens=4, min_new_tokens=4))

    plain_seconds = 0.0
    seconds = {(i, k): 0.0 for i in range(len(kinds)) for k in ks}
    accepted = {key: 0 for key in seconds}
    drafted = {key: 0 for key in seconds}
    committed = {key: [] for key in seconds}
    mismatches = 0
    # Prompt-major order: plain greedy and every draft run back to back on each prompt, so machine noise
    # spreads over all methods alike.
    for ids in tqdm(prompts, desc="acceptance", disable=not progress):
        ids = ids.to(device)
        t = time.perf_counter()
        ref = model.generate(ids, **gen)
        plain_seconds += time.perf_counter() - t
        for i, kind in enumerate(kinds):
            for k in ks:
                t = time.perf_counter()
                out = model.generate(ids, custom_generate=speculative_generate, assistant_config=kind.assistant_config(k),
                                     return_dict_in_generate=True, **gen)
                seconds[(i, k)] += time.perf_counter() - t
                mismatches += int(not torch.equal(out.sequences, ref))
                stats = out.spec_stats
                accepted[(i, k)] += sum(stats.accepted_lengths) - len(stats.accepted_lengths)
                drafted[(i, k)] += sum(stats.drafted_tokens)
                committed[(i, k)] += stats.accepted_lengths
    for i, r in enumerate(results):
        for k in ks:
            r.alpha[k] = accepted[(i, k)] / max(1, drafted[(i, k)])
            r.mean_accepted_length[k] = sum(committed[(i, k)]) / max(1, len(committed[(i, k)]))
            r.speedup[k] = plain_seconds / max(seconds[(i, k)], 1e-9)

    best = max(((r, k) for r in results for k in ks), key=lambda rk: rk[0].speedup[rk[1]], default=None)
    recommendation = None
    if best is not None:
        r, k = best
        recommendation = dict(label=r.label, fields=r.fields, k=k, speedup=r.speedup[k], alpha=r.alpha[k],
                              mean_accepted_length=r.mean_accepted_length[k])
    agreement = {k: _spearman([-math.log(r.ppl_ratio) for r in results], [r.alpha[k] for r in results]) for k in ks}
    return AnalysisReport(
        model=name, kind=adapter.kind, num_layers=len(adapter.decoder_layers(model)), full_perplexity=full_ppl,
        plain_seconds=plain_seconds, prompts=len(prompts), new_tokens=new_tokens, ks=list(ks), results=results,
        gate_mismatches=mismatches, recommendation=recommendation, rank_agreement=agreement,
    )


# ---------------------------------------------------------------------- reporting
def format_table(report: AnalysisReport) -> str:
    ks = report.ks
    head = f"{'draft':<26}{'ppl':>9}{'ratio':>9}" + "".join(f"{'a@' + str(k):>8}" for k in ks)
    head += "".join(f"{'tau@' + str(k):>8}" for k in ks) + "".join(f"{'x@' + str(k):>7}" for k in ks)
    lines = [head, f"{'full model':<26}{report.full_perplexity:>9.3f}{1.0:>9.2f}"]
    for r in report.results:
        row = f"{r.label:<26}{r.perplexity:>9.3f}{r.ppl_ratio:>9.2f}"
        row += "".join(f"{r.alpha[k]:>8.3f}" for k in ks)
        row += "".join(f"{r.mean_accepted_length[k]:>8.2f}" for k in ks)
        row += "".join(f"{r.speedup[k]:>7.2f}" for k in ks)
        lines.append(row)
    return "\n".join(lines)


def plot(report: AnalysisReport, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in report.results:
        left.plot(report.ks, [r.alpha[k] for k in report.ks], marker="o", label=r.label)
    left.set_xlabel("draft length k")
    left.set_ylabel("acceptance alpha (accepted / drafted)")
    left.set_xticks(report.ks)
    left.set_ylim(0, 1)
    left.set_title(f"{report.model}: acceptance")
    left.legend(fontsize=7)
    k_mid = report.ks[min(1, len(report.ks) - 1)]
    for drafter, marker in (("self_ssm", "s"), ("layerskip", "o")):
        rows = [r for r in report.results if r.fields["drafter"] == drafter]
        right.scatter([r.ppl_ratio for r in rows], [r.alpha[k_mid] for r in rows], marker=marker, label=drafter)
        for r in rows:
            right.annotate(r.label.split(":", 1)[1], (r.ppl_ratio, r.alpha[k_mid]), fontsize=7, xytext=(3, 3),
                           textcoords="offset points")
    right.legend(fontsize=7)
    right.set_xscale("log")
    right.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    right.set_xlabel("perplexity ratio (ablated / full)")
    right.set_ylabel(f"alpha at k={k_mid}")
    right.set_title("does the perplexity ratio predict acceptance?")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _load(spec: str, dtype: torch.dtype, device: str):
    if spec.startswith("tiny:"):
        from .testing import tiny_model

        return tiny_model(spec.split(":", 1)[1], dtype=dtype).to(device), None
    model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    return model, AutoTokenizer.from_pretrained(spec)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m hf_hybrid_spec.analysis", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="local path / Hub id, or tiny:<model_type> (random weights, "
                                                       "random-token text: a smoke test)")
    parser.add_argument("--package", default="trl", help="installed package whose .py files join the text set "
                                                         "('' for the built-in prompts only)")
    parser.add_argument("--max-files", type=int, default=200, help="most .py files taken from --package")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts for the acceptance runs")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=48, help="greedy tokens generated per prompt and run")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4], help="draft lengths")
    parser.add_argument("--ppl-chunks", type=int, default=16, help="text chunks for perplexity")
    parser.add_argument("--ppl-tokens", type=int, default=256, help="tokens per perplexity chunk")
    parser.add_argument("--exit-layers", type=int, nargs="+", default=None, help="layerskip exits (default: all)")
    parser.add_argument("--ssm-scales", type=float, nargs="+", default=[1.5],
                        help="SSM multipliers tried with the rescale_ssm variant (parallel hybrids)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", default=None, help="directory for results.json and analysis.png")
    parser.add_argument("--allow-mismatch", action="store_true",
                        help="report but do not fail when a speculative output differs from plain greedy")
    args = parser.parse_args(argv)
    if any(k < 1 for k in args.ks):
        parser.error("--ks must be positive")

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = _load(args.model, getattr(torch, args.dtype), args.device)
    kinds = draft_kinds(model, args.exit_layers, tuple(args.ssm_scales))
    if not kinds:
        parser.error(f"no self-speculative draft applies to {args.model}")
    if tokenizer is None:
        vocab = model.config.get_text_config().vocab_size
        stream = torch.randint(2, vocab, (args.ppl_chunks * args.ppl_tokens + args.prompt_tokens,),
                               generator=torch.Generator().manual_seed(0))
    else:
        stream = token_stream(text_set(args.package or None, max_files=args.max_files), tokenizer, tokenizer.eos_token_id)
    chunks = evenly_spaced_windows(stream, args.ppl_chunks, args.ppl_tokens)
    prompts = evenly_spaced_windows(stream, args.num_prompts, args.prompt_tokens)
    report = analyze(model, prompts, chunks, kinds, tuple(args.ks), args.new_tokens, name=args.model)

    print(f"\nmodel={args.model} ({report.kind} hybrid, {report.num_layers} layers) device={args.device} "
          f"dtype={args.dtype} prompts={report.prompts}x{args.prompt_tokens} tokens, {args.new_tokens} new tokens; "
          f"text: built-in prompts + {args.package or 'nothing else'}")
    print(f"correctness gate: {'PASS' if report.gate_mismatches == 0 else 'FAIL'} "
          f"({report.gate_mismatches} speculative outputs differ from plain greedy)")
    print(format_table(report))
    print("a@k: acceptance at draft length k; tau@k: tokens per target forward; x@k: wall-clock speedup vs plain "
          "greedy (same run)")
    print("rank agreement of perplexity ratio with alpha (Spearman): "
          + ", ".join(f"k={k}: {'n/a' if v is None else f'{v:+.2f}'}" for k, v in report.rank_agreement.items()))
    rec = report.recommendation
    setting = (f"{rec['label']} with chains of k={rec['k']} (alpha {rec['alpha']:.3f}, {rec['mean_accepted_length']:.2f} "
               f"tokens per target forward, measured {rec['speedup']:.2f}x here): AssistantConfig("
               f"{', '.join(f'{a}={b!r}' for a, b in rec['fields'].items())}, max_depth={rec['k']})")
    if rec["speedup"] >= 1.0:
        print(f"recommendation: {setting}")
    else:
        print(f"recommendation: plain greedy decoding; no self-speculative draft beat it on this machine. The best "
              f"was {setting}")
    summary = asdict(report)
    summary["device"] = args.device
    summary["dtype"] = args.dtype
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        plot(report, os.path.join(args.out, "analysis.png"))
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary))
    if report.gate_mismatches and not args.allow_mismatch:
        sys.exit(1)
    return summary


if __name__ == "__main__":
    main()
