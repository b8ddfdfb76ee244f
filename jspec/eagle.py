"""Published EAGLE-3 heads: load them for a jspec target, and write heads in their layout.

The layout the public heads use (SGLang's `LlamaForCausalLMEagle3`, vLLM's
`Eagle3LlamaForCausalLM`, vllm-project/speculators):

  config.json        a Llama config with "architectures": ["LlamaForCausalLMEagle3"],
                     hidden_size, intermediate_size, num_attention_heads,
                     num_key_value_heads, rms_norm_eps, rope_theta / rope_scaling,
                     vocab_size (the target's), draft_vocab_size, optional
                     target_hidden_size, norm_before_residual and
                     eagle_config.eagle_aux_hidden_state_layer_ids (default: the inputs of
                     target layers 2, L // 2, L - 3; counted two ways: `feature_layers`)
  model.safetensors  (or pytorch_model.bin; either sharded, with its index)
                     fc.weight [D, 3 Dt]; midlayer.{input_layernorm, hidden_norm,
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
import logging
import math
import os
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from jspec import hf_names
from jspec._checks import check_bool, check_path, check_type
from jspec.config import UnsupportedModelError, canonical_dtype, rope_parameters, rope_spec
from jspec.feature_head import FeatureHead, eagle3_layers, head_config, slot_map
from jspec.loading import (
    DIGEST_FILE,
    WEIGHT_FILES,
    CheckpointError,
    TensorReader,
    np_dtype,
    read_config_json,
    resolve_checkpoint,
)
from jspec.model import Model
from jspec.options import KernelOptions

LOG = logging.getLogger("jspec")

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# The top-level architecture of vllm-project/speculators' EAGLE-3 configs (their layer
# nested in `transformer_layer_config`, which may name an architecture of its own).
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
# How a config's feature layer ids count (see `feature_layers`).
Convention = Literal["auto", "entering", "after"]
CONVENTIONS = ("auto", "entering", "after")
# Config keys only vllm-project/speculators writes (its heads use the "entering" ids).
# The eagle_config key save_eagle3 writes its convention in (other readers ignore it).
CONVENTION_KEY = "layer_ids_convention"
SPECULATORS_KEYS = ("speculators_model_type", "speculators_config", "speculators_version",
                    "transformer_layer_config")


# The fields the head's layer is built from (the rest default as transformers' do).
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size")
# Optional integer fields (absent or null: their defaults); a value that is not a positive
# integer (2.5, "16", 0) was cast or replaced by the default without a word.
OPTIONAL_INT_KEYS = ("num_key_value_heads", "head_dim", "draft_vocab_size",
                     "target_hidden_size")
# Optional flags: a string ("false") read as a truth value was true.
BOOL_KEYS = ("norm_before_residual", "tie_word_embeddings")


def read_head_config(path: str) -> dict:
    """An EAGLE-3 head directory's config.json, checked (a CheckpointError or
    UnsupportedModelError naming the file and field)."""
    fn = os.path.join(path, "config.json")
    cfg = read_config_json(path, " (an EAGLE-3 head directory has one)")
    if "transformer_layer_config" in cfg:  # the speculators layout: the layer nested
        if not isinstance(cfg["transformer_layer_config"], dict):
            raise CheckpointError(f"{fn}: transformer_layer_config must be a JSON object (the "
                                  "head's layer config, in the speculators layout)")
        top = {k: v for k, v in cfg.items() if k != "transformer_layer_config"}
        cfg = {**cfg["transformer_layer_config"], **top}
        cfg["architectures"] = [ARCHITECTURES[0] if a == SPECULATORS_ARCHITECTURE else a
                                for a in top.get("architectures") or ARCHITECTURES[:1]]
    archs = cfg.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        raise UnsupportedModelError(f"{fn}: architectures={archs}; an EAGLE-3 head is one of "
                                    f"{ARCHITECTURES}")
    if cfg.get("num_hidden_layers", 1) != 1:
        raise UnsupportedModelError(f"{fn}: num_hidden_layers={cfg['num_hidden_layers']!r}; "
                                    "jspec's feature head has one decoder layer")
    for flag in ("attention_bias", "mlp_bias", "bias"):
        if cfg.get(flag):
            raise UnsupportedModelError(f"{fn}: {flag}=True is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{fn}: hidden_act={cfg['hidden_act']!r} is not supported "
                                    "(the head's MLP is Llama's, silu)")
    eps = cfg.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < math.inf:
        raise CheckpointError(f"{fn}: rms_norm_eps={eps!r} must be a finite number > 0")
    for key in BOOL_KEYS:  # null: the default for tie_word_embeddings alone
        if key in cfg and not isinstance(cfg[key], bool) and not (
                key == "tie_word_embeddings" and cfg[key] is None):
            raise CheckpointError(f"{fn}: {key}={cfg[key]!r} must be true or false")
    for key in REQUIRED_KEYS + OPTIONAL_INT_KEYS:
        value = cfg.get(key)
        if value is None:
            if key in OPTIONAL_INT_KEYS:
                continue
            raise CheckpointError(f"{fn}: no {key!r}; an EAGLE-3 head's config names "
                                  f"{', '.join(REQUIRED_KEYS)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{fn}: {key}={value!r} must be a positive integer")
    _check_eagle_config(fn, cfg)
    return cfg


def _check_eagle_config(fn: str, cfg: dict) -> None:
    """`eagle_config` an object (or absent) with its layer ids a list, its
    `use_aux_hidden_state` a bool and its `layer_ids_convention` one jspec writes: each
    was an AttributeError or TypeError, or a value read as another (the string "false"
    as true, a misspelt convention as "auto")."""
    eagle = cfg.get("eagle_config")
    if eagle is not None and not isinstance(eagle, dict):
        raise CheckpointError(f"{fn}: eagle_config={eagle!r} must be a JSON object (with "
                              "eagle_aux_hidden_state_layer_ids, use_aux_hidden_state)")
    eagle = eagle or {}
    for where, holder in (("eagle_config.", eagle), ("", cfg)):
        ids = holder.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and not isinstance(ids, list):
            raise CheckpointError(f"{fn}: {where}eagle_aux_hidden_state_layer_ids={ids!r} "
                                  "must be a list of target layer ids")
    flag = eagle.get("use_aux_hidden_state")
    if flag is not None and not isinstance(flag, bool):
        raise CheckpointError(f"{fn}: eagle_config.use_aux_hidden_state={flag!r} must be true "
                              "or false")
    convention = eagle.get(CONVENTION_KEY)
    if convention is not None and convention not in ("entering", "after"):
        raise CheckpointError(f"{fn}: eagle_config.{CONVENTION_KEY}={convention!r}; expected "
                              "'entering' or 'after' (or leave it out: see "
                              "jspec.eagle.feature_layers)")


def _rope(cfg: dict, where: str):
    params = cfg.get("rope_parameters") or dict(cfg.get("rope_scaling") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return rope_spec(params, None, where)


def feature_layers(cfg: dict, num_layers: int, convention: Convention = "auto",
                   where: str = "") -> tuple[int, ...]:
    """The target layers whose entering hidden states a head reads, from its config.

    Producers count the ids two ways, one layer apart:
    - "entering": id k is the hidden state entering target layer k (0: the embedding
      output). jspec, vLLM (`SupportsEagle3` captures before running layer k), the EAGLE
      repo (SafeAILab/EAGLE: its targets keep the input of layers 2, L // 2, L - 3; its
      heads write no ids) and vllm-project/speculators (configs with
      `speculators_model_type` / `speculators_config`, ids at the top level).
    - "after": id k is the output of layer k, i.e. entering layer k + 1. SpecForge
      (sgl-project/SpecForge) captures with a forward hook on layer k and writes
      `eagle_config.eagle_aux_hidden_state_layer_ids`, default [1, L // 2 - 1, L - 4].
    Nothing in a SpecForge config names its producer. "auto" (the default) reads: no ids
    -> jspec's default (2, L // 2, L - 3), the same layers in both conventions' defaults;
    `eagle_config.layer_ids_convention` (written by `save_eagle3`) -> that; speculators
    keys -> "entering"; otherwise a first id of 1 -> "after" (a first
    feature taken after layer 0 is SpecForge's default; SGLang decides the same way),
    anything else -> "entering". Pass the convention explicitly when it is known.
    """
    eagle = cfg.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or cfg.get(
        "eagle_aux_hidden_state_layer_ids")
    if not ids:
        return eagle3_layers(num_layers)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{where}: eagle_aux_hidden_state_layer_ids={ids} must be "
                              "integers")
    if convention == "auto":
        if eagle.get(CONVENTION_KEY) in ("entering", "after"):
            convention = eagle[CONVENTION_KEY]
        elif any(k in cfg for k in SPECULATORS_KEYS):
            convention = "entering"
        else:
            convention = "after" if ids[0] == 1 else "entering"
        LOG.info("%s: feature layer ids %s read as %r (aux_layers_convention='auto'; pass "
                 "it explicitly to override)", where, list(ids), convention)
    layers = tuple(i + 1 for i in ids) if convention == "after" else tuple(ids)
    bad = [i for i in layers if not 0 <= i <= num_layers]
    if bad:
        shown = bad if convention == "entering" else [i - 1 for i in bad]
        lo = 0 if convention == "entering" else -1
        raise CheckpointError(f"{where}: feature layers {shown} are outside the target's "
                              f"{lo}..{num_layers + lo} (ids read as {convention!r})")
    return layers


def load_eagle3(path: str, target: Model, *, dtype=None,
                options: KernelOptions | None = None,
                aux_layers_convention: Convention = "auto") -> FeatureHead:
    """Loads an EAGLE-3 head directory (or a hub id in the local HF cache) for `target`:
    weights in model.safetensors, sharded safetensors, pytorch_model.bin or sharded bins.

    dtype: the head's (default the target's); options: its kernel choices (default the
    target's backend with the fusions' defaults). aux_layers_convention: how to read the
    config's feature layer ids (`feature_layers`): "entering" (id k = the hidden state
    entering target layer k, jspec's, vLLM's, speculators' and the EAGLE repo's
    convention), "after" (id k = the output of layer k, SpecForge's: read as k + 1) or
    "auto" (the default: decided from the config, see `feature_layers`). Wrap the result
    in `jspec.FeatureDrafter` to draft with it.
    """
    check_type("target", target, Model, "the jspec.Model the head drafts for (jspec.load_hf)")
    if options is not None:
        check_type("options", options, KernelOptions, "a jspec.KernelOptions or None (the "
                   "target's backend)")
    if aux_layers_convention not in CONVENTIONS:
        raise ValueError(f"aux_layers_convention={aux_layers_convention!r}; expected one of "
                         f"{CONVENTIONS}")
    path = resolve_checkpoint(path)
    cfg = read_head_config(path)
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
    if eagle.get("use_aux_hidden_state") is False:
        raise UnsupportedModelError(f"{path}: use_aux_hidden_state=False (a head over the "
                                    "target's normed last hidden state) is not supported")
    layers = feature_layers(cfg, tcfg.num_layers, aux_layers_convention, path)
    D, H = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or D // H)
    dtype = canonical_dtype(dtype) if dtype is not None else tcfg.dtype
    try:
        hcfg = head_config(
            tcfg, hidden_size=D, intermediate_size=int(cfg["intermediate_size"]), num_heads=H,
            num_kv_heads=int(cfg.get("num_key_value_heads") or H), head_dim=head_dim,
            draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
            feature_layers=layers, rope=_rope(cfg, path),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), dtype=dtype,
            norm_before_residual=bool(cfg.get("norm_before_residual", False)))
    except CheckpointError:
        raise
    except ValueError as e:  # the head's shapes, checked by its config: name the head
        raise UnsupportedModelError(f"{path}/config.json: {e}") from e
    L, V, Vd = hcfg.layer, hcfg.vocab_size, hcfg.layer.vocab_size
    reader = TensorReader(path)
    pre = next((p for p in hf_names.EAGLE3_LAYER_PREFIXES
                if reader.has(p + "hidden_norm.weight")), None)
    if pre is None:
        raise CheckpointError(f"{path}: missing tensor 'midlayer.hidden_norm.weight' (not an "
                              "EAGLE-3 head's layer)")
    dt = np_dtype(dtype)

    def get(name, shape):
        return reader.get(name, shape, dt)

    def lin(name, out_dim, in_dim):  # HF [out, in] -> [in, out]
        return np.ascontiguousarray(get(name, (out_dim, in_dim)).T)

    layer = hf_names.build(hf_names.EAGLE3_LAYER, hf_names.dims(L), get, pre)
    params = {"layer": layer, "norm": get("norm.weight", (D,))}
    if hcfg.has_fc:
        if reader.has("fc.weight"):  # its width says how many feature layers it was made for
            width = reader.read("fc.weight").shape[-1]
            if width != hcfg.feature_width and width % tcfg.hidden_size == 0:
                raise CheckpointError(
                    f"{path}: fc.weight reads {width // tcfg.hidden_size} feature layers "
                    f"({width} = {width // tcfg.hidden_size} x {tcfg.hidden_size}), but the "
                    f"config names {len(layers)} (eagle_aux_hidden_state_layer_ids)")
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
        embed = target.params["embed"]  # the target's own, shared (a copy in the
        if embed.dtype != dt:  # head's dtype where that differs: a tied LM head is it)
            embed = jnp.asarray(embed, dt)
        params["embed"] = embed
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


# The files of a checkpoint in a directory: save_eagle3 replaces none without overwrite.
CHECKPOINT_FILES = ("config.json",) + tuple(f for pair in WEIGHT_FILES for f in pair)


def saved_files(path: str) -> list[str]:
    """The checkpoint files (`CHECKPOINT_FILES`) directory `path` holds already."""
    return [n for n in CHECKPOINT_FILES if os.path.exists(os.path.join(path, n))]


def save_eagle3(path: str, head: FeatureHead, *, save_embedding: bool = False,
                overwrite: bool = False) -> str:
    """Writes `head` in the published EAGLE-3 layout (config.json, model.safetensors);
    `load_eagle3(path, target)` reads it back bitwise; the EAGLE reference
    implementation, vLLM and SGLang read it right too. `path` is a new or empty
    directory, or one holding a checkpoint (`CHECKPOINT_FILES`: a head, or a model) only
    with overwrite=True, which replaces its config.json and model.safetensors (the
    single file is what every reader loads before an index or a `.bin`).

    How each reads the width of the features and the embedding:
    - EAGLE (SafeAILab/EAGLE `cnets.Model`): fc is [D, 3 target_hidden_size] if the config
      has target_hidden_size, else [D, 3 hidden_size]; it copies the target's embedding
      only when the config has no target_hidden_size, and otherwise keeps its random
      one unless the weights hold embed_tokens.weight.
    - vLLM (`Eagle3LlamaForCausalLM`): the same fc rule; embed_tokens.weight from the
      weights if there, else the target's.
    - SGLang (`LlamaForCausalLMEagle3`): the same fc rule; always the target's embedding.
    So target_hidden_size is written only when it differs from hidden_size (then the
    embedding is saved too, as a head narrower than its target needs its own; SGLang
    cannot run such a head), and the embedding is otherwise left out unless
    save_embedding.
    """
    path = check_path("path", path)
    check_bool("overwrite", overwrite)
    check_bool("save_embedding", save_embedding)
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{path}: a file, not a directory")

    if os.path.exists(os.path.join(path, DIGEST_FILE)):  # never mixed into another format
        raise FileExistsError(f"{path} holds a jspec params checkpoint (save_params); "
                              "save_eagle3 writes a Hugging Face head: give another directory")
    existing = saved_files(path)
    if existing and not overwrite:
        raise FileExistsError(f"{path} holds a checkpoint already ({', '.join(existing)}); "
                              "save_eagle3 replaces none without overwrite=True: pass it, or "
                              "another directory")
    check_type("head", head, FeatureHead, "a jspec FeatureHead (load_eagle3, random_head, "
               "or a trained head)")
    cfg, p = head.config, head.params
    L = cfg.layer
    D = L.hidden_size
    os.makedirs(path, exist_ok=True)
    dt = np_dtype(L.dtype)

    def a(x):
        return np.asarray(x).astype(dt)

    def hf(x):  # [in, out] -> HF [out, in]
        return np.ascontiguousarray(a(x).T)

    layer = {k: a(v) for k, v in p["layer"].items()}
    slot = np.asarray(p["head_slot"])
    target_ids = np.full((L.vocab_size,), -1, np.int64)
    target_ids[slot[slot >= 0]] = np.flatnonzero(slot >= 0)
    tensors = dict(hf_names.split(hf_names.EAGLE3_LAYER, hf_names.dims(L), layer,
                                  hf_names.EAGLE3_LAYER_PREFIXES[0]))
    tensors |= {"norm.weight": a(p["norm"]), "lm_head.weight": hf(p["lm_head"]),
                "d2t": target_ids - np.arange(L.vocab_size, dtype=np.int64),
                "t2d": slot >= 0}
    if cfg.has_fc:
        tensors["fc.weight"] = hf(p["fc"])
    if save_embedding or D != cfg.target_hidden:
        tensors["embed_tokens.weight"] = a(p["embed"])
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(_config(head), f, indent=2)
    return path


def _config(head: FeatureHead) -> dict:
    cfg = head.config
    L = cfg.layer
    rope = rope_parameters(L.rope)
    config = {
        "architectures": [ARCHITECTURES[0]], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": L.hidden_size, "intermediate_size": L.intermediate_size,
        "num_attention_heads": L.num_heads, "num_key_value_heads": L.num_kv_heads,
        "head_dim": L.head_dim, "num_hidden_layers": 1, "rms_norm_eps": L.rms_eps,
        "rope_theta": L.rope.theta,
        "rope_scaling": rope if rope["rope_type"] != "default" else None,
        "max_position_embeddings": L.max_position, "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": L.vocab_size,
        "torch_dtype": L.dtype, "norm_before_residual": cfg.norm_before_residual,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers),
                         "use_aux_hidden_state": True, CONVENTION_KEY: "entering"},
    }
    if cfg.target_hidden != L.hidden_size:  # see save_eagle3: EAGLE reads its presence
        config["target_hidden_size"] = cfg.target_hidden
    return config

