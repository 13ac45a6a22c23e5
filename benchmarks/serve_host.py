"""Host cost per step of the serving engine, with the target's forward and commit taken out.

On the H200 the serving engine with speculation is host-bound at 16 slots (docs/benchmarks.md, "Serving agentic
sessions"): a step's own work on the host (drafting for every request, the budget, the trees, the verification's
bookkeeping, the records and stopping checks, the drafters' accept, the chunked prompts' trie feeding) costs more
than its verify forward. This measures that work alone, on any machine: the batched runner's verify forward is
replaced by one whose argmax at each node is the token of the node's first child with probability `--accept` (a
random token otherwise) and its commit by nothing, so the engine runs every step as it would, at an acceptance like
the fixtures', without the model. Requests: the agentic workload suite's first prompts (the fixture's tokenizer).

The replacement patches `StaticRunner`'s `_run` / `commit` / `commit_device` / `finish_commit` in this process
only. Correctness is not what this measures (the tokens are the fake forward's).

Usage: python benchmarks/serve_host.py [--requests 32] [--max-new-tokens 128] [--slots 16] [--budget] [--profile]
"""

from __future__ import annotations

import json
import os
import sys
import time
import types

import torch
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import load_suite  # noqa: E402

from hf_hybrid_spec.cli import argument_parser


class ArgmaxOnly:
    """What the engine reads of a verify forward's logits when every request decodes greedily: the argmax per node
    (`best` [R, n]), row / column slices and row selection; a single node's row (a prompt's last token, whose
    logits pick the first token) is a real [1, V] tensor."""

    def __init__(self, best: torch.Tensor, vocab: int):
        self.best, self.vocab = best, vocab

    def argmax(self, dim=-1):
        return self.best

    def __getitem__(self, index):
        if isinstance(index, tuple) and len(index) == 2 and isinstance(index[1], slice):
            return ArgmaxOnly(self.best[index], self.vocab)
        row = torch.zeros(1, self.vocab)
        row[0, 3] = 1.0
        return row

    def index_select(self, dim, index):
        return ArgmaxOnly(self.best.index_select(dim, index.cpu()), self.vocab)

    @property
    def shape(self):
        return (*self.best.shape, self.vocab)

    @property
    def device(self):
        return torch.device("cpu")


def patch_runner(vocab: int, accept: float, seed: int = 0) -> None:
    """Replace the batched runner's forward and commit (see the module docstring)."""
    from hf_hybrid_spec.engine import static

    generator = torch.Generator().manual_seed(seed)

    def run(self, bucket):
        tokens, parent = bucket.tokens, bucket.parent
        rows, n = tokens.shape
        is_child = parent.unsqueeze(1) == torch.arange(n).view(1, n, 1)  # [R, i, j]: j's parent is i
        has_child = is_child.any(-1)
        first = torch.where(has_child, is_child.float().argmax(-1), 0)
        keep = has_child & (torch.rand(rows, n, generator=generator) < accept)
        best = torch.where(keep, tokens.gather(1, first), torch.randint(3, vocab, (rows, n), generator=generator))
        return types.SimpleNamespace(logits=ArgmaxOnly(best, vocab), hidden_states=None)

    def done(self, *args):
        self._active = None

    runner = static.StaticRunner
    runner._run = run
    runner.commit = done
    runner.commit_device = lambda self, leaves: None
    runner.finish_commit = done


def main(argv=None) -> dict:
    parser = argument_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the qwen3_5-small fixture)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=600, help="each prompt's last tokens kept")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--accept", type=float, default=0.8, help="chance that a node's first child is accepted")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="one more run under cProfile: the top functions")
    parser.add_argument("--budget", action="store_true",
                        help="run the batch-wide budget's choice and selection every step, as the engine does on "
                             "CUDA (on the CPU it measures no cost model and skips them): a cost model shaped like "
                             "the H200's 16-slot verify forward, 1.3 ms plus 9 us per node of width")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_hybrid_spec as H
    from hf_hybrid_spec.serving.engine import ServingEngine, ServingRequest
    from hf_hybrid_spec.testing import fixture_path

    torch.manual_seed(0)
    path = args.model or fixture_path("qwen3_5-small")
    if path is None:
        parser.error("no --model and no qwen3_5-small fixture found (../shared/models)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = model.get_output_embeddings().weight.shape[0]
    patch_runner(vocab, args.accept)
    if args.budget:
        from hf_hybrid_spec.engine.budget import VerifyCost

        def cost_model(engine):
            widths = list(engine.backend.widths or [1, 8, 16, 32, 64])
            return VerifyCost(widths=widths, seconds=[1.3e-3 + 9e-6 * w for w in widths],
                              padded=engine.backend.widths is not None)

        ServingEngine._cost_model = cost_model
    suite = load_suite(os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads.json"))
    sessions = suite.select(workloads=("agent_loop", "code_edit", "tool_calls"), split="train",
                            interleave=True)[: args.requests]
    prompts = [tokenizer(s.texts[0])["input_ids"][-args.prompt_tokens :] for s in sessions]
    config = H.AssistantConfig(global_cache=False, compile=True)
    serving = H.ServingConfig(max_slots=args.slots, max_total_tokens=args.prompt_tokens + args.max_new_tokens + 1)

    def run():
        """Every request queued at once, the engine stepped until all are done: (seconds, outputs, stats)."""
        engine = ServingEngine(model, config, serving)
        outputs = [engine.add(ServingRequest(f"req_{i}", ids, args.max_new_tokens)) for i, ids in enumerate(prompts)]
        t0 = time.perf_counter()
        while engine.has_work:
            engine.step()
        return time.perf_counter() - t0, outputs, engine.stats

    run()  # warm-up
    best = None
    for _ in tqdm(range(args.repeats), desc="runs"):
        found = run()
        if best is None or found[0] < best[0]:
            best = found
    seconds, outputs, stats = best
    tokens = sum(len(o.generated_tokens) for o in outputs)
    result = {"requests": len(prompts), "slots": args.slots, "steps": stats.steps, "tokens": tokens,
              "tokens_per_step": round(tokens / max(stats.steps, 1), 2),
              "host_ms_per_step": round(1e3 * seconds / max(stats.steps, 1), 3),
              "draft_ms_per_step": round(1e3 * stats.draft_seconds / max(stats.steps, 1), 3),
              "verify_ms_per_step": round(1e3 * stats.verify_seconds / max(stats.steps, 1), 3),
              "record_ms_per_step": round(1e3 * stats.record_seconds / max(stats.steps, 1), 3)}
    print(f"{result['steps']} steps, {result['tokens_per_step']} tokens per step: host {result['host_ms_per_step']} ms "
          f"per step (drafting {result['draft_ms_per_step']}, forward + verification {result['verify_ms_per_step']}, "
          f"records {result['record_ms_per_step']})")
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        run()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats("hf_hybrid_spec", 30)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
