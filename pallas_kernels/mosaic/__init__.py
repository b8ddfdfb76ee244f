"""Mosaic GPU lowerings of jspec's invariant kernels (rule R11: a lowering is a
configuration).

JAX has deprecated Pallas's Triton backend; Mosaic GPU is its Hopper-native GPU
backend (warpgroup MMA, TMA bulk copies). The kernels here are the Mosaic GPU
lowering of kernels whose Triton lowering sits one level up, with the same jnp
references and the same rules: tiles a function of the weight shape only, K walked
from 0 upward into one accumulator, no atomics, no reduction across rows. The two
lowerings may give different bits from each other; each is row-invariant on its own.

So far, every kernel of a dense forward, which `jspec.KernelOptions.lowering` selects:
the matmul family (`matmul`, `matmul_glu`, and `matmul_partials` for row-parallel
weights), an unfused GLU (`glu.py`), the norms (`rmsnorm`, `add_rmsnorm`), RoPE
with the q/k norms (`qk_norm_rope`, `rope`), and split-KV and tree attention
(`attention.attention`, `attention.tree_attention`, for the shapes `attention.takes`),
and a mixture of experts' grouped kernels (`moe.py`: gate/up + GLU and down, 16-bit
weights, expert widths a multiple of 64) and routing (`route.py`, up to 256 experts);
top-p has its own (`top_p.py`). The
matmul's design (64-row tiles, or the swapped design's 64 weight columns by 16 tokens) is
chosen per weight shape by `matmul_tuned.json`, written by a device sweep's bit checks.
"""

from pallas_kernels.mosaic.matmul import (
    MosaicMatmulConfig,
    matmul,
    matmul_glu,
    matmul_partials,
    mosaic_matmul_config,
)
from pallas_kernels.mosaic.norms import add_rmsnorm, rmsnorm
from pallas_kernels.mosaic.qk_rope import qk_norm_rope, rope

__all__ = ["MosaicMatmulConfig", "add_rmsnorm", "matmul", "matmul_glu", "matmul_partials",
           "mosaic_matmul_config", "qk_norm_rope", "rmsnorm", "rope"]
