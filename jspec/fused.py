"""The `fused` backend's few-row forward: a fast path for draft models.

`forward` on a model whose backend is "fused" runs this path when the step has at
most `MAX_ROWS` rows (B * T: decode and the draft's two-token commit step) and the
architecture has no sandwich norms; anything else (prefill, Gemma 3) runs the
`xla` backend's ops. A layer here is five fused kernels (pallas_kernels/
fused_decode.py), two in-place cache writes and the split-KV attention kernels,
against ~20 kernels a layer on the `xla` backend.

The `fused` backend is not invariant (its logits depend on the path that computed
them) and is meant for drafts: a draft's numerics decide which tokens are
proposed, never what the target accepts, so speculative output stays exactly the
target's. Use `pallas` for any model whose logits must be exact.
"""

from __future__ import annotations

import jax.numpy as jnp

from jspec.cache import KVCache, write_kv
from jspec.config import ModelConfig
from pallas_kernels._common import pad_rows
from pallas_kernels.attention import attention
from pallas_kernels.fused_decode import (
    matmul_residual,
    norm_matmul_glu,
    norm_matmul_qk_rope,
)
from pallas_kernels.matmul import matmul_reference
from pallas_kernels.rmsnorm import rmsnorm_reference
from pallas_kernels.softcap import softcap_reference

MAX_ROWS = 16  # one row tile of every fused kernel


def applies(cfg: ModelConfig, rows: int) -> bool:
    """Whether a forward of `rows` = B * T rows takes the fused path."""
    return cfg.backend == "fused" and rows <= MAX_ROWS and not cfg.sandwich_norms


def fused_forward(cfg: ModelConfig, params: dict, tokens, cache: KVCache, cos_tab, sin_tab):
    """tokens [B, T] (B * T <= MAX_ROWS) -> (logits [B, T, V] f32, cache); cos_tab, sin_tab
    [2, S, hd/2] (global, local RoPE tables)."""
    B, T = tokens.shape
    M = B * T
    dtype = jnp.dtype(cfg.dtype)
    H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    interp = cfg.interpret
    eps, off = cfg.rms_eps, cfg.norm_offset
    lengths = cache.lengths
    pos = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]

    x = jnp.take(params["embed"], tokens.reshape(-1), axis=0)  # [M, D]
    if cfg.embed_scale is not None:
        x = x * jnp.asarray(cfg.embed_scale, dtype)
    x = pad_rows(x, MAX_ROWS)  # [16, D]: padding rows stay finite and are sliced away
    flat = pos.reshape(-1)
    cos_all = pad_rows(jnp.asarray(cos_tab)[:, flat].transpose(1, 0, 2), MAX_ROWS)  # [16, 2, hd/2]
    sin_all = pad_rows(jnp.asarray(sin_tab)[:, flat].transpose(1, 0, 2), MAX_ROWS)

    new_k, new_v = [], []
    for i, lp in enumerate(params["layers"]):
        sliding = cfg.layer_sliding[i]
        window = jnp.int32(cfg.sliding_window if sliding else 0)
        qw, kw = (lp["q_norm"], lp["k_norm"]) if cfg.qk_norm else (None, None)
        heads = norm_matmul_qk_rope(
            x, lp["attn_norm"], lp["wqkv"], qw, kw, cos_all[:, int(sliding)],
            sin_all[:, int(sliding)], num_q=H, num_k=Hkv, eps=eps, offset=off,
            interpret=interp)[:M]  # [M, H + 2Hkv, hd]
        q, k, v = heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:]
        k_buf = write_kv(cache.k[i], k.reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3), lengths)
        v_buf = write_kv(cache.v[i], v.reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3), lengths)
        new_k.append(k_buf)
        new_v.append(v_buf)
        o = attention(q.reshape(B, T, H, hd), k_buf, v_buf, pos, window, scale=cfg.attn_scale,
                      softcap=cfg.attn_softcap, interpret=interp, split=cfg.attn_split)
        o = pad_rows(o.reshape(M, H * hd), MAX_ROWS)  # [16, H*hd]
        x = matmul_residual(o, lp["wo"], x, interpret=interp)
        a = norm_matmul_glu(x, lp["mlp_norm"], lp["w_gate_up"], eps=eps, offset=off,
                            activation=cfg.activation, interpret=interp)
        x = matmul_residual(a, lp["w_down"], x, interpret=interp)

    h = rmsnorm_reference(x[:M], params["final_norm"], eps=eps, offset=off)
    logits = matmul_reference(h, params["lm_head"], out_dtype=jnp.float32)  # [M, V]
    if cfg.final_softcap is not None:
        logits = softcap_reference(logits, cfg.final_softcap)
    new_cache = cache.replace(k=tuple(new_k), v=tuple(new_v), lengths=lengths + T)
    return logits.reshape(B, T, cfg.vocab_size), new_cache
