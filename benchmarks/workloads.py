"""The agentic-style workload suite of Hybrid Verified Decoding, built from offline material.

A *session* is a sequence of calls to the model, each call's prompt carrying the earlier calls' outputs, as agent
loops do: prompt_i = text_0 + output_0 + text_1 + output_1 + ... + text_i (`Session.prompt`). Four workloads:

- `agent_loop`: a coding agent's three steps on one task (implement, test, revise): the revision re-reads its
  first draft, so outputs repeat earlier outputs. Tasks: the function specifications (name, description,
  parameters) of the Berkeley Function-Calling Leaderboard's `simple_python` cases (`bfcl-eval`).
- `code_edit`: a Python file, then a revised version of it (an identifier renamed, comments dropped), then a second
  revision: the model re-writes a file it has just seen. Files: windows of the tool implementations that
  `bfcl-eval` ships (`eval_checker/multi_turn_eval/func_source_code/*.py`).
- `tool_calls`: tool-call transcripts rendered from `bfcl-eval`'s multi-turn cases (`multi_turn_base`): the
  involved tool classes as Python stubs, then one call per user turn, seeded with the turn's first ground-truth call.
- `plain_code`: single-call code prompts (`hf_hybrid_spec.prompts.code_prompts`), fresh text where cache drafts
  mostly fail.

No networkx, sympy or pandas source is used (they are kept out of the fixtures' training data for evaluation).
Every fourth session of a workload is held out (`split="heldout"`): the benchmark runs those, the payoff predictor
trains on the others. `bfcl-eval` is needed to build the suite (`pip install --no-deps bfcl-eval`); the built suite
is a JSON file (benchmarks/workloads.json), which is all the benchmark reads:

    python benchmarks/workloads.py --out benchmarks/workloads.json
"""

from __future__ import annotations

import itertools
import json
import keyword
import random
import re
from dataclasses import asdict, dataclass, field

from hf_hybrid_spec.cli import argument_parser

__all__ = ["Session", "Suite", "WORKLOADS", "AGENTIC", "build_suite", "load_suite"]

WORKLOADS = ("agent_loop", "code_edit", "tool_calls", "plain_code")
# Workloads whose calls carry earlier outputs (HVD's targets are stated over these).
AGENTIC = ("agent_loop", "code_edit", "tool_calls")
_EXCLUDED = ("networkx", "sympy", "pandas")
FORMAT_VERSION = 1


@dataclass
class Session:
    """One multi-call session.

    Attributes:
        workload: one of `WORKLOADS`.
        id: unique within the suite.
        split: "train" or "heldout".
        texts: the text each call adds before the model continues; call i's prompt is the session so far.
        source: where the material came from (a dataset case id or a file path).
    """

    workload: str
    id: str
    split: str
    texts: list[str]
    source: str = ""

    @property
    def num_calls(self) -> int:
        return len(self.texts)

    def prompt(self, call: int, outputs: list[str]) -> str:
        """The prompt of call `call`, given the decoded outputs of the calls before it."""
        if not 0 <= call < len(self.texts) or len(outputs) < call:
            raise ValueError(f"call {call} of a {len(self.texts)}-call session needs the {call} earlier outputs")
        parts = []
        for i in range(call):
            parts += [self.texts[i], outputs[i]]
        parts.append(self.texts[call])
        return "".join(parts)


@dataclass
class Suite:
    """The workload suite: sessions plus a record of the sources and sizes."""

    sessions: list[Session]
    sources: dict = field(default_factory=dict)
    version: int = FORMAT_VERSION

    def select(self, workloads=None, split: str | None = None, per_workload: int | None = None,
               interleave: bool = False) -> list[Session]:
        """Sessions of the given workloads (all by default) and split, at most `per_workload` of each; with
        `interleave`, in round-robin order over the workloads (a run cut short still covers every workload)."""
        chosen, counts = [], {}
        for s in self.sessions:
            if (workloads and s.workload not in workloads) or (split and s.split != split):
                continue
            if per_workload is not None and counts.get(s.workload, 0) >= per_workload:
                continue
            counts[s.workload] = counts.get(s.workload, 0) + 1
            chosen.append(s)
        if interleave:
            groups = [[s for s in chosen if s.workload == w] for w in WORKLOADS]
            chosen = [s for row in itertools.zip_longest(*groups) for s in row if s is not None]
        return chosen

    def sizes(self) -> dict:
        """Per workload: sessions, calls and characters of new text, per split."""
        out: dict = {}
        for s in self.sessions:
            row = out.setdefault(s.workload, {}).setdefault(s.split, {"sessions": 0, "calls": 0, "chars": 0})
            row["sessions"] += 1
            row["calls"] += s.num_calls
            row["chars"] += sum(len(t) for t in s.texts)
        return out

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump({"version": self.version, "sources": self.sources, "sizes": self.sizes(),
                       "sessions": [asdict(s) for s in self.sessions]}, f, indent=1)
            f.write("\n")


