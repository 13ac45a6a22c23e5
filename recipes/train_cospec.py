"""Train a CoSpec arbiter by policy-gradient RL on rollouts of speculative generation.

    python recipes/train_cospec.py --target ../shared/models/qwen3_5-small --draft ../shared/models/falcon_h1-small \
        --task cospec_data --out checkpoints/arbiters/qwen3_5-small_drafted-by_falcon_h1-small --max-minutes 35

What one step does:

1. Prompts: `--prompts-per-step` rows of the task's train split (a `datasets` dataset built offline by
   `recipes/cospec_task.py`), each repeated `--num-generations` times by TRL's `RepeatSampler` (a GRPO group).
   With `--prefilter N` (default), the first N shuffled train rows are screened first with one teacher-forced
   forward per model: does the target's / the draft's greedy line equal the answer? Only rows where exactly one
   of them is right can move the correctness reward (where both are wrong, mixing them almost never helps; where
   both are right they rarely disagree inside the line), so training draws from those rows, plus a share
   `--other-fraction` of the rest so the speed term still sees ordinary rows. A rollout costs a target and a
   draft prefill and several forwards of each; the screen costs one forward per model, which is what makes RL
   affordable on a shared CPU.
2. Rollouts: for every copy, `model.generate(custom_generate=speculative_generate)` with the model drafter and
   `verification="cospec"`, the arbiter wrapped in a `SamplingArbiter`: at each draft/target mismatch it samples
   keep-the-draft ~ Bernoulli(sigmoid(log-odds)) and records the inputs, the action and its log-probability.
3. Reward (verifiable): 1 if the completed line equals the file's real next line, else 0, plus
   `--speed-weight` * (1 - target forwards / new tokens), the share of target forwards speculation saved.
4. Advantages: TRL GRPO's group-relative rule, reward minus the mean of the prompt's group, divided by the
   group's std when `scale_rewards="group"` (default "none", Dr. GRPO: the speed term's small differences must
   not be blown up to the size of a correctness difference in groups where no rollout is correct).
5. Update: GRPO's clipped surrogate (`epsilon`, `num_iterations` passes over the batch), averaged over decisions
   (DAPO normalisation), no KL term (`beta = 0`: there is no reference policy worth staying near). Decisions at
   positions the kept output never reached (past the end of the line) changed nothing and are masked.

Hyperparameters live in a `trl.GRPOConfig`, and the sampler is TRL's; the trainer class is not used because
`GRPOTrainer` optimises a language model that writes the completion token by token (it tokenises prompts,
generates with the policy model and scores per-token log-probs over its vocabulary). Here the policy is a
binary classifier that acts *inside* another model's decoding loop, at a variable number of mismatches per
rollout, and its actions change which tokens the target and the draft run next; none of GRPOTrainer's
generation or log-prob machinery applies, so this file keeps its advantage and loss rules and runs its own loop.

Every `--eval-every` steps the greedy arbiter (threshold 0.5) is scored on `--eval-examples` validation rows; the
best checkpoint by validation reward is kept. At the end, the decision threshold is chosen on the same rows among
`--thresholds` (highest accuracy, then fewest target forwards per token), and the arbiter is saved in Hub format
(config.json, model.safetensors, README.md model card) with `reward_curve.png` and `train_log.jsonl` beside it.

`--target tiny:<model_type>` / `--draft tiny:<model_type>` use random-weight models from the test suite's
configs with a byte-level tokenizer (258 tokens) built in memory: for smoke tests, no files needed.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hf_hybrid_spec.cli import argument_parser


def parse_args(argv=None):
    p = argument_parser(__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target model: path / Hub id, or tiny:<model_type>")
    p.add_argument("--draft", required=True, help="draft model (same tokenizer): path / Hub id, or tiny:<model_type>")
    p.add_argument("--task", required=True, help="directory of the task DatasetDict (recipes/cospec_task.py)")
    p.add_argument("--out", required=True, help="where the trained arbiter is saved (Hub format)")
    p.add_argument("--steps", type=int, default=10_000, help="most optimisation steps")
    p.add_argument("--prefilter", type=int, default=600, help="train rows screened by teacher forcing (0: off)")
    p.add_argument("--other-fraction", type=float, default=0.25, help="share of uninformative rows kept")
    p.add_argument("--screening-from", help="screening.jsonl of an earlier run (e.g. the swapped pairing) to reuse")
    p.add_argument("--max-minutes", type=float, default=35.0, help="wall-time bound of the training loop")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--num-generations", type=int, default=4, help="rollouts per prompt (GRPO group size)")
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--num-iterations", type=int, default=2, help="passes over each batch (GRPO's mu)")
    p.add_argument("--epsilon", type=float, default=0.2, help="clip range of the ratio")
    p.add_argument("--scale-rewards", default="none", choices=["none", "group", "batch"])
    p.add_argument("--speed-weight", type=float, default=0.2, help="weight of the saved-target-forwards term")
    p.add_argument("--max-depth", type=int, default=6, help="draft chain length")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--init-accept-prob", type=float, default=0.3)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-examples", type=int, default=40)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.5], help="decision thresholds tried at the end")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help, --version and bad options answer here, before torch and the models load

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cospec_task import MethodRun, load_task, method_config, run_method  # noqa: E402

from hf_hybrid_spec.cospec import CoSpecArbiter, CoSpecArbiterConfig, SamplingArbiter, decision_log_probs  # noqa: E402


# ---------------------------------------------------------------------------------------------------- models
def byte_tokenizer():
    """A byte-level tokenizer with no merges: ids 0 / 1 are <|endoftext|> / <|pad|>, then the 256 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|endoftext|>": 0, "<|pad|>": 1, **{ch: i + 2 for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


