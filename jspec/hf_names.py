"""The one map of Hugging Face checkpoint tensor names to jspec params.

A layer is a table of rows. A row names a jspec param key and the HF tensors it is made
of, in order, each with its output width:

  Tensor("wqkv", (("self_attn.q_proj.weight", "Q"), ("self_attn.k_proj.weight", "KV"),
                  ("self_attn.v_proj.weight", "KV")), in_dim="D")

A row with `in_dim` is a linear weight: each HF tensor is [out, in] and jspec's param is
their transposes [in, out] side by side (q/k/v and gate/up are fused this way); a row
without is a vector [out] (a norm; Qwen2's q/k/v biases, concatenated the same way).
Widths are symbols ("D", "F", "Q", "KV", "hd", "H", "2D") looked up in a dims dict
(`dims(cfg)`), so one row serves every size.

`build` reads a layer through a table (the loader, `jspec.loading.convert_params`, used
by the sharded loader too, and the EAGLE-3 loader); `split` is its inverse (the HF
exporter `jspec.bench.hf_peers` and `jspec.save_eagle3`).

A family adds its rows as a tuple here and one line to `layer_table`. A mixture of experts'
sparse layer keeps the attention and norm rows and drops `MLP`; its router and experts
(per-expert tensors stacked into [E, in, out], or transformers 5's fused 3-D tensors) are
read by `jspec.loading.MOE_LAYERS`, one function per family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

# Where the text model's tensors sit: plain causal LMs ("model."), transformers 5's
# multimodal layout ("model.language_model.", Gemma3ForConditionalGeneration), the
# layout of the published Gemma 3 4B-27B uploads ("language_model.model."), bare.
TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "")
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
EMBED = "embed_tokens.weight"  # [V, D], under a text prefix
FINAL_NORM = "norm.weight"  # [D], under a text prefix


def layer_prefix(text_prefix: str, i: int) -> str:
    return f"{text_prefix}layers.{i}."


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One jspec param of a layer and the HF tensors it is made of.

    Attributes:
      key: the jspec param key ("wqkv").
      parts: (HF name relative to the layer prefix, output width symbol) per tensor, in
        the order they are fused along jspec's output axis.
      in_dim: the input width symbol of a linear weight (HF [out, in] -> jspec [in, out]);
        None for a vector.
    """

    key: str
    parts: tuple[tuple[str, str], ...]
    in_dim: str | None = None


def norm(key: str, hf: str, dim: str = "D") -> Tensor:
    return Tensor(key, ((hf, dim),))


def linear(key: str, parts: tuple[tuple[str, str], ...], in_dim: str) -> Tensor:
    return Tensor(key, parts, in_dim)


QKV = (("self_attn.q_proj.weight", "Q"), ("self_attn.k_proj.weight", "KV"),
       ("self_attn.v_proj.weight", "KV"))
O_PROJ = (("self_attn.o_proj.weight", "D"),)
ATTENTION = (norm("attn_norm", "input_layernorm.weight"), linear("wqkv", QKV, "D"),
             linear("wo", O_PROJ, "Q"))
QKV_BIAS = (Tensor("bqkv", (("self_attn.q_proj.bias", "Q"), ("self_attn.k_proj.bias", "KV"),
                            ("self_attn.v_proj.bias", "KV"))),)  # Qwen2
O_BIAS = (Tensor("bo", (("self_attn.o_proj.bias", "D"),)),)  # gpt-oss
SINKS = (Tensor("sinks", (("self_attn.sinks", "H"),)),)  # gpt-oss: a logit a head
QK_NORM = (norm("q_norm", "self_attn.q_norm.weight", "hd"),
           norm("k_norm", "self_attn.k_norm.weight", "hd"))
PLAIN_NORMS = (norm("mlp_norm", "post_attention_layernorm.weight"),)
SANDWICH_NORMS = (norm("post_attn_norm", "post_attention_layernorm.weight"),  # Gemma
                  norm("mlp_norm", "pre_feedforward_layernorm.weight"),
                  norm("post_mlp_norm", "post_feedforward_layernorm.weight"))
MLP = (linear("w_gate_up", (("mlp.gate_proj.weight", "F"), ("mlp.up_proj.weight", "F")), "D"),
       linear("w_down", (("mlp.down_proj.weight", "D"),), "F"))

# The EAGLE-3 head's layer ("midlayer."): its attention reads [embedding | feature], 2D.
EAGLE3_LAYER_PREFIXES = ("midlayer.", "layers.0.")
EAGLE3_LAYER = (norm("input_norm", "input_layernorm.weight"),
                norm("hidden_norm", "hidden_norm.weight"),
                norm("post_norm", "post_attention_layernorm.weight"),
                linear("wqkv", QKV, "2D"), linear("wo", O_PROJ, "Q")) + MLP


def layer_table(cfg, i: int = 0) -> tuple[Tensor, ...]:
    """The rows of decoder layer i of a `ModelConfig`, in jspec's param order. A mixture of
    experts' sparse layer has no dense MLP rows: its router and stacked experts are read by
    the family's function in `jspec.loading.MOE_LAYERS`."""
    mlp = () if cfg.is_moe_layer(i) else MLP
    return (ATTENTION + (QKV_BIAS if cfg.qkv_bias else ()) + (O_BIAS if cfg.o_bias else ())
            + (SINKS if cfg.attn_sinks else ()) + (QK_NORM if cfg.qk_norm else ())
            + (SANDWICH_NORMS if cfg.sandwich_norms else PLAIN_NORMS) + mlp)


def dims(cfg) -> dict[str, int]:
    """Width symbols of a `ModelConfig` (a feature head's layer config too)."""
    D = cfg.hidden_size
    return {"D": D, "2D": 2 * D, "F": cfg.intermediate_size, "Q": cfg.q_size,
            "KV": cfg.kv_size, "hd": cfg.head_dim, "H": cfg.num_heads}


def build(table: tuple[Tensor, ...], widths: dict[str, int],
          get: Callable[[str, tuple[int, ...]], np.ndarray], prefix: str
          ) -> dict[str, np.ndarray]:
    """A layer's params from HF tensors: `get(name, HF shape)` returns a checked tensor
    (in the params' dtype); linear weights are transposed and fused (C-contiguous)."""
    out = {}
    for t in table:
        if t.in_dim is None:
            vs = [get(prefix + name, (widths[dim],)) for name, dim in t.parts]
            out[t.key] = np.ascontiguousarray(vs[0] if len(vs) == 1 else np.concatenate(vs))
            continue
        ws = [get(prefix + name, (widths[o], widths[t.in_dim])).T for name, o in t.parts]
        out[t.key] = np.ascontiguousarray(ws[0] if len(ws) == 1 else np.concatenate(ws, axis=1))
    return out


def split(table: tuple[Tensor, ...], widths: dict[str, int], layer: dict, prefix: str
          ) -> Iterator[tuple[str, np.ndarray]]:
    """`build`'s inverse: (HF name, HF-layout array) per tensor of a layer's params (numpy
    or jax arrays, each brought to the host when its turn comes)."""
    for t in table:
        w = np.asarray(layer[t.key])
        cuts = np.cumsum([widths[o] for _, o in t.parts])[:-1]
        if t.in_dim is None:
            for (name, _), part in zip(t.parts, np.split(w, cuts), strict=True):
                yield prefix + name, np.ascontiguousarray(part)
            continue
        for (name, _), part in zip(t.parts, np.split(w, cuts, axis=1), strict=True):
            yield prefix + name, np.ascontiguousarray(part.T)
