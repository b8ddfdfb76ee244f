"""torch `.bin` checkpoints read without torch (jspec.torch_bin), and EAGLE-3 heads as the
field ships them: .bin weights, SpecForge's feature layer ids, the config save writes.

The reader is checked against genuine torch.save output (tests/fixtures/torch_bin, made by
make_torch_bin.py with torch): every dtype, views of a shared storage (offset, strides,
transpose) and a state dict's `_metadata`, bitwise equal to what torch.load reads. A
pickle naming anything else is refused without being run.
"""

import json
import os
import pickle
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import torch_save
from conftest import bits, load
from safetensors.numpy import load_file

import jspec
from jspec.eagle import feature_layers, load_eagle3, save_eagle3
from jspec.feature_head import random_head
from jspec.loading import CheckpointError, TensorReader
from jspec.torch_bin import TorchBin

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "torch_bin")


@pytest.mark.parametrize("fn", ["tensors.bin", "linear.bin"])
def test_genuine_torch_files_read_bitwise_as_torch_reads_them(fn):
    expected = np.load(os.path.join(FIX, "expected.npz"))
    want = {k.split("/", 1)[1]: expected[k] for k in expected.files if k.startswith(fn + "/")}
    tb = TorchBin(os.path.join(FIX, fn))
    assert set(tb.keys()) == set(want)
    for name, w in want.items():
        got = tb.get_tensor(name)
        if got.dtype == ml_dtypes.bfloat16:
            got = got.view(np.uint16)
        assert got.dtype == w.dtype and got.shape == w.shape, name
        assert np.array_equal(got.view(f"u{got.itemsize}") if got.dtype != bool else got,
                              w.view(f"u{w.itemsize}") if w.dtype != bool else w), name
    if fn == "tensors.bin":  # the kinds the fixture is meant to cover
        dtypes = {tb.records[n].dtype.name for n in tb.keys()}
        assert {"float32", "bfloat16", "float16", "int64", "bool"} <= dtypes
        assert tb.records["view"].offset > 0 and tb.records["wt"].stride == (1, 5)


def test_views_of_a_shared_storage_and_their_bounds(tmp_path):
    flat = np.arange(20, dtype=np.float32)
    views = {"a": ("0", 0, (4, 5), (5, 1)), "b": ("0", 6, (2, 3), (5, 1)),
             "t": ("0", 0, (5, 4), (1, 5))}
    fn = str(tmp_path / "v.bin")
    torch_save.write_archive(fn, torch_save.pickle_state_dict(views, {"0": flat}), {"0": flat})
    tb = TorchBin(fn)
    m = flat.reshape(4, 5)
    assert np.array_equal(tb.get_tensor("a"), m)
    assert np.array_equal(tb.get_tensor("b"), m[1:3, 1:4])
    assert np.array_equal(tb.get_tensor("t"), m.T)
    bad = str(tmp_path / "bad.bin")
    over = {"x": ("0", 15, (2, 5), (5, 1))}
    torch_save.write_archive(bad, torch_save.pickle_state_dict(over, {"0": flat}), {"0": flat})
    with pytest.raises(CheckpointError, match=r"'x'.*reaches element 24 of a storage of 20"):
        TorchBin(bad).get_tensor("x")


@pytest.mark.parametrize("payload", ["global", "nested"])
def test_a_pickle_naming_anything_else_is_refused(tmp_path, payload):
    import datetime

    obj = ({"w": datetime.date(2020, 1, 1)} if payload == "global"
           else {"w": {"inner": 1}})
    fn = str(tmp_path / "evil.bin")
    torch_save.write_archive(fn, pickle.dumps(obj, protocol=2), {})
    match = "names datetime.date.*refused" if payload == "global" else "'w' is not a tensor"
    with pytest.raises(CheckpointError, match=match):
        TorchBin(fn)
    with open(fn, "wb") as f:
        f.write(b"\x80\x02}q\x00.")  # a bare pickle: the legacy (pre-zip) layout
    with pytest.raises(CheckpointError, match=r"the legacy torch.save format \(torch < 1.6\)"):
        TorchBin(fn)


