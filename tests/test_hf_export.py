"""jspec params -> HF checkpoint (jspec.bench.hf_peers) is the exact inverse of load_hf.

bench_e2e gives transformers the target's weights through this converter, so a
round trip must give back the same config and every parameter bit for bit.
"""


import jax
import numpy as np
import pytest
from conftest import fixture_path

import jspec
from jspec.bench.hf_peers import hf_config_dict, save_hf_dir
from jspec.random_model import random_model


def _assert_same(a: jspec.Model, b: jspec.Model):
    assert a.config == b.config
    la, lb = jax.tree.leaves_with_path(a.params), jax.tree.leaves_with_path(b.params)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, path
        bits = f"u{x.dtype.itemsize}"
        assert np.array_equal(x.view(bits), y.view(bits)), jax.tree_util.keystr(path)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gemma3"])
def test_random_preset_round_trip_bitwise(preset, tmp_path):
    model = random_model(preset, dtype="bfloat16", interpret=True)
    save_hf_dir(model.config, model.params, str(tmp_path))
    _assert_same(model, jspec.load_hf(str(tmp_path), dtype="bfloat16", interpret=True))


@pytest.mark.parametrize("name", ["llama3", "qwen3", "gemma3", "mistral", "ministral", "qwen2",
                                  "gemma2"])
def test_fixture_checkpoint_round_trip_bitwise(name, tmp_path):
    model = jspec.load_hf(fixture_path(name), dtype="float32", interpret=True)
    save_hf_dir(model.config, model.params, str(tmp_path))
    _assert_same(model, jspec.load_hf(str(tmp_path), dtype="float32", interpret=True))


def test_real_shape_configs_convert():
    """The presets bench_e2e hands to transformers map to an HF config and back unchanged."""
    from transformers import AutoConfig

    from jspec.random_model import preset_config

    for name in ("qwen3-8b", "qwen3-0.6b", "llama3-8b", "gemma3-4b", "mistral-7b",
                 "qwen2.5-7b", "gemma2-9b"):
        cfg = preset_config(name)
        d = hf_config_dict(cfg)
        hf = AutoConfig.for_model(d.pop("model_type"), **d)
        assert jspec.from_hf_config(hf) == cfg, name


def test_export_refuses_before_writing_and_never_overwrites_silently(tmp_path):
    # A refused model emptied an existing config.json (opened for writing first); an
    # existing checkpoint was replaced without a word.
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(fixture_path("llama3"), d)
    before = {f: (d / f).read_bytes() for f in ("config.json", "model.safetensors")}
    moe = jspec.load_hf(fixture_path("qwen3_moe"), dtype="float32", interpret=True)
    with pytest.raises(ValueError, match="no HF architecture for family 'qwen3_moe'"):
        save_hf_dir(moe.config, moe.params, str(d), overwrite=True)
    dense = jspec.load_hf(fixture_path("qwen3"), dtype="float32", interpret=True)
    with pytest.raises(FileExistsError, match="holds a checkpoint already"):
        save_hf_dir(dense.config, dense.params, str(d))
    assert {f: (d / f).read_bytes() for f in before} == before
    save_hf_dir(dense.config, dense.params, str(d), overwrite=True)
    _assert_same(dense, jspec.load_hf(str(d), dtype="float32", interpret=True))
