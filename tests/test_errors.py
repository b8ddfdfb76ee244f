"""Every bad input named in the design gets a clear error (one test each)."""

import json
import os
import shutil

import numpy as np
import pytest
from conftest import expected, fixture_path, load
from safetensors.numpy import load_file, save_file

import jspec


def _copy_fixture(tmp_path, name="qwen3"):
    dst = tmp_path / name
    shutil.copytree(fixture_path(name), dst)
    return dst


def test_prompt_longer_than_cache():
    model = load("qwen3", "xla")
    with pytest.raises(ValueError, match="exceeds max_len"):
        jspec.generate(model, [np.arange(30)], max_new_tokens=8, max_len=32)
    P = model.config.max_position  # no max_len given: the model's positions bound the run
    with pytest.raises(ValueError, match=rf"a prompt of 30 tokens \(the longest\) \+ {P} "
                       rf"positions after it \(max_new_tokens\) = {P + 30} exceeds the "
                       rf"model's max_position_embeddings \({P}\)"):
        jspec.generate(model, [np.arange(30)], max_new_tokens=P)
    draft = load("qwen3", "xla")  # a speculative run names its last verify block too
    with pytest.raises(ValueError, match=rf"\+ {P + 5} positions after it \(max_new_tokens "
                       rf"{P} \+ the last round's verify block of 5\)"):
        jspec.speculative_generate(model, jspec.ModelDrafter(draft), [np.arange(30)],
                                   jspec.SpecConfig(gamma=4, max_new_tokens=P))
    cache = jspec.init_cache(model, 1, 16)
    with pytest.raises(ValueError, match="exceeds the cache max_len 16"):
        jspec.forward(model, np.zeros((1, 17), np.int32), cache)
    other = jspec.init_cache(model, 1, 16)  # another model's cache: a layer fewer
    other = other.replace(k=other.k[:-1], v=other.v[:-1])
    with pytest.raises(ValueError, match=r"does not fit this model: its K buffers are 1 x"):
        jspec.forward(model, np.zeros((1, 2), np.int32), other)


def test_token_id_out_of_range():
    model = load("qwen3", "xla")
    V = model.config.vocab_size
    with pytest.raises(ValueError, match=f"token id {V} at index 2 is out of range"):
        jspec.generate(model, [[1, 2, V]], max_new_tokens=2)
    with pytest.raises(ValueError, match="token id -1 .* out of range"):
        jspec.forward(model, np.array([[-1]]), jspec.init_cache(model, 1, 8))


def test_unknown_architecture(tmp_path):
    d = _copy_fixture(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(jspec.UnsupportedModelError, match="model_type='gpt2'"):
        jspec.load_hf(str(d))


def test_missing_tensor(tmp_path):
    d = _copy_fixture(tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(jspec.CheckpointError, match="missing tensor 'model.layers.1.mlp.up_proj"):
        jspec.load_hf(str(d))


def test_misshaped_tensor(tmp_path):
    d = _copy_fixture(tmp_path)
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(jspec.CheckpointError, match=f"tensor '{name}' .* has shape"):
        jspec.load_hf(str(d))


def test_missing_shard(tmp_path):
    d = _copy_fixture(tmp_path, "qwen3_sharded")
    shard = sorted(p for p in os.listdir(d) if p.endswith(".safetensors"))[-1]
    os.remove(d / shard)
    with pytest.raises(jspec.CheckpointError, match=f"shard {shard}"):
        jspec.load_hf(str(d))


def test_not_a_checkpoint_dir(tmp_path):
    with pytest.raises(jspec.CheckpointError, match="no config.json"):
        jspec.load_hf(str(tmp_path))


def test_bad_generation_arguments():
    model = load("qwen3", "xla")
    p = [expected("qwen3")["prompt"]]
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        jspec.generate(model, p, max_new_tokens=0)
    with pytest.raises(ValueError, match="prompts is empty"):
        jspec.generate(model, [], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 0 must be a non-empty"):
        jspec.generate(model, [[]], max_new_tokens=2)
    with pytest.raises(ValueError, match="temperature=-1"):
        jspec.make_sampler(-1.0)
    with pytest.raises(ValueError, match="top_p"):
        jspec.Sample(top_p=0.0)
    with pytest.raises(ValueError, match="backend='tpu'"):
        load("qwen3", "xla").options.replace(backend="tpu")
