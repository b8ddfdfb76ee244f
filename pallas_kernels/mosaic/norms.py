"""Row-invariant RMSNorm and residual-add RMSNorm on Mosaic GPU.

The Mosaic GPU lowering of `pallas_kernels/rmsnorm.py` and `add_rmsnorm.py` (their
docstrings give the semantics, Hugging Face's; the jnp references are theirs). One
program owns one row, so the row count changes only the grid (R1) and no row's
arithmetic ever sees another row (R2).

A row of D features is zero-padded to Dp = D rounded up to 256 and viewed as [Dp / 256,
256] (a TMA copy moves at most 256 elements along an axis). TMA copies it into shared
memory; it is loaded into registers in the warpgroup's strided layout (thread t of the
128 holds a fixed set of elements, a function of Dp only), and the sum of squares is
`jnp.sum` over that array: each thread adds its elements in a fixed order, then the
threads' partial sums are combined by a fixed butterfly of warp shuffles and a fixed
pass over the four warps' sums in shared memory. Every step of that order is set by the
layout, which is set by Dp: the same D gives every row the same sum order, whatever M.
Padded features are zeros and add nothing; the mean divides by the true D. rsqrt, the
scaling and the weight product run in the kernel in `rmsnorm.py`'s arithmetic, rounded to
the activation dtype in the same places. The sum's order is this lowering's own (R11):
its bits may differ from the Triton lowering's in the last place, and each lowering is
row-invariant on its own.

`add_rmsnorm` adds the residual in f32, rounds it to the activation dtype (the bits of a
plain add, as `add_rmsnorm.py` explains), writes it out, and normalises the rounded sum,
so h is bitwise this module's `rmsnorm(x + o)`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import check_eps, pad_axis, round_up
from pallas_kernels.add_rmsnorm import _check_args as _check_add_args
from pallas_kernels.add_rmsnorm import add_rmsnorm_reference
from pallas_kernels.rmsnorm import _check_shapes, rmsnorm_reference

__all__ = ["LANES", "add_rmsnorm", "add_rmsnorm_reference", "rmsnorm", "rmsnorm_reference"]

LANES = 256  # a row is viewed as [Dp / LANES, LANES]: TMA copies <= 256 elements an axis


def _row_shape(d: int) -> tuple[int, int]:
    """[rows, LANES] view of one zero-padded feature row; a function of D only."""
    return round_up(d, LANES) // LANES, LANES


def _normalise(xs, w_smem, h_smem, *, d: int, eps: float, offset: float) -> None:
    """h = rmsnorm(xs) * (offset + w) for one row xs (f32, [R, LANES]), as rmsnorm.py."""
    ss = jnp.sum(xs * xs)  # the layout's fixed order (module docstring)
    inv = lax.rsqrt(ss / jnp.float32(d) + jnp.float32(eps))
    ws = w_smem[...].astype(jnp.float32)
    if offset == 0.0:
        normed = (xs * inv).astype(h_smem.dtype).astype(jnp.float32)
        h_smem[...] = (normed * ws).astype(h_smem.dtype)
    else:
        h_smem[...] = (xs * inv * (jnp.float32(offset) + ws)).astype(h_smem.dtype)


def _store(smem_gmem_pairs) -> None:
    plgpu.commit_smem()
    for smem, gmem in smem_gmem_pairs:
        plgpu.copy_smem_to_gmem(smem, gmem)
    plgpu.wait_smem_to_gmem(0)


def _rmsnorm_kernel(x_gmem, w_gmem, h_gmem, x_smem, w_smem, h_smem, bar, *, d, eps, offset):
    # x_gmem, h_gmem [M, R, LANES]; w_gmem [R, LANES]; *_smem [R, LANES]: one row.
    i = lax.axis_index("m")
    plgpu.copy_gmem_to_smem(x_gmem.at[i], x_smem, bar)
    plgpu.copy_gmem_to_smem(w_gmem, w_smem, bar)
    plgpu.barrier_wait(bar)
    _normalise(x_smem[...].astype(jnp.float32), w_smem, h_smem, d=d, eps=eps, offset=offset)
    _store([(h_smem, h_gmem.at[i])])


def _add_rmsnorm_kernel(x_gmem, o_gmem, w_gmem, xo_gmem, h_gmem, x_smem, o_smem, w_smem,
                        xo_smem, h_smem, bar, *, d, eps, offset):
    i = lax.axis_index("m")
    plgpu.copy_gmem_to_smem(x_gmem.at[i], x_smem, bar)
    plgpu.copy_gmem_to_smem(o_gmem.at[i], o_smem, bar)
    plgpu.copy_gmem_to_smem(w_gmem, w_smem, bar)
    plgpu.barrier_wait(bar)
    summed = (x_smem[...].astype(jnp.float32) + o_smem[...].astype(jnp.float32)
              ).astype(xo_smem.dtype)  # the bits of a plain add (add_rmsnorm.py)
    xo_smem[...] = summed
    _normalise(summed.astype(jnp.float32), w_smem, h_smem, d=d, eps=eps, offset=offset)
    _store([(xo_smem, xo_gmem.at[i]), (h_smem, h_gmem.at[i])])


def _rows(x: jax.Array) -> jax.Array:
    """[M, D] -> [M, R, LANES], zero-padded features."""
    m, d = x.shape
    return pad_axis(x, 1, round_up(d, LANES)).reshape(m, *_row_shape(d))


def _launch(kernel, args, smem: dict, n_out: int, m: int, d: int, dtype, interpret: bool,
            name: str) -> tuple[jax.Array, ...]:
    """Runs `kernel` over a grid of one program a row. args: gmem inputs ([M, R, LANES]
    rows, then the [R, LANES] weight); smem: the kernel's shared-memory scratch by name
    (a barrier last, which every input copy arrives at). -> n_out [M, D] outputs."""
    shape = _row_shape(d)
    out = plgpu.kernel(
        kernel,
        out_type=tuple(jax.ShapeDtypeStruct((m, *shape), dtype) for _ in range(n_out)),
        scratch_types=smem | dict(bar=plgpu.Barrier(num_arrivals=len(args))),
        grid=(m,),
        grid_names=("m",),
        kernel_name=name,
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*args)
    return tuple(o.reshape(m, -1)[:, :d] for o in out)


@functools.partial(jax.jit, static_argnames=("eps", "offset", "interpret"))
def rmsnorm(x: jax.Array, w: jax.Array, *, eps: float, offset: float = 0.0,
            interpret: bool = False) -> jax.Array:
    """RMSNorm of each row of x [M, D] with weight w [D] on Mosaic GPU; returns x.dtype.
    `interpret`: Pallas's GPU interpret mode (CPU)."""
    check_eps("rmsnorm", eps)
    _check_shapes(x, w)
    if offset not in (0.0, 1.0):
        raise ValueError(f"rmsnorm supports offset 0.0 (Llama) or 1.0 (Gemma); got {offset=}")
    m, d = x.shape
    if m == 0:
        return x
    shape = _row_shape(d)
    smem = dict(x_smem=plgpu.SMEM(shape, x.dtype), w_smem=plgpu.SMEM(shape, w.dtype),
                h_smem=plgpu.SMEM(shape, x.dtype))
    kernel = functools.partial(_rmsnorm_kernel, d=d, eps=float(eps), offset=float(offset))
    (h,) = _launch(kernel, (_rows(x), _rows(w[None])[0]), smem, 1, m, d, x.dtype, interpret,
                   "jspec_mosaic_rmsnorm")
    return h


@functools.partial(jax.jit, static_argnames=("eps", "offset", "interpret"))
def add_rmsnorm(x: jax.Array, o: jax.Array, w: jax.Array, *, eps: float, offset: float = 0.0,
                interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(x + o, rmsnorm(x + o) * (offset + w)) for rows of x, o [M, D] on Mosaic GPU."""
    check_eps("add_rmsnorm", eps)
    _check_add_args(x, o, w, offset)  # o: x's dtype, so a float too
    m, d = x.shape
    if m == 0:
        return x, x
    shape = _row_shape(d)
    smem = dict(x_smem=plgpu.SMEM(shape, x.dtype), o_smem=plgpu.SMEM(shape, x.dtype),
                w_smem=plgpu.SMEM(shape, w.dtype), xo_smem=plgpu.SMEM(shape, x.dtype),
                h_smem=plgpu.SMEM(shape, x.dtype))
    kernel = functools.partial(_add_rmsnorm_kernel, d=d, eps=float(eps), offset=float(offset))
    x_new, h = _launch(kernel, (_rows(x), _rows(o), _rows(w[None])[0]), smem, 2, m, d,
                       x.dtype, interpret, "jspec_mosaic_add_rmsnorm")
    return x_new, h
