"""Timing helpers of the benchmarks: warm-up first, then medians.

`timed` needs neither jax nor torch (the caller's `fn` must block until its
work is done); `median_time` and `copy_bandwidth` block on jax arrays.
"""

from __future__ import annotations

import statistics
import time


def timed(fn, iters: int):
    """(output of the last call, median seconds of `iters` calls after one warm-up)."""
    out = fn()  # warm-up (compiles)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return out, statistics.median(ts)


def median_time(fn, *args, iters: int, warmup: int = 3) -> float:
    """Median seconds of fn(*args) with `jax.block_until_ready`, after `warmup` calls."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def copy_bandwidth(iters: int, reps: int = 8) -> float:
    """Bytes read + written per second by `a + 1` over a large f32 array on the device
    (4 GiB on an accelerator, 4 MiB on a CPU, where the figure is only a smoke test).

    One timed call runs `reps` passes in a device-side loop, so the host's dispatch and
    sync (small against a pass) stay out of the figure, as they do for the device-side
    step loops it is compared with."""
    import jax
    import jax.numpy as jnp

    n = (1 << 30) if jax.default_backend() != "cpu" else (1 << 20)
    x = jnp.arange(n, dtype=jnp.float32)
    fn = jax.jit(lambda a: jax.lax.fori_loop(0, reps, lambda i, b: b + 1.0, a))
    t = median_time(fn, x, iters=max(iters, 5))
    del x
    return 2 * 4 * n * reps / t