def load_suite(path) -> Suite:
    """A suite written by `Suite.save` (or `python benchmarks/workloads.py`)."""
    with open(path) as f:
        data = json.load(f)
    if data.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: workload suite format {data.get('version')!r}, expected {FORMAT_VERSION}; rebuild "
                         "it with python benchmarks/workloads.py")
    sessions = [Session(**s) for s in data["sessions"]]
    bad = sorted({s.workload for s in sessions} - set(WORKLOADS))
    if bad:
        raise ValueError(f"{path}: unknown workloads {bad}")
    return Suite(sessions=sessions, sources=data.get("sources", {}))


# ---------------------------------------------------------------------- material
def _bfcl():
    try:
        import bfcl_eval
    except ImportError as err:
        raise ImportError("building the HVD workload suite needs the Berkeley Function-Calling Leaderboard data: "
                          "pip install --no-deps bfcl-eval (or use the built suite, benchmarks/workloads.json)"
                          ) from err
    from importlib.resources import files

    return files(bfcl_eval), getattr(bfcl_eval, "__version__", None)


def _read_jsonl(resource) -> list[dict]:
    return [json.loads(line) for line in resource.read_text().splitlines() if line.strip()]


def _identifier(name: str) -> str:
    ident = re.sub(r"\W", "_", name)
    return ident + "_" if keyword.iskeyword(ident) else ident


_PY_TYPES = {"integer": "int", "float": "float", "string": "str", "boolean": "bool", "array": "list", "dict": "dict",
             "tuple": "tuple", "any": "object"}


def _signature(params: dict, with_self: bool = False) -> str:
    props = params.get("properties", {})
    required = set(params.get("required", []))
    args = ["self"] if with_self else []
    optional = []
    for name, spec in props.items():
        annotation = _PY_TYPES.get(spec.get("type", "any"), "object")
        if name in required:
            args.append(f"{_identifier(name)}: {annotation}")
        else:
            optional.append(f"{_identifier(name)}: {annotation} = None")
    return ", ".join(args + optional)


def _first_sentence(text: str, limit: int = 110) -> str:
    text = text.split("Tool description:")[-1].strip()
    sentence = re.split(r"(?<=\.)\s", text, maxsplit=1)[0]
    return sentence if len(sentence) <= limit else sentence[: limit - 3].rstrip() + "..."


def _agent_loop(root, count: int) -> list[Session]:
    cases = _read_jsonl(root / "data" / "BFCL_v4_simple_python.json")
    sessions, seen = [], set()
    for case in cases:
        spec = case["function"][0]
        name = _identifier(spec["name"])
        if name in seen:
            continue
        seen.add(name)
        params = spec.get("parameters", {})
        sig = _signature(params)
        doc = _first_sentence(spec.get("description", ""), 160)
        lines = "\n".join(f"- {p} ({s.get('type', 'any')}): {_first_sentence(s.get('description', ''), 90)}"
                          for p, s in params.get("properties", {}).items())
        request = case["question"][0][0]["content"]
        head = (f'"""Agent session: implement `{name}`.\n\nTask: {doc}\nParameters:\n{lines}\n'
                f'Example request: {request}\n"""\n\n\n')
        texts = [
            head + f'def {name}({sig}):\n    """{doc}"""\n',
            (f"\n\n# --- step 2: tests for {name} (step 1 above is the agent's first implementation) ---\n\n\n"
             f"def test_{name}():\n"),
            (f"\n\n# --- step 3: final version of {name}, revised after the tests ---\n\n\n"
             f'def {name}({sig}):\n    """{doc}"""\n'),
        ]
        sessions.append(Session("agent_loop", f"agent_loop/{case['id']}", "", texts, f"bfcl-eval {case['id']}"))
        if len(sessions) == count:
            break
    return sessions


