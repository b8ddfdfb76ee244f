"""Row-invariant gated linear unit on Mosaic GPU: out = act(gate) * up.

The Mosaic GPU lowering of `pallas_kernels/glu.py` (its docstring gives the activations
and Hugging Face's roundings), through `mosaic/elementwise.py`: elementwise, so no order
to fix; every element runs `matmul_glu`'s `_glu_tile` arithmetic on its own gate and up,
and its bits depend on those two values only (R1, R2), never on M, F or the block it lies
in. The model takes it where the GLU is not fused into the gate/up matmul (`fuse_glu`
off, or a tensor-parallel column shard). The two lowerings' exp and tanh are each their
own (R11): this one's bits may differ from the Triton kernel's.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.glu import _check_args, glu_reference
from pallas_kernels.matmul_glu import _glu_tile
from pallas_kernels.mosaic.elementwise import elementwise

__all__ = ["glu", "glu_reference"]


@functools.partial(jax.jit, static_argnames=("activation", "interpret"))
def glu(gate: jax.Array, up: jax.Array, *, activation: str, interpret: bool = False
        ) -> jax.Array:
    """act(gate) * up for gate, up [M, F]; returns gate.dtype, on Mosaic GPU.
    `interpret`: Pallas's GPU interpret mode (CPU)."""
    _check_args(gate, up, activation)
    if gate.size == 0:  # no rows or no features: nothing to launch
        return gate
    return elementwise(lambda g, u: _glu_tile(g, u, activation), (gate, up), gate.dtype,
                       name="jspec_mosaic_glu", interpret=interpret)
