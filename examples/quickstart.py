"""Quickstart: speculative decoding on a hybrid model, checked against plain greedy decoding.

    python examples/quickstart.py [--model PATH_OR_HUB_ID] [--max-new-tokens 128]

Without --model it uses the trained fixture ../shared/models/qwen3_5-small when present, else a small
random-init Qwen3.5-style model built from a config (it says so: random weights give meaningless
acceptance, but the output must still be identical).
"""

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_hybrid_spec import AssistantConfig, speculative_generate
from hf_hybrid_spec.testing import fixture_path, tiny_model

PROMPT = 'import numpy as np\n\n\ndef moving_average(x, window):\n    """Return the moving average of `x` over `window` samples."""\n'


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local path or Hub id (e.g. Qwen/Qwen3.5-0.8B)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    path = args.model or fixture_path("qwen3_5-small")
    if path is not None:
        print(f"model: {path}")
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        inputs = tokenizer(PROMPT, return_tensors="pt")
    else:
        print("model: ../shared/models/qwen3_5-small not found; using a small RANDOM-INIT Qwen3.5-style model "
              "(acceptance numbers are meaningless, identity still holds)")
        tokenizer = None
        model = tiny_model("qwen3_5_text", vocab_size=256)
        inputs = {"input_ids": torch.randint(2, 256, (1, 32), generator=torch.Generator().manual_seed(0))}

    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, min_new_tokens=args.max_new_tokens)
    model.generate(**inputs, max_new_tokens=4)  # warm-up

    t = time.perf_counter()
    plain = model.generate(**inputs, **kwargs)
    t_plain = time.perf_counter() - t

    t = time.perf_counter()
    out = model.generate(**inputs, **kwargs, custom_generate=speculative_generate,
                         assistant_config=AssistantConfig(drafter="suffix"), return_dict_in_generate=True)
    t_spec = time.perf_counter() - t

    same = torch.equal(out.sequences, plain)
    stats = out.spec_stats
    print(f"identical to plain greedy: {same}")
    print(f"plain greedy: {t_plain:.2f}s   speculative (suffix drafter): {t_spec:.2f}s   "
          f"speedup {t_plain / t_spec:.2f}x")
    print(f"target forwards: {stats.target_forwards}, mean tokens per forward: {stats.mean_accepted_length:.2f}")
    if tokenizer is not None:
        print("-" * 60)
        print(tokenizer.decode(out.sequences[0]))
    if not same:
        raise SystemExit("speculative output differs from plain greedy")


if __name__ == "__main__":
    main()
