"""Train the HVD payoff predictor for a target and its model drafter: collect labels, train, evaluate, save.

    python recipes/train_payoff.py --target ../shared/models/qwen3_5-small \\
        --eagle checkpoints/drafters/qwen3_5-small-eagle3 --out checkpoints/payoff/qwen3_5-small --work runs/payoff-qwen

Stages (`--stages`, default all; `collect` is skipped when `--work` already holds data collected with the same
settings):

1. collect: label collection. The train-split sessions of the workload suite (`benchmarks/workloads.py`,
   built offline from bfcl-eval and the built-in code prompts; never networkx, sympy or pandas) run through
   `speculative_generate` with a `HybridDrafter` in collection mode (`CollectPolicy`): every step the cache
   (suffix) drafter and the model drafter both propose, the target verifies ONE tree merging the two, and the step
   record keeps the features and the realized payoff of the cache draft, the model draft and the merge (greedy: each
   one's longest greedy-matching root path, read off the verified path). The decoding loop itself is untouched and
   the outputs are the target's greedy outputs, which the next call of the session carries. The held-out sessions
   are collected the same way, for evaluation only. Rows go into a `datasets.DatasetDict` under `--work/data`.
2. train: a `PayoffPredictor` (two small MLPs) with the transformers `Trainer`, Huber loss on the realized payoffs,
   inputs standardized with the training rows' mean and std; a sixth of the training sessions is the validation
   set that picks the best epoch.
3. evaluate: on the held-out sessions, per head: MAE, Spearman rank correlation, the MAE of a constant predictor,
   and a calibration plot (`calibration.png`); for the cache head also the suffix drafter's own score (the sum of
   its path probabilities, SuffixDecoding's estimate of the accepted length) as a baseline predictor.
4. save: `save_pretrained(--out)` (config, safetensors, a model card with the training record) plus metrics.json.

`--help` lists every option. CPU is fine: collection dominates (one verify forward per step); training takes
seconds. Run it bounded on shared machines: `nice -n 19 ... --max-minutes 40 --threads 1`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

from hf_hybrid_spec.cli import argument_parser, resolve_device


STAGES = ("collect", "train", "evaluate", "save")


def parse_args(argv=None) -> argparse.Namespace:
    p = argument_parser(__doc__)
    p.add_argument("--target", required=True, help="target model directory or Hub id")
    p.add_argument("--eagle", default=None, help="EAGLE-3 drafter (EagleDrafter directory / Hub id) for the target")
    p.add_argument("--assistant", default=None, help="or an assistant causal LM as the model drafter")
    p.add_argument("--workloads", default="benchmarks/workloads.json", help="the workload suite's JSON file")
    p.add_argument("--out", required=True, help="where the trained predictor is saved (Hub format)")
    p.add_argument("--work", required=True, help="working directory: collected data, trainer checkpoints")
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--recollect", action="store_true", help="collect again even when --work holds data")
    p.add_argument("--train-sessions", type=int, default=None, help="train-split sessions per workload (all)")
    p.add_argument("--heldout-sessions", type=int, default=None, help="held-out sessions per workload (all)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per call")
    p.add_argument("--max-draft-tokens", type=int, default=32, help="cache draft budget (HVD's max_draft_tokens)")
    p.add_argument("--max-depth", type=int, default=12, help="deepest draft node (HVD's max_depth)")
    p.add_argument("--model-tokens", type=int, default=24, help="model drafter's tree nodes (hvd_model_tokens)")
    p.add_argument("--model-depth", type=int, default=6, help="model drafter's tree depth (hvd_model_depth)")
    p.add_argument("--top-k", type=int, default=8, help="model drafter's children per expanded node (draft_top_k)")
    p.add_argument("--merged-share", type=float, default=0.6,
                   help="share of collection steps that verify the merged tree (the others: one draft alone)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop collecting new sessions after this long")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--huber-delta", type=float, default=0.5,
                   help="Huber loss delta: small values fit the median payoff (low MAE), large ones the mean")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=1e-3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="auto", help="'auto': cuda where a GPU is seen, else cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if (args.eagle is None) == (args.assistant is None):
        p.error("give exactly one model drafter: --eagle or --assistant")
    args.device = resolve_device(args.device)
    return args


if __name__ == "__main__":
    parse_args()  # --help, --version and bad options answer here, before torch and the models load

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers.utils import logging  # noqa: E402

# The workload suite and the session runner live with the benchmarks (the suite is also what they run).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from sessions import LABEL_COLUMNS, record_rows, timed_generate  # noqa: E402
from workloads import load_suite  # noqa: E402

from hf_hybrid_spec import AssistantConfig  # noqa: E402
from hf_hybrid_spec.drafters import clear_global_suffix_cache, make_drafter  # noqa: E402
from hf_hybrid_spec.hvd import (  # noqa: E402
    FEATURE_NAMES,
    HEADS,
    CollectPolicy,
    HybridDrafter,
    PayoffPredictor,
    PayoffPredictorConfig,
)
from hf_hybrid_spec.hvd.factory import make_model_drafter  # noqa: E402
from hf_hybrid_spec.hvd.metrics import payoff_metrics, plot_calibration  # noqa: E402

logger = logging.get_logger("train_payoff")


def load_models(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, attn_implementation="sdpa")
    target = target.to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    if args.eagle is not None:
        from hf_hybrid_spec.eagle import EagleDrafter

        draft = EagleDrafter.from_pretrained(args.eagle).to(device=args.device, dtype=dtype).eval()
    else:
        draft = AutoModelForCausalLM.from_pretrained(args.assistant, dtype=dtype, attn_implementation="sdpa")
        draft = draft.to(args.device).eval()
    return target, tokenizer, draft


def collection_settings(args) -> dict:
    """What the collected data depends on (a rerun with other settings collects again)."""
    keys = ("target", "eagle", "assistant", "workloads", "train_sessions", "heldout_sessions", "max_new_tokens",
            "max_draft_tokens", "max_depth", "model_tokens", "model_depth", "top_k", "merged_share", "dtype", "seed")
    return {k: getattr(args, k) for k in keys}


def collect(args, target, tokenizer, draft) -> dict[str, list[dict]]:
    """Stage 1: run the sessions with a collecting HybridDrafter; rows per split."""
    suite = load_suite(args.workloads)
    config = AssistantConfig(drafter="suffix", max_draft_tokens=args.max_draft_tokens, max_depth=args.max_depth,
                             draft_top_k=args.top_k)
    # The verified tree holds both drafts in full; the cache draft keeps its deployed budget.
    loop_config = config.replace(max_draft_tokens=args.max_draft_tokens + args.model_tokens)
    gen_kwargs = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, eos_token_id=None,
                      pad_token_id=tokenizer.pad_token_id)
    rows: dict[str, list[dict]] = {"train": [], "heldout": []}
    start = time.perf_counter()
    for split, per_workload in (("train", args.train_sessions), ("heldout", args.heldout_sessions)):
        # Each split starts from an empty process-wide suffix cache, as a fresh server would.
        clear_global_suffix_cache()
        sessions = suite.select(split=split, per_workload=per_workload, interleave=True)
        for session in tqdm(sessions, desc=f"collect {split}"):
            if split == "train" and args.max_minutes and time.perf_counter() - start > 60 * args.max_minutes:
                logger.warning("collection stopped after %.1f minutes (--max-minutes)", args.max_minutes)
                break
            outputs: list[str] = []
            for call in range(session.num_calls):
                ids = tokenizer(session.prompt(call, outputs), return_tensors="pt").input_ids.to(args.device)
                drafter = HybridDrafter(make_drafter(config, target), make_model_drafter(config, target, draft),
                                        CollectPolicy(args.merged_share, seed=args.seed * 100003 + len(rows[split])),
                                        model_tokens=args.model_tokens, model_depth=args.model_depth,
                                        cache_tokens=args.max_draft_tokens, record=True)
                run = timed_generate(target, ids, gen_kwargs, assistant_config=loop_config, drafter=drafter)
                outputs.append(tokenizer.decode(run.sequences[0, ids.shape[1]:]))
                rows[split] += record_rows(drafter.records, session, call)
    clear_global_suffix_cache()
    return rows


def to_datasets(rows: dict[str, list[dict]], seed: int):
    """DatasetDict(train, validation, heldout): validation = a sixth of the training sessions (at least one), chosen
    by a hash of their ids."""
    from datasets import Dataset, DatasetDict

    sessions = sorted({r["session"] for r in rows["train"]},
                      key=lambda s: hashlib.sha1(f"{seed}:{s}".encode()).hexdigest())
    if len(sessions) < 2 or not rows["heldout"]:
        raise ValueError(f"need at least 2 training sessions and some held-out steps, got {len(sessions)} sessions "
                         f"and {len(rows['heldout'])} held-out steps")
    valid = set(sessions[: max(1, len(sessions) // 6)])

    def build(items: list[dict]) -> Dataset:
        table = {k: [r[k] for r in items] for k in ("features", "session", "workload", "call", "position", "option")}
        table["labels"] = [[r[c] for c in LABEL_COLUMNS] for r in items]
        return Dataset.from_dict(table)

    train = [r for r in rows["train"] if r["session"] not in valid]
    validation = [r for r in rows["train"] if r["session"] in valid]
    return DatasetDict(train=build(train), validation=build(validation), heldout=build(rows["heldout"]))


def standardization(features: torch.Tensor) -> tuple[list[float], list[float]]:
    mean = features.mean(0)
    std = features.std(0)
    # A constant feature (e.g. one the data never varied) passes through unscaled.
    std = torch.where(std > 1e-6, std, torch.ones_like(std))
    return mean.tolist(), std.tolist()


def train(args, data, drafters: dict) -> PayoffPredictor:
    """Stage 2: the transformers Trainer on the train split, best epoch by validation loss."""
    from transformers import Trainer, TrainingArguments

    features = torch.tensor(data["train"]["features"], dtype=torch.float32)
    mean, std = standardization(features)
    config = PayoffPredictorConfig(width=args.width, num_layers=args.num_layers, feature_mean=mean, feature_std=std,
                                   huber_delta=args.huber_delta, drafters=drafters)
    torch.manual_seed(args.seed)
    model = PayoffPredictor(config)

    def compute_metrics(pred) -> dict:
        payoffs = torch.as_tensor(pred.predictions)
        labels = torch.as_tensor(pred.label_ids)
        return {f"mae_{h}": payoff_metrics(payoffs[:, i], labels[:, i]).mae for i, h in enumerate(HEADS)}

    training_args = TrainingArguments(
        output_dir=os.path.join(args.work, "trainer"), num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=512, learning_rate=args.lr,
        weight_decay=args.weight_decay, lr_scheduler_type="cosine", warmup_steps=0.05, eval_strategy="epoch",
        save_strategy="epoch", save_total_limit=1, load_best_model_at_end=True, metric_for_best_model="loss",
        logging_strategy="epoch", report_to=[], seed=args.seed, use_cpu=args.device == "cpu",
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=data["train"], eval_dataset=data["validation"],
                      compute_metrics=compute_metrics)
    trainer.train()
    best = trainer.model.eval()
    best.config.training.update({"epochs_run": args.epochs, "best_validation_loss": trainer.state.best_metric})
    return best


def evaluate(args, predictor: PayoffPredictor, data) -> dict:
    """Stage 3: held-out metrics per head, and the calibration plot."""
    features = torch.tensor(data["heldout"]["features"], dtype=torch.float32)
    labels = torch.tensor(data["heldout"]["labels"], dtype=torch.float32)
    pred = predictor.predict(features)
    metrics = {}
    curves = {}
    score = features[:, FEATURE_NAMES.index("cache_score")]
    columns = [(head, pred[:, i], labels[:, i]) for i, head in enumerate(HEADS)]
    columns.append(("suffix_score", score, labels[:, 0]))
    for head, p, y in columns:
        m = payoff_metrics(p, y)
        metrics[head] = {k: (round(v, 4) if isinstance(v, float) and not math.isnan(v) else v)
                         for k, v in m.__dict__.items()}
        curves["cache draft: suffix score" if head == "suffix_score" else head] = (p, y)
    os.makedirs(args.out, exist_ok=True)
    plot_calibration(curves, os.path.join(args.out, "calibration.png"),
                     f"payoff predictor, held-out sessions ({os.path.basename(args.target.rstrip('/'))})")
    return metrics


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data_dir = os.path.join(args.work, "data")
    settings_path = os.path.join(args.work, "collect_settings.json")
    settings = collection_settings(args)
    have_data = False
    if os.path.isdir(data_dir) and os.path.isfile(settings_path):
        with open(settings_path) as f:
            have_data = json.load(f) == settings
    target = tokenizer = draft = None
    if "collect" in args.stages and (args.recollect or not have_data):
        target, tokenizer, draft = load_models(args)
        started = time.perf_counter()
        rows = collect(args, target, tokenizer, draft)
        data = to_datasets(rows, args.seed)
        data.save_to_disk(data_dir)
        settings["collect_minutes"] = round((time.perf_counter() - started) / 60, 2)
        with open(settings_path, "w") as f:
            json.dump(collection_settings(args), f, indent=2)
    if set(args.stages) == {"collect"}:
        return {"collected": data_dir}
    from datasets import load_from_disk

    data = load_from_disk(data_dir)
    print({split: len(ds) for split, ds in data.items()})
    drafters = {"target": args.target, "model_drafter": args.eagle or args.assistant,
                "model_drafter_kind": "eagle" if args.eagle else "assistant",
                "max_draft_tokens": args.max_draft_tokens, "max_depth": args.max_depth,
                "hvd_model_tokens": args.model_tokens, "hvd_model_depth": args.model_depth, "draft_top_k": args.top_k}
    if "train" in args.stages:
        predictor = train(args, data, drafters)
    else:
        predictor = PayoffPredictor.from_pretrained(args.out).eval()
    train_sessions = set(data["train"]["session"]) | set(data["validation"]["session"])
    summary = {"data": f"{len(data['train'])} train / {len(data['validation'])} validation steps from "
                       f"{len(train_sessions)} train-split sessions "
                       f"of {args.workloads}; {len(data['heldout'])} steps of held-out sessions for evaluation",
               "max_new_tokens": args.max_new_tokens}
    metrics = evaluate(args, predictor, data) if "evaluate" in args.stages else {}
    for head, m in metrics.items():
        summary[f"heldout_{head}_mae"] = m["mae"]
        summary[f"heldout_{head}_spearman"] = m["spearman"]
        summary[f"heldout_{head}_mae_constant"] = m["mae_constant"]
    predictor.config.training.update(summary)
    if "save" in args.stages:
        predictor.save_pretrained(args.out)
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump({"heldout": metrics, "settings": settings}, f, indent=2)
    print(f"{'head':<14}{'steps':>7}{'MAE':>8}{'const':>8}{'rho':>7}{'mean pred':>11}{'mean true':>11}")
    for head, m in metrics.items():
        print(f"{head:<14}{m['count']:>7}{m['mae']:>8.3f}{m['mae_constant']:>8.3f}{m['spearman']:>7.3f}"
              f"{m['mean_pred']:>11.3f}{m['mean_true']:>11.3f}")
    result = {"out": args.out, "features": len(FEATURE_NAMES), "heldout": metrics}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
