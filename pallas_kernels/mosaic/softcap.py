"""Row-invariant logit soft-capping on Mosaic GPU: y = tanh(x / cap) * cap, in f32.

The Mosaic GPU lowering of `pallas_kernels/softcap.py` (Gemma 2's and Gemma 3 text's
final logits), through `mosaic/elementwise.py`: elementwise, so no order to fix; every
logit runs the same f32 division, tanh and product, and its bits depend on its value and
`cap` only (R1, R2). The two lowerings' tanh are each their own (R11): this one's bits
may differ from the Triton kernel's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.mosaic.elementwise import elementwise
from pallas_kernels.softcap import _check_args, softcap_reference

__all__ = ["softcap", "softcap_reference"]


@functools.partial(jax.jit, static_argnames=("cap", "interpret"))
def softcap(x: jax.Array, cap: float, *, interpret: bool = False) -> jax.Array:
    """tanh(x / cap) * cap for x [M, N] float32, on Mosaic GPU. `interpret`: Pallas's GPU
    interpret mode (CPU)."""
    _check_args(x, cap)
    if x.size == 0:
        return x

    def capped(b):  # the cap made inside the kernel: a constant, not a captured array
        k = jnp.float32(cap)
        return jnp.tanh(b / k) * k

    return elementwise(capped, (x,), jnp.float32, name="jspec_mosaic_softcap",
                       interpret=interpret)
