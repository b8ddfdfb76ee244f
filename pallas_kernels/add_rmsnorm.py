"""Residual add fused with the RMSNorm that follows it, in one row-invariant kernel.

The decoder does `x = x + o; h = rmsnorm(x)` after every attention and MLP
block. As two launches that is an XLA add (its rounding pinned by
`xla_allow_excess_precision=False`) and the RMSNorm kernel. Here one kernel
writes both outputs:

  x_new = x + o                                  rounded to x.dtype
  h     = rmsnorm(x_new) * (offset + w)          as pallas_kernels/rmsnorm.py

The add is taken in f32 and rounded to x.dtype. For f32 inputs that is the
add itself. For bf16 it is the correctly rounded bf16 sum: the exact sum is
rounded to f32 (24 bits) and then to bf16 (8 bits), and a double rounding
through a format of at least 2p + 2 bits gives the same result as one rounding
for +, so these are the bits of a bf16 add. The norm then
reads the rounded x_new, never the f32 sum, and runs the ops of
`_rmsnorm_kernel` with the tiling of `rmsnorm_config` (a function of D, dtype
and interpret mode, never of M). So h is bitwise `rmsnorm(x + o)` of the
unfused path, which tests/test_fused.py checks.

The sum is recomputed from x and o in the write pass rather than read back
from the x_new output: elementwise, deterministic, and it keeps the kernel
free of a read-after-write on an output buffer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import check_eps, check_float, pad_axis, pad_rows, triton_params
from pallas_kernels.rmsnorm import norm_rows, rmsnorm_config, rmsnorm_reference


def _add_rmsnorm_kernel(x_ref, o_ref, w_ref, xo_ref, h_ref, *, d: int, bd: int, nd: int,
                        eps: float, offset: float):
    # x_ref, o_ref, xo_ref, h_ref [bm, Dp]; w_ref [1, Dp]; Dp = nd * bd, zero padded.
    def summed(cols):  # x + o rounded to the activation dtype
        xs = x_ref[:, cols].astype(jnp.float32) + o_ref[:, cols].astype(jnp.float32)
        return xs.astype(xo_ref.dtype)

    def load_and_store(cols):  # pass 1 also writes x + o out
        xn = summed(cols)
        xo_ref[:, cols] = xn
        return xn.astype(jnp.float32)

    def load(cols):  # pass 2 recomputes x + o instead of reading xo_ref back
        return summed(cols).astype(jnp.float32)

    norm_rows(load_and_store, load, w_ref, h_ref, d=d, bd=bd, nd=nd, eps=eps, offset=offset)


def _check_args(x: jax.Array, o: jax.Array, w: jax.Array, offset: float) -> None:
    if x.ndim != 2 or x.shape != o.shape or w.ndim != 1 or x.shape[1] != w.shape[0]:
        raise ValueError(
            f"add_rmsnorm wants x, o [M, D] and w [D]; got {x.shape=} {o.shape=} {w.shape=}")
    if x.dtype != o.dtype:
        raise ValueError(f"add_rmsnorm wants x and o of one dtype; got {x.dtype=} {o.dtype=}")
    check_float("x", x)
    check_float("w", w)
    if offset not in (0.0, 1.0):
        raise ValueError(f"add_rmsnorm supports offset 0.0 (Llama) or 1.0 (Gemma); got {offset=}")


@functools.partial(jax.jit, static_argnames=("eps", "offset", "interpret"))
def add_rmsnorm(
    x: jax.Array, o: jax.Array, w: jax.Array, *, eps: float, offset: float = 0.0,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(x + o, rmsnorm(x + o) * (offset + w)) for rows of x, o [M, D]; both x.dtype."""
    check_eps("add_rmsnorm", eps)
    _check_args(x, o, w, offset)
    m, d = x.shape
    cfg = rmsnorm_config(d, x.dtype, interpret)  # the plain RMSNorm's tiling
    dp = cfg.nd * cfg.bd
    xp = pad_rows(pad_axis(x, 1, dp), cfg.bm)  # [Mp, Dp]
    op = pad_rows(pad_axis(o, 1, dp), cfg.bm)
    wp = pad_axis(w, 0, dp).reshape(1, dp)  # [1, Dp]
    mp = xp.shape[0]

    kernel = functools.partial(
        _add_rmsnorm_kernel, d=d, bd=cfg.bd, nd=cfg.nd, eps=float(eps), offset=float(offset)
    )
    rows = pl.BlockSpec((cfg.bm, dp), lambda i: (i, 0))
    x_new, h = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((mp, dp), x.dtype),
                   jax.ShapeDtypeStruct((mp, dp), x.dtype)),
        grid=(mp // cfg.bm,),
        in_specs=[rows, rows, pl.BlockSpec((1, dp), lambda i: (0, 0))],
        out_specs=(rows, rows),
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="jspec_add_rmsnorm",
    )(xp, op, wp)
    return x_new[:m, :d], h[:m, :d]


def add_rmsnorm_reference(
    x: jax.Array, o: jax.Array, w: jax.Array, *, eps: float, offset: float = 0.0
) -> tuple[jax.Array, jax.Array]:
    """Plain jnp: the unfused `x = x + o; h = rmsnorm(x)` (the xla backend's add_norm)."""
    x = x + o
    return x, rmsnorm_reference(x, w, eps=eps, offset=offset)
