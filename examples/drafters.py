"""A tour of the drafters on one prompt, each checked against plain greedy decoding.

    python examples/drafters.py [--model PATH_OR_HUB_ID] [--max-new-tokens 96]

With the fixture ../shared/models/qwen3_5-small (the default when present) it runs the suffix drafter, prompt lookup
through the stock kwarg, the committed EAGLE-3 drafter (checkpoints/drafters/) and the committed MTP head
(checkpoints/mtp/). With --model a Qwen3.5 or Qwen3-Next checkpoint that ships MTP weights, the MTP row uses the
checkpoint's own head (`use_mtp=True`). The fixture repeats itself more than real models do, so its acceptance is
higher than a real checkpoint's would be.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_hybrid_spec as H
from hf_hybrid_spec.testing import fixture_path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = ('import numpy as np\n\n\ndef normalize(x, axis=0):\n    """Scale `x` to zero mean and unit variance along '
          '`axis`."""\n')


def runs(model, name: str):
    """(label, generate kwargs) of each drafter this model can use."""
    yield "suffix (default)", dict(custom_generate=H.speculative_generate, assistant_config=H.AssistantConfig())
    yield "prompt lookup (stock kwarg)", dict(prompt_lookup_num_tokens=8)
    fixture = Path(name).name
    eagle = ROOT / "checkpoints" / "drafters" / f"{fixture}-eagle3"
    if eagle.is_dir():
        from hf_hybrid_spec.eagle import EagleDrafter

        drafter = EagleDrafter.from_pretrained(eagle).to(model.device, model.dtype)
        yield "EAGLE-3 tree", dict(custom_generate=H.speculative_generate, draft_model=drafter,
                                   assistant_config=H.AssistantConfig(drafter="eagle"))
    from hf_hybrid_spec.mtp import MtpHead, mtp_layer_count

    shard = ROOT / "checkpoints" / "mtp" / fixture / "mtp.safetensors"
    if mtp_layer_count(model.config):
        yield "MTP head (use_mtp=True)", dict(use_mtp=True)
    elif shard.is_file():
        head = MtpHead.from_target(model, load=True, checkpoint=shard, layers=1)
        yield "MTP head (trained here)", dict(custom_generate=H.speculative_generate, draft_model=head,
                                              assistant_config=H.AssistantConfig(drafter="mtp"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local path or Hub id (default: the Qwen3.5 fixture)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    name = args.model or fixture_path("qwen3_5-small")
    if name is None:
        print("no --model and no fixture in ../shared/models: nothing to run", file=sys.stderr)
        return 2
    name = str(name)
    model = H.enable(AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, attn_implementation="sdpa").eval())
    tok = AutoTokenizer.from_pretrained(name)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None)
    model.generate(ids, **dict(kw, max_new_tokens=4))
    t = time.perf_counter()
    ref = model.generate(ids, **kw)
    plain = time.perf_counter() - t
    print(f"{'drafter':<30}{'identical':>10}{'accepted/forward':>18}{'vs plain':>10}")
    ok = True
    for label, extra in runs(model, name):
        model.generate(ids, **dict(kw, max_new_tokens=4), **extra)  # untimed: first calls allocate and load
        t = time.perf_counter()
        out = model.generate(ids, return_dict_in_generate=True, **kw, **extra)
        seconds = time.perf_counter() - t
        same = torch.equal(out.sequences, ref)
        ok &= same
        print(f"{label:<30}{str(same):>10}{out.spec_stats.mean_accepted_length:>18.2f}{plain / seconds:>9.2f}x")
    print(tok.decode(ref[0, ids.shape[1]:]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
