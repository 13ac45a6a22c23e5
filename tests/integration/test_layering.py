"""The package's structure: imports point one way (kernels -> cache -> runtime -> models -> drafters -> verification ->
engine -> API), no import cycles (imports inside functions included), and a new drafter or verification rule is one
file plus one registration line."""

import ast
from pathlib import Path

import pytest
import torch

import hf_hybrid_spec as H
from hf_hybrid_spec.testing import tiny_model

REPO = Path(__file__).resolve().parents[2]
# Layer of each module, by the longest matching name prefix (see docs/design.md). A module may import its own layer
# and the layers below it.
LAYERS = {
    "hf_hybrid_spec.kernels": 0, "hf_hybrid_spec._lazy": 0, "hf_hybrid_spec.registry": 0,
    "hf_hybrid_spec._native": 0,  # builds and loads the optional C speed-ups
    "hf_hybrid_spec.config": 1, "hf_hybrid_spec.tree": 1, "hf_hybrid_spec.graphs": 1, "hf_hybrid_spec.stopping": 1,
    "hf_hybrid_spec.staging": 1,
    "hf_hybrid_spec.hub": 1, "hf_hybrid_spec.prompts": 1,
    "hf_hybrid_spec.cache": 2,
    "hf_hybrid_spec.routing": 3, "hf_hybrid_spec.fusion": 3, "hf_hybrid_spec.forward": 3,
    "hf_hybrid_spec.models": 4,
    "hf_hybrid_spec.drafters": 5, "hf_hybrid_spec.eagle": 5, "hf_hybrid_spec.mtp": 5, "hf_hybrid_spec.hvd": 5, "hf_hybrid_spec.cospec": 5,
    "hf_hybrid_spec.testing": 5,  # test utilities: tiny models (layer 1 needs) and the acceptance-controlled drafter
    "hf_hybrid_spec.verification": 6,
    "hf_hybrid_spec.engine": 7,
    # The API and what drives the loop from above it.
    "hf_hybrid_spec.generate": 8, "hf_hybrid_spec.analysis": 8, "hf_hybrid_spec.hvd.profiling": 8,
    "hf_hybrid_spec.hvd.factory": 8, "hf_hybrid_spec": 8,
    "hf_hybrid_spec.serving": 8,  # continuous batching and the server, on the engine
}


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in (("hf_hybrid_spec", "hf_hybrid_spec"), ("kernels", "hf_hybrid_spec.kernels")):
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Package modules `module` imports anywhere in its file (functions included), TYPE_CHECKING blocks aside."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    base = module if is_package else module.rsplit(".", 1)[0]
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                prefix = ".".join(anchor + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from pkg import name`: the submodule pkg.name when there is one, else pkg itself.
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != module)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    found = modules()
    return {m: imports(m, p, set(found)) for m, p in found.items()}


def test_no_module_imports_a_layer_above_its_own(graph):
    upward = sorted(f"{m} ({layer(m)}) imports {t} ({layer(t)})" for m, targets in graph.items() for t in targets
                    if layer(t) > layer(m))
    assert not upward, "\n".join(upward)


def test_no_import_cycles(graph):
    # Depth-first search for a back edge; reports one cycle.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                cycle = visit(t)
                if cycle:
                    return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)


def test_the_layer_map_covers_every_module(graph):
    assert all(any(m == p or m.startswith(p + ".") for p in LAYERS) for m in graph)


def test_a_toy_drafter_is_one_file_and_one_registration_line():
    import toy_drafter  # noqa: F401  (registers it)

    model = tiny_model("qwen3_5_text")
    ids = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4]])
    ref = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    out = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                         custom_generate=H.speculative_generate, assistant_config=H.AssistantConfig(drafter="toy"))
    assert torch.equal(out.sequences, ref) and sum(out.spec_stats.drafted_tokens) > 0


def test_a_toy_verification_rule_is_one_file_and_one_registration_line():
    import toy_rule

    model = tiny_model("falcon_h1")
    ids = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4]])
    ref = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    out = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None,
                         custom_generate=H.speculative_generate,
                         assistant_config=H.AssistantConfig(drafter="ngram", verification="toy_greedy"))
    assert torch.equal(out, ref) and toy_rule.CALLS["verify"] > 0 and toy_rule.CALLS["first_token"] == 1


def test_unknown_names_list_the_registered_ones():
    with pytest.raises(ValueError, match="drafter must be one of .*'suffix'"):
        H.AssistantConfig(drafter="nope")
    with pytest.raises(ValueError, match="verification must be one of .*'lossless'"):
        H.AssistantConfig(verification="nope")
    from hf_hybrid_spec.registry import register_drafter

    with pytest.raises(ValueError, match="already registered"):
        register_drafter("suffix", lambda config, target, draft_model: None)
