"""Host-side cost per step of HVD's drafting and bookkeeping against the suffix drafter alone, without a target.

On the H200 the step split of `hvd.bench` puts HVD ~0.1 ms per step above suffix-only in drafting (features, the
payoff prediction, the policy) on agentic workloads where both verify the same cache drafts. This replays one
request's steps on the host: the cache drafter proposes, "verification" accepts the longest root path that matches a
known continuation (plus a bonus token), and both drafters are told; only propose + accept are timed.

Usage: python benchmarks/hvd_host_overhead.py --predictor checkpoints/payoff/qwen3_5-small --cost COST.json
"""
import statistics
import time

import torch
from transformers import AutoTokenizer

import hf_hybrid_spec as H
from hf_hybrid_spec.cli import argument_parser
from hf_hybrid_spec.drafters import DraftBudget, Drafter
from hf_hybrid_spec.drafters.suffix import SuffixDrafter
from hf_hybrid_spec.hvd.cost import CostProfile
from hf_hybrid_spec.hvd.drafter import HybridDrafter
from hf_hybrid_spec.hvd.modeling import load_predictor
from hf_hybrid_spec.hvd.policy import LearnedPolicy
from hf_hybrid_spec.tree import VerifyResult, empty_draft


class NoModel(Drafter):
    """A model drafter that proposes nothing (the replay never verifies a model draft)."""

    target_hidden_layers = ()

    def propose(self, input_ids, budget):
        return empty_draft(1, input_ids.device)


def verify(draft, future: list[int]) -> tuple[list[int], list[int]]:
    """Longest root path of `draft` matching `future`, as verify-tree node indices (root 0), and the committed
    tokens (accepted + bonus)."""
    parents = draft.parents[0].tolist() if draft.num_nodes else []
    tokens = draft.tokens[0].tolist() if draft.num_nodes else []
    path, node = [0], -1
    for tok in future[:-1]:
        child = next((i for i, (p, t) in enumerate(zip(parents, tokens)) if p == node and t == tok), None)
        if child is None:
            break
        path.append(child + 1)
        node = child
    return path, future[: len(path)]


def replay(drafter, ids: list[int], prompt_len: int, steps: int, budget: DraftBudget) -> list[float]:
    seq = torch.tensor([ids[:prompt_len + 1]])
    drafter.begin(seq[:, :prompt_len], None, None)
    first = ids[prompt_len]
    drafter.accept(seq, VerifyResult(path=[0], tokens=torch.tensor([first]), score_nodes=[0], token_list=[first]))
    times = []
    for _ in range(steps):
        length = seq.shape[1]
        if length + budget.max_depth + 1 >= len(ids):
            break
        t = time.perf_counter()
        draft = drafter.propose(seq, budget)
        t_draft = time.perf_counter() - t
        path, committed = verify(draft, ids[length : length + budget.max_depth + 1])
        seq = torch.tensor([ids[: length + len(committed)]])
        t = time.perf_counter()
        drafter.accept(seq, VerifyResult(path=path, tokens=torch.tensor(committed), score_nodes=path[:],
                                         token_list=committed))
        times.append(t_draft + time.perf_counter() - t)
    drafter.end(seq)
    return times


def main():
    parser = argument_parser(__doc__)
    parser.add_argument("--tokenizer", default="../shared/models/qwen3_5-small")
    parser.add_argument("--predictor", default="checkpoints/payoff/qwen3_5-small")
    parser.add_argument("--cost", required=True, help="a CostProfile JSON (hvd.bench writes cost_profile.json)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    # An agent-loop-like request: the continuation copies a stretch of the prompt, with edits.
    from hf_hybrid_spec.prompts import code_prompts
    text = "\n".join(code_prompts()[:8])
    ids = tok(text).input_ids
    prompt_len = len(ids)
    edited = [t if i % 37 else (t + 1) % tok.vocab_size for i, t in enumerate(ids[40:])]
    ids = ids + edited
    config = H.AssistantConfig(drafter="suffix", global_cache=False)
    budget = DraftBudget(max_nodes=config.max_draft_tokens, max_depth=config.max_depth)
    cost = CostProfile.load(args.cost)
    predictor = load_predictor(args.predictor)
    results = {}
    for name in ("suffix", "hvd") * args.repeats:
        suffix = SuffixDrafter(max_match_length=config.max_match_length, max_depth=config.max_depth, use_global=False)
        drafter = suffix if name == "suffix" else HybridDrafter(suffix, NoModel(), LearnedPolicy(predictor), cost)
        times = replay(drafter, ids, prompt_len, args.steps, budget)
        results.setdefault(name, []).append(1e6 * statistics.median(times))
    for name, values in results.items():
        print(f"{name:<7} median us per step (propose + accept), per repeat: "
              + " ".join(f"{v:.0f}" for v in values))
    print(f"hvd - suffix: {min(results['hvd']) - min(results['suffix']):.0f} us per step (best repeats)")


if __name__ == "__main__":
    main()