def load_models(target: str, draft: str):
    """(target, draft, tokenizer); `tiny:<model_type>` builds a random-weight model for the byte tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_hybrid_spec.testing import tiny_model

    if target.startswith("tiny:") != draft.startswith("tiny:"):
        raise ValueError("--target and --draft must both be tiny:<model_type> or both real checkpoints")
    if target.startswith("tiny:"):
        tokenizer = byte_tokenizer()
        vocab = len(tokenizer)
        return (tiny_model(target[5:], seed=0, vocab_size=vocab), tiny_model(draft[5:], seed=1, vocab_size=vocab),
                tokenizer)
    kwargs = dict(dtype=torch.float32, attn_implementation="sdpa")
    return (AutoModelForCausalLM.from_pretrained(target, **kwargs).eval(),
            AutoModelForCausalLM.from_pretrained(draft, **kwargs).eval(), AutoTokenizer.from_pretrained(target))


# ---------------------------------------------------------------------------------------------------- screening
@torch.no_grad()
def greedy_line_is_answer(model, tokenizer, example) -> bool:
    """Teacher-forced check that greedy decoding writes "\n" + answer and then ends the line (one forward)."""
    prompt = tokenizer(example["prompt"]).input_ids
    line = tokenizer("\n" + example["answer"]).input_ids
    ids = torch.tensor([prompt + line])
    logits = model(ids, logits_to_keep=len(line) + 1).logits[0]
    pred = logits.argmax(dim=-1).tolist()
    if pred[:-1] != line:
        return False
    return tokenizer.decode([pred[-1]]).startswith("\n")


def screen(rows, models, names, tokenizer, count: int, other_fraction: float, seed: int, known: dict):
    """Indices of `rows` to train on: informative ones (exactly one endpoint right) plus a share of the rest.

    `models` / `names`: (target, draft) and their names; `known` maps (name, row) to an earlier screen's answer
    (the other pairing screens the same rows with the roles swapped). Returns (keep, informative, table).
    """
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()[:count]
    informative, other, table = [], [], []
    for i in tqdm(order, desc="screening", unit="row"):
        ok = [known[(n, i)] if (n, i) in known else greedy_line_is_answer(m, tokenizer, rows[i])
              for m, n in zip(models, names)]
        table.append({"row": i, "correct": dict(zip(names, ok))})
        (informative if ok[0] != ok[1] else other).append(i)
    keep = informative + other[: round(other_fraction * len(informative) / max(1e-9, 1 - other_fraction))]
    return sorted(keep), informative, table


# ---------------------------------------------------------------------------------------------------- rollouts
@dataclass
class Rollout:
    """One sampled speculative generation: its decisions (masked to those that mattered) and reward."""

    run: MethodRun
    decisions: list
    reward: float


def reward_of(run: MethodRun, speed_weight: float) -> float:
    speed = 1.0 - run.target_forwards / max(run.new_tokens, 1)
    return float(run.correct) + speed_weight * speed


def rollout(example, policy: SamplingArbiter, models, tokenizer, args) -> Rollout:
    target, draft = models
    policy.reset()
    cfg = method_config("cospec", args.max_depth, arbiter=policy)
    run = run_method("cospec", example, target, draft, tokenizer, args.max_new_tokens, args.max_depth, config=cfg)
    end = len(tokenizer(example["prompt"]).input_ids) + run.new_tokens
    kept = [d for d in policy.decisions if d.position < end]
    return Rollout(run, kept, reward_of(run, args.speed_weight))


def group_advantages(rewards: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """TRL GRPO's rule: rewards [N] (N = groups * group) minus the group mean, over the group std if "group"."""
    grouped = rewards.view(-1, group)
    adv = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    if scale == "group":
        adv = adv / (grouped.std(dim=1, keepdim=True).expand_as(grouped).reshape(-1) + 1e-4)
    elif scale == "batch":
        adv = adv / (rewards.std() + 1e-4)
    return adv


