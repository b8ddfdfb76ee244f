"""q/k RMSNorm and RoPE of every q and k head in one row-invariant kernel.

The attention block of Qwen3 and Gemma 3 normalises each q head and each k head
(RMSNorm over head_dim, one weight for q heads, another for k heads) and then
rotates both; Llama only rotates. Unfused that is four kernels (q norm, k norm,
q rope, k rope) with pads, slices and reshapes between them. Here one kernel
reads the heads straight out of the fused qkv projection and writes q and k
heads rotated.

Per program: `bm` rows of one head (grid: row blocks x q and k heads). The
arithmetic is the unfused kernels', in their order: the sum of squares over the
whole head in one [bm, D] tile reduced along the lanes (as `rmsnorm` does for a
row of D <= 8192 features), the scaling rounded to the dtype (and, for the
Llama-style weight, the product with the weight rounded again), then the HF
"rotate_half" rotation in f32 of the rounded values, rounded once. So with a
power-of-2 head_dim the result equals `rmsnorm` then `rope` bit for bit on the
CPU (tests/test_qk_rope.py), and property P holds by construction either way:
the tiling depends on head_dim and interpret mode only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check_float, pad_axis, pad_rows, triton_params
from pallas_kernels.rmsnorm import rmsnorm, rmsnorm_config
from pallas_kernels.rope import rope, rope_config, rope_reference


def _kernel(x_ref, qw_ref, kw_ref, cos_ref, sin_ref, o_ref, *, half: int, d: int, eps: float,
            offset: float, num_q: int, norm: bool):
    # x_ref, o_ref [bm, 2*half]: one head; qw_ref, kw_ref [1, 2*half] (q weight, k weight);
    # cos_ref, sin_ref [bm, half] f32.
    dtype = o_ref.dtype
    x1 = x_ref[:, :half].astype(jnp.float32)
    x2 = x_ref[:, half:].astype(jnp.float32)
    if norm:
        xs = x_ref[...].astype(jnp.float32)  # [bm, 2*half]: the whole head, one tile
        acc = jnp.zeros(xs.shape, jnp.float32) + xs * xs
        ms = jnp.sum(acc, axis=1, keepdims=True) / jnp.float32(d)  # [bm, 1]
        inv = lax.rsqrt(ms + jnp.float32(eps))
        is_q = pl.program_id(1) < num_q

        def scaled(xh, cols):  # elementwise, exactly as rmsnorm's scaling pass
            ws = jnp.where(is_q, qw_ref[:, cols], kw_ref[:, cols]).astype(jnp.float32)  # [1, half]
            if offset == 0.0:
                normed = (xh * inv).astype(dtype).astype(jnp.float32)
                return (normed * ws).astype(dtype).astype(jnp.float32)
            return (xh * inv * (jnp.float32(offset) + ws)).astype(dtype).astype(jnp.float32)

        x1 = scaled(x1, pl.ds(0, half))
        x2 = scaled(x2, pl.ds(half, half))
    c = cos_ref[...]
    s = sin_ref[...]
    o_ref[:, :half] = (x1 * c - x2 * s).astype(dtype)
    o_ref[:, half:] = (x2 * c + x1 * s).astype(dtype)


def _check(qkv, q_w, k_w, cos, sin, num_q, num_k, offset):
    """The arguments of both lowerings' `qk_norm_rope`, checked before tracing."""
    if qkv.ndim != 3 or qkv.shape[1] < num_q + num_k or qkv.shape[2] % 2:
        raise ValueError(f"qk_norm_rope wants qkv [M, >= {num_q} + {num_k} heads, D] with D "
                         f"even; got {qkv.shape=}")
    m, _, d = qkv.shape
    if cos.shape != (m, d // 2) or sin.shape != (m, d // 2):
        raise ValueError(f"qk_norm_rope wants cos and sin [M, D/2] = {(m, d // 2)}; got "
                         f"{cos.shape=} {sin.shape=}")
    for name, w in (("q_w", q_w), ("k_w", k_w)):
        if w is not None and w.shape != (d,):
            raise ValueError(f"qk_norm_rope wants {name} [D] = [{d}]; got {w.shape=}")
        if w is not None:
            check_float(name, w)
    check_float("qkv", qkv)
    if (q_w is None) != (k_w is None):
        raise ValueError("qk_norm_rope needs both q_w and k_w, or neither")
    if offset not in (0.0, 1.0):
        raise ValueError(f"qk_norm_rope supports offset 0.0 or 1.0; got {offset=}")


@functools.partial(jax.jit, static_argnames=("num_q", "num_k", "eps", "offset", "interpret"))
def qk_norm_rope(qkv: jax.Array, q_w: jax.Array | None, k_w: jax.Array | None, cos: jax.Array,
                 sin: jax.Array, *, num_q: int, num_k: int, eps: float = 1e-6,
                 offset: float = 0.0, interpret: bool = False) -> jax.Array:
    """qkv [M, >= num_q + num_k, D] (q heads, then k heads, then anything, e.g. v)
    -> [M, num_q + num_k, D]: each head RMSNorm-ed (q_w for q heads, k_w for k heads;
    both None: no norm) then rotated by per-row cos, sin [M, D/2]; qkv.dtype."""
    _check(qkv, q_w, k_w, cos, sin, num_q, num_k, offset)
    m, _, d = qkv.shape
    cfg = rope_config(d, interpret)
    half, norm = cfg.half, q_w is not None
    if 2 * half != d:  # pad each half (only odd head sizes; real models have 2^n)
        qkv = pad_axis(qkv.reshape(m, -1, 2, d // 2), 3, half).reshape(m, -1, 2 * half)
    xp = pad_rows(qkv, cfg.bm)  # [Mp, heads, 2*half]
    cp = pad_rows(pad_axis(cos.astype(jnp.float32), 1, half), cfg.bm)  # [Mp, half]
    sp = pad_rows(pad_axis(sin.astype(jnp.float32), 1, half), cfg.bm)
    def weight(w):  # [D] -> [1, 2*half]: each half padded, as the heads
        if w is None:
            return jnp.zeros((1, 2 * half), qkv.dtype)
        w = w.astype(qkv.dtype).reshape(1, 2, d // 2)
        return pad_axis(w, 2, half).reshape(1, 2 * half) if 2 * half != d else w.reshape(1, d)

    qw, kw = weight(q_w), weight(k_w)
    mp = xp.shape[0]
    num_warps = rmsnorm_config(2 * half, qkv.dtype, interpret).num_warps if norm else \
        cfg.num_warps
    head_spec = pl.BlockSpec((cfg.bm, None, 2 * half), lambda i, j: (i, j, 0))
    table_spec = pl.BlockSpec((cfg.bm, half), lambda i, j: (i, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, half=half, d=d, eps=float(eps), offset=float(offset),
                          num_q=num_q, norm=norm),
        out_shape=jax.ShapeDtypeStruct((mp, num_q + num_k, 2 * half), qkv.dtype),
        grid=(mp // cfg.bm, num_q + num_k),
        in_specs=[head_spec, pl.BlockSpec((1, 2 * half), lambda i, j: (0, 0)),
                  pl.BlockSpec((1, 2 * half), lambda i, j: (0, 0)), table_spec, table_spec],
        out_specs=head_spec,
        compiler_params=triton_params(num_warps, cfg.num_stages),
        interpret=interpret,
        name="jspec_qk_norm_rope",
    )(xp, qw, kw, cp, sp)
    out = out[:m]
    if 2 * half != d:
        out = out.reshape(m, -1, 2, half)[..., : d // 2].reshape(m, -1, d)
    return out


def qk_norm_rope_unfused(qkv, q_w, k_w, cos, sin, *, num_q: int, num_k: int, eps: float = 1e-6,
                         offset: float = 0.0, interpret: bool = False) -> jax.Array:
    """The same result from the separate `rmsnorm` and `rope` kernels (for bit checks)."""
    m, _, d = qkv.shape
    q, k = qkv[:, :num_q], qkv[:, num_q: num_q + num_k]
    if q_w is not None:
        q = rmsnorm(q.reshape(-1, d), q_w, eps=eps, offset=offset, interpret=interpret)
        k = rmsnorm(k.reshape(-1, d), k_w, eps=eps, offset=offset, interpret=interpret)
    q = rope(q.reshape(m, num_q, d), cos, sin, interpret=interpret)
    k = rope(k.reshape(m, num_k, d), cos, sin, interpret=interpret)
    return jnp.concatenate([q, k], axis=1)


def qk_norm_rope_reference(qkv, q_w, k_w, cos, sin, *, num_q: int, num_k: int,
                           eps: float = 1e-6, offset: float = 0.0) -> jax.Array:
    """Plain jnp: per-head RMSNorm (as `rmsnorm_reference`) then HF RoPE."""
    from pallas_kernels.rmsnorm import rmsnorm_reference

    m, _, d = qkv.shape
    q, k = qkv[:, :num_q], qkv[:, num_q: num_q + num_k]
    if q_w is not None:
        q = rmsnorm_reference(q.reshape(-1, d), q_w, eps=eps, offset=offset).reshape(m, -1, d)
        k = rmsnorm_reference(k.reshape(-1, d), k_w, eps=eps, offset=offset).reshape(m, -1, d)
    return jnp.concatenate([rope_reference(q, cos, sin), rope_reference(k, cos, sin)], axis=1)
