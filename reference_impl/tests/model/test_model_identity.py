"""Model identity: a model's config.json and a sample of its safetensors weights, not the folder it lies in."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from hybridkv.model.layout import LayoutError
from hybridkv.model.model_identity import model_identity

CONFIG = {"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 8, "rms_norm_eps": 1e-6,
          "text_config": {"head_dim": 16, "_name_or_path": "x"}, "_name_or_path": "/models/a",
          "transformers_version": "5.17.0"}


def write_model(d, config=CONFIG, weights: np.ndarray | None = None):
    """A model folder: config.json and, given weights, one safetensors file written by hand (the format is an
    8-byte header length, a JSON header, the tensor bytes)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=2))
    if weights is not None:
        data = weights.astype("<f4").tobytes()
        header = json.dumps({"w": {"dtype": "F32", "shape": list(weights.shape), "data_offsets": [0, len(data)]},
                             "__metadata__": {"format": "pt"}}).encode()
        (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + data)
    return d


def test_the_same_checkpoint_at_two_paths_is_one_model(tmp_path):
    w = np.random.default_rng(0).standard_normal((64, 64))
    a = write_model(tmp_path / "a", weights=w)
    b = shutil.copytree(a, tmp_path / "b")
    # saved elsewhere by another transformers version, keys in another order: the same model
    moved = {**CONFIG, "_name_or_path": "/elsewhere", "transformers_version": "5.19.0"}
    (b / "config.json").write_text(json.dumps(dict(reversed(list(moved.items())))))
    assert model_identity(a) == model_identity(b)
    assert model_identity(a).startswith("Qwen3NextForCausalLM@")


def test_another_config_weights_or_engine_dtype_is_another_model(tmp_path):
    w = np.random.default_rng(0).standard_normal((64, 64))
    base = model_identity(write_model(tmp_path / "base", weights=w))
    tuned = w.copy()
    tuned[32, 7] += 1e-3  # a fine-tune: same config, weights differ in the middle of a tensor
    others = [
        model_identity(write_model(tmp_path / "eps", {**CONFIG, "rms_norm_eps": 1e-5}, weights=w)),
        model_identity(write_model(tmp_path / "nested", {**CONFIG, "text_config": {"head_dim": 32}}, weights=w)),
        model_identity(write_model(tmp_path / "tuned", weights=tuned)),
        model_identity(tmp_path / "base", {"dtype": "float16"}),
    ]
    assert len({base, *others}) == 5


def test_without_weights_the_path_decides(tmp_path):
    a, b = write_model(tmp_path / "a"), write_model(tmp_path / "b")
    assert model_identity(a) != model_identity(b)
    assert model_identity(a, fallback_path="Qwen/Qwen3.6-27B") == model_identity(b, fallback_path="Qwen/Qwen3.6-27B")


def test_unreadable_models_name_the_folder(tmp_path):
    with pytest.raises(LayoutError, match="no readable config.json in model folder .*missing"):
        model_identity(tmp_path / "missing")
    bad = write_model(tmp_path / "bad")
    (bad / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little"))
    with pytest.raises(LayoutError, match="model.safetensors: not a safetensors file"):
        model_identity(bad)
