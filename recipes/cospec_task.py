"""Line-level code completion on real Python files: a verifiable task for CoSpec, built offline.

    python recipes/cospec_task.py --out cospec_data            # build train / validation / test
    python recipes/cospec_task.py --out cospec_data --show 3   # and print a few examples

How the task is built (everything comes from the packages installed next to this interpreter; no download):

1. Sources: the `.py` files of general-purpose packages in site-packages (`DEFAULT_PACKAGES`: CLI, templating,
   HTTP, parsing, packaging and Hugging Face libraries). networkx, sympy and pandas are refused: they are held out
   of the fixtures' training data and must not be used for training, tuning or this task. The fixtures were
   trained on a scientific-Python stack, so numpy / scipy / torch / transformers / matplotlib are left out too;
   the chosen packages may still overlap the fixtures' corpus (it is not published file by file), which the
   splits below do not need: they hold files out from the *arbiter*, not from the language models.
2. Splits by source file: sha256("<package>/<relative path>") decides train (70 %), validation (10 %) or test
   (20 %), so no file contributes to two splits.
3. Targets: lines of code (not blank, not comment-only, not inside a multi-line string, 6 to 100 characters
   stripped) at least 5 lines into the file; up to `--per-file` per file, drawn with a seed from the file's hash.
4. Prompt: the lines before the target, joined with "\\n", cut to the last `--context-chars` characters at a line
   boundary, WITHOUT the trailing newline: the byte-level BPE merges a newline with the next line's
   indentation ("\\n   "), so the model writes the newline itself, as it would when generating.
5. Answer: the target line, exactly (indentation included). A completion is correct when it starts with a
   newline and the text up to the next newline equals the answer (trailing whitespace ignored).

Each split is capped (`--max-train` / `--max-validation` / `--max-test`, seeded sample); the DatasetDict is saved
with `save_to_disk` next to a `manifest.json` (package versions, counts, arguments), so a rebuild is checkable.

The module also holds the evaluation pieces shared by `train_cospec.py` and `bench_cospec.py`: the stopping
criterion (`NextLineStop`), answer extraction (`completion_line`, `is_correct`) and `run_method`, which runs one
decoding method on one example and returns a `MethodRun`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import io
import json
import random
import sys
import time
import tokenize
from dataclasses import dataclass
from pathlib import Path

from hf_hybrid_spec.cli import argument_parser

DEFAULT_PACKAGES = (
    "rich", "click", "jinja2", "markdown_it", "anyio", "_pytest", "pluggy", "packaging", "dateutil", "yaml",
    "fsspec", "huggingface_hub", "pydantic", "typer", "fire", "dill", "filelock", "httpx2", "httpcore2", "h11",
    "pyparsing", "tqdm", "accelerate", "peft", "trl", "datasets",
)


def parse_args(argv=None):
    parser = argument_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the DatasetDict (save_to_disk) and manifest.json")
    parser.add_argument("--packages", nargs="+", default=list(DEFAULT_PACKAGES), help="installed packages to read")
    parser.add_argument("--per-file", type=int, default=3, help="most target lines drawn per file")
    parser.add_argument("--context-chars", type=int, default=1000, help="prompt size (characters, whole lines)")
    parser.add_argument("--max-train", type=int, default=4000)
    parser.add_argument("--max-validation", type=int, default=300)
    parser.add_argument("--max-test", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=0, help="print this many test examples")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help, --version and bad options answer here, before torch and the models load

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import StoppingCriteria, StoppingCriteriaList  # noqa: E402

FORBIDDEN_PACKAGES = ("networkx", "sympy", "pandas")
SPLITS = ("train", "validation", "test")

# Decoding methods `run_method` knows (the rows of the benchmark table).
METHODS = ("target", "draft", "lossless", "fly", "typical", "cospec")


# ---------------------------------------------------------------------------------------------------- building
def package_files(package: str) -> list[tuple[str, Path]]:
    """(relative name "<package>/<path>", file) of every .py file of an installed package, sorted."""
    if package.split(".")[0] in FORBIDDEN_PACKAGES:
        raise ValueError(f"{package} is held out of the fixtures' training data and may not be used")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {package!r} is not installed (or is a single module)")
    root = Path(next(iter(spec.submodule_search_locations)))
    return [(f"{package}/{p.relative_to(root).as_posix()}", p) for p in sorted(root.rglob("*.py"))]


def split_of(name: str) -> str:
    """train / validation / test from the hash of the file's relative name."""
    bucket = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100
    return "train" if bucket < 70 else "validation" if bucket < 80 else "test"


