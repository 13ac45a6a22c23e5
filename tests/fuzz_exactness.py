"""A differential fuzzer of exactness: random calls, each run several ways, whose tokens must agree.

    python tests/fuzz_exactness.py --target generate --cases 200      # speculative_generate against stock generate
    python tests/fuzz_exactness.py --target serving --cases 100       # the serving engine against plain generate
    python tests/fuzz_exactness.py --target serving --device cuda     # the same on a GPU (its graphs and kernels)

Each case draws a tiny model (two families, a vocabulary of 12 or 96: a small one makes replies repeat tokens, where
n-gram bans and penalties bite), a batch of left-padded prompts that repeat a pattern (cache drafters match them),
logits processors (repetition penalty, n-gram bans, multi-token bad words and biases, `min_new_tokens` with an eos,
`suppress_tokens`, a processor of the caller's own; the server's presence / frequency penalties), eos tokens, and
greedy or sampling settings (with a streamer at B = 1, which must see the tokens returned). It then runs the call
under several configurations (drafters, eager or static path, a fixed or calibrated budget, which sends the batch
through runs of plain steps; for the serving engine: speculation on or off, eager or chunked prefill, a prefix store
with agents' follow-up turns, fewer slots than requests, streamed requests, log-probabilities, a request cancelled
midway, which the others must not notice):

- greedy: every configuration's tokens are stock `generate`'s (and, with `output_scores`, its scores);
- sampling: every configuration gives the same tokens as the first. The keyed rule draws each position's token from
  the seed, the row and the position, so the tokens do not depend on what was drafted or which steps were plain.

It runs for minutes, so the suite runs a few of its cases (`integration/test_fuzz_exactness.py`).
Exit status 1 when a case fails; each failure is printed with its seed
(`--start SEED --cases 1` runs that case again).
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

logger = logging.getLogger("fuzz_exactness")
PAD = 1
# Where the cases run (`--device`). On a GPU the stock side's fp32 runs fla's kernels, whose dots take TF32 inputs,
# so scores and log-probabilities are compared to that precision there; tokens must still agree exactly.
DEVICE = torch.device("cpu")


def _atol() -> float:
    return 1e-4 if DEVICE.type == "cpu" else 5e-3


class _Models(dict):
    def __missing__(self, key):
        from hf_hybrid_spec.testing import tiny_model

        self[key] = tiny_model(key[0], vocab_size=key[1]).to(DEVICE)
        return self[key]


MODELS = _Models()


def _shift_from_last():
    """A processor speculation does not know (called once per context length): lowers the token after the last."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class ShiftFromLast(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores.scatter_add(1, (input_ids[:, -1:] + 1) % scores.shape[1],
                                      torch.full_like(scores[:, :1], -3.0))

    return LogitsProcessorList([ShiftFromLast()])


def _settings(rng: random.Random, tokens: list[int], serving: bool) -> dict:
    """Up to three processors' settings over tokens the call generates without them (so that they bite)."""
    kinds = ["rep", "ngram", "bad", "bias", "min_new", "suppress", "none", "none"] + (["occurrence"] if serving
                                                                                      else ["custom"])
    kw = {}
    for kind in rng.sample(kinds, rng.randint(0, 3)):
        if kind == "rep":
            kw["repetition_penalty"] = rng.choice([1.2, 1.5])
        elif kind == "ngram":
            kw["no_repeat_ngram_size"] = rng.choice([1, 2, 3])
        elif kind == "bad":
            kw["bad_words_ids"] = [[rng.choice(tokens), rng.choice(tokens)]]
        elif kind == "bias":
            kw["sequence_bias"] = {(rng.choice(tokens), rng.choice(tokens)): -3.0}
        elif kind == "min_new":
            kw["min_new_tokens"] = rng.randint(2, 8)
            kw["eos_token_id"] = rng.choice(tokens)
        elif kind == "suppress":
            kw["suppress_tokens"] = [rng.choice(tokens)]
        elif kind == "occurrence":
            kw["presence_penalty"], kw["frequency_penalty"] = rng.choice([0.5, 1.0]), rng.choice([0.0, 0.7])
        elif kind == "custom":
            kw["logits_processor"] = _shift_from_last()
    return kw


def _sampling(rng: random.Random) -> dict:
    return dict(do_sample=True, temperature=rng.choice([0.7, 1.3]), top_k=rng.choice([0, 5]),
                top_p=rng.choice([1.0, 0.9]))


