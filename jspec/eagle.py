"""Published EAGLE-3 heads: load them for a jspec target, and write heads in their layout.

The layout the public heads use (SGLang's `LlamaForCausalLMEagle3`, vLLM's
`Eagle3LlamaForCausalLM`, vllm-project/speculators):

  config.json        a Llama config with "architectures": ["LlamaForCausalLMEagle3"],
                     hidden_size, intermediate_size, num_attention_heads,
                     num_key_value_heads, rms_norm_eps, rope_theta / rope_scaling,
                     vocab_size (the target's), draft_vocab_size, optional
                     target_hidden_size, norm_before_residual and
                     eagle_config.eagle_aux_hidden_state_layer_ids (default: the inputs of
                     target layers 2, L // 2, L - 3)
  model.safetensors  fc.weight [D, 3 Dt]; midlayer.{input_layernorm, hidden_norm,
                     post_attention_layernorm}.weight [D];
                     midlayer.self_attn.{q,k,v}_proj.weight [.., 2D]; o_proj [D, H hd];
                     midlayer.mlp.{gate,up,down}_proj.weight; norm.weight [D];
                     lm_head.weight [Vd, D]; d2t [Vd] (target id - draft id); t2d [V]
                     bool (the target ids on the head); optional embed_tokens.weight [V, D]
                     (else the target's embedding). `layers.0.` is accepted for `midlayer.`.

Every mismatch (names, shapes, the target's hidden size or vocabulary, the maps) is a
`CheckpointError` naming it.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from jspec.config import UnsupportedModelError, canonical_dtype, rope_spec
from jspec.feature_head import FeatureHead, eagle3_layers, head_config, slot_map
from jspec.loading import (
    CheckpointError,
    TensorReader,
    np_dtype,
    read_config_json,
    resolve_checkpoint,
)
from jspec.model import Model
from jspec.options import KernelOptions

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_LAYER = ("midlayer.", "layers.0.")


def _read_config(path: str) -> dict:
    fn = os.path.join(path, "config.json")
    cfg = read_config_json(path, " (an EAGLE-3 head directory has one)")
    if "transformer_layer_config" in cfg:  # the speculators layout: the layer nested
        cfg = {**cfg["transformer_layer_config"], **{k: v for k, v in cfg.items()
                                                     if k != "transformer_layer_config"}}
        cfg.setdefault("architectures", [ARCHITECTURES[0]])
    archs = cfg.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        raise UnsupportedModelError(f"{fn}: architectures={archs}; an EAGLE-3 head is one of "
                                    f"{ARCHITECTURES}")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise UnsupportedModelError(f"{fn}: num_hidden_layers={cfg['num_hidden_layers']}; "
                                    "jspec's feature head has one decoder layer")
    for flag in ("attention_bias", "mlp_bias", "bias"):
        if cfg.get(flag):
            raise UnsupportedModelError(f"{fn}: {flag}=True is not supported")
    return cfg


def _rope(cfg: dict, where: str):
    params = cfg.get("rope_parameters") or dict(cfg.get("rope_scaling") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return rope_spec(params, None, where)


def load_eagle3(path: str, target: Model, *, dtype=None,
                options: KernelOptions | None = None) -> FeatureHead:
    """Loads an EAGLE-3 head directory (or a hub id in the local HF cache) for `target`.

    dtype: the head's (default the target's); options: its kernel choices (default the
    target's backend with the fusions' defaults). Wrap the result in
    `jspec.FeatureDrafter` to draft with it.
    """
    path = resolve_checkpoint(path)
    cfg = _read_config(path)
    tcfg = target.config
    Dt = int(cfg.get("target_hidden_size") or cfg["hidden_size"])
    if Dt != tcfg.hidden_size:
        raise CheckpointError(f"{path}: the head reads features of width {Dt} "
                              f"(target_hidden_size) but the target's hidden_size is "
                              f"{tcfg.hidden_size}: this head was trained for another target")
    if int(cfg["vocab_size"]) != tcfg.vocab_size:
        raise CheckpointError(f"{path}: vocab_size={cfg['vocab_size']} but the target's "
                              f"vocabulary has {tcfg.vocab_size} ids")
    eagle = cfg.get("eagle_config") or {}
    layers = tuple(eagle.get("eagle_aux_hidden_state_layer_ids")
                   or cfg.get("eagle_aux_hidden_state_layer_ids")
                   or eagle3_layers(tcfg.num_layers))
    if eagle.get("use_aux_hidden_state") is False:
        raise UnsupportedModelError(f"{path}: use_aux_hidden_state=False (a head over the "
                                    "target's normed last hidden state) is not supported")
    bad = [i for i in layers if not 0 <= int(i) <= tcfg.num_layers]
    if bad:
        raise CheckpointError(f"{path}: feature layers {bad} are outside the target's "
                              f"0..{tcfg.num_layers}")
    D, H = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or D // H)
    dtype = canonical_dtype(dtype) if dtype is not None else tcfg.dtype
    hcfg = head_config(
        tcfg, hidden_size=D, intermediate_size=int(cfg["intermediate_size"]), num_heads=H,
        num_kv_heads=int(cfg.get("num_key_value_heads") or H), head_dim=head_dim,
        draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
        feature_layers=tuple(int(i) for i in layers), rope=_rope(cfg, path),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), dtype=dtype,
        norm_before_residual=bool(cfg.get("norm_before_residual", False)))
    L, V, Vd = hcfg.layer, hcfg.vocab_size, hcfg.layer.vocab_size
    reader = TensorReader(path)
    pre = next((p for p in _LAYER if reader.has(p + "hidden_norm.weight")), None)
    if pre is None:
        raise CheckpointError(f"{path}: missing tensor 'midlayer.hidden_norm.weight' (not an "
                              "EAGLE-3 head's layer)")
    dt = np_dtype(dtype)

    def get(name, shape):
        return reader.get(name, shape).astype(dt)

    def lin(name, out_dim, in_dim):  # HF [out, in] -> [in, out]
        return np.ascontiguousarray(get(name, (out_dim, in_dim)).T)

    F = L.intermediate_size
    layer = {
        "input_norm": get(pre + "input_layernorm.weight", (D,)),
        "hidden_norm": get(pre + "hidden_norm.weight", (D,)),
        "post_norm": get(pre + "post_attention_layernorm.weight", (D,)),
        "wqkv": np.concatenate([lin(pre + f"self_attn.{n}_proj.weight", size, 2 * D)
                                for n, size in (("q", L.q_size), ("k", L.kv_size),
                                                ("v", L.kv_size))], axis=1),
        "wo": lin(pre + "self_attn.o_proj.weight", D, L.q_size),
        "w_gate_up": np.concatenate([lin(pre + "mlp.gate_proj.weight", F, D),
                                     lin(pre + "mlp.up_proj.weight", F, D)], axis=1),
        "w_down": lin(pre + "mlp.down_proj.weight", D, F),
    }
    params = {"layer": layer, "norm": get("norm.weight", (D,))}
    if hcfg.has_fc:
        params["fc"] = lin("fc.weight", D, hcfg.feature_width)
    if reader.has("lm_head.weight"):
        params["lm_head"] = lin("lm_head.weight", Vd, D)
    elif Vd == V and cfg.get("tie_word_embeddings"):
        params["lm_head"] = None  # set from the embedding below
    else:
        raise CheckpointError(f"{path}: missing tensor 'lm_head.weight' (expected shape "
                              f"({Vd}, {D}))")
    if reader.has("embed_tokens.weight"):
        params["embed"] = get("embed_tokens.weight", (V, D))
    elif D == tcfg.hidden_size:
        params["embed"] = target.params["embed"]  # the target's own, shared
    else:
        raise CheckpointError(f"{path}: no embed_tokens.weight and the head's width {D} is "
                              f"not the target's {tcfg.hidden_size}")
    if params["lm_head"] is None:
        params["lm_head"] = jnp.asarray(params["embed"]).T
    params["head_slot"] = _head_slot(reader, path, Vd, V)
    unused = sorted(set(reader.where) - reader.used)
    if unused:
        raise CheckpointError(f"{path}: {len(unused)} tensors are not part of an EAGLE-3 head: "
                              f"{', '.join(unused[:10])}")
    params = jax.tree.map(jnp.asarray, params)  # the target's embedding: no copy
    options = options or KernelOptions(backend=target.options.backend,
                                       interpret=target.options.interpret)
    return FeatureHead(config=hcfg, params=params, options=options)


def _head_slot(reader: TensorReader, path: str, Vd: int, V: int):
    """The published d2t [Vd] (target id = draft id + d2t) and t2d [V] maps -> head_slot."""
    if not reader.has("d2t"):
        if Vd != V:
            raise CheckpointError(f"{path}: draft_vocab_size={Vd} < vocab_size={V} but no "
                                  "d2t map (target id = draft id + d2t[draft id])")
        return jnp.arange(V, dtype=jnp.int32)
    d2t = reader.get("d2t", (Vd,))
    if not np.issubdtype(d2t.dtype, np.integer):
        raise CheckpointError(f"{path}: d2t must hold integers; got {d2t.dtype}")
    target_ids = np.arange(Vd, dtype=np.int64) + d2t.astype(np.int64)
    try:
        slot = slot_map(target_ids, V)
    except ValueError as e:
        raise CheckpointError(f"{path}: d2t: {e}") from e
    if reader.has("t2d"):
        t2d = reader.get("t2d", (V,)).astype(bool)
        if not np.array_equal(t2d, slot >= 0):
            raise CheckpointError(f"{path}: t2d marks {int(t2d.sum())} target ids, d2t maps "
                                  f"to {Vd}: the maps disagree on "
                                  f"{int(np.sum(t2d != (slot >= 0)))} ids")
    return jnp.asarray(slot)


def save_eagle3(path: str, head: FeatureHead, *, save_embedding: bool = False) -> str:
    """Writes `head` in the published EAGLE-3 layout (config.json, model.safetensors);
    `load_eagle3(path, target)` reads it back bitwise. The target's embedding is left out
    unless save_embedding (heads narrower than their target must save it)."""
    cfg, p = head.config, head.params
    L = cfg.layer
    D = L.hidden_size
    os.makedirs(path, exist_ok=True)
    dt = np_dtype(L.dtype)

    def a(x):
        return np.asarray(x).astype(dt)

    def hf(x):  # [in, out] -> HF [out, in]
        return np.ascontiguousarray(a(x).T)

    lp = p["layer"]
    q, k, v = np.split(np.asarray(lp["wqkv"]), [L.q_size, L.q_size + L.kv_size], axis=1)
    gate, up = np.split(np.asarray(lp["w_gate_up"]), 2, axis=1)
    slot = np.asarray(p["head_slot"])
    target_ids = np.full((L.vocab_size,), -1, np.int64)
    target_ids[slot[slot >= 0]] = np.flatnonzero(slot >= 0)
    tensors = {
        "midlayer.input_layernorm.weight": a(lp["input_norm"]),
        "midlayer.hidden_norm.weight": a(lp["hidden_norm"]),
        "midlayer.post_attention_layernorm.weight": a(lp["post_norm"]),
        "midlayer.self_attn.q_proj.weight": hf(q), "midlayer.self_attn.k_proj.weight": hf(k),
        "midlayer.self_attn.v_proj.weight": hf(v), "midlayer.self_attn.o_proj.weight":
            hf(lp["wo"]),
        "midlayer.mlp.gate_proj.weight": hf(gate), "midlayer.mlp.up_proj.weight": hf(up),
        "midlayer.mlp.down_proj.weight": hf(lp["w_down"]),
        "norm.weight": a(p["norm"]), "lm_head.weight": hf(p["lm_head"]),
        "d2t": target_ids - np.arange(L.vocab_size, dtype=np.int64), "t2d": slot >= 0,
    }
    if cfg.has_fc:
        tensors["fc.weight"] = hf(p["fc"])
    if save_embedding or D != cfg.target_hidden:
        tensors["embed_tokens.weight"] = a(p["embed"])
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    rope = {"rope_type": "default", "rope_theta": L.rope.theta}
    if L.rope.llama3 is not None:
        f, lo, hi, old = L.rope.llama3
        rope |= {"rope_type": "llama3", "factor": f, "low_freq_factor": lo,
                 "high_freq_factor": hi, "original_max_position_embeddings": old}
    config = {
        "architectures": [ARCHITECTURES[0]], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": D, "intermediate_size": L.intermediate_size,
        "num_attention_heads": L.num_heads, "num_key_value_heads": L.num_kv_heads,
        "head_dim": L.head_dim, "num_hidden_layers": 1, "rms_norm_eps": L.rms_eps,
        "rope_theta": L.rope.theta, "rope_scaling": rope if L.rope.llama3 else None,
        "max_position_embeddings": L.max_position, "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": L.vocab_size,
        "target_hidden_size": cfg.target_hidden, "torch_dtype": L.dtype,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers),
                         "use_aux_hidden_state": True},
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path