def _strip_comments(lines: list[str]) -> list[str]:
    return [line for line in lines if not line.strip().startswith("#")]


def _rename(lines: list[str], rng: random.Random) -> tuple[list[str], str] | None:
    """Rename one identifier used at least twice in the window (not a keyword, builtin-looking or dunder name)."""
    text = "\n".join(lines)
    words = re.findall(r"\b[a-z_][a-z0-9_]{3,}\b", text)
    counts: dict[str, int] = {}
    for w in words:
        counts[w] = counts.get(w, 0) + 1
    candidates = sorted(w for w, c in counts.items() if c >= 2 and not keyword.iskeyword(w) and not w.startswith("__")
                        and w not in {"self", "return", "none", "true", "false", "print", "dict", "list", "str",
                                      "float", "bool"})
    if not candidates:
        return None
    old = rng.choice(candidates)
    new = old + "_value"
    return [re.sub(rf"\b{old}\b", new, line) for line in lines], f"rename {old} to {new}"


def _code_edit(root, count: int, rng: random.Random) -> list[Session]:
    src = root / "eval_checker" / "multi_turn_eval" / "func_source_code"
    files = sorted(p for p in src.iterdir() if p.name.endswith(".py") and p.name != "__init__.py")
    windows = []
    for path in files:
        lines = path.read_text().splitlines()
        # Windows that start at a method definition, about 28 lines each.
        starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ") and i + 20 < len(lines)]
        for i in starts[::3]:
            windows.append((path.name, i + 1, lines[i : i + 28]))
    rng.shuffle(windows)
    sessions = []
    for name, line_no, window in windows:
        first = _rename(window, rng)
        if first is None:
            continue
        revised, edit = first
        second = _strip_comments(revised)
        if second == revised:
            second_result = _rename(revised, rng)
            if second_result is None:
                continue
            second, edit2 = second_result
        else:
            edit2 = "drop comments"
        texts = [
            f"# file: {name} (original, lines {line_no}-{line_no + len(window) - 1})\n" + "\n".join(window)
            + f"\n\n\n# file: {name} (revised: {edit})\n" + "\n".join(revised[:3]) + "\n",
            f"\n\n\n# file: {name} (revised again: {edit2})\n" + "\n".join(second[:3]) + "\n",
        ]
        sessions.append(Session("code_edit", f"code_edit/{name}:{line_no}", "", texts,
                                f"bfcl-eval func_source_code/{name} lines {line_no}-{line_no + len(window) - 1}"))
        if len(sessions) == count:
            break
    return sessions


_TOOL_CLASSES = {
    "GorillaFileSystem": "gorilla_file_system.json", "MathAPI": "math_api.json", "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json", "TicketAPI": "ticket_api.json", "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json", "VehicleControlAPI": "vehicle_control.json",
}