def test_a_truncated_bin_is_named_as_such(tmp_path):
    # A cut download was reported as the legacy pre-zip format ("re-save it with torch").
    fn = str(tmp_path / "pytorch_model.bin")
    flat = np.arange(4000, dtype=np.float32)
    torch_save.write_archive(fn, torch_save.pickle_state_dict(
        {"w": ("0", 0, (4000,), (1,))}, {"0": flat}), {"0": flat})
    TorchBin(fn)
    data = open(fn, "rb").read()
    with open(fn, "wb") as f:
        f.write(data[:-5000])
    with pytest.raises(CheckpointError, match=r"a zip archive that is truncated or corrupt"):
        TorchBin(fn)
    with open(fn, "wb") as f:
        f.write(b"<html>not found</html>")
    with pytest.raises(CheckpointError, match=r"not a torch.save archive .*b'<htm'"):
        TorchBin(fn)


def test_load_hf_reads_a_checkpoint_that_ships_only_a_bin(tmp_path):
    src = os.path.join(os.path.dirname(__file__), "fixtures", "qwen3")
    d = tmp_path / "qwen3_bin"
    d.mkdir()
    shutil.copy(os.path.join(src, "config.json"), d / "config.json")
    torch_save.save(load_file(os.path.join(src, "model.safetensors")),
                    str(d / "pytorch_model.bin"))
    a = jspec.load_hf(src, dtype="float32", backend="xla")
    b = jspec.load_hf(str(d), dtype="float32", backend="xla")
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        assert np.array_equal(bits(x), bits(y))


# ------------------------------------------------------------------- EAGLE-3 heads


@pytest.fixture(scope="module")
def target():
    return load("qwen3", "xla")


def _bf16_head(target):
    return random_head(target, seed=5, draft_vocab_size=None, feature_layers=(0, 1, 2),
                       dtype="bfloat16", options=jspec.KernelOptions(backend="xla"))


def _as_bin(src: str, dst, *, shards: int = 1) -> str:
    """The head dir src with its safetensors rewritten as pytorch_model.bin (or `shards`
    bins and a pytorch_model.bin.index.json)."""
    dst.mkdir()
    (dst / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    t = load_file(os.path.join(src, "model.safetensors"))
    if shards == 1:
        torch_save.save(t, str(dst / "pytorch_model.bin"))
        return str(dst)
    names = sorted(t)
    weight_map = {}
    for s in range(shards):
        fn = f"pytorch_model-{s + 1:05d}-of-{shards:05d}.bin"
        part = {n: t[n] for n in names[s::shards]}
        torch_save.save(part, str(dst / fn))
        weight_map |= dict.fromkeys(part, fn)
    (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(dst)


@pytest.mark.parametrize("shards", [1, 3])
def test_a_head_saved_as_bin_loads_bitwise_as_its_safetensors(target, tmp_path, shards):
    head = _bf16_head(target)
    d = save_eagle3(str(tmp_path / "st"), head)
    b = _as_bin(d, tmp_path / "bin", shards=shards)
    from_st, from_bin = (load_eagle3(x, target, dtype="bfloat16") for x in (d, b))
    assert from_bin.config == from_st.config == head.config
    for x, y in zip(jax.tree.leaves(from_bin.params), jax.tree.leaves(from_st.params),
                    strict=True):
        assert x.dtype == y.dtype and np.array_equal(bits(x), bits(y))
    assert TensorReader(b).where.keys() == TensorReader(d).where.keys()


def test_feature_layer_conventions():
    L = 32
    specforge = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
    entering = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}}
    speculators = {"speculators_model_type": "eagle3",
                   "eagle_aux_hidden_state_layer_ids": [1, 16, 29]}
    assert feature_layers(specforge, L) == (2, 16, 29)  # auto: SpecForge's default
    assert feature_layers(specforge, L, "entering") == (1, 15, 28)
    assert feature_layers(entering, L) == (2, 16, 29)
    assert feature_layers(entering, L, "after") == (3, 17, 30)
    assert feature_layers(speculators, L) == (1, 16, 29)
    assert feature_layers({}, L, "after") == (2, 16, 29)  # no ids: the shared default
    with pytest.raises(CheckpointError, match=r"feature layers \[32\] are outside the "
                       r"target's -1\.\.31 \(ids read as 'after'\)"):
        feature_layers({"eagle_aux_hidden_state_layer_ids": [2, 32]}, L, "after")


