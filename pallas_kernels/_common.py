"""Small helpers shared by the row-invariant Pallas kernels.

Every kernel in this package pads its rows up to a row tile that depends only on
the feature/weight shape, so the number of rows M changes the grid and nothing
else. These helpers do that padding, pick power-of-2 tiles (Triton needs every
loaded tile to have a power-of-2 number of elements) and build the Triton
compiler parameters.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as plgpu


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


def next_pow2(n: int) -> int:
    """Smallest power of 2 that is >= max(n, 1)."""
    return 1 << max(n - 1, 0).bit_length()


def pow2_tile(n: int, lo: int, hi: int) -> int:
    """A power-of-2 tile for an axis of size n, between lo and hi (powers of 2).

    Prefers the largest tile that divides n, so that no padding copy is needed
    (real model dimensions are multiples of 128); otherwise the smallest tile
    that covers n, capped at hi, and the caller pads the axis.
    """
    t = hi
    while t >= lo:
        if n % t == 0:
            return t
        t //= 2
    return min(hi, max(lo, next_pow2(n)))


def pad_axis(x: jax.Array, axis: int, size: int, value: float = 0.0) -> jax.Array:
    """Pads `axis` of x at the end up to `size` with `value` (no-op when equal)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def pad_rows(x: jax.Array, tile: int, value: float = 0.0) -> jax.Array:
    """Pads axis 0 of x up to a multiple of `tile`."""
    return pad_axis(x, 0, round_up(x.shape[0], tile), value)


def triton_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    """Triton compiler parameters; ignored by interpret mode."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def check_eps(name: str, eps) -> None:
    """A norm's epsilon: a finite number > 0 (0 gives NaN on a zero row, < 0 NaN on any
    row whose mean square is below -eps): checked as the kernel traces."""
    if (isinstance(eps, bool) or not isinstance(eps, int | float | np.integer | np.floating)
            or not math.isfinite(float(eps)) or eps <= 0):
        raise ValueError(f"{name}: eps={eps!r} must be a finite number > 0")


def check_out_dtype(name: str, out_dtype) -> None:
    """A matmul's out_dtype: None (float32) or a float dtype, never a silent cast of the
    f32 accumulator to an integer type."""
    if out_dtype is not None and not jnp.issubdtype(jnp.dtype(out_dtype), jnp.floating):
        raise ValueError(f"{name}: out_dtype={jnp.dtype(out_dtype)} must be a float dtype "
                         "(the f32 accumulator's rounding)")


def check_float(name: str, x: jax.Array) -> None:
    """Raises ValueError unless x is float32 or bfloat16."""
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"{name} must be float32 or bfloat16, got {name}.dtype={x.dtype}")


@dataclasses.dataclass(frozen=True)
class VocabRowConfig:
    """Tiling of a kernel that walks rows of V vocabulary entries in ascending blocks."""

    bm: int  # rows per program
    bv: int  # vocabulary entries per block of the ascending loop
    num_warps: int
    num_stages: int


def vocab_row_config(V: int, interpret: bool) -> VocabRowConfig:
    """Tiling for rows of V logits (logsumexp, top-p); deliberately takes no M."""
    if interpret:
        return VocabRowConfig(bm=64, bv=pow2_tile(V, 128, 8192), num_warps=4, num_stages=1)
    # GPU: one row per program; bv up to 4096 keeps 8 warps busy per block.
    bv = pow2_tile(V, 1024, 4096) if V >= 1024 else next_pow2(V)
    return VocabRowConfig(bm=1, bv=bv, num_warps=8 if bv >= 2048 else 4, num_stages=2)


def safe_max(m: jax.Array) -> jax.Array:
    """m, with -inf replaced by 0 so that x - m is never -inf - -inf."""
    return jnp.where(m == -jnp.inf, jnp.float32(0.0), m)


def dot_f32(op, *operands, precision=None, **kwargs):
    """op(*operands, preferred_element_type=f32): a dot or einsum of the plain-jnp paths
    with f32 accumulation. XLA's CPU runtime has no bf16 x bf16 -> f32 dot (it fails at
    run time once the dot is a real GEMM), so on the CPU bf16 operands are widened to f32
    first: a bf16 product is exact in f32, and the sum accumulates in f32 as asked.
    Elsewhere the native bf16 dot runs."""
    def native(*a):
        return op(*a, precision=precision, preferred_element_type=jnp.float32, **kwargs)

    if all(x.dtype != jnp.bfloat16 for x in operands):
        return native(*operands)

    def widened(*a):
        return op(*(x.astype(jnp.float32) for x in a), precision=lax.Precision.HIGHEST,
                  preferred_element_type=jnp.float32, **kwargs)

    return lax.platform_dependent(*operands, cpu=widened, default=native)