def _tool_calls(root, count: int, calls: int, stub_chars: int) -> list[Session]:
    cases = _read_jsonl(root / "data" / "BFCL_v4_multi_turn_base.json")
    answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(root / "data" / "possible_answer" /
                                                                "BFCL_v4_multi_turn_base.json")}
    docs = {cls: _read_jsonl(root / "data" / "multi_turn_func_doc" / fname) for cls, fname in _TOOL_CLASSES.items()}
    sessions = []
    for case in cases:
        truth = answers.get(case["id"])
        classes = [c for c in case["involved_classes"] if c in docs]
        turns = [t for t in case["question"] if t]
        if truth is None or len(classes) != len(case["involved_classes"]) or len(turns) < calls:
            continue
        if any(not truth[i] for i in range(calls)):
            continue
        used = {p.split(".")[-1] for p in case.get("path", [])}
        stub = ["# Tool-calling agent: one block of calls per user turn.", ""]
        budget = stub_chars // len(classes)
        for cls in classes:
            block = [f"class {cls}:"]
            # The functions this case uses first, then the others while the budget lasts.
            funcs = sorted(docs[cls], key=lambda d: (d["name"] not in used, d["name"]))
            for d in funcs:
                line = (f"    def {d['name']}({_signature(d.get('parameters', {}), with_self=True)}):\n"
                        f'        """{_first_sentence(d.get("description", ""))}"""')
                if sum(len(b) + 1 for b in block) + len(line) > budget and d["name"] not in used:
                    continue
                block.append(line)
            stub += block + [""]
        stub.append("")
        texts = []
        for i in range(calls):
            request = turns[i][-1]["content"].strip().replace("\n", " ")
            opening = "\n".join(stub) if i == 0 else "\n\n"
            texts.append(f"{opening}# Turn {i + 1}: {request}\n{truth[i][0]}\n")
        sessions.append(Session("tool_calls", f"tool_calls/{case['id']}", "", texts, f"bfcl-eval {case['id']}"))
        if len(sessions) == count:
            break
    return sessions


def _plain_code() -> list[Session]:
    from hf_hybrid_spec.prompts import code_prompts

    return [Session("plain_code", f"plain_code/{i}", "", [text], "hf_hybrid_spec.prompts.code_prompts")
            for i, text in enumerate(code_prompts())]


def build_suite(sessions_per_workload: int = 24, tool_turns: int = 3, stub_chars: int = 1400, seed: int = 0) -> Suite:
    """Build the suite from `bfcl-eval`'s data files and the built-in code prompts (see the module docstring)."""
    root, version = _bfcl()
    rng = random.Random(seed)
    sessions = (_agent_loop(root, sessions_per_workload) + _code_edit(root, sessions_per_workload, rng)
                + _tool_calls(root, sessions_per_workload, tool_turns, stub_chars) + _plain_code())
    counters: dict[str, int] = {}
    for s in sessions:
        k = counters[s.workload] = counters.get(s.workload, 0) + 1
        s.split = "heldout" if k % 4 == 0 else "train"
        if any(bad in s.source.lower() or bad in "".join(s.texts) for bad in _EXCLUDED):
            raise RuntimeError(f"session {s.id} mentions an excluded package ({_EXCLUDED}); it must not be used")
    sources = {
        "agent_loop": f"bfcl-eval {version} data/BFCL_v4_simple_python.json (function specifications, Apache-2.0)",
        "code_edit": f"bfcl-eval {version} eval_checker/multi_turn_eval/func_source_code/*.py (Apache-2.0)",
        "tool_calls": f"bfcl-eval {version} data/BFCL_v4_multi_turn_base.json, possible_answer/, multi_turn_func_doc/",
        "plain_code": "hf_hybrid_spec.prompts.code_prompts (written for this project)",
        "excluded": list(_EXCLUDED),
        "heldout": "every fourth session of each workload",
    }
    return Suite(sessions=sessions, sources=sources)


def main(argv: list[str] | None = None) -> Suite:
    parser = argument_parser(__doc__)
    parser.add_argument("--out", required=True, help="the suite's JSON file")
    parser.add_argument("--sessions-per-workload", type=int, default=24,
                        help="sessions of agent_loop, code_edit and tool_calls (plain_code: every built-in prompt)")
    parser.add_argument("--tool-turns", type=int, default=3, help="calls per tool-call session")
    parser.add_argument("--stub-chars", type=int, default=1400, help="characters of tool stubs per transcript")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    suite = build_suite(args.sessions_per_workload, args.tool_turns, args.stub_chars, args.seed)
    suite.save(args.out)
    print(f"{'workload':<12}{'split':<9}{'sessions':>9}{'calls':>7}{'chars':>9}")
    for workload, splits in suite.sizes().items():
        for split, row in sorted(splits.items()):
            print(f"{workload:<12}{split:<9}{row['sessions']:>9}{row['calls']:>7}{row['chars']:>9}")
    print(json.dumps({"out": args.out, "sessions": len(suite.sessions)}))
    return suite


if __name__ == "__main__":
    main()
