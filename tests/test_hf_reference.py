"""jspec against transformers: logits within float32 tolerance, greedy tokens equal.

The expected values were written by tests/fixtures/make_fixtures.py with
transformers + torch on the CPU (float32). Tolerances belong here only: these
compare two different implementations, not two computations of jspec.
"""

import numpy as np
import pytest
from conftest import FAMILIES, MOE_FAMILIES, expected, fixture_path, load, slow_except

import jspec

BACKENDS = ("xla", "pallas")
# gemma3_mm: a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration), its text
# model read out of it; that class applies no final softcap where its text_config sets one.
# mistral: Llama with one sliding window on every layer (the dense draft of a Mixtral);
# ministral: windowed and full layers by layer_types;
# qwen2: q/k/v biases; gemma2: softcapped attention scores.
# qwen2_moe: Qwen2's attention, a shared expert under a sigmoid gate; gpt_oss: biases
# everywhere, attention sinks, a clamped SwiGLU, yarn RoPE; gpt_oss_mxfp4: the same model
# with its experts stored as MXFP4 (gpt_oss's expected values).
MOE = MOE_FAMILIES + ("qwen2_moe", "gpt_oss", "gpt_oss_mxfp4")
ALL = FAMILIES + ("mistral", "ministral", "qwen2", "gemma2") + MOE + ("gemma3_mm",)
SAME_MODEL = {"gpt_oss_mxfp4": "gpt_oss"}  # fixtures of one model, one expected.npz


def full_sequence(name):
    e = expected(SAME_MODEL.get(name, name))
    return np.concatenate([e["prompt"], e["greedy"]]).astype(np.int32)


# pallas on every family; the xla baseline on the three main ones (the rest: slow).
@pytest.mark.parametrize("name,backend", slow_except(
    [(n, "pallas") for n in ALL] + [(n, "xla") for n in FAMILIES], ALL, BACKENDS))
