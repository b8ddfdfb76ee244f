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

`decode_rows_prmt` gives `decode_rows`' bfloat16 values with a byte-permute table in
inline PTX (GPU only; `KernelOptions.mxfp4_prmt`): every value it builds is a normal
bfloat16 or zero, and the scale is a power of two, so its one multiply is exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

GROUP = 32  # rows of K sharing one scale


def decode(codes: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """codes uint8 [..., H, N] and scales uint8 [..., H / 16, N] (each >= 2) -> the
    weight [..., 2 H, N] in dtype, exactly: `decode_rows` on each row's byte and scale,
    expanded by broadcasts and reshapes (no join of the two nibbles: Triton halves the
    register layout (kWidth) of a dot operand whose inputs pass a join)."""
    *lead, H, N = codes.shape
    c = jnp.broadcast_to(codes[..., :, None, :], (*lead, H, 2, N)).reshape(*lead, 2 * H, N)
    G = scales.shape[-2]
    s = jnp.broadcast_to(scales[..., :, None, :], (*lead, G, GROUP, N))
    return decode_rows(c, s.reshape(*lead, G * GROUP, N), dtype)


def decode_rows(codes: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """The weight's rows from each row's own byte and scale: codes uint8 [..., R, N] (row
    r: the byte holding its code, the low nibble for even r, the high for odd r), scales
    uint8 [..., R, N] (row r's scale, >= 2) -> [..., R, N] in dtype, exactly. Only
    elementwise integer ops: the grouped kernels load each row's byte and scale straight
    into this layout (a gather of rows r // 2 and r // 32), so nothing is moved between
    layouts before the dot."""
    odd = lax.broadcasted_iota(jnp.int32, codes.shape, codes.ndim - 2) & 1
    c = lax.shift_right_logical(codes.astype(jnp.int32), odd * 4)
    return _values(c, scales.astype(jnp.int32), dtype)


# Four codes a call (`pack=4`): $2 the four rows' bytes, $3 their scales, $4 a mask byte
# each (0xFF: an odd row, whose code is the high nibble). Each byte's nibble (sign bit 3,
# magnitude q in bits 0-2) -> the four magnitudes as prmt selectors -> the low and high
# bytes of the bfloat16 of q's value (0, 0.5, 1, 1.5, 2, 3, 4, 6) from two 8-byte tables,
# the sign ORed into the high bytes -> two bf16x2 ($0: values 0, 1; $1: values 2, 3),
# times 2^(s - 127) (the scale byte s shifted into a bfloat16's exponent field).
PRMT_ASM = """{
.reg .b32 t, n, u, v, sel, lo, hi, sg, s01, s23;
shr.b32 t, $2, 4;
lop3.b32 n, t, $2, $4, 0xE4;
and.b32 n, n, 0x0F0F0F0F;
shr.b32 u, n, 4;
or.b32 v, n, u;
and.b32 v, v, 0x77777777;
prmt.b32 sel, v, v, 0x0020;
prmt.b32 lo, 0xC0800000, 0xC0804000, sel;
prmt.b32 hi, 0x3F3F3F00, 0x40404040, sel;
shl.b32 sg, n, 4;
and.b32 sg, sg, 0x80808080;
or.b32 hi, hi, sg;
prmt.b32 $0, lo, hi, 0x5140;
prmt.b32 $1, lo, hi, 0x7362;
prmt.b32 s01, $3, 0, 0x4140;
prmt.b32 s23, $3, 0, 0x4342;
shl.b32 s01, s01, 7;
shl.b32 s23, s23, 7;
mul.rn.bf16x2 $0, $0, s01;
mul.rn.bf16x2 $1, $1, s23;
}"""


def odd_rows(shape) -> jax.Array:
    """`decode_rows_prmt`'s mask: uint8 [..., R, N], 0xFF on odd rows (the high nibble)."""
    odd = lax.broadcasted_iota(jnp.int32, shape, len(shape) - 2) & 1
    return (odd * 255).astype(jnp.uint8)


def decode_rows_prmt(codes: jax.Array, scales: jax.Array, odd: jax.Array) -> jax.Array:
    """`decode_rows(codes, scales, jnp.bfloat16)` inside a Triton kernel, by `PRMT_ASM`
    (odd: `odd_rows(codes.shape)`, which a loop computes once): about 5 instructions a
    value where the integer decode takes about 15 (the loop of gpt-oss-120b's grouped
    kernels: 406-419 SASS instructions a K step against 603-612). Values only: q's table entry
    is exact, 2^(s - 127) is a normal bfloat16 for 2 <= s <= 252 and their product is
    exact and normal (no subnormal anywhere, so no flush-to-zero can differ). No
    interpret mode (XLA has no PTX): the CPU checks the asm by emulating it."""
    from jax.experimental.pallas import triton as pltriton

    [out] = pltriton.elementwise_inline_asm(
        PRMT_ASM, args=[codes, scales, odd], constraints="=r,=r,r,r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(codes.shape, jnp.bfloat16)])
    return out


def decode_planes(codes: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """`decode`'s values, for XLA: each nibble plane decoded elementwise straight into
    dtype, then the two planes interleaved, so no int32 copy of the weight is kept
    (`decode`'s int32 join is the size of the weight twice over in float32)."""
    *lead, H, N = codes.shape
    G = scales.shape[-2]
    s = scales.astype(jnp.int32)[..., :, None, :]
    s = jnp.broadcast_to(s, (*lead, G, GROUP // 2, N)).reshape(*lead, H, N)
    c = codes.astype(jnp.int32)
    low, high = _values(c, s, dtype), _values(lax.shift_right_logical(c, 4), s, dtype)
    return jnp.stack([low, high], axis=-2).reshape(*lead, 2 * H, N)  # rows 2j, 2j + 1


def _values(c: jax.Array, s: jax.Array, dtype) -> jax.Array:
    """Codes c (int32, the code in the low 4 bits; higher bits ignored) and scales s
    (int32) -> the values in dtype. The magnitude code q = (e, m) placed at bit 22 puts e
    in the exponent field and m in the mantissa's top bit, so adding (s - 1) << 23 gives
    the biased exponent e - 1 + s for e > 0; q = 1 (0.5) is (s - 1) << 23 alone, q = 0
    zero; the sign is bit 3 moved to bit 31."""
    q = c & 7
    s1 = lax.shift_left(s - 1, 23)
    mag = jnp.where(q >= 2, lax.shift_left(q, 22) + s1, q * s1)
    bits = mag | lax.shift_left(c & 8, 28)
    return lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)
