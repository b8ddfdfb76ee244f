"""Checkpoint loading: dtype spellings, hub ids from the local cache, the official Gemma 3
layout and a vocabulary-prefix draft (jspec.tiny's fixtures), and one clear
`CheckpointError` for every way a checkpoint can be wrong."""

import json
import logging
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bits, fixture_path
from safetensors.numpy import load_file, save_file

import jspec
from jspec import loading
from jspec.config import from_hf_config
from jspec.rope import rope_inv_freq
from jspec.tiny import (
    GEMMA3_EOS_IDS,
    TINY_GEMMA3_DRAFT_VOCAB,
    TINY_GEMMA3_TARGET_VOCAB,
    write_tiny_gemma3,
    write_tiny_gemma3_pair,
)


def _copy_fixture(tmp_path, name="qwen3"):
    dst = tmp_path / name
    shutil.copytree(fixture_path(name), dst)
    return dst


def _edit_tensors(d, edit, name="model.safetensors"):
    fn = d / name
    tensors = load_file(fn)
    edit(tensors)
    save_file(tensors, fn)


def _edit_config(d, **fields):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))


def _xla(path):
    return jspec.load_hf(str(path), dtype="float32", backend="xla")


def _logits(model, tokens):
    logits, _ = jspec.forward(model, np.asarray([tokens], np.int32),
                              jspec.init_cache(model, 1, 32))
    return np.asarray(logits)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """The tiny Gemma 3 pair (target in the published multimodal layout) and the target
    written in the other two layouts."""
    root = tmp_path_factory.mktemp("gemma3")
    target, draft = write_tiny_gemma3_pair(str(root))
    dirs = {"multimodal": target, "draft": draft}
    for layout in ("multimodal_v5", "text"):
        dirs[layout] = write_tiny_gemma3(str(root / layout), layout=layout,
                                         tokenizer_from=target)
    return dirs


# ----------------------------------------------------------------------------- dtype


@pytest.mark.parametrize("dtype, name", [
    (jnp.bfloat16, "bfloat16"), (jnp.dtype("bfloat16"), "bfloat16"), ("bf16", "bfloat16"),
    (np.float32, "float32"), (jnp.float32, "float32"), ("fp32", "float32"),
    ("f32", "float32")])
def test_dtype_spellings(dtype, name):
    model = jspec.load_hf(fixture_path("qwen3"), dtype=dtype, backend="xla")
    assert type(model.config.dtype) is str and model.config.dtype == name
    assert {str(x.dtype) for x in jax.tree.leaves(model.params)} == {name}


@pytest.mark.parametrize("dtype", ["float16", np.float64, None, "int8"])
def test_unsupported_dtype(dtype):
    with pytest.raises(ValueError, match=f"dtype={dtype!r} is not supported; expected "
                                         r"bfloat16 \('bfloat16', 'bf16'"):
        jspec.load_hf(fixture_path("qwen3"), dtype=dtype, backend="xla")


# --------------------------------------------------------------------------- hub ids