def test_logits_match_transformers(name, backend):
    model = load(name, backend)
    seq = full_sequence(name)
    cache = jspec.init_cache(model, 1, len(seq))
    logits, _ = jspec.forward(model, seq[None], cache)
    ref = expected(SAME_MODEL.get(name, name))["logits"]
    np.testing.assert_allclose(np.asarray(logits[0]), ref, rtol=2e-4, atol=1e-3)
    if name in MOE:  # routing and experts: max error relative to the logits' range
        assert np.abs(np.asarray(logits[0]) - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("name", ALL)
def test_batched_logits_match_transformers(name):
    model = load(name, "xla")
    e = expected(SAME_MODEL.get(name, name))
    cache = jspec.init_cache(model, 2, e["batch_prompts"].shape[1])
    logits, _ = jspec.forward(model, e["batch_prompts"], cache)
    np.testing.assert_allclose(np.asarray(logits), e["batch_logits"], rtol=2e-4, atol=1e-3)


# The default run takes one family on pallas; the rest are further cases
# (test_logits_match_transformers covers every family, MoE ones included, on both backends).
@pytest.mark.parametrize("name,backend", [
    (n, b) if (n, b) == ("qwen3", "pallas")
    else pytest.param(n, b, marks=pytest.mark.slow) for b in BACKENDS for n in ALL])
def test_greedy_matches_transformers_generate(name, backend):
    e = expected(SAME_MODEL.get(name, name))
    n = len(e["greedy"])
    assert n >= 32
    out = jspec.generate(load(name, backend), [e["prompt"]], max_new_tokens=n)
    assert out.row(0) == e["greedy"].tolist()


def test_sharded_checkpoint_loads_same_params():
    single = jspec.load_hf(fixture_path("qwen3"), dtype="float32", backend="xla")
    sharded = jspec.load_hf(fixture_path("qwen3_sharded"), dtype="float32", backend="xla")
    flat_a, tree_a = __import__("jax").tree.flatten(single.params)
    flat_b, tree_b = __import__("jax").tree.flatten(sharded.params)
    assert tree_a == tree_b
    for a, b in zip(flat_a, flat_b, strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_family_features_are_read():
    llama, qwen, gemma = (load(n, "xla").config for n in FAMILIES)
    assert llama.rope.llama3 is not None and not llama.tie_embeddings
    assert qwen.qk_norm and qwen.tie_embeddings and qwen.num_kv_heads < qwen.num_heads
    assert gemma.sandwich_norms and gemma.norm_offset == 1.0
    assert any(gemma.layer_sliding) and not all(gemma.layer_sliding)
    assert gemma.sliding_window < len(full_sequence("gemma3"))
    assert gemma.rope_local.theta != gemma.rope.theta
    assert gemma.attn_softcap is None and gemma.final_softcap and gemma.embed_scale


def test_mistral_features_are_read():
    from transformers import AutoConfig

    mistral = load("mistral", "xla").config
    assert mistral.family == "mistral" and all(mistral.layer_sliding)
    assert mistral.sliding_window == 16 < len(full_sequence("mistral"))
    assert mistral.head_dim == 32 and not mistral.qk_norm and not mistral.tie_embeddings
    raw = AutoConfig.from_pretrained(fixture_path("mistral"))
    raw.sliding_window = None  # Mistral v0.2+: no window
    cfg = jspec.from_hf_config(raw)
    assert cfg.sliding_window == 0 and not any(cfg.layer_sliding)


def test_ministral_layer_types_are_read(tmp_path):
    # transformers reads a Mistral config with layer_types as Ministral (windowed and full
    # layers); jspec does too (was refused as model_type='ministral', a name the file lacks).
    import json
    import shutil

    cfg = load("ministral", "xla").config
    assert cfg.family == "ministral" and cfg.layer_sliding == (True, False, True)
    assert cfg.sliding_window == 16 < len(full_sequence("ministral"))
    d = tmp_path / "mistral_with_layer_types"
    shutil.copytree(fixture_path("ministral"), d)
    raw = json.loads((d / "config.json").read_text())
    raw |= {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    (d / "config.json").write_text(json.dumps(raw))
    assert jspec.load_hf(str(d), dtype="float32", backend="xla").config == cfg
    raw |= {"sliding_window": None}  # no window: every layer full, as transformers masks
    (d / "config.json").write_text(json.dumps(raw))
    cfg = jspec.load_hf(str(d), dtype="float32", backend="xla").config
    assert cfg.sliding_window == 0 and not any(cfg.layer_sliding)


def test_qwen2_biases_are_read():
    model = load("qwen2", "xla")
    cfg, lp = model.config, model.params["layers"][0]
    assert cfg.family == "qwen2" and cfg.qkv_bias and not cfg.qk_norm and cfg.tie_embeddings
    assert lp["bqkv"].shape == (cfg.q_size + 2 * cfg.kv_size,) and np.abs(lp["bqkv"]).min() > 0


def test_gemma2_features_are_read():
    cfg = load("gemma2", "xla").config
    assert cfg.family == "gemma2" and cfg.attn_softcap == 5.0 and cfg.final_softcap == 30.0
    assert cfg.layer_sliding == (True, False, True) and cfg.rope_local is None
    assert cfg.sandwich_norms and not cfg.qk_norm and cfg.attn_scale == 24**-0.5


def test_qwen2_moe_features_are_read():
    model = load("qwen2_moe", "xla")
    cfg, layers = model.config, model.params["layers"]
    assert cfg.layer_experts == (True, False, True) and cfg.shared_expert_size == 32
    assert cfg.qkv_bias and not cfg.qk_norm and not cfg.norm_topk_prob
    assert layers[0]["w_shared_gate"].shape == (64, 1) and "w_shared_down" not in layers[1]


def test_gpt_oss_features_are_read():
    """Every gpt-oss part is read, and MXFP4 experts load to the float checkpoint's bits
    (the fixture's float experts are transformers' dequantization of the MXFP4 ones)."""
    model, packed = load("gpt_oss", "xla"), load("gpt_oss_mxfp4", "xla")
    cfg, lp = model.config, model.params["layers"][0]
    assert cfg.family == "gpt_oss" and cfg.activation == "gpt_oss" and cfg.topk_softmax
    assert cfg.layer_sliding == (True, False, True) and cfg.sliding_window == 8
    assert cfg.qkv_bias and cfg.o_bias and cfg.attn_sinks and cfg.expert_bias
    assert cfg.router_bias and cfg.rope.yarn.factor == 4.0 and not cfg.rope.yarn.truncate
    shapes = {"bo": (64,), "sinks": (4,), "router_bias": (4,), "b_gate_up": (4, 64),
              "b_down": (4, 64), "w_gate_up": (4, 64, 64), "w_down": (4, 32, 64)}
    assert {k: lp[k].shape for k in shapes} == shapes
    assert cfg == packed.config
    for a, b in zip(model.params["layers"], packed.params["layers"], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(np.asarray(a[k]).view(np.uint32),
                                          np.asarray(b[k]).view(np.uint32), err_msg=k)


def test_moe_features_are_read():
    qwen, mixtral = (load(n, "xla").config for n in MOE_FAMILIES)
    assert qwen.layer_experts == (True, False, True)  # mlp_only_layers=[1]
    assert (qwen.num_experts, qwen.experts_per_token, qwen.expert_size) == (8, 2, 16)
    assert qwen.norm_topk_prob and qwen.qk_norm and qwen.intermediate_size == 128
    assert mixtral.layer_experts == (True, True) and mixtral.norm_topk_prob
    assert (mixtral.num_experts, mixtral.expert_size) == (4, mixtral.intermediate_size)
    assert all(mixtral.layer_sliding) and mixtral.sliding_window < len(full_sequence("mixtral"))
