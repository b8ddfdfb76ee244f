"""Numerics that cannot lie, CPU.

Each test fails without its fix: a checkpoint whose weights are finite but whose
activations overflow (embedding scaled by 1e38: every logit exactly 0.0, token 0 forever)
stops serial, speculative and text runs with a NonFiniteError naming row, position and
where; a NaN in one layer's weights names that layer; a NaN RoPE table is caught as
non-finite attention inputs (attention used to swallow it); RoPE parameters, eps and sizes
that give NaN tables or activations are refused when a config is read; integer weights are
refused, not cast; the parity audit reports degenerate logits (all equal) as a failure on
both backends instead of counting them as matches.
"""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest
from conftest import expected, fixture_path, load

import jspec
from jspec import audit, parity
from jspec.config import RopeSpec, UnsupportedModelError, rope_spec
from jspec.text import TextPipeline


def _prompt():
    return [expected("qwen3")["prompt"][:6]]


def _scaled_embedding(model, scale=1e38):
    params = dict(model.params)
    params["embed"] = params["embed"] * scale  # finite weights, overflowing activations
    return model.replace(params=params)


def _poisoned(model, layer: int, name: str):
    params = jax.tree.map(lambda x: x, model.params)
    lp = dict(params["layers"][layer])
    lp[name] = lp[name].at[0, 0].set(np.nan)
    params["layers"] = [lp if i == layer else p for i, p in enumerate(params["layers"])]
    return model.replace(params=params)


SPEC = jspec.SpecConfig(gamma=2, max_new_tokens=4)
OVERFLOW = r"row 0, position 0: the residual stream entering layer 0 .* overflows f32"


def test_overflowing_activations_stop_serial_speculative_and_stream_runs():
    model = _scaled_embedding(load("qwen3", "xla"))
    fwd = jspec.forward(model, np.zeros((1, 3), np.int32), jspec.init_cache(model, 1, 8))
    assert np.all(np.asarray(fwd.logits) == 0.0)  # what used to pass every parity check
    assert np.all(np.asarray(fwd.bad) == 0)  # code 0: the stream entering layer 0
    with pytest.raises(jspec.NonFiniteError, match="serial decoding: " + OVERFLOW):
        jspec.generate(model, _prompt(), max_new_tokens=4)
    with pytest.raises(jspec.NonFiniteError, match=OVERFLOW):
        list(jspec.generate_stream(model, _prompt(), max_new_tokens=4))
    with pytest.raises(jspec.NonFiniteError, match="speculative decoding.*" + OVERFLOW):
        jspec.speculative_generate(model, jspec.PromptLookupDrafter(), _prompt(), SPEC)
    with pytest.raises(jspec.NonFiniteError, match=OVERFLOW):
        list(jspec.speculative_stream(model, jspec.PromptLookupDrafter(), _prompt(), SPEC))


def test_a_healthy_forward_flags_nothing():
    model = load("qwen3", "xla")
    fwd = jspec.forward(model, np.zeros((2, 3), np.int32), jspec.init_cache(model, 2, 8))
    assert fwd.bad.shape == (2, 3) and np.all(np.asarray(fwd.bad) == -1)