def _fake_hub_cache(cache, repo_id, src, commit="0123456789abcdef0123456789abcdef01234567"):
    """`src`'s files in the Hugging Face cache layout: blobs, a snapshot of symlinks to
    them, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for i, fn in enumerate(sorted(os.listdir(src))):
        blob = repo / "blobs" / f"blob{i:04d}"
        shutil.copy(os.path.join(src, fn), blob)
        os.symlink(os.path.relpath(blob, snap), snap / fn)


def test_hub_id_from_local_cache(gemma3, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    _fake_hub_cache(cache, "tiny-org/gemma-3-tiny-it", gemma3["multimodal"])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    model = _xla("tiny-org/gemma-3-tiny-it")
    want = _xla(gemma3["multimodal"])
    assert model.config == want.config
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))
    tok = jspec.load_tokenizer("tiny-org/gemma-3-tiny-it")
    assert tok("hi")["input_ids"][0] == 2  # <bos>
    for load in (_xla, jspec.load_tokenizer):
        with pytest.raises(jspec.CheckpointError,
                           match=f"'tiny-org/absent' .*not in the local Hugging Face cache "
                                 f"\\({cache}\\); jspec does not download"):
            load("tiny-org/absent")


def test_hub_cache_from_hf_home(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert loading.hub_cache_dir() == str(tmp_path / "hub")


# -------------------------------------------------------------------------- Gemma 3


@pytest.mark.parametrize("layout", ["multimodal", "multimodal_v5"])
def test_gemma3_multimodal_loads_its_text_model(gemma3, layout, caplog):
    """The official layouts load the text model: the same config, params and logits
    (bitwise, one backend) as the same weights written as a gemma3_text directory; the
    vision tower and projector are logged as ignored."""
    caplog.set_level(logging.INFO, logger="jspec")
    model = _xla(gemma3[layout])
    text = _xla(gemma3["text"])
    assert model.config == text.config
    assert model.config.vocab_size == TINY_GEMMA3_TARGET_VOCAB
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(text.params), strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))
    tokens = [2, 300, 17, 450, 106, 511, 9, 120, 77, 3]
    got = _logits(model, tokens)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(bits(got), bits(_logits(text, tokens)))
    names = [k for fn in os.listdir(gemma3[layout]) if fn.endswith(".safetensors")
             for k in load_file(os.path.join(gemma3[layout], fn))]
    n_vision = sum(("vision_tower." in k or "multi_modal_projector." in k) for k in names)
    ignored = [r.getMessage() for r in caplog.records if "harmless" in r.getMessage()]
    assert len(ignored) == 1 and f"{n_vision} tensors" in ignored[0], ignored
    assert "vision_tower." in ignored[0]


def test_gemma3_pair_fixture(gemma3):
    """The draft's vocabulary is a prefix of the target's, their tokenizer is Gemma's in
    miniature (BOS added, byte fallback, EOS ids 1 and 106), and both give finite logits."""
    target, draft = _xla(gemma3["multimodal"]), _xla(gemma3["draft"])
    assert draft.config.vocab_size == TINY_GEMMA3_DRAFT_VOCAB
    assert target.config.vocab_size == TINY_GEMMA3_DRAFT_VOCAB + 64
    assert draft.config.layer_sliding == target.config.layer_sliding == (True, False)
    tok = jspec.load_tokenizer(gemma3["draft"])
    assert len(tok) == TINY_GEMMA3_DRAFT_VOCAB
    ids = tok("x = 'é'")["input_ids"]
    assert ids[0] == 2 and max(ids) < TINY_GEMMA3_DRAFT_VOCAB
    assert tok.decode(ids[1:]) == "x = 'é'"
    assert tok.convert_tokens_to_ids(["<eos>", "<end_of_turn>"]) == list(GEMMA3_EOS_IDS)
    for d in (gemma3["multimodal"], gemma3["draft"]):
        with open(os.path.join(d, "generation_config.json")) as f:
            assert json.load(f)["eos_token_id"] == list(GEMMA3_EOS_IDS)
    for model in (target, draft):
        assert np.isfinite(_logits(model, ids)).all()


def test_gemma3_fixtures_are_deterministic(gemma3, tmp_path):
    again, _ = write_tiny_gemma3_pair(str(tmp_path))
    for fn in sorted(os.listdir(again)):
        if fn.endswith(".safetensors") or fn == "tokenizer.json":
            with open(os.path.join(again, fn), "rb") as a, \
                    open(os.path.join(gemma3["multimodal"], fn), "rb") as b:
                assert a.read() == b.read(), fn


def test_linear_rope_is_transformers_linear(gemma3):
    """Gemma 3 4B-27B's global layers scale RoPE linearly: every inverse frequency divided
    by the factor in float32, as transformers computes it."""
    from transformers import AutoConfig

    cfg = from_hf_config(AutoConfig.from_pretrained(gemma3["multimodal"]))
    hd = cfg.head_dim
    base = (np.float32(1.0) / (np.float32(1e6) ** (
        np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / np.float32(hd))))
    np.testing.assert_array_equal(rope_inv_freq(cfg.rope, hd),
                                  (base / np.float32(8.0)).astype(np.float32))
    np.testing.assert_array_equal(rope_inv_freq(cfg.rope_local, hd).view(np.uint32),
                                  (np.float32(1.0) / (np.float32(1e4) ** (
                                      np.arange(0, hd, 2).astype(np.float32)
                                      / np.float32(hd)))).astype(np.float32).view(np.uint32))


YARN = np.load(fixture_path("rope_yarn.npz"))


@pytest.mark.parametrize("case", range(len(json.loads(str(YARN["cases"])))))
def test_yarn_rope_is_transformers_yarn(case):
    """YaRN (Qwen3 / Qwen2.5 long-context configs, gpt-oss, DeepSeek): the inverse
    frequencies, the attention factor and the scaled cos / sin tables transformers' rotary
    embeddings compute (`rope_yarn.npz`, made by `make_fixtures.py rope_yarn`)."""
    from jspec.config import rope_parameters, rope_spec
    from jspec.rope import rope_table

    kw, params = json.loads(str(YARN["cases"]))[case]
    spec = rope_spec(params, None, "yarn")
    hd = kw["head_dim"]
    # numpy's and torch's float32 pow differ by an ulp at some exponents; at position p
    # that moves an angle by ~p ulps (p < 160 here)
    np.testing.assert_allclose(rope_inv_freq(spec, hd), YARN[f"inv_freq_{case}"], rtol=2.5e-7)
    assert spec.yarn.attention_factor == pytest.approx(float(YARN[f"attention_factor_{case}"]),
                                                       rel=1e-12)
    cos, sin = rope_table(spec, hd, YARN[f"cos_{case}"].shape[0])
    np.testing.assert_allclose(cos, YARN[f"cos_{case}"], rtol=0, atol=3e-5)
    np.testing.assert_allclose(sin, YARN[f"sin_{case}"], rtol=0, atol=3e-5)
    assert rope_spec(rope_parameters(spec), None, "again") == spec  # the inverse


def test_yarn_config_loads_and_runs_with_its_table(tmp_path):
    """A Qwen3 checkpoint with Qwen's documented long-context `rope_scaling` (yarn, factor 4)
    loads with the yarn table, and its logits move (the table is used)."""
    d = _copy_fixture(tmp_path)
    plain = _xla(d)
    _edit_config(d, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                     "original_max_position_embeddings": 16})
    model = _xla(d)
    assert model.config.rope.yarn.factor == 4.0
    tokens = np.load(os.path.join(fixture_path("qwen3"), "expected.npz"))["prompt"].tolist()
    a, b = _logits(plain, tokens), _logits(model, tokens)
    assert np.isfinite(b).all() and np.abs(a - b).max() > 1e-3


def test_gemma3_per_layer_type_yarn_loads_and_a_truncate_transformers_ignores_is_refused(
        tmp_path):
    """Gemma 3's per-layer-type rope_parameters take yarn on the full layers; transformers
    reads yarn's `truncate` from the top level of rope_parameters only, so a per-layer
    truncate=false (which jspec honoured: another table than the reference's) is refused."""
    d = _copy_fixture(tmp_path, "gemma3")
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
            "original_max_position_embeddings": 128}
    local = {"rope_type": "default", "rope_theta": 1e4}
    _edit_config(d, rope_parameters={"full_attention": yarn, "sliding_attention": local})
    model = _xla(d)
    assert model.config.rope.yarn.truncate and model.config.rope_local.yarn is None
    _edit_config(d, rope_parameters={"full_attention": yarn | {"truncate": False},
                                     "sliding_attention": local})
    with pytest.raises(jspec.UnsupportedModelError,
                       match="gemma3 full_attention: yarn truncate=false .*not supported"):
        _xla(d)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}])
