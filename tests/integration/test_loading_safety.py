"""What a downloaded artifact may make the library do: read data, never write where it says, never run its code.

For every loadable class (AssistantConfig, EagleDrafter, CoSpecArbiter, PayoffPredictor): a pickle payload in place of
the weights is refused (weights-only loading) and `auto_map` code does not run without `trust_remote_code`; for every
path-valued field of an AssistantConfig read from JSON, generating with it writes nothing there.
"""

import json
import os

import pytest
import torch
from transformers import AutoModel

import hf_hybrid_spec as H
from hf_hybrid_spec.cospec import CoSpecArbiter, CoSpecArbiterConfig
from hf_hybrid_spec.eagle import EagleDrafter
from hf_hybrid_spec.hvd import PayoffPredictor, PayoffPredictorConfig
from hf_hybrid_spec.testing import tiny_model


class _WritesWhenUnpickled:
    """Unpickling this calls open(marker, "w"): the file appears only if the pickle's code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _saved(kind, path):
    if kind == "eagle":
        EagleDrafter.from_target(tiny_model("qwen3_5_text"), draft_vocab_size=32).save_pretrained(path)
    elif kind == "arbiter":
        CoSpecArbiter(CoSpecArbiterConfig()).save_pretrained(path)
    else:
        PayoffPredictor(PayoffPredictorConfig(width=8, num_layers=1)).save_pretrained(path)
    return {"eagle": EagleDrafter, "arbiter": CoSpecArbiter, "predictor": PayoffPredictor}[kind]


@pytest.mark.parametrize("kind", ["eagle", "arbiter", "predictor"])
def test_a_pickle_payload_in_place_of_the_weights_never_runs(kind, tmp_path):
    folder = tmp_path / "artifact"
    cls = _saved(kind, folder)
    marker = tmp_path / "pwned"
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    torch.save({"weight": _WritesWhenUnpickled(str(marker))}, folder / "pytorch_model.bin")
    with pytest.raises(Exception):  # noqa: B017 - refused one way or another; what matters is the marker
        cls.from_pretrained(folder)
    with pytest.raises(Exception):  # noqa: B017
        AutoModel.from_pretrained(folder)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["eagle", "arbiter", "predictor"])
def test_auto_map_code_does_not_run_without_trust_remote_code(kind, tmp_path):
    folder = tmp_path / "artifact"
    cls = _saved(kind, folder)
    marker = tmp_path / "pwned"
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.Config", "AutoModel": "evil.Model"}
    (folder / "config.json").write_text(json.dumps(config))
    cls.from_pretrained(folder)
    try:
        AutoModel.from_pretrained(folder)
    except Exception:  # transformers may instead ask for trust_remote_code: refusing is fine too
        pass
    assert not marker.exists()


def test_assistant_config_json_holds_no_code(tmp_path):
    (tmp_path / "assistant_config.json").write_text(json.dumps({"auto_map": {"x": "evil.X"}}))
    with pytest.raises(ValueError, match="unknown AssistantConfig fields"):
        H.AssistantConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("field", ["hvd_cost_profile", "hvd_predictor", "arbiter"])
def test_no_path_in_a_saved_config_is_written_to(field, tmp_path):
    """Each path-valued field, from a config read back from JSON, names a file that does not exist: generating with
    it fails clearly (these are files to read) and creates nothing there, or anywhere under the folder."""
    target = tmp_path / "target_dir" / "written.json"
    base = {
        "hvd_cost_profile": dict(drafter="hvd", hvd_policy="learned"),
        "hvd_predictor": dict(drafter="hvd", hvd_policy="learned"),
        "arbiter": dict(drafter="model", verification="cospec"),
    }[field]
    if field == "hvd_cost_profile":
        predictor = tmp_path / "predictor"
        PayoffPredictor(PayoffPredictorConfig(width=8, num_layers=1)).save_pretrained(predictor)
        base["hvd_predictor"] = str(predictor)
    H.AssistantConfig(**base, **{field: str(target)}).save_pretrained(tmp_path / "config")
    cfg = H.AssistantConfig.from_pretrained(tmp_path / "config")
    model = tiny_model("qwen3_5_text")
    draft = EagleDrafter.from_target(model, draft_vocab_size=32) if cfg.drafter == "hvd" else model
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises((FileNotFoundError, OSError)):
        model.generate(torch.tensor([[3, 4, 5, 3, 4]]), max_new_tokens=4, do_sample=False,
                       custom_generate=H.speculative_generate, assistant_config=cfg, draft_model=draft)
    assert not target.exists() and not target.parent.exists()
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert not os.path.exists(target)