@pytest.mark.parametrize("backend", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_a_traced_id_out_of_range_is_flagged_at_its_position_alone(backend):
    # Before, its NaN embedding reached the positions before it (their masked key's zero
    # weight times NaN values): NaN logits flagged where the input was valid.
    model = load("qwen3", backend)
    V = model.config.vocab_size
    run = jax.jit(lambda t, c: jspec.apply(model, t, c))
    good = run(np.array([[1, 2, 3, 4]], np.int32), jspec.init_cache(model, 1, 8))
    for wrong in (V, -3):
        fwd = run(np.array([[1, 2, wrong, 4]], np.int32), jspec.init_cache(model, 1, 8))
        assert fwd.bad.tolist() == [[-1, -1, 0, -1]]
        assert np.isfinite(np.asarray(fwd.logits)).all()
        assert np.array_equal(np.asarray(fwd.logits)[0, :2], np.asarray(good.logits)[0, :2])


@pytest.mark.parametrize("name,layer,where", [
    ("wqkv", 1, "the attention inputs .* of layer 1 hold NaN"),
    ("w_down", 0, "the residual stream entering layer 1 holds NaN"),
])
def test_a_nan_in_one_layer_names_that_layer(name, layer, where):
    model = _poisoned(load("qwen3", "xla"), layer, name)
    with pytest.raises(jspec.NonFiniteError, match=r"row 0, position \d+: " + where):
        jspec.generate(model, _prompt(), max_new_tokens=3)


def test_a_nan_rope_table_is_caught_as_non_finite_attention_inputs():
    model = load("qwen3", "xla")
    cfg = model.config
    object.__setattr__(cfg := dataclasses.replace(cfg), "rope", RopeSpec(theta=0.0))  # bypass
    model = model.replace(config=cfg)
    with pytest.raises(jspec.NonFiniteError, match="attention inputs .* of layer 0"):
        jspec.generate(model, _prompt(), max_new_tokens=3)


@pytest.mark.slow  # a further case of a property the default run proves
def test_the_text_api_raises_on_overflowing_activations(tmp_path):
    from jspec.tiny import write_tiny_gemma3_pair

    target_dir, _ = write_tiny_gemma3_pair(str(tmp_path))
    pipe = jspec.load_text(target_dir, backend="xla", dtype="float32")
    pipe = dataclasses.replace(pipe, target=_scaled_embedding(pipe.target))
    assert isinstance(pipe, TextPipeline)
    with pytest.raises(jspec.NonFiniteError, match="overflows f32"):
        pipe.generate(["hello"], max_new_tokens=3)


@pytest.mark.parametrize("params,field", [
    ({"rope_theta": 0.0}, "rope_theta=0.0"),
    ({"rope_theta": -1.0}, "rope_theta=-1.0"),
    ({"rope_theta": float("nan")}, "rope_theta=nan"),
    ({"rope_theta": 1e4, "rope_type": "linear", "factor": 0.0}, "linear factor=0.0"),
    ({"rope_theta": 1e4, "rope_type": "llama3", "factor": 0.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, "llama3 factor=0.0"),
    ({"rope_theta": 1e4, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, "less than"),
    ({"rope_theta": 1e4, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 0},
     "original_max_position_embeddings=0"),
    ({"rope_theta": 1e4, "rope_type": "llama3", "factor": 8.0}, "needs"),
])
def test_rope_parameters_that_give_nan_tables_are_refused(params, field):
    with pytest.raises(UnsupportedModelError, match=f"where: .*{field}"):
        rope_spec(params, None, "where")


def _copy_fixture(tmp_path, name="qwen3"):
    dst = tmp_path / name
    shutil.copytree(fixture_path(name), dst)
    return dst


@pytest.mark.parametrize("family,edit,field", [
    ("qwen3", {"rope_parameters": {"rope_theta": 0.0, "rope_type": "default"}},
     "rope_theta=0.0"),
    ("llama3", {"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 0.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}},
     "llama3 factor=0.0"),
    ("qwen3", {"rms_norm_eps": 0.0}, "rms_norm_eps=0.0"),
    ("qwen3", {"rms_norm_eps": -1e-6}, "rms_norm_eps=-1e-06"),
    ("qwen3", {"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ("qwen3", {"intermediate_size": 0}, "intermediate_size=0"),
    ("qwen3", {"head_dim": 0}, "head_dim=0"),
    ("qwen3", {"head_dim": 24}, "head_dim=24 is not a power of two >= 16"),  # at load
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]},
     "layer_types asks for layers \\[1\\] to be 'sliding_attention'"),
    ("gemma3", {"final_logit_softcapping": -30.0}, "final_softcap=-30.0"),
])
def test_a_config_that_breaks_the_numerics_is_refused_naming_file_and_field(
        tmp_path, family, edit, field):
    d = _copy_fixture(tmp_path, family)
    cfg = json.loads((d / "config.json").read_text())
    target = cfg.get("text_config", cfg) if family == "gemma3" else cfg
    target.update(edit)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((UnsupportedModelError, jspec.CheckpointError),
                       match=f"{d}/config.json: .*{field}"):
        jspec.load_hf(str(d), dtype="float32", backend="xla")


def test_an_integer_weight_is_refused_naming_file_and_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy_fixture(tmp_path)
    fn = os.path.join(d, "model.safetensors")
    tensors = load_file(fn)
    name = next(n for n in tensors if n.endswith("mlp.down_proj.weight"))
    tensors[name] = tensors[name].astype(np.int32)
    save_file(tensors, fn, metadata={"format": "pt"})
    with pytest.raises(jspec.CheckpointError, match=f"{name}.*dtype int32.*floating point"):
        jspec.load_hf(str(d), dtype="float32", backend="xla")


def test_degenerate_rows():
    a = np.array([[0.0, 0.0, 0.0], [1.0, 2.0, 0.5], [1.0, np.nan, 0.0], [3.0, 3.0, 3.0]])
    assert parity.degenerate_rows(a).tolist() == [True, False, True, True]


@pytest.mark.parametrize("backend", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_the_audit_reports_degenerate_logits_as_a_failure(backend):
    model = _scaled_embedding(load("qwen3", backend))
    prefix = expected("qwen3")["prompt"][:4].astype(np.int32)
    res = audit.same_prefix_controls(model, prefix, np.array([5, 7], np.int32), 1)
    assert not res["equal"]
    for h in res["histories"].values():
        c = h["vs_prefill_of_prefix+proposals"]
        assert c["mismatched_rows"] == 0  # every bit agrees ...
        assert c["degenerate_rows"] == c["rows"] and not c["equal"]  # ... on nothing
        assert "degenerate" in c["first_degenerate"]["why"]