def test_load_eagle3_reads_specforge_ids_one_layer_later(target, tmp_path):
    head = _bf16_head(target)
    d = save_eagle3(str(tmp_path / "h"), head)
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["eagle_config"]["layer_ids_convention"] == "entering"
    del cfg["eagle_config"]["layer_ids_convention"]  # as SpecForge writes it
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 0, 1]
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert load_eagle3(d, target).config.feature_layers == (2, 1, 2)
    assert load_eagle3(d, target, aux_layers_convention="entering").config.feature_layers == (
        1, 0, 1)
    with pytest.raises(ValueError, match="aux_layers_convention='before'; expected one of"):
        load_eagle3(d, target, aux_layers_convention="before")


def test_a_head_config_that_does_not_fit_names_the_head(target, tmp_path):
    # Each was a bare ValueError (no path), or a shape error on fc.weight instead of the
    # number of feature layers the config names.
    from jspec.config import UnsupportedModelError

    d = save_eagle3(str(tmp_path / "h"), _bf16_head(target))
    cfg = json.load(open(os.path.join(d, "config.json")))

    def edited(**changes):
        eagle = changes.pop("eagle_config", {})
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg | changes | {"eagle_config": cfg["eagle_config"] | eagle}, f)
        return d

    with pytest.raises(UnsupportedModelError, match=f"{d}/config.json: draft vocabulary"):
        load_eagle3(edited(draft_vocab_size=cfg["vocab_size"] + 1), target)
    with pytest.raises(UnsupportedModelError, match=f"{d}/config.json: head_dim=48"):
        load_eagle3(edited(head_dim=48), target)
    with pytest.raises(CheckpointError, match=f"{d}: fc.weight reads 3 feature layers .* the "
                                              "config names 2"):
        load_eagle3(edited(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1]}), target)


def _consumer_view(config: dict, names: set[str], consumer: str) -> dict:
    """What each published reader makes of a saved head (the rules in save_eagle3's
    docstring): the width fc expects per feature, and whose embedding it runs with."""
    width = config.get("target_hidden_size", config["hidden_size"])
    saved = "embed_tokens.weight" in names
    if consumer == "eagle":  # SafeAILab/EAGLE cnets.Model: load_emb only without the key
        emb = "saved" if saved else ("random" if "target_hidden_size" in config else "target")
    elif consumer == "vllm":
        emb = "saved" if saved else "target"
    else:  # SGLang: set_embed(target's) always
        emb = "target"
    return {"width": width, "embedding": emb}


@pytest.mark.parametrize("save_embedding", [False, True])
def test_saved_config_is_read_right_by_eagle_vllm_and_sglang(target, tmp_path, save_embedding):
    head = _bf16_head(target)
    d = save_eagle3(str(tmp_path / "h"), head, save_embedding=save_embedding)
    cfg = json.load(open(os.path.join(d, "config.json")))
    names = set(load_file(os.path.join(d, "model.safetensors")))
    assert "target_hidden_size" not in cfg  # equal to hidden_size: left out
    for consumer in ("eagle", "vllm", "sglang"):
        view = _consumer_view(cfg, names, consumer)
        assert view["width"] == target.config.hidden_size, consumer
        # the target's embedding, or a saved copy of it: never a random one
        assert view["embedding"] in ("target", "saved"), consumer
    back = load_eagle3(d, target, dtype="bfloat16")
    # (a saved embedding is the f32 target's cast to the head's bf16)
    keys = [k for k in head.params if not (save_embedding and k == "embed")]
    for x, y in zip(*(jax.tree.leaves([h.params[k] for k in keys]) for h in (back, head)),
                    strict=True):
        assert np.array_equal(bits(x), bits(y))