def test_a_top_level_original_max_position_embeddings_wins_as_in_transformers(tmp_path,
                                                                              scaling):
    """transformers' rotary embeddings re-run `standardize_rope_params`, where a top-level
    `original_max_position_embeddings` replaces the rope dict's (Phi-3's layout); jspec
    read the dict's value (or max_position_embeddings), another table, silently."""
    from transformers import AutoConfig

    from jspec.config import rope_spec

    d = _copy_fixture(tmp_path)
    _edit_config(d, rope_parameters={"rope_theta": 1e6, "original_max_position_embeddings": 128,
                                     **scaling}, original_max_position_embeddings=64)
    model = _xla(d)
    hf = AutoConfig.from_pretrained(d)
    hf.standardize_rope_params()  # what the rotary embedding reads
    assert hf.rope_parameters["original_max_position_embeddings"] == 64
    assert model.config.rope == rope_spec(hf.rope_parameters, None, "reference")


@pytest.mark.parametrize("params,field", [
    ({"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 64},
     "needs \\['factor'\\]"),
    ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 0.0,
      "original_max_position_embeddings": 64}, "yarn factor=0.0"),
    ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": -1.0,
      "original_max_position_embeddings": 64}, "yarn beta_fast=-1.0"),
    ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "truncate": "no",
      "original_max_position_embeddings": 64}, "truncate='no'"),
    ({"rope_type": "yarn", "rope_theta": 1, "factor": 4.0,
      "original_max_position_embeddings": 64}, "rope_theta=1.0 with yarn.*log"),
    ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale": -10.0,
      "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}, "yarn mscale=-10.0"),
    ({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}, "depend on later tokens"),
    ({"rope_type": "longrope", "rope_theta": 1e4}, "rope_type='longrope' is not supported"),
])
def test_bad_or_unsupported_rope_is_named(params, field):
    from jspec.config import rope_spec

    with pytest.raises(jspec.UnsupportedModelError, match=f"where: .*{field}"):
        rope_spec(params, None, "where")


GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"


def _set(name, fn):
    def edit(t):
        t[name] = fn(t[name])
    return edit


@pytest.mark.parametrize("edit,match", [
    (_set(GATE_UP + "_scales", lambda s: np.where(np.arange(s.size).reshape(s.shape) == 5,
                                                  np.uint8(255), s)),
     "gate_up_proj: an MXFP4 scale is NaN"),
    (_set(GATE_UP + "_blocks", lambda b: b.astype(np.float32)),
     "gate_up_proj_blocks.*is float32.*MXFP4 wants uint8"),
    (_set(GATE_UP + "_scales", lambda s: s[:, :, :1]), "gate_up_proj_scales.*wants uint8"),
    (lambda t: t.pop(GATE_UP + "_scales"), "missing tensor .*gate_up_proj_scales"),
])
def test_bad_mxfp4_experts_are_named(tmp_path, edit, match):
    d = _copy_fixture(tmp_path, "gpt_oss_mxfp4")
    _edit_tensors(d, edit)
    with pytest.raises(jspec.CheckpointError, match=match):
        _xla(d)


def _shard_mxfp4(tmp_path):
    """The MXFP4 fixture split over two shards with an index; returns (dir, weight_map)."""
    d = _copy_fixture(tmp_path, "gpt_oss_mxfp4")
    tensors = load_file(d / "model.safetensors")
    os.remove(d / "model.safetensors")
    names = sorted(tensors)
    weight_map = {n: f"model-0000{1 + (i >= len(names) // 2)}-of-00002.safetensors"
                  for i, n in enumerate(names)}
    for fn in set(weight_map.values()):
        save_file({n: tensors[n] for n in names if weight_map[n] == fn}, d / fn)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d, weight_map


def test_sharded_mxfp4_experts_load_and_a_misplaced_block_is_named(tmp_path):
    """MXFP4 blocks and scales read through a shard index load as the single file does;
    an index placing a blocks tensor in a shard that lacks it is a CheckpointError naming
    the shard (it was safetensors' own error)."""
    d, weight_map = _shard_mxfp4(tmp_path)
    packed = _xla(d)
    single = _xla(fixture_path("gpt_oss_mxfp4"))
    for a, b in zip(jax.tree.leaves(packed.params), jax.tree.leaves(single.params),
                    strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))
    blocks = next(n for n in sorted(weight_map, reverse=True) if n.endswith("_blocks"))
    other = next(fn for fn in set(weight_map.values()) if fn != weight_map[blocks])
    weight_map[blocks] = other
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(jspec.CheckpointError,
                       match=f"{other}: the shard index places tensor '{blocks}'"):
        _xla(d)