def _excluded_lines(text: str) -> set[int]:
    """0-based lines that are comments only or lie on a multi-line string (docstrings). Raises on bad Python."""
    excluded: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.STRING and tok.end[0] > tok.start[0]:
            excluded.update(range(tok.start[0] - 1, tok.end[0]))
        elif tok.type == tokenize.COMMENT and not tok.line[: tok.start[1]].strip():
            excluded.add(tok.start[0] - 1)
    return excluded


def file_examples(name: str, text: str, per_file: int, context_chars: int) -> list[dict]:
    """Up to `per_file` (prompt, answer) examples from one file's text; [] for files that do not tokenize."""
    try:
        excluded = _excluded_lines(text)
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return []
    lines = text.split("\n")
    candidates = [
        i for i in range(5, len(lines))
        if i not in excluded and 6 <= len(lines[i].strip()) <= 100 and not lines[i].lstrip().startswith("#")
    ]
    rng = random.Random(int(hashlib.sha256(name.encode()).hexdigest(), 16))
    chosen = sorted(rng.sample(candidates, min(per_file, len(candidates))))
    examples = []
    for i in chosen:
        context: list[str] = []
        size = 0
        for line in reversed(lines[:i]):
            if size + len(line) + 1 > context_chars and context:
                break
            context.insert(0, line)
            size += len(line) + 1
        examples.append({
            "id": f"{name}:{i + 1}", "path": name, "line_number": i + 1,
            "prompt": "\n".join(context), "answer": lines[i].rstrip(),
        })
    return examples


def build(packages=DEFAULT_PACKAGES, per_file=3, context_chars=1000, caps=(4000, 300, 300), seed=0):
    """The task as a `datasets.DatasetDict` (train / validation / test) and a manifest dict."""
    from datasets import Dataset, DatasetDict

    rows: dict[str, list[dict]] = {s: [] for s in SPLITS}
    files = [f for p in packages for f in package_files(p)]
    for name, path in tqdm(files, desc="files", unit="file"):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) > 300_000:
            continue
        for ex in file_examples(name, text, per_file, context_chars):
            ex["package"] = name.split("/")[0]
            rows[split_of(name)].append(ex)
    rng = random.Random(seed)
    out = {}
    for split, cap in zip(SPLITS, caps):
        kept = rows[split] if len(rows[split]) <= cap else rng.sample(rows[split], cap)
        kept.sort(key=lambda r: r["id"])
        out[split] = Dataset.from_list(kept)
    manifest = {
        "packages": {p: _version(p) for p in packages},
        "files": len(files),
        "candidates": {s: len(rows[s]) for s in SPLITS},
        "examples": {s: len(out[s]) for s in SPLITS},
        "args": {"per_file": per_file, "context_chars": context_chars, "caps": list(caps), "seed": seed},
        "python": sys.version.split()[0],
    }
    return DatasetDict(out), manifest


def _version(package: str) -> str:
    dist = {"_pytest": "pytest", "yaml": "PyYAML", "dateutil": "python-dateutil", "markdown_it": "markdown-it-py",
            "huggingface_hub": "huggingface_hub"}.get(package, package)
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def load_task(path: str | Path):
    """The DatasetDict saved by `build` / this script."""
    from datasets import load_from_disk

    return load_from_disk(str(path))


# ---------------------------------------------------------------------------------------------------- evaluation
class NextLineStop(StoppingCriteria):
    """Stops once the completion (text after `prompt_length` tokens) holds a newline past its first character."""

    def __init__(self, tokenizer, prompt_length: int):
        self.tokenizer = tokenizer
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        text = self.tokenizer.decode(input_ids[0, self.prompt_length:])
        return torch.tensor([text.find("\n", 1) >= 0], device=input_ids.device)


