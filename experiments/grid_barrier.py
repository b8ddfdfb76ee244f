"""A grid-wide barrier for persistent Pallas (Triton) kernels, in two polling variants.

All `programs` programs of the kernel must be resident at once (a barrier waits for
every one of them). Barrier `idx` uses its own int32 counter `bar_ref[idx]`, zero at
launch: each program arrives once (after a CTA-wide sync, so its threads' earlier
writes are ordered before the arrival; Triton runs a scalar atomic on one thread, with
acquire/release semantics at GPU scope), then waits until the count reaches
`programs`, acquires, and syncs its threads again.

spin="atomic" (the default) polls with the acquire RMW itself (an atomic add of 0);
spin="volatile" polls with volatile loads and acquires once after. On the H200
(`barrier_check.py`, 2026-11-30g) only the atomic poll orders memory: with volatile
polling ~99% of a stress test's rounds read stale rows, with atomic polling none in
528,000 (interpret mode, which cannot discharge an atomic inside a loop, polls with
loads either way).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

SPINS = ("atomic", "volatile")


def grid_barrier(bar_ref, idx, programs: int, *, interpret: bool, spin: str = "atomic"):
    """All programs reach barrier idx before any passes it; every program's writes before
    it are visible to every program after it. (Interpret mode runs one thread per
    program and the programs one after another: only programs == 1 can pass.)"""
    if spin not in SPINS:
        raise ValueError(f"spin={spin!r}; expected one of {SPINS}")
    if not interpret:
        plgpu.debug_barrier()
    plgpu.atomic_add(bar_ref, (idx,), jnp.int32(1))
    if spin == "volatile" or interpret:  # (interpret mode discharges no RMW in a loop)
        def poll():
            return plgpu.load(bar_ref.at[idx], volatile=True)
    else:
        def poll():
            return plgpu.atomic_add(bar_ref, (idx,), jnp.int32(0))
    lax.while_loop(lambda v: v < programs, lambda v: poll(), poll())
    plgpu.atomic_add(bar_ref, (idx,), jnp.int32(0))  # acquire
    if not interpret:
        plgpu.debug_barrier()