def policy_loss(arbiter, rollouts: list[Rollout], advantages: torch.Tensor, eps_low: float, eps_high: float):
    """GRPO's clipped surrogate over every kept decision of the batch, averaged over decisions."""
    decisions, adv = [], []
    for r, a in zip(rollouts, advantages.tolist()):
        decisions += r.decisions
        adv += [a] * len(r.decisions)
    if not decisions:
        return None
    new = decision_log_probs(arbiter, decisions)
    old = torch.tensor([d.log_prob for d in decisions], device=new.device)
    adv_t = torch.tensor(adv, device=new.device)
    ratio = torch.exp(new - old)
    surrogate = torch.minimum(ratio * adv_t, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv_t)
    return -surrogate.mean()


# ---------------------------------------------------------------------------------------------------- evaluation
def evaluate(arbiter, rows, models, tokenizer, args, desc="validation") -> dict:
    """Greedy arbiter on `rows`: accuracy, target forwards per token, overrides per example, mean reward."""
    target, draft = models
    runs = [run_method("cospec", ex, target, draft, tokenizer, args.max_new_tokens, args.max_depth, arbiter=arbiter)
            for ex in tqdm(rows, desc=desc, leave=False)]
    tokens = max(1, sum(r.new_tokens for r in runs))
    return {
        "accuracy": sum(r.correct for r in runs) / len(runs),
        "forwards_per_token": sum(r.target_forwards for r in runs) / tokens,
        "overrides_per_example": sum(r.overrides for r in runs) / len(runs),
        "reward": sum(reward_of(r, args.speed_weight) for r in runs) / len(runs),
    }


