"""Row-invariant RMSNorm (Llama/Qwen3 style and Gemma's `1 + w` style).

Used for the block norms and, reshaped to [M*H, head_dim], for per-head q/k
norms. The sum of squares over the feature axis is a reduction whose order XLA
would choose from the whole array shape; here it runs inside a kernel whose
tiling (row tile, feature block, warps) depends on D, dtype and interpret mode
only. Each row's D features are walked in ascending feature blocks (one block
when D <= 8192) into an elementwise f32 accumulator that is summed once at the
end, so a row gets the same bits whatever other rows share its call. rsqrt and
the weight multiply also run in the kernel, so their rounding is fixed too.

Semantics (Hugging Face, computed in f32, xf = x.astype(f32)):
  offset=0.0 (Llama/Qwen3): y = (xf * rsqrt(mean(xf^2) + eps)).astype(x.dtype) * w,
      the weight product taken in f32 and rounded to x.dtype.
  offset=1.0 (Gemma):       y = (xf * rsqrt(mean(xf^2) + eps) * (1 + w)).astype(x.dtype).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    check_eps,
    check_float,
    next_pow2,
    pad_axis,
    pad_rows,
    triton_params,
)

_MAX_WHOLE_ROW = 8192  # widest feature axis held in one tile
_LOOP_BLOCK = 4096  # feature block when the row is wider than that


@dataclasses.dataclass(frozen=True)
class RMSNormConfig:
    bm: int  # rows per program
    bd: int  # features per block (power of 2)
    nd: int  # feature blocks per row, walked in ascending order
    num_warps: int
    num_stages: int


def rmsnorm_config(D: int, dtype, interpret: bool) -> RMSNormConfig:
    """Tiling for rows of D features; deliberately takes no M."""
    del dtype  # same tiling for f32 and bf16
    bd = next_pow2(D) if D <= _MAX_WHOLE_ROW else _LOOP_BLOCK
    nd = -(-D // bd)
    if interpret:
        # Few large steps for the CPU interpreter.
        return RMSNormConfig(
            bm=max(1, min(64, 65536 // bd)), bd=bd, nd=nd, num_warps=4, num_stages=1
        )
    # GPU: about 4096 elements per program; a whole model row (D >= 4096) gets
    # one program per row, narrow rows (q/k norm, head_dim 128) share one.
    return RMSNormConfig(
        bm=max(1, min(16, 4096 // bd)),
        bd=bd,
        nd=nd,
        num_warps=min(max(bd // 256, 1), 8),
        num_stages=1,
    )


def norm_rows(load_pass1, load_pass2, w_ref, h_ref, *, d: int, bd: int, nd: int, eps: float,
              offset: float) -> None:
    """RMSNorm of rows [bm, Dp] (Dp = nd * bd) into h_ref, in a fixed reduction order.

    load_pass1(cols) / load_pass2(cols) give the rows' values at `cols` as f32 [bm, bd]
    for the sum of squares and for the scaling pass. Pass 1 keeps one running sum
    per lane over the nd blocks, then sums the lanes; the kernels that share this
    (plain and fused-add RMSNorm) therefore round alike.
    """
    bm = h_ref.shape[0]

    def square_sum(j, acc):  # acc [bm, bd] f32: one running sum per lane
        xs = load_pass1(pl.ds(j * bd, bd))
        return acc + xs * xs

    acc = lax.fori_loop(0, nd, square_sum, jnp.zeros((bm, bd), jnp.float32))
    # Padded features are zeros and add nothing; divide by the true D.
    ms = jnp.sum(acc, axis=1, keepdims=True) / jnp.float32(d)  # [bm, 1]
    inv = lax.rsqrt(ms + jnp.float32(eps))  # [bm, 1]

    def write(j, carry):
        cols = pl.ds(j * bd, bd)
        xs = load_pass2(cols)  # [bm, bd]
        ws = w_ref[:, cols].astype(jnp.float32)  # [1, bd]
        if offset == 0.0:
            normed = (xs * inv).astype(h_ref.dtype).astype(jnp.float32)
            h_ref[:, cols] = (normed * ws).astype(h_ref.dtype)
        else:
            h_ref[:, cols] = (xs * inv * (jnp.float32(offset) + ws)).astype(h_ref.dtype)
        return carry

    lax.fori_loop(0, nd, write, 0)


def _rmsnorm_kernel(x_ref, w_ref, o_ref, *, d: int, bd: int, nd: int, eps: float, offset: float):
    # x_ref [bm, Dp], w_ref [1, Dp], o_ref [bm, Dp]; Dp = nd * bd, zero padded.
    def load(cols):
        return x_ref[:, cols].astype(jnp.float32)

    norm_rows(load, load, w_ref, o_ref, d=d, bd=bd, nd=nd, eps=eps, offset=offset)


def _check_shapes(x: jax.Array, w: jax.Array) -> None:
    if x.ndim != 2 or w.ndim != 1 or x.shape[1] != w.shape[0]:
        raise ValueError(f"rmsnorm wants x [M, D] and w [D]; got {x.shape=} {w.shape=}")
    check_float("x", x)
    check_float("w", w)


@functools.partial(jax.jit, static_argnames=("eps", "offset", "interpret"))
def rmsnorm(
    x: jax.Array, w: jax.Array, *, eps: float, offset: float = 0.0, interpret: bool = False
) -> jax.Array:
    """RMSNorm of each row of x [M, D] with weight w [D]; returns x.dtype."""
    check_eps("rmsnorm", eps)
    _check_shapes(x, w)
    if offset not in (0.0, 1.0):
        raise ValueError(f"rmsnorm supports offset 0.0 (Llama) or 1.0 (Gemma); got {offset=}")
    m, d = x.shape
    cfg = rmsnorm_config(d, x.dtype, interpret)
    dp = cfg.nd * cfg.bd
    xp = pad_rows(pad_axis(x, 1, dp), cfg.bm)  # [Mp, Dp]
    wp = pad_axis(w, 0, dp).reshape(1, dp)  # [1, Dp]
    mp = xp.shape[0]

    kernel = functools.partial(
        _rmsnorm_kernel, d=d, bd=cfg.bd, nd=cfg.nd, eps=float(eps), offset=float(offset)
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, dp), x.dtype),
        grid=(mp // cfg.bm,),
        in_specs=[
            pl.BlockSpec((cfg.bm, dp), lambda i: (i, 0)),
            pl.BlockSpec((1, dp), lambda i: (0, 0)),
        ],
        out_specs=pl.BlockSpec((cfg.bm, dp), lambda i: (i, 0)),
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="jspec_rmsnorm",
    )(xp, wp)
    return out[:m, :d]


def rmsnorm_reference(x: jax.Array, w: jax.Array, *, eps: float, offset: float = 0.0) -> jax.Array:
    """Plain jnp RMSNorm with the same semantics (for tolerance checks)."""
    xf = x.astype(jnp.float32)
    inv = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    wf = w.astype(jnp.float32)
    if offset == 0.0:
        normed = (xf * inv).astype(x.dtype).astype(jnp.float32)
        return (normed * wf).astype(x.dtype)
    return (xf * inv * (offset + wf)).astype(x.dtype)