def completion_line(completion: str) -> str | None:
    """The line a completion writes after the prompt, or None when it does not start with a newline."""
    if not completion.startswith("\n"):
        return None
    return completion[1:].split("\n", 1)[0]


def is_correct(completion: str, answer: str) -> bool:
    line = completion_line(completion)
    return line is not None and line.rstrip() == answer.rstrip()


@dataclass
class MethodRun:
    """One decoding method on one example.

    Attributes:
        completion: decoded new text; correct: whether its line equals the answer.
        seconds: wall time of the generate call.
        new_tokens: tokens generated.
        target_forwards: forwards of the target model after the prompt (AR: one per token but the first, which
            comes from the prefill; speculative: verification forwards). 0 for draft-only.
        overrides / decisions: arbiter counts (lossy methods).
    """

    completion: str
    correct: bool
    seconds: float
    new_tokens: int
    target_forwards: int
    overrides: int = 0
    decisions: int = 0


def method_config(method: str, max_depth: int, arbiter=None, **overrides):
    """The AssistantConfig of a speculative method (lossless / fly / typical / cospec) with the model drafter."""
    from hf_hybrid_spec import AssistantConfig

    if method not in ("lossless", "fly", "typical", "cospec"):
        raise ValueError(f"{method!r} is not a speculative method")
    kwargs = dict(drafter="model", max_depth=max_depth, max_draft_tokens=max(max_depth, 1), verification=method)
    if method == "cospec":
        kwargs["arbiter"] = arbiter
    return AssistantConfig(**{**kwargs, **overrides})


@torch.no_grad()
def run_method(method: str, example: dict, target, draft, tokenizer, max_new_tokens: int = 48, max_depth: int = 6,
               arbiter=None, config=None) -> MethodRun:
    """Run `method` (one of METHODS) on `example` (a row of the task) with greedy decoding.

    `config` (an AssistantConfig) replaces the default one of a speculative method; `arbiter` is the CoSpec
    arbiter (an instance or a saved directory).
    """
    from hf_hybrid_spec import speculative_generate

    ids = tokenizer(example["prompt"], return_tensors="pt").input_ids
    stop = StoppingCriteriaList([NextLineStop(tokenizer, ids.shape[1])])
    common = dict(do_sample=False, max_new_tokens=max_new_tokens, stopping_criteria=stop, pad_token_id=1,
                  return_dict_in_generate=True)
    t0 = time.perf_counter()
    if method in ("target", "draft"):
        out = (target if method == "target" else draft).generate(ids, **common)
        stats = None
    else:
        cfg = config if config is not None else method_config(method, max_depth, arbiter)
        out = target.generate(ids, custom_generate=speculative_generate, draft_model=draft, assistant_config=cfg,
                              **common)
        stats = out.spec_stats
    seconds = time.perf_counter() - t0
    new = out.sequences[0, ids.shape[1]:]
    completion = tokenizer.decode(new)
    n = int(new.shape[0])
    return MethodRun(
        completion=completion, correct=is_correct(completion, example["answer"]), seconds=seconds, new_tokens=n,
        target_forwards=0 if method == "draft" else (max(n - 1, 0) if stats is None else stats.target_forwards),
        overrides=0 if stats is None else stats.arbiter_overrides,
        decisions=0 if stats is None else stats.arbiter_decisions,
    )


def main(argv=None):
    args = parse_args(argv)
    task, manifest = build(args.packages, args.per_file, args.context_chars,
                           (args.max_train, args.max_validation, args.max_test), args.seed)
    out = Path(args.out)
    task.save_to_disk(str(out))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for ex in task["test"].select(range(min(args.show, len(task["test"])))):
        print(f"--- {ex['id']}\n{ex['prompt'][-300:]}\n>>> {ex['answer']!r}")
    print(json.dumps({"out": str(out), **manifest["examples"], "files": manifest["files"]}))


if __name__ == "__main__":
    main()
