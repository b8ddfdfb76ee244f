"""Row-invariant matmul: y = x @ w with a fixed, sequential K reduction.

Every projection of the model (q/k/v/o, MLP, lm head) goes through here. XLA's
own dot picks its algorithm from the full shape, M included (on CPU, f32
`jnp.dot` of 1 row differs in the last bits from the same row inside 8 rows),
so the logits of a token would depend on how many rows were computed with it.

Here the tiling (bm, bn, bk, warps, stages) is a pure function of the weight
shape, dtype and interpret flag (`matmul_config`). Rows are padded up to bm, so
M only changes the grid. Each program owns one [bm, bn] output tile and walks K
from 0 upward in bk-wide blocks inside a `lax.fori_loop`, accumulating in f32;
no grid axis, atomic or split runs over K, so every output element sees the
same additions in the same order whatever M is. The f32 result is cast to
`out_dtype` inside the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    check_float,
    pad_axis,
    pad_rows,
    pow2_tile,
    round_up,
    triton_params,
)


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    bm: int  # rows per program (rows are padded to a multiple of this)
    bn: int  # output columns per program
    bk: int  # K elements per step of the sequential K loop
    num_warps: int
    num_stages: int


def matmul_config(K: int, N: int, dtype, interpret: bool) -> MatmulConfig:
    """Tiles for a [K, N] weight; deliberately takes no M."""
    if interpret:
        # Few, large grid steps: the interpreter pays per step, not per FLOP.
        return MatmulConfig(
            bm=32, bn=pow2_tile(N, 16, 512), bk=pow2_tile(K, 16, 512), num_warps=4, num_stages=1
        )
    # GPU: 16 rows keeps the decode step (M=1) cheap; tiles >= 16 for tl.dot.
    # f32 tiles cost twice the shared memory per pipeline stage, so halve bk.
    bk_max = 128 if jnp.dtype(dtype).itemsize <= 2 else 64
    return MatmulConfig(
        bm=16, bn=pow2_tile(N, 32, 64), bk=pow2_tile(K, 32, bk_max), num_warps=4, num_stages=4
    )


def _matmul_kernel(x_ref, w_ref, o_ref, *, bk: int, nk: int):
    # x_ref [bm, Kp], w_ref [Kp, bn], o_ref [bm, bn]
    bm, bn = o_ref.shape

    def step(k, acc):  # acc [bm, bn] f32
        xs = x_ref[:, pl.ds(k * bk, bk)]  # [bm, bk]
        ws = w_ref[pl.ds(k * bk, bk), :]  # [bk, bn]
        # HIGHEST: f32 tiles use exact f32 products (IEEE), never TF32, whatever
        # the global default precision; bf16 tiles are unaffected.
        prod = jnp.dot(xs, ws, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return acc + prod

    # Sequential k = 0, 1, ..., nk-1: the order of the K sum is fixed.
    acc = lax.fori_loop(0, nk, step, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _check_shapes(x: jax.Array, w: jax.Array) -> None:
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"matmul wants x [M, K] and w [K, N]; got {x.shape=} {w.shape=}")
    if x.dtype != w.dtype:
        raise ValueError(f"matmul wants x and w of one dtype; got {x.dtype=} {w.dtype=}")
    check_float("x", x)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def matmul(x: jax.Array, w: jax.Array, *, out_dtype=None, interpret: bool = False) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in out_dtype (default float32)."""
    _check_shapes(x, w)
    out_dtype = jnp.dtype(jnp.float32 if out_dtype is None else out_dtype)
    m, k = x.shape
    n = w.shape[1]
    cfg = matmul_config(k, n, w.dtype, interpret)

    # Zero padding: extra K terms add exact zeros at the end of the sum; extra
    # rows/columns are sliced away.
    kp = round_up(k, cfg.bk)
    xp = pad_rows(pad_axis(x, 1, kp), cfg.bm)  # [Mp, Kp]
    wp = pad_axis(pad_axis(w, 0, kp), 1, round_up(n, cfg.bn))  # [Kp, Np]
    mp, np_ = xp.shape[0], wp.shape[1]

    out = pl.pallas_call(
        functools.partial(_matmul_kernel, bk=cfg.bk, nk=kp // cfg.bk),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // cfg.bm, np_ // cfg.bn),
        in_specs=[
            pl.BlockSpec((cfg.bm, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((kp, cfg.bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((cfg.bm, cfg.bn), lambda i, j: (i, j)),
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="jspec_matmul",
    )(xp, wp)
    return out[:m, :n]


def matmul_reference(x: jax.Array, w: jax.Array, *, out_dtype=None) -> jax.Array:
    """XLA's own dot with f32 accumulation (NOT row-invariant; the `xla` backend).

    bf16 operands take XLA's native bf16 path, as any JAX model would; f32
    operands ask for full f32 products so the tolerance checks stay tight.
    """
    out_dtype = jnp.float32 if out_dtype is None else out_dtype
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)