def _pattern(rng: random.Random, vocab: int, length: int) -> list[int]:
    pattern = [rng.randint(3, vocab - 1) for _ in range(rng.randint(2, 5))]
    return (pattern * (length // len(pattern) + 1))[:length]


class _Collect:
    """A streamer that keeps what it is given (transformers' `BaseStreamer` protocol: the prompt, then each step's
    new tokens, then `end`)."""

    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens += value.flatten().tolist()

    def end(self):
        self.ended = True


# ---------------------------------------------------------------------------------------------- generate
def generate_case(seed: int) -> list[str]:
    """One `generate` case; returns its failures (empty: every configuration agreed)."""
    import hf_hybrid_spec as H
    from helpers import RandomTreeDrafter, drafter_kwargs
    from hf_hybrid_spec.drafters import Drafter
    from hf_hybrid_spec.tree import empty_draft

    class Silent(Drafter):  # never drafts: every step a plain one where the path has them
        def propose(self, input_ids, budget):
            return empty_draft(1)

    rng = random.Random(seed)
    family, vocab = rng.choice(["qwen3_5_text", "falcon_h1"]), rng.choice([12, 96])
    model = MODELS[family, vocab]
    rows = rng.choice([1, 1, 2, 3, 4])
    lengths = [rng.randint(3, 14) for _ in range(rows)]
    width = max(lengths)
    ids = torch.full((rows, width), PAD)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, width - n :] = torch.tensor(_pattern(rng, vocab, n))
        mask[r, width - n :] = 1
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    new = rng.randint(4, 16)
    base = dict(attention_mask=mask, pad_token_id=PAD, max_new_tokens=new)
    free = model.generate(ids, do_sample=False, eos_token_id=None, **base)[:, width:]
    tokens = free.flatten().tolist()
    kw = _settings(rng, tokens, serving=False)
    if "eos_token_id" not in kw and rng.random() < 0.4:
        kw["eos_token_id"] = rng.choice(tokens)
    kw.setdefault("eos_token_id", None)
    if kw["eos_token_id"] is not None and rng.random() < 0.3:
        kw["eos_token_id"] = [kw["eos_token_id"], rng.choice(tokens)]
    if rng.random() < 0.2:
        base["max_length"] = width + base.pop("max_new_tokens")
    if rng.random() < 0.2:
        kw["min_length"] = width + rng.randint(1, new)
    sample = rng.random() < 0.4
    gen = dict(base, **kw, **(_sampling(rng) if sample else dict(do_sample=False)))
    outputs = rng.random() < 0.5  # scores and logits as stock returns them
    if outputs:
        gen.update(return_dict_in_generate=True, output_scores=True, output_logits=True)
    reference = None if sample else model.generate(ids, **gen)
    configs = [(c, b, d) for c in (False, True) for b in ("fixed", "calibrated")
               for d in ("suffix", "ngram", "silent", "random", "eagle", "model", "hvd", "self_ssm", "layerskip")]
    rng.shuffle(configs)
    draw = rng.randint(0, 10**6)
    failures, first = [], "stock"
    for compile_, budget, name in configs[:6]:
        if name in ("silent", "random"):
            if name == "silent":
                drafters = [Silent() for _ in range(rows)]
            else:  # random trees around greedy's continuation: deep acceptances and rejections
                greedy = model.generate(ids, **{k: v for k, v in gen.items() if not k.startswith(("output_", "return_"))
                                                and k not in ("temperature", "top_k", "top_p")} | dict(do_sample=False))
                pads = (mask == 0).sum(-1).tolist()
                drafters = [RandomTreeDrafter(vocab, reference=greedy[r : r + 1, pads[r] :], seed=r,
                                              max_nodes=min(16, vocab // 2)) for r in range(rows)]
            how = dict(drafter=drafters if rows > 1 else drafters[0],
                       assistant_config=H.AssistantConfig(compile=compile_, batch_budget=budget, global_cache=False))
        else:
            how = drafter_kwargs(name, model, compile=compile_, batch_budget=budget)
        where = f"compile={compile_} budget={budget} drafter={name}"
        streamer = _Collect() if rows == 1 else None  # (stock takes a streamer at B = 1 only)
        torch.manual_seed(draw)
        try:
            out = model.generate(ids, custom_generate=H.speculative_generate, streamer=streamer, **how, **gen)
        except NotImplementedError as error:  # a combination refused by name: what a user would get
            logger.debug("case %d: %s refused: %s", seed, where, error)
            continue
        except Exception as error:
            failures.append(f"{where}: raised {error!r}\n{traceback.format_exc(limit=-4)}")
            continue
        sequences = out.sequences if outputs else out
        if streamer is not None and (streamer.tokens != sequences[0].tolist() or not streamer.ended):
            failures.append(f"{where}: streamed {streamer.tokens} (ended: {streamer.ended}), returned "
                            f"{sequences[0].tolist()}")
        if reference is None:
            reference, first = out, where
            continue
        got, expected = (out.sequences, reference.sequences) if outputs else (out, reference)
        if not torch.equal(got, expected):
            failures.append(f"{where}: tokens differ from {first}'s\n{got[:, width:]}\n{expected[:, width:]}")
        elif outputs:
            # Each row's steps until it stopped: a stopped row's later scores are stock's forward over its padding,
            # ours the pad token's certainty (docs/batching.md, "Drafters and rules at B > 1").
            eos = kw["eos_token_id"]
            eos = [-1] if eos is None else eos if isinstance(eos, list) else [eos]
            stops = torch.isin(expected[:, width:], torch.tensor(eos, device=DEVICE))
            running = (stops.long().cumsum(-1) - stops.long()) == 0  # [rows, new]: no eos before this step
            for field in ("scores", "logits"):
                a, b = getattr(out, field), getattr(reference, field)
                if a is None or len(a) != len(b) or not all(
                        torch.allclose(x[running[:, t]], y[running[:, t]], atol=_atol(), rtol=_atol())
                        for t, (x, y) in enumerate(zip(a, b))):
                    failures.append(f"{where}: {field} differ from {first}'s")
    if failures:
        failures.insert(0, f"family={family} vocab={vocab} rows={rows} lengths={lengths} settings="
                           f"{ {k: v for k, v in gen.items() if k != 'attention_mask'} }")
    return failures


# ---------------------------------------------------------------------------------------------- serving
def serving_case(seed: int) -> list[str]:
    """One serving case: several requests, four engine configurations; returns its failures."""
    import hf_hybrid_spec as H
    from transformers import GenerationConfig, LogitsProcessorList
    from hf_hybrid_spec.serving import ServingConfig, ServingEngine, ServingRequest
    from hf_hybrid_spec.serving.penalties import OccurrencePenaltyLogitsProcessor

    def plain(model, ids, n, **kw):
        out = model.generate(torch.tensor([ids], device=DEVICE),
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=DEVICE),
                             max_new_tokens=n, do_sample=False, pad_token_id=PAD, **kw)
        return out[0, len(ids) :].tolist()

    def expected(model, ids, n, kw):
        kw = {k: v for k, v in kw.items() if k != "logprobs"}
        presence, frequency = kw.pop("presence_penalty", 0.0), kw.pop("frequency_penalty", 0.0)
        if presence or frequency:
            kw["logits_processor"] = LogitsProcessorList([OccurrencePenaltyLogitsProcessor(presence, frequency,
                                                                                           len(ids))])
        kw.setdefault("eos_token_id", None)
        return plain(model, ids, n, **kw)

    def drain(engine, cancel: tuple[str, int] | None = None) -> dict:
        """Step until no work is left; `cancel` = (request id, step): that request is cancelled before that step."""
        outputs, steps = {}, 0
        while engine.has_work:
            if cancel is not None and steps == cancel[1]:
                engine.cancel(cancel[0])
            for output in engine.step():
                outputs[output.request_id] = output
            steps += 1
        return outputs

    rng = random.Random(seed)
    family, vocab = rng.choice(["qwen3_5_text", "falcon_h1"]), rng.choice([12, 96])
    model = MODELS[family, vocab]
    requests = []  # (id, prompt, new tokens, settings, samples, seed)
    for i in range(rng.randint(1, 6)):
        ids = _pattern(rng, vocab, rng.randint(3, 20))
        n = rng.randint(1, 14)
        kw = _settings(rng, plain(model, ids, n, eos_token_id=None), serving=True)
        if "eos_token_id" not in kw and rng.random() < 0.3:
            kw["eos_token_id"] = rng.choice(plain(model, ids, n, eos_token_id=None))
        sample = rng.random() < 0.35
        if sample:
            kw.update(_sampling(rng))
        if rng.random() < 0.3:  # log-probabilities (the same in every configuration)
            kw["logprobs"] = rng.choice([0, 2])
        requests.append((f"r{i}", ids, n, kw, sample, rng.randint(0, 10**6)))
    failures, sampled, logprobs = [], {}, {}
    for _ in range(4):
        cfg = dict(speculation=rng.choice([True, True, False]), prefill=rng.choice(["eager", "chunked"]),
                   prefix_cache_bytes=rng.choice([0, 1 << 20]), max_slots=rng.randint(1, 6))
        assistant = dict(drafter=rng.choice(["suffix", "ngram"]), compile=rng.choice([True, False]),
                         batch_budget=rng.choice(["fixed", "calibrated"]))
        where = f"{cfg} {assistant}"
        engine = ServingEngine(model, H.AssistantConfig(global_cache=False, **assistant),
                               ServingConfig(max_total_tokens=64, **cfg))

        def add(name, ids, n, kw, s):
            gen = GenerationConfig(**{"do_sample": False, "eos_token_id": None, "pad_token_id": PAD,
                                      **{k: v for k, v in kw.items() if k != "logprobs"}})
            gen.seed, gen.logprobs = s, kw.get("logprobs")
            engine.add(ServingRequest(name, ids, max_new_tokens=n, generation_config=gen,
                                      streaming=rng.random() < 0.5))

        # Now and then a request cancelled midway: the others must not notice.
        cancel = (rng.choice(requests)[0], rng.randint(0, 6)) if rng.random() < 0.3 else None
        try:
            for name, ids, n, kw, _, s in requests:
                add(name, ids, n, kw, s)
            outputs = drain(engine, cancel)
            ran = [r for r in requests if cancel is None or r[0] != cancel[0]]
            if cfg["prefix_cache_bytes"]:  # each greedy request's next turn: its prompt, its reply, a few tokens
                for name, ids, n, kw, sample, s in ran:
                    if not sample and outputs.get(name) is not None and not outputs[name].error:
                        follow = ids + outputs[name].generated_tokens + _pattern(rng, vocab, rng.randint(1, 4))
                        m = rng.randint(1, 8)
                        add(name + "+", follow, m, kw, s)
                        ran.append((name + "+", follow, m, kw, False, s))
                outputs.update(drain(engine))
        except Exception as error:
            failures.append(f"{where}: raised {error!r}\n{traceback.format_exc(limit=-4)}")
            continue
        finally:
            engine.release()
        for name, ids, n, kw, sample, _ in ran:
            output = outputs.get(name)
            if output is None or output.error:
                failures.append(f"{where}: {name} has no reply ({None if output is None else output.error})")
                continue
            if kw.get("logprobs") is not None:
                entries = output.logprobs or []
                values = torch.tensor([e.logprob for e in entries])
                # (by prompt too: a follow-up turn's new tokens are drawn per configuration)
                before = logprobs.setdefault((name, tuple(ids)), (where, output.generated_tokens, values))
                if [e.token for e in entries] != output.generated_tokens:
                    failures.append(f"{where}: {name}'s logprobs are not its tokens'")
                elif before[1] == output.generated_tokens and not torch.allclose(before[2], values, atol=_atol()):
                    failures.append(f"{where}: {name}'s logprobs differ from those under {before[0]}")
            if sample:
                before = sampled.setdefault(name, (where, output.generated_tokens))
                if before[1] != output.generated_tokens:
                    failures.append(f"{where}: {name} ({kw}) sampled {output.generated_tokens}, {before[1]} under "
                                    f"{before[0]}")
            elif output.generated_tokens != expected(model, ids, n, kw):
                failures.append(f"{where}: {name} ({kw}) got {output.generated_tokens}, plain generate "
                                f"{expected(model, ids, n, kw)}")
    if failures:
        failures.insert(0, f"family={family} vocab={vocab} requests={[(r[0], r[1], r[2], r[3]) for r in requests]}")
    return failures


CASES = {"generate": generate_case, "serving": serving_case}


def main(argv: list[str] | None = None) -> int:
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--target", choices=sorted(CASES), default="generate", help="what to fuzz")
    parser.add_argument("--start", type=int, default=0, help="the first case's seed")
    parser.add_argument("--cases", type=int, default=50, help="how many cases (seeds start, start + 1, ...)")
    parser.add_argument("--device", default="cpu", help="where the models run (cuda: the GPU paths, graphs included)")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    hf_logging.set_verbosity_error()  # (stock's warnings about length constraints the cases draw)
    warnings.filterwarnings("ignore", category=UserWarning, module="transformers")
    failed = 0
    for seed in tqdm(range(args.start, args.start + args.cases), desc=f"fuzzing {args.target}", unit="case"):
        failures = CASES[args.target](seed)
        if failures:
            failed += 1
            logger.error("case %d failed:\n  %s", seed, "\n  ".join(failures))
    logger.info("%d of %d %s cases failed", failed, args.cases, args.target)
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main())