def _as_mxfp4(name):
    """An edit storing float tensor `name` [N, K] as zero MXFP4 blocks and scales."""
    def edit(t):
        n, k = t.pop(name).shape
        stem = name.removesuffix(".weight") if "experts" in name else name
        t[stem + "_blocks"] = np.zeros((n, k // 32, 16), np.uint8)
        t[stem + "_scales"] = np.full((n, k // 32), 127, np.uint8)
    return edit


@pytest.mark.parametrize("fixture,name", [
    ("gpt_oss_mxfp4", "model.layers.0.self_attn.q_proj.weight"),
    ("qwen3_moe", "model.layers.0.mlp.experts.0.gate_proj.weight")])
def test_mxfp4_where_jspec_reads_floats_is_named_as_quantized(tmp_path, fixture, name):
    """MXFP4 blocks where jspec reads a float tensor (attention, another family's experts):
    the error names the tensor as stored quantized, not only as missing."""
    d = _copy_fixture(tmp_path, fixture)
    _edit_tensors(d, _as_mxfp4(name))
    with pytest.raises(jspec.CheckpointError,
                       match=f"'{name}' is stored quantized .*MXFP4.*gpt-oss's experts only"):
        _xla(d)


@pytest.mark.parametrize("edit,match", [
    ({"swiglu_limit": 10.0}, "swiglu_limit=10.0 is not supported"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     "layer_types=.*chunked_attention"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 is not in \\[1, 4\\]"),
    ({"experts_per_token": 1}, "experts_per_token=1 disagrees with num_experts_per_tok=2"),
])
def test_unsupported_gpt_oss_configs_are_named(tmp_path, edit, match):
    d = _copy_fixture(tmp_path, "gpt_oss")
    _edit_config(d, **edit)
    with pytest.raises(jspec.UnsupportedModelError, match=match):
        _xla(d)


def test_a_quantized_checkpoint_other_than_gpt_oss_mxfp4_is_refused(tmp_path):
    d = _copy_fixture(tmp_path)
    _edit_config(d, quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(jspec.UnsupportedModelError, match="quant_method='mxfp4'.*not supported"):
        _xla(d)


# ------------------------------------------------------------------- unused tensors


def test_qwen3_weights_under_llama_config(tmp_path):
    d = _copy_fixture(tmp_path)
    _edit_config(d, model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(jspec.CheckpointError,
                       match="4 tensors in the checkpoint are not used: q_norm/k_norm weights "
                             "present but model_type llama has no q/k norm: is this a Qwen3 "
                             r"checkpoint\? Unused: model.layers.0.self_attn.k_norm.weight"):
        _xla(d)


def test_extra_layer_is_an_error(tmp_path):
    d = _copy_fixture(tmp_path)

    def edit(t):
        t["model.layers.2.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"]
    _edit_tensors(d, edit)
    with pytest.raises(jspec.CheckpointError, match="weights for layer 2 but "
                                                    "num_hidden_layers=2"):
        _xla(d)


def test_harmless_extras_are_logged(tmp_path, caplog):
    """RoPE buffers and a tied LM head equal to the embedding load, logged; a tied LM head
    that differs from the embedding is an error."""
    caplog.set_level(logging.INFO, logger="jspec")
    d = _copy_fixture(tmp_path)

    def edit(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(16, np.float32)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    _edit_tensors(d, edit)
    _xla(d)
    logged = [r.getMessage() for r in caplog.records if "harmless" in r.getMessage()]
    assert len(logged) == 1 and "2 tensors" in logged[0], logged

    def edit2(t):
        t["lm_head.weight"][0, 0] += 1.0
    _edit_tensors(d, edit2)
    with pytest.raises(jspec.CheckpointError, match="lm_head.weight differs from the "
                                                    "embedding but config.json says "
                                                    "tie_word_embeddings=true"):
        _xla(d)


# --------------------------------------------------------------- damaged checkpoints


def test_non_finite_weight(tmp_path):
    d = _copy_fixture(tmp_path)
    name = "model.layers.1.mlp.down_proj.weight"

    def edit(t):
        t[name][3, 5] = np.nan
        t[name][0, 0] = -np.inf
    _edit_tensors(d, edit)
    with pytest.raises(jspec.CheckpointError,
                       match=f"tensor '{name}' in {d}/model.safetensors has 2 non-finite "
                             r"values \(1 NaN, 1 inf\) of 8192"):
        _xla(d)


def test_truncated_safetensors(tmp_path):
    d = _copy_fixture(tmp_path)
    fn = d / "model.safetensors"
    fn.write_bytes(fn.read_bytes()[: fn.stat().st_size // 2])
    with pytest.raises(jspec.CheckpointError,
                       match=f"{fn}: not a readable safetensors file"):
        _xla(d)


def test_truncated_shard(tmp_path):
    d = _copy_fixture(tmp_path, "qwen3_sharded")
    fn = d / sorted(p for p in os.listdir(d) if p.endswith(".safetensors"))[1]
    fn.write_bytes(fn.read_bytes()[:-10])
    with pytest.raises(jspec.CheckpointError, match=f"{fn}: not a readable safetensors file"):
        _xla(d)


@pytest.mark.parametrize("text, match", [
    ("{\"weight_map\": ", "model.safetensors.index.json: not a JSON shard index"),
    ("{\"metadata\": {}}", "model.safetensors.index.json: no \"weight_map\" object")])
def test_bad_shard_index(tmp_path, text, match):
    d = _copy_fixture(tmp_path, "qwen3_sharded")
    (d / "model.safetensors.index.json").write_text(text)
    with pytest.raises(jspec.CheckpointError, match=match):
        _xla(d)


@pytest.mark.parametrize("where", ["outside", "absolute"])
def test_a_shard_outside_the_checkpoints_folder_is_refused(tmp_path, where):
    """An index naming a shard by an absolute path or through '..' read a file outside the
    checkpoint's folder (a moved or tampered index); it is named, nothing is read."""
    d = _copy_fixture(tmp_path, "qwen3_sharded")
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shutil.copy(d / first, tmp_path / first)
    name = f"../{first}" if where == "outside" else str(tmp_path / first)
    index["weight_map"] = {k: name if v == first else v for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    with pytest.raises(jspec.CheckpointError,
                       match=rf"index.json: shard {re.escape(repr(name))} is outside the "
                             "checkpoint's folder"):
        _xla(d)


def test_config_not_json(tmp_path):
    d = _copy_fixture(tmp_path)
    (d / "config.json").write_text("{\"model_type\": \"qwen3\",")
    with pytest.raises(jspec.CheckpointError, match=f"{d}/config.json: not valid JSON"):
        _xla(d)


def test_quantized_checkpoint_refused(tmp_path):
    # A quantization_config means the stored tensors are not the dense floats jspec
    # reads: refused by name, before any weight is read.
    d = _copy_fixture(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(jspec.UnsupportedModelError, match="quant_method='fp8'.*not supported"):
        _xla(d)


def test_float8_tensor_named(tmp_path):
    # A float8 tensor (an FP8 checkpoint without its quantization_config): an error that
    # says so, not numpy's missing attribute.
    d = _copy_fixture(tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    n = tensors["model.norm.weight"].size
    header, offset, blobs = {}, 0, []
    for name, a in tensors.items():
        dtype, data = ("F8_E4M3", b"\x38" * n) if name == "model.norm.weight" else (
            {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[a.dtype.name], a.tobytes())
        header[name] = {"dtype": dtype, "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    (d / "model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head
                                          + b"".join(blobs))
    with pytest.raises(jspec.CheckpointError, match="'model.norm.weight' is stored in float8"):
        _xla(d)


def test_missing_path(tmp_path):
    with pytest.raises(jspec.CheckpointError, match="not a checkpoint directory"):
        _xla(tmp_path / "nowhere")


# -------------------------------------------------------- progress and interpret mode


def test_progress_bar_over_threshold(tmp_path, monkeypatch, capsys):
    jspec.load_hf(fixture_path("qwen3"), backend="xla")
    assert "loading" not in capsys.readouterr().err  # a small checkpoint: no bar
    monkeypatch.setattr(loading, "PROGRESS_MIN_BYTES", 0)
    jspec.load_hf(fixture_path("qwen3"), backend="xla")
    assert "loading qwen3" in capsys.readouterr().err


def test_interpret_mode_warns_once(tmp_path, caplog):
    d = _copy_fixture(tmp_path)
    caplog.set_level(logging.INFO, logger="jspec")
    jspec.load_hf(str(d), backend="xla", interpret=True)
    jspec.load_hf(str(d), backend="pallas", interpret=True)
    jspec.load_hf(str(d), backend="pallas", interpret=True)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    msg = warned[0].getMessage()
    assert "interpreted on the CPU" in msg and "a token" in msg and "backend='xla'" in msg
    assert loading.interpret_seconds_per_token(135_000_000) == pytest.approx(1.9)


# ------------------------------------------------------------ what loads, and as what


@pytest.mark.parametrize("stored, dtype, value", [("float64", "float32", 1e300),
                                                  ("float32", "bfloat16", 3.4e38)])
def test_values_beyond_the_load_dtype_are_an_error(tmp_path, stored, dtype, value):
    """The finiteness check ran on the stored values: a float64 weight above float32's
    largest, or a float32 one that rounds to bfloat16's inf, loaded as inf."""
    d = _copy_fixture(tmp_path)
    name = "model.layers.0.mlp.down_proj.weight"

    def edit(t):
        t[name] = t[name].astype(stored)
        t[name][3, 5] = value
    _edit_tensors(d, edit)
    with pytest.raises(jspec.CheckpointError,
                       match=f"tensor '{name}' in {d}/model.safetensors has 1 values beyond "
                             f"the range of {dtype} .*stored as {stored}"):
        jspec.load_hf(str(d), dtype=dtype, backend="xla")


def test_a_single_file_wins_over_an_index_as_in_transformers(tmp_path, caplog):
    """A directory with both model.safetensors and a shard index: transformers loads the
    single file, jspec read the index (other weights than the reference's, silently)."""
    d = _copy_fixture(tmp_path, "qwen3_sharded")
    t = load_file(os.path.join(fixture_path("qwen3"), "model.safetensors"))
    t["model.norm.weight"] = t["model.norm.weight"] * 2
    save_file(t, str(d / "model.safetensors"))
    caplog.set_level(logging.WARNING, logger="jspec")
    model = _xla(d)
    np.testing.assert_array_equal(np.asarray(model.params["final_norm"]), t["model.norm.weight"])
    assert any("reading model.safetensors (as transformers does)" in r.getMessage()
               for r in caplog.records)


def test_a_shards_tensors_left_out_of_the_index_are_read_or_an_error(tmp_path):
    """The index alone named the tensors: one a shard holds but the index leaves out was
    neither read (a "missing tensor" transformers loads) nor flagged as unused."""
    d = _copy_fixture(tmp_path, "qwen3_sharded")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = index["weight_map"].pop("model.norm.weight")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert bits(_xla(d).params["final_norm"]).tolist() == bits(
        _xla(fixture_path("qwen3")).params["final_norm"]).tolist()

    def edit(t):
        t["model.layers.2.mlp.up_proj.weight"] = np.ones((128, 64), np.float32)
    _edit_tensors(d, edit, shard)
    with pytest.raises(jspec.CheckpointError, match="not used: weights for layer 2 but "
                                                    "num_hidden_layers=2"):
        _xla(d)


@pytest.mark.parametrize("rope_type", ["llama3", "linear"])
def test_partial_rotary_factor_with_scaled_rope_is_refused(tmp_path, rope_type):
    """transformers' llama3 and linear tables rotate partial_rotary_factor of each head;
    jspec rotated the whole head without a word."""
    d = _copy_fixture(tmp_path, "llama3")
    if rope_type == "linear":
        _edit_config(d, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                         "rope_theta": 5e5})
    _edit_config(d, partial_rotary_factor=0.5)
    with pytest.raises(jspec.UnsupportedModelError,
                       match=f"partial_rotary_factor=0.5 with rope_type='{rope_type}'"):
        _xla(d)


@pytest.mark.parametrize("fixture, window, layers", [
    ("gemma3", None, "[0, 1]"), ("gemma3", 0, "[0, 1]"), ("gemma2", 0, "[0, 2]"),
    ("gpt_oss", None, "[0, 2]")])
def test_sliding_layers_without_a_window_are_refused(tmp_path, fixture, window, layers):
    """layer_types with sliding layers and sliding_window null or 0 loaded those layers
    with full attention (jspec's window 0 is none), where transformers raises (null) or
    masks every key (0)."""
    d = _copy_fixture(tmp_path, fixture)
    _edit_config(d, sliding_window=window)
    with pytest.raises(jspec.UnsupportedModelError,
                       match=rf"layers {re.escape(layers)} 'sliding_attention' but "
                             rf"sliding_window={window!r}: a sliding layer needs a window"):
        _xla(d)


@pytest.mark.parametrize("fixture, window", [("mistral", 0), ("mixtral", 0), ("mistral", -4)])
def test_a_window_on_every_layer_is_at_least_one_key(tmp_path, fixture, window):
    """Mistral's and Mixtral's sliding_window of 0 loaded as full attention (jspec's window
    0 is none), where transformers masks every key."""
    d = _copy_fixture(tmp_path, fixture)
    _edit_config(d, sliding_window=window)
    with pytest.raises(jspec.UnsupportedModelError,
                       match=rf"{fixture}: sliding_window={window!r}: a window is a whole number"):
        _xla(d)


def test_a_null_window_on_every_layer_is_full_attention(tmp_path):
    d = _copy_fixture(tmp_path, "mistral")
    _edit_config(d, sliding_window=None)
    assert _xla(d).config.sliding_window == 0


def test_a_mesh_neither_drops_mxfp4_experts_nor_the_config_files_name(tmp_path):
    """load_hf(mesh=...) ignored mxfp4_experts=True, and its config errors began
    "config:" where those without a mesh name config.json."""
    from jspec import sharding

    mesh = sharding.make_mesh(1)
    with pytest.raises(ValueError, match="mxfp4_experts=True with a mesh"):
        jspec.load_hf(fixture_path("qwen3"), mesh=mesh, backend="xla", mxfp4_experts=True)
    d = _copy_fixture(tmp_path)
    _edit_config(d, rms_norm_eps=0.0)
    with pytest.raises(jspec.UnsupportedModelError,
                       match=re.escape(os.path.join(str(d), "config.json")) + ": rms_norm_eps"):
        jspec.load_hf(str(d), mesh=mesh, backend="xla")


def test_a_params_checkpoint_given_to_load_hf_points_to_restore_params(tmp_path):
    from jspec.checkpoint import DIGEST_FILE

    (tmp_path / DIGEST_FILE).write_text("{}")
    with pytest.raises(jspec.CheckpointError, match="params checkpoint of jspec.checkpoint."
                                                    "save_params.*restore_params"):
        _xla(tmp_path)


def test_a_cast_from_the_stored_dtype_is_said(tmp_path, caplog):
    # float16 weights loaded as bfloat16 lose 3 mantissa bits: a warning (was silent, even
    # at INFO); any other cast is said at INFO; a load in the stored dtype says nothing.
    d = _copy_fixture(tmp_path, "qwen3")
    _edit_tensors(d, lambda t: t.update({k: v.astype(np.float16) for k, v in t.items()}))
    caplog.set_level(logging.INFO, logger="jspec")
    jspec.load_hf(str(d), dtype="bfloat16", backend="xla")
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("weights stored as float16 load as bfloat16 (3 mantissa bits fewer" in
               r.getMessage() for r in warned), [r.getMessage() for r in caplog.records]
    caplog.clear()
    jspec.load_hf(str(d), dtype="float32", backend="xla")
    assert [r.levelno for r in caplog.records if "stored as float16 load as float32"
            in r.getMessage()] == [logging.INFO]
    caplog.clear()
    jspec.load_hf(fixture_path("qwen3"), dtype="float32", backend="xla")
    assert not [r for r in caplog.records if "stored as" in r.getMessage()]
