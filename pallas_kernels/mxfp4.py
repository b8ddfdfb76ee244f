"""MXFP4 weights (e2m1 codes, e8m0 scales) decoded with integer ops: inside a kernel's K
loop (`moe.grouped_matmul(..., scales=...)`) or outside one, the same values.

A code c (4 bits: sign, 2 exponent bits e, 1 mantissa bit m) with scale s stands for
(-1)^sign * (e ? 2^(e-1) (1 + m/2) : m/2) * 2^(s - 127). With s >= 2 that value is a
normal float32 (or zero) whose bits are built directly: biased exponent e - 1 + s (or
s - 1 for the code 0.5, 0 for zero), the mantissa's top bit m. Casting it to bfloat16 is
exact (two significant bits). No table, no rounding: every lowering gives the same
values, and `jspec.mxfp4.dequantize_mxfp4` (transformers' table) gives them too.

Layout: codes uint8 [..., K / 2, N], byte (j, n) holding row 2j's code in its low nibble
and row 2j + 1's in its high nibble; scales uint8 [..., K / 32, N], one per 32 rows of a
column.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

GROUP = 32  # rows of K sharing one scale


def decode(codes: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """codes uint8 [..., H, N] and scales uint8 [..., H / 16, N] (each >= 2) -> the
    weight [..., 2 H, N] in dtype, exactly. Plain integer ops, broadcasts and reshapes
    (row r takes byte r // 2 shifted by 4 (r % 2)): it lowers inside a Pallas Triton
    kernel as it runs in jnp. No join of the two nibbles: Triton halves the register
    layout (kWidth) of a dot operand whose inputs pass a join (see `moe._expert_k_loop`)."""
    *lead, H, N = codes.shape
    c = codes.astype(jnp.int32)[..., :, None, :]
    c = jnp.broadcast_to(c, (*lead, H, 2, N)).reshape(*lead, 2 * H, N)  # row r: byte r // 2
    odd = lax.broadcasted_iota(jnp.int32, (*lead, 2 * H, N), len(lead)) & 1
    c = lax.shift_right_logical(c, odd * 4) & 15  # rows 2j: low nibble, 2j + 1: high
    G = scales.shape[-2]
    s = scales.astype(jnp.int32)[..., :, None, :]
    s = jnp.broadcast_to(s, (*lead, G, GROUP, N)).reshape(*lead, G * GROUP, N)
    return _values(c, s, dtype)


def decode_planes(codes: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """`decode`'s values, for XLA: each nibble plane decoded elementwise straight into
    dtype, then the two planes interleaved, so no int32 copy of the weight is kept
    (`decode`'s int32 join is the size of the weight twice over in float32)."""
    *lead, H, N = codes.shape
    G = scales.shape[-2]
    s = scales.astype(jnp.int32)[..., :, None, :]
    s = jnp.broadcast_to(s, (*lead, G, GROUP // 2, N)).reshape(*lead, H, N)
    c = codes.astype(jnp.int32)
    low, high = _values(c & 15, s, dtype), _values(lax.shift_right_logical(c, 4), s, dtype)
    return jnp.stack([low, high], axis=-2).reshape(*lead, 2 * H, N)  # rows 2j, 2j + 1


def _values(c: jax.Array, s: jax.Array, dtype) -> jax.Array:
    """Codes c and scales s (int32, one each a value) -> the values in dtype."""
    e, m = lax.shift_right_logical(c, 1) & 3, c & 1
    exponent = jnp.where(e > 0, e - 1 + s, jnp.where(m > 0, s - 1, 0))
    bits = (lax.shift_left(lax.shift_right_logical(c, 3), 31)
            | lax.shift_left(exponent, 23) | lax.shift_left(jnp.where(e > 0, m, 0), 22))
    return lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)
