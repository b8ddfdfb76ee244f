"""Row-invariant logit soft-capping (Gemma 2): y = tanh(x / cap) * cap, in f32.

tanh is a transcendental whose XLA implementation (vectorised polynomial vs.
scalar path, fusion with neighbours) may round differently for different array
shapes. In the kernel every element runs the same f32 code, with a tiling that
depends only on N and interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import pad_axis, pad_rows, pow2_tile, round_up, triton_params


@dataclasses.dataclass(frozen=True)
class SoftcapConfig:
    bm: int  # rows per program
    bn: int  # columns per program
    num_warps: int
    num_stages: int


def softcap_config(N: int, interpret: bool) -> SoftcapConfig:
    """Tiling for rows of N values; deliberately takes no M."""
    if interpret:
        return SoftcapConfig(bm=64, bn=pow2_tile(N, 128, 4096), num_warps=4, num_stages=1)
    return SoftcapConfig(bm=16, bn=pow2_tile(N, 128, 512), num_warps=4, num_stages=1)


def _softcap_kernel(x_ref, o_ref, *, cap: float):
    # x_ref, o_ref [bm, bn] f32
    c = jnp.float32(cap)
    o_ref[...] = jnp.tanh(x_ref[...] / c) * c


def _check_args(x: jax.Array, cap: float) -> None:
    if x.ndim != 2:
        raise ValueError(f"softcap wants x [M, N]; got {x.shape=}")
    if x.dtype != jnp.float32:
        raise ValueError(f"softcap wants float32 x; got {x.dtype=}")
    if not cap > 0:
        raise ValueError(f"softcap wants cap > 0; got {cap=}")


@functools.partial(jax.jit, static_argnames=("cap", "interpret"))
def softcap(x: jax.Array, cap: float, *, interpret: bool = False) -> jax.Array:
    """tanh(x / cap) * cap for x [M, N] float32."""
    _check_args(x, cap)
    m, n = x.shape
    cfg = softcap_config(n, interpret)
    xp = pad_rows(pad_axis(x, 1, round_up(n, cfg.bn)), cfg.bm)  # [Mp, Np]
    mp, np_ = xp.shape

    spec = pl.BlockSpec((cfg.bm, cfg.bn), lambda i, j: (i, j))
    out = pl.pallas_call(
        functools.partial(_softcap_kernel, cap=float(cap)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
        grid=(mp // cfg.bm, np_ // cfg.bn),
        in_specs=[spec],
        out_specs=spec,
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="jspec_softcap",
    )(xp)
    return out[:m, :n]


def softcap_reference(x: jax.Array, cap: float) -> jax.Array:
    """Plain jnp soft-capping."""
    return jnp.tanh(x / cap) * cap
