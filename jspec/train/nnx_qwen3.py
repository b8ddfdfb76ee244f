"""A Qwen3-architecture decoder in flax nnx, for training, and its HF export.

The same architecture as transformers' `Qwen3ForCausalLM` (and jspec's qwen3
family): RMSNorm before attention and MLP, per-head RMSNorm on q and k, RoPE
(rotate-half), grouped-query attention, SwiGLU, tied embeddings. Parameters are
f32; matmuls run in `compute_dtype`. Weights are stored `[in, out]`; `export_hf`
writes the HF names and layout (`[out, in]`), config.json and the tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class PairModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 64
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    max_position: int = 4096

    def num_params(self) -> int:
        D, F, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = D * hd * (2 * self.num_heads + 2 * self.num_kv_heads) + 2 * hd
        return self.vocab_size * D + D + self.num_layers * (attn + 3 * D * F + 2 * D)


def rms_norm(x, w, eps):  # x [..., D] any dtype -> f32
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, positions, theta):  # x [B, T, H, hd] f32, positions [T]
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)  # [hd/2]
    ang = positions[:, None].astype(jnp.float32) * inv[None, :]  # [T, hd/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[None, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[None, :, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], -1) * sin


def _w(rngs, *shape, std=0.02):
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * std)


class Block(nnx.Module):
    def __init__(self, c: PairModelConfig, rngs: nnx.Rngs):
        D, F, hd = c.hidden_size, c.intermediate_size, c.head_dim
        out_std = 0.02 / (2 * c.num_layers) ** 0.5
        self.attn_norm = nnx.Param(jnp.ones(D))
        self.wq = _w(rngs, D, c.num_heads * hd)
        self.wk = _w(rngs, D, c.num_kv_heads * hd)
        self.wv = _w(rngs, D, c.num_kv_heads * hd)
        self.wo = _w(rngs, c.num_heads * hd, D, std=out_std)
        self.q_norm = nnx.Param(jnp.ones(hd))
        self.k_norm = nnx.Param(jnp.ones(hd))
        self.mlp_norm = nnx.Param(jnp.ones(D))
        self.w_gate = _w(rngs, D, F)
        self.w_up = _w(rngs, D, F)
        self.w_down = _w(rngs, F, D, std=out_std)
        self.c = c

    def __call__(self, x, positions, dt):  # x [B, T, D] f32
        c = self.c
        B, T, _ = x.shape

        def mm(a, w):
            return jnp.dot(a.astype(dt), w[...].astype(dt), preferred_element_type=jnp.float32)

        h = rms_norm(x, self.attn_norm[...], c.rms_eps)
        q = mm(h, self.wq).reshape(B, T, c.num_heads, c.head_dim)
        k = mm(h, self.wk).reshape(B, T, c.num_kv_heads, c.head_dim)
        v = mm(h, self.wv).reshape(B, T, c.num_kv_heads, c.head_dim)
        q = rope(rms_norm(q, self.q_norm[...], c.rms_eps), positions, c.rope_theta)
        k = rope(rms_norm(k, self.k_norm[...], c.rms_eps), positions, c.rope_theta)
        a = jax.nn.dot_product_attention(q.astype(dt), k.astype(dt), v.astype(dt),
                                         is_causal=True)  # [B, T, H, hd]
        x = x + mm(a.reshape(B, T, -1), self.wo)
        h = rms_norm(x, self.mlp_norm[...], c.rms_eps)
        g = jax.nn.silu(mm(h, self.w_gate)) * mm(h, self.w_up)
        return x + mm(g, self.w_down)


class Qwen3(nnx.Module):
    def __init__(self, c: PairModelConfig, rngs: nnx.Rngs):
        self.c = c
        self.embed = _w(rngs, c.vocab_size, c.hidden_size)
        self.layers = nnx.List([Block(c, rngs) for _ in range(c.num_layers)])
        self.final_norm = nnx.Param(jnp.ones(c.hidden_size))

    def __call__(self, tokens, compute_dtype=jnp.float32):  # tokens [B, T] -> [B, T, V] f32
        x = self.embed[...][tokens]
        positions = jnp.arange(tokens.shape[1])
        for layer in self.layers:
            x = layer(x, positions, compute_dtype)
        x = rms_norm(x, self.final_norm[...], self.c.rms_eps)
        return jnp.dot(x.astype(compute_dtype), self.embed[...].T.astype(compute_dtype),
                       preferred_element_type=jnp.float32)


def hf_tensors(model: Qwen3) -> dict[str, np.ndarray]:
    """HF Qwen3 names -> f32 arrays in HF layout ([out, in] for linear weights)."""
    def a(p):
        return np.asarray(p[...], np.float32)

    t = {"model.embed_tokens.weight": a(model.embed), "model.norm.weight": a(model.final_norm)}
    for i, L in enumerate(model.layers):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": a(L.attn_norm),
              p + "post_attention_layernorm.weight": a(L.mlp_norm),
              p + "self_attn.q_proj.weight": a(L.wq).T, p + "self_attn.k_proj.weight": a(L.wk).T,
              p + "self_attn.v_proj.weight": a(L.wv).T, p + "self_attn.o_proj.weight": a(L.wo).T,
              p + "self_attn.q_norm.weight": a(L.q_norm),
              p + "self_attn.k_norm.weight": a(L.k_norm),
              p + "mlp.gate_proj.weight": a(L.w_gate).T, p + "mlp.up_proj.weight": a(L.w_up).T,
              p + "mlp.down_proj.weight": a(L.w_down).T}
    return {k: np.ascontiguousarray(v) for k, v in t.items()}


def hf_config(c: PairModelConfig, dtype: str, eos_id: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "hidden_act": "silu", "max_position_embeddings": c.max_position,
        "rms_norm_eps": c.rms_eps, "tie_word_embeddings": True, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "use_sliding_window": False, "bos_token_id": eos_id, "eos_token_id": eos_id,
        "dtype": dtype,
    }


def export_hf(model: Qwen3, path: str, tokenizer_dir: str, *, dtype: str = "bfloat16",
              eos_id: int = 0, card: str | None = None) -> str:
    """Writes config.json, model.safetensors and the tokenizer files to `path`."""
    import shutil

    import ml_dtypes
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    np_dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    tensors = {k: v.astype(np_dt) for k, v in hf_tensors(model).items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(model.c, dtype, eos_id), f, indent=2)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(path, name))
    if card:
        with open(os.path.join(path, "README.md"), "w") as f:
            f.write(card)
    return path
