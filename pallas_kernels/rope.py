"""Row-invariant rotary position embedding (Hugging Face "rotate_half" layout).

out = x * cos + rotate_half(x) * sin, rotate_half(x) = concat(-x2, x1), where
x1 = x[..., :D/2] and x2 = x[..., D/2:], i.e.
  out1 = x1 * cos - x2 * sin,   out2 = x2 * cos + x1 * sin.
There is no reduction, but the multiply-adds are glue that XLA would fuse (and
possibly contract into FMAs or vectorise) differently for different array
shapes, changing the rounding. In the kernel the arithmetic is computed in f32
by the same code for every element, and rounded once to x.dtype. The tiling
(row tile, one head per program) depends on head_dim and interpret mode only.

cos and sin are per-row [M, D/2] float32 tables that the caller gathers from a
precomputed position table (so different rows may sit at different positions).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import check_float, next_pow2, pad_axis, pad_rows, triton_params


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    bm: int  # rows per program (each program does one head)
    half: int  # padded half head_dim (power of 2)
    num_warps: int
    num_stages: int


def rope_config(D: int, interpret: bool) -> RopeConfig:
    """Tiling for head_dim D; deliberately takes no M."""
    half = next_pow2(D // 2)
    if interpret:
        return RopeConfig(bm=64, half=half, num_warps=4, num_stages=1)
    return RopeConfig(bm=16, half=half, num_warps=4, num_stages=1)


def _rope_kernel(x_ref, cos_ref, sin_ref, o_ref, *, half: int):
    # x_ref, o_ref [bm, 2*half] (one head); cos_ref, sin_ref [bm, half] f32
    x1 = x_ref[:, :half].astype(jnp.float32)
    x2 = x_ref[:, half:].astype(jnp.float32)
    c = cos_ref[...]
    s = sin_ref[...]
    o_ref[:, :half] = (x1 * c - x2 * s).astype(o_ref.dtype)
    o_ref[:, half:] = (x2 * c + x1 * s).astype(o_ref.dtype)


def _check_shapes(x: jax.Array, cos: jax.Array, sin: jax.Array) -> None:
    if x.ndim != 3 or x.shape[2] % 2:
        raise ValueError(f"rope wants x [M, H, D] with D even; got {x.shape=}")
    want = (x.shape[0], x.shape[2] // 2)
    if cos.shape != want or sin.shape != want:
        raise ValueError(
            f"rope wants cos and sin [M, D/2] = {want}; got {x.shape=} {cos.shape=} {sin.shape=}"
        )
    check_float("x", x)


def _split_pad_halves(x: jax.Array, half: int) -> jax.Array:
    """[M, H, D] -> [M, H, 2*half], each half zero padded to `half` columns."""
    m, h, d = x.shape
    if d // 2 == half:
        return x
    return pad_axis(x.reshape(m, h, 2, d // 2), 3, half).reshape(m, h, 2 * half)


@functools.partial(jax.jit, static_argnames=("interpret",))
def rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interpret: bool = False) -> jax.Array:
    """Rotates x [M, H, D] by per-row cos, sin [M, D/2]; returns x.dtype."""
    _check_shapes(x, cos, sin)
    m, h, d = x.shape
    cfg = rope_config(d, interpret)
    half = cfg.half
    xp = pad_rows(_split_pad_halves(x, half), cfg.bm)  # [Mp, H, 2*half]
    cp = pad_rows(pad_axis(cos.astype(jnp.float32), 1, half), cfg.bm)  # [Mp, half]
    sp = pad_rows(pad_axis(sin.astype(jnp.float32), 1, half), cfg.bm)  # [Mp, half]
    mp = xp.shape[0]

    head_spec = pl.BlockSpec((cfg.bm, None, 2 * half), lambda i, j: (i, j, 0))
    table_spec = pl.BlockSpec((cfg.bm, half), lambda i, j: (i, 0))
    out = pl.pallas_call(
        functools.partial(_rope_kernel, half=half),
        out_shape=jax.ShapeDtypeStruct((mp, h, 2 * half), x.dtype),
        grid=(mp // cfg.bm, h),
        in_specs=[head_spec, table_spec, table_spec],
        out_specs=head_spec,
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="jspec_rope",
    )(xp, cp, sp)
    out = out[:m]
    if d // 2 != half:
        out = out.reshape(m, h, 2, half)[..., : d // 2].reshape(m, h, d)
    return out


def rope_reference(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Plain jnp HF rotate_half RoPE in f32, rounded once to x.dtype."""
    xf = x.astype(jnp.float32)  # [M, H, D]
    d2 = x.shape[-1] // 2
    c = jnp.concatenate([cos, cos], axis=-1).astype(jnp.float32)[:, None, :]  # [M, 1, D]
    s = jnp.concatenate([sin, sin], axis=-1).astype(jnp.float32)[:, None, :]
    rotated = jnp.concatenate([-xf[..., d2:], xf[..., :d2]], axis=-1)
    return (xf * c + rotated * s).astype(x.dtype)
