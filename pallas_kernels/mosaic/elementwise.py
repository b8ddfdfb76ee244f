"""Elementwise kernels on Mosaic GPU: one launcher for arithmetic that reads no neighbour.

Rows of N elements are zero-padded to a multiple of BLOCK (16 x 256) and cut into blocks;
one program a (row, block) copies each input's block into shared memory by TMA, applies
the function to them and copies the result back. The grid follows M and N, the
arithmetic neither: every element runs the same instructions on its own values (R1, R2).
The final softcap (`softcap.py`) and a shared expert's gate (`shared_gate.py`) use it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import pad_axis, round_up

__all__ = ["BLOCK", "elementwise"]

ROWS, LANES = 16, 256  # a block [16, 256]: a TMA box (<= 256 elements an axis)
BLOCK = ROWS * LANES


def elementwise(fn: Callable, arrays: tuple[jax.Array, ...], out_dtype, *, name: str,
                interpret: bool) -> jax.Array:
    """fn over [M, N] arrays of one shape, block by block: fn(*blocks) -> a block in
    out_dtype. `interpret`: Pallas's GPU interpret mode (CPU)."""
    m, n = arrays[0].shape
    blocks = round_up(n, BLOCK) // BLOCK

    def kernel(*refs):
        # refs: the inputs' [M, C, ROWS, LANES] views, the output's, a block of shared
        # memory an input, one for the output, the barrier the copies arrive at.
        k = len(arrays)
        ins, out, in_smem, o_smem, bar = refs[:k], refs[k], refs[k + 1:2 * k + 1], *refs[-2:]
        i, c = lax.axis_index("m"), lax.axis_index("c")
        for src, dst in zip(ins, in_smem, strict=True):
            plgpu.copy_gmem_to_smem(src.at[i, c], dst, bar)
        plgpu.barrier_wait(bar)
        o_smem[...] = fn(*(s[...] for s in in_smem)).astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out.at[i, c])
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((ROWS, LANES), a.dtype) for a in arrays]
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m, blocks, ROWS, LANES), out_dtype),
        scratch_types=(*scratch, plgpu.SMEM((ROWS, LANES), out_dtype),
                       plgpu.Barrier(num_arrivals=len(arrays))),
        grid=(m, blocks),
        grid_names=("m", "c"),
        kernel_name=name,
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*(pad_axis(a, 1, blocks * BLOCK).reshape(m, blocks, ROWS, LANES) for a in arrays))
    return out.reshape(m, -1)[:, :n]