def plot_curves(log: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [e for e in log if e["kind"] == "train"]
    val = [e for e in log if e["kind"] == "validation"]
    fig, axes = plt.subplots(1, 2 if val else 1, figsize=(11 if val else 6.5, 4), squeeze=False)
    ax1 = axes[0][0]
    steps = [e["step"] for e in train]
    rewards = [e["reward"] for e in train]
    ax1.plot(steps, rewards, alpha=0.35, label="batch mean reward")
    window = max(1, len(rewards) // 10)
    smooth = [sum(rewards[max(0, i - window + 1): i + 1]) / len(rewards[max(0, i - window + 1): i + 1])
              for i in range(len(rewards))]
    ax1.plot(steps, smooth, label=f"moving average ({window})")
    ax1.plot(steps, [e["accuracy"] for e in train], ".", alpha=0.3, label="batch accuracy")
    ax1.plot(steps, [e["accept_rate"] for e in train], ":", alpha=0.7, label="sampled keep-draft rate")
    ax1.set_xlabel("step")
    ax1.set_title("training rollouts (sampled arbiter)")
    ax1.legend()
    if val:
        ax2 = axes[0][1]
        vs = [e["step"] for e in val]
        ax2.plot(vs, [e["reward"] for e in val], "o-", label="reward")
        ax2.plot(vs, [e["accuracy"] for e in val], "s-", label="accuracy")
        ax2.plot(vs, [e["forwards_per_token"] for e in val], "^-", label="target forwards / token")
        ax2.set_xlabel("step")
        ax2.set_title("validation (greedy arbiter)")
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------- main
def main(argv=None):
    from trl import GRPOConfig
    from trl.trainer.utils import RepeatSampler

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grpo = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="cospec_grpo_"), num_generations=args.num_generations,
        per_device_train_batch_size=args.num_generations * args.prompts_per_step, learning_rate=args.learning_rate,
        num_iterations=args.num_iterations, epsilon=args.epsilon, scale_rewards=args.scale_rewards, beta=0.0,
        seed=args.seed, report_to=[], use_cpu=True,
    )
    eps_high = grpo.epsilon_high if grpo.epsilon_high is not None else grpo.epsilon

    target, draft, tokenizer = load_models(args.target, args.draft)
    start = time.time()  # --max-minutes bounds screening and training together
    task = load_task(args.task)
    train, val = task["train"], task["validation"].select(range(min(args.eval_examples, len(task["validation"]))))
    screened = None
    if args.prefilter > 0:
        known = {}
        if args.screening_from:
            with open(args.screening_from) as f:
                known = {(n, e["row"]): ok for e in map(json.loads, f) for n, ok in e["correct"].items()}
        keep, informative, table = screen(train, (target, draft), (args.target, args.draft), tokenizer,
                                          args.prefilter, args.other_fraction, args.seed, known)
        with open(out / "screening.jsonl", "w") as f:
            for entry in table:
                f.write(json.dumps(entry) + "\n")
        screened = {"rows": len(table), "informative": len(informative), "kept": len(keep),
                    "target_correct": sum(e["correct"][args.target] for e in table),
                    "draft_correct": sum(e["correct"][args.draft] for e in table)}
        tqdm.write(f"screening: {json.dumps(screened)}")
        if not keep:
            raise SystemExit("no train row has exactly one of target / draft right: nothing to learn from")
        train = train.select(keep)
    arbiter = CoSpecArbiter(CoSpecArbiterConfig(width=args.width, init_accept_prob=args.init_accept_prob))
    optim = torch.optim.AdamW(arbiter.parameters(), lr=grpo.learning_rate, weight_decay=0.0)
    policy = SamplingArbiter(arbiter, torch.Generator().manual_seed(args.seed))
    sampler = iter(RepeatSampler(train, mini_repeat_count=grpo.num_generations, batch_size=args.prompts_per_step,
                                 repeat_count=1, shuffle=True, seed=args.seed))
    models = (target, draft)
    log: list[dict] = []
    best = {"reward": -math.inf, "state": None, "step": 0}
    deadline = start + 60 * args.max_minutes
    bar = tqdm(total=args.steps, desc="steps", unit="step")
    step = 0
    while step < args.steps and time.time() < deadline:
        try:
            indices = [next(sampler) for _ in range(grpo.per_device_train_batch_size)]
        except StopIteration:
            sampler = iter(RepeatSampler(train, mini_repeat_count=grpo.num_generations,
                                         batch_size=args.prompts_per_step, shuffle=True, seed=args.seed + step))
            continue
        arbiter.eval()
        rollouts = [rollout(train[i], policy, models, tokenizer, args) for i in indices]
        rewards = torch.tensor([r.reward for r in rollouts])
        advantages = group_advantages(rewards, grpo.num_generations, grpo.scale_rewards)
        arbiter.train()
        losses = []
        for _ in range(grpo.num_iterations):
            loss = policy_loss(arbiter, rollouts, advantages, grpo.epsilon, eps_high)
            if loss is None or not bool(advantages.abs().sum() > 0):
                break
            optim.zero_grad()
            loss.backward()
            optim.step()
            losses.append(loss.item())
        step += 1
        n_dec = sum(len(r.decisions) for r in rollouts)
        entry = {
            "kind": "train", "step": step, "seconds": round(time.time() - start, 1),
            "reward": float(rewards.mean()), "accuracy": sum(r.run.correct for r in rollouts) / len(rollouts),
            "decisions": n_dec, "accept_rate": sum(d.accept for r in rollouts for d in r.decisions) / max(1, n_dec),
            "loss": losses[-1] if losses else None,
        }
        log.append(entry)
        bar.update(1)
        bar.set_postfix(reward=f"{entry['reward']:.3f}", acc=f"{entry['accuracy']:.2f}",
                        accept=f"{entry['accept_rate']:.2f}")
        if step % args.eval_every == 0:
            arbiter.eval()
            metrics = evaluate(arbiter, val, models, tokenizer, args)
            log.append({"kind": "validation", "step": step, **metrics})
            tqdm.write(f"step {step}: validation {json.dumps(metrics)}")
            if metrics["reward"] > best["reward"]:
                best = {"reward": metrics["reward"], "step": step,
                        "state": {k: v.detach().clone() for k, v in arbiter.state_dict().items()}}
    bar.close()
    if best["state"] is not None:
        arbiter.load_state_dict(best["state"])
    arbiter.eval()

    # Decision threshold on the validation rows: best accuracy, then fewest target forwards per token.
    choices = []
    for threshold in args.thresholds:
        arbiter.config.threshold = threshold
        choices.append((threshold, evaluate(arbiter, val, models, tokenizer, args, desc=f"threshold {threshold}")))
    threshold, chosen = max(choices, key=lambda c: (c[1]["accuracy"], -c[1]["forwards_per_token"]))
    log.append({"kind": "validation", "step": step, "threshold": threshold, **chosen})
    arbiter.config.threshold = threshold
    arbiter.config.training_summary = {
        "target": args.target, "draft": args.draft, "task": "next-line code completion (recipes/cospec_task.py)",
        "train_rows": len(train), "screening": screened, "validation_rows": len(val), "steps": step,
        "best_step": best["step"],
        "minutes": round((time.time() - start) / 60, 1), "reward": f"exact line + {args.speed_weight} * saved forwards",
        "grpo": {"num_generations": grpo.num_generations, "prompts_per_step": args.prompts_per_step,
                 "learning_rate": grpo.learning_rate, "num_iterations": grpo.num_iterations,
                 "epsilon": grpo.epsilon, "scale_rewards": grpo.scale_rewards},
        "max_depth": args.max_depth, "threshold": threshold,
        "validation": {str(t): m for t, m in choices},
    }
    arbiter.save_pretrained(out)
    with open(out / "train_log.jsonl", "w") as f:
        for entry in log:
            f.write(json.dumps(entry) + "\n")
    plot_curves(log, out / "reward_curve.png")
    print(json.dumps({"out": str(out), "steps": step, "best_step": best["step"], "threshold": threshold, **chosen}))


if __name__ == "__main__":
    main()
