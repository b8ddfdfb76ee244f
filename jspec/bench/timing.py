"""Timing helpers of the benchmarks: warm-up first, then medians.

`timed` needs neither jax nor torch (the caller's `fn` must block until its
work is done); `median_time` and `copy_bandwidth` block on jax arrays;
`side_by_side` times the text entry points' runs (serial and speculative) alternately
from the engine's own timings (`run_seconds`); `dependent_launches` and `device_steps`
are device-side loops to time.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from jspec.cache import rollback
from jspec.model import COMPILER_OPTIONS, apply


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


def run_seconds(stats: dict) -> float:
    """A jspec run's prefill + loop seconds, from its statistics (`tokens / tokens_per_s`:
    the engine's own timing, without the host's text handling)."""
    return stats["tokens"] / max(stats["tokens_per_s"], 1e-9)


def side_by_side(runs: dict, shapes: dict[str, set], n: int) -> dict:
    """Each kind's run() -> an output with jspec `stats` (`TextOutput`, `SpecOutput`),
    timed side by side: a shape's first run (it compiled the programs; the shape is the
    stats' (prompt_bucket, max_len), recorded in `shapes[kind]`) is left out, then the
    kinds' runs alternate until each has `n`, so a changing machine load favours neither;
    returns each kind's run of median time."""
    n, outs = max(n, 1), {}
    for kind, run in runs.items():
        out = run()
        key = (out.stats["prompt_bucket"], out.stats["max_len"])
        outs[kind] = [out] if key in shapes[kind] else []
        shapes[kind].add(key)
    while any(len(o) < n for o in outs.values()):
        for kind, run in runs.items():
            if len(outs[kind]) < n:
                outs[kind].append(run())
    return {kind: sorted(o, key=lambda x: run_seconds(x.stats))[(len(o) - 1) // 2]
            for kind, o in outs.items()}


def dependent_launches(fn, reps: int, carry: int = 0):
    """loop(*args): `reps` calls of fn(*args) in one jitted loop, each depending on the one
    before (the first element of its first output, times zero, is added to args[carry]),
    so no call is merged with another or hoisted out; returns the sum of those elements.
    Time it with `median_time` and divide by reps: a few-us kernel's time a launch."""
    @jax.jit
    def loop(*args):
        def body(_, state):
            x, acc = state
            out = fn(*args[:carry], x, *args[carry + 1:])
            first = jax.tree.leaves(out)[0].reshape(-1)[0].astype(jnp.float32)
            return x + (first * 0.0).astype(x.dtype), acc + first
        return jax.lax.fori_loop(0, reps, body, (args[carry], jnp.float32(0)))[1]
    return loop


STEP_REPS = 10  # forward steps per timed device-side loop (`device_steps`)


@functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
def device_steps(model, tokens, cache):
    """STEP_REPS forwards of tokens [B, T] on the same cache, in one lax.fori_loop (time it
    with `median_time` and divide by STEP_REPS: one dispatch, no host sync between steps)."""
    lengths = cache.lengths

    def body(_, carry):
        c, acc = carry
        logits, c = apply(model, tokens, c)
        return rollback(c, lengths), acc + logits[0, -1, 0]

    return jax.lax.fori_loop(0, STEP_REPS, body, (cache, jnp.float32(0)))[1]


SPEC_PEAKS_FILE = os.path.join(os.path.dirname(__file__), "spec_peaks.json")


def spec_peaks(kind: str | None = None) -> tuple[float, float, str]:
    """(bf16 FLOP/s, HBM bytes/s, name) of `kind` (default: the first device's
    `device_kind`) from the cards of SPEC_PEAKS_FILE (a substring of the kind, the first
    match wins); an unlisted device gets the file's assumed card, its name saying so, so
    a roofline fraction always names the card it is a fraction of."""
    kind = jax.devices()[0].device_kind if kind is None else kind
    with open(SPEC_PEAKS_FILE) as f:
        table = json.load(f)
    cards = {c["name"]: c for c in table["cards"]}
    name = next((n for n in cards if n.lower() in kind.lower()), None)
    card = cards[name or table["assumed"]]
    label = name or f"{table['assumed']} (assumed: {kind} is not in spec_peaks.json)"
    return float(card["bf16_flops"]), float(card["hbm_bytes_per_s"]), label
