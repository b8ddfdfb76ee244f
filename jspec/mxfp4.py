"""MXFP4 expert weights kept packed in memory (gpt-oss), dequantized exactly when used.

gpt-oss ships its experts in MXFP4: 4-bit e2m1 codes, one power-of-two scale (e8m0) per
32 values along the input axis. Every value is a code's value times a power of two, so
it is exact in bfloat16 and float32: `dequantize` gives the very weights
`dequantize_mxfp4` gives at load time, and a model that keeps its experts
packed computes the bits of the one that loaded them dequantized (the grouped kernels
see the same weights, with the model's own tiles: `table_experts`; or, with
`KernelOptions.mxfp4_kernel`, read the codes and decode each block in their K loop).

Packed layout (a layer's params `{name}_mx` and `{name}_scale` for w_gate_up, w_down):
  codes  uint8 [E, K / 2, N]: byte (j, n) holds row 2j's code (low nibble) and row
         2j + 1's (high nibble) of the [E, K, N] weight jspec uses;
  scales uint8 [E, K / 32, N]: the scale of rows 32g .. 32g + 31 of column n, 2 ** (s -
         127).
4.25 bits a weight: gpt-oss-120b's experts take 61 GB instead of 229 GB in bfloat16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jspec._checks import CheckpointError
from pallas_kernels.mxfp4 import decode_planes

# The e2m1 value of each 4-bit code (transformers' `integrations.mxfp4.FP4_VALUES`).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
PACKED = ("w_gate_up", "w_down")  # the expert weights a layer may keep packed
# The smallest scale kept packed: below it a weight may be subnormal in float32, which
# arithmetic that flushes subnormals (XLA on a CPU, a GPU's fast paths) would zero.
MIN_SCALE = 2


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, name: str = "") -> np.ndarray:
    """MXFP4 [N, G, 16] uint8 blocks (two e2m1 codes a byte, the low nibble first) and
    [N, G] uint8 e8m0 scales (2 ** (s - 127) per 32 values) -> float32 [G * 32, N], i.e.
    transformers' `convert_moe_packed_tensors` for one expert, on the host at load
    (`dequantize` is its traced twin on the packed layout): every value is exact (a
    code times a power of two); a scale of 255 (e8m0's NaN) or one overflowing float32 is
    a CheckpointError naming `name`."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [N, G, 16, 2]
    values = FP4_VALUES[codes].reshape(*blocks.shape[:2], 32)  # [N, G, 32]
    with np.errstate(over="ignore", invalid="ignore"):
        out = values * np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
    if not np.isfinite(out).all() or (scales == 255).any():
        raise CheckpointError(f"{name}: an MXFP4 scale is NaN (255) or overflows float32")
    return np.ascontiguousarray(out.reshape(blocks.shape[0], -1).T)


def pack(blocks: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A checkpoint's MXFP4 tensor ([E, N, K / 32, 16] uint8 blocks, two codes a byte
    along K, low nibble first; [E, N, K / 32] scales) -> (codes [E, K / 2, N], scales
    [E, K / 32, N]) in the packed layout (the same codes, moved)."""
    E, N, G, _ = blocks.shape
    return (np.ascontiguousarray(blocks.reshape(E, N, G * 16).transpose(0, 2, 1)),
            np.ascontiguousarray(scales.transpose(0, 2, 1)))


def take_columns(codes: np.ndarray, scales: np.ndarray, columns: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The packed weight's columns reordered (`columns` [N] indices): codes and scales
    move together, so the dequantized weight's columns move the same way."""
    return (np.ascontiguousarray(codes[..., columns]),
            np.ascontiguousarray(scales[..., columns]))


def dequantize(codes: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """codes [S, K / 2, N] uint8, scales [S, K / 32, N] uint8 (each in [MIN_SCALE, 252])
    -> [S, K, N] in dtype, exactly: the values of `pallas_kernels.mxfp4.decode`, the
    integer decoding the grouped kernels run in their K loop (`mxfp4_kernel`), which are
    `dequantize_mxfp4`'s (tests/test_moe_kernels.py checks every code and scale), with
    no temporary larger than the result (`decode_planes`)."""
    return decode_planes(codes, scales, dtype)


def expert_params(lp: dict) -> dict:
    """A MoE layer's expert weights, float or packed ({key: array}), biases aside."""
    names = {n for n in PACKED} | {f"{n}_{part}" for n in PACKED for part in ("mx", "scale")}
    return {key: w for key, w in lp.items() if key in names}


def is_packed(lp: dict, name: str) -> bool:
    """Whether layer params `lp` hold expert weight `name` packed."""
    return f"{name}_mx" in lp


def weights(lp: dict, name: str, experts: jax.Array | None, dtype) -> jax.Array:
    """Expert weight `name` of layer params `lp` as [S, K, N] in dtype: all E experts
    (experts None) or those listed (experts [S] int, gathered before dequantizing, so
    only their bytes are read). A float weight is returned (or gathered) as it is."""
    if not is_packed(lp, name):
        w = lp[name]
        return w if experts is None else w[experts]
    codes, scales = lp[f"{name}_mx"], lp[f"{name}_scale"]
    if experts is not None:
        codes, scales = codes[experts], scales[experts]
    return dequantize(codes, scales, dtype)


def unpacked(params: dict, dtype) -> dict:
    """params with every packed expert weight dequantized ({key}_mx / {key}_scale ->
    {key}): the model loaded the default way, for comparisons."""
    def layer(lp):
        out = {k: v for k, v in lp.items() if k not in expert_params(lp) or k in PACKED}
        return out | {n: weights(lp, n, None, dtype) for n in PACKED if is_packed(lp, n)}
    return params | {"layers": [layer(lp) for lp in params["layers"]]}


def random_packed(key: jax.Array, E: int, K: int, N: int) -> dict[str, jax.Array]:
    """Random packed codes and scales of an [E, K, N] weight (scales 2^-8 .. 2^-6, so
    weights of about a 2880-wide layer's initial scale)."""
    k1, k2 = jax.random.split(key)
    codes = _random_codes(k1, E, K // 2, N)
    scales = jax.random.randint(k2, (E, K // 32, N), 119, 122, jnp.int32).astype(jnp.uint8)
    return {"mx": codes, "scale": scales}


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _random_codes(key: jax.Array, E: int, R: int, N: int) -> jax.Array:
    """Random uint8 [E, R, N], one expert at a time: a single uint8 draw of gpt-oss-120b's
    gate/up codes (1.06 GB) takes 4x-16x that in 32-bit temporaries, more than one GPU
    has left beside the layers already built."""
    words = -(-N // 4)

    def one(k):
        bits = jax.random.bits(k, (R, words), jnp.uint32)
        return jax.lax.bitcast_convert_type(bits, jnp.uint8).reshape(R, 4 * words)[:, :N]

    return jax.lax.map(one, jax.random.split(key, E))
