"""Warm-up: compile what a speculative run will run, before the run.

A jitted program compiles on its first call with new shapes. A plain run meets that once,
in its prefill and its first round. An adaptive run (`jspec.Adaptive`) meets it again at
each round shape's first chunk, and a compacted run (`SpecConfig(compact=True)`) at each
batch size it continues in, for every shape, and at each pair of sizes it compacts
between: programs that compile in the middle of a timed run, at sizes and shapes that
depend on when rows finish and on which shape the controller picks.

`warm_up` compiles them all ahead: the prefill at the run's batch and prompt bucket; the
round loop of every shape (the adaptive shapes, else the chain or tree) at the batch and,
with compaction, at every power of two below it that a compaction can reach; and the
compaction programs between each pair of those sizes. Each loop runs one round on a
throwaway state of that size, so the programs are the run's own (the jit caches are keyed
by the same shapes and static config) and each has run once: on a GPU a program's first
execution loads its kernels, milliseconds that a chunk of no rounds (the loop's body never
entered) would leave to the run's first round of that shape, where `Adaptive` times its
probe.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec import compaction
from jspec._checks import check_bool
from jspec.adaptive import shape_name
from jspec.compaction import batch_for, compact
from jspec.loop import token_bar
from jspec.spec_config import SpecConfig, shape_spec
from jspec.speculative import _cache_size, _prefill_jit, _setup, spec_loop


def compaction_sizes(batch: int) -> list[int]:
    """The batch sizes a compacted run of `batch` rows can continue in: every power of
    two up to batch_for(batch // 2), descending (none for one row)."""
    if batch <= 1:
        return []
    top = batch_for(batch // 2)
    return [1 << k for k in range(top.bit_length() - 1, -1, -1)]


def _fresh(state):
    """A copy of every buffer: a loop donates its state, and a cut state shares buffers
    with the one it was cut from."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), state)


def _first(state, drafter, n: int):
    """The first n rows as a state of n rows; `state` is kept."""
    idx = np.arange(n, dtype=np.int32)
    return compact(state, drafter, idx, idx, consume=False)


def _compile_sizes(state, drafter, B: int, sizes: list[int], loops):
    """Every shape's loop at the batch and each size, and every compaction pair (from, to)
    between them; returns the batch's state."""
    state = loops(state, B)
    if sizes:
        compaction.check_batch_major(drafter, state.draft, B)
    for i, frm in enumerate([B] + sizes):
        source = state if i == 0 else _first(state, drafter, frm)
        for to in sizes[i:]:
            small = _first(source, drafter, to)
            if i == 0:  # each size's loops once
                loops(_fresh(small), to)
            del small
        del source
    return state


def warm_up(target, drafter, prompts, spec: SpecConfig, *, max_len: int | None = None,
            progress: bool = False) -> dict:
    """Compiles what `speculative_generate(target, drafter, prompts, spec,
    max_len=max_len)` runs, so that the run compiles nothing (see the module docstring).
    For `speculative_generate`; a stream (`speculative_stream`) runs other programs.

    The prompts fix the batch and the prompt bucket, as they do for the run; their tokens
    do not matter. progress=True shows a bar of the loops compiled. Returns {"seconds",
    "programs" (newly compiled round loops and compaction programs; -1 where jax does not
    count), "batch_sizes", "shapes" (names)}.
    """
    check_bool("progress", progress)
    t0 = time.perf_counter()
    tokens, lens, max_len, spec = _setup(target, drafter, prompts, spec, max_len)
    compacting, adaptive = spec.compact, spec.adaptive
    seed, spec = jnp.int32(spec.seed), spec.static()
    shapes = adaptive.shapes if adaptive is not None else (None,)
    specs = {s: (shape_spec(spec, s) if s is not None else spec) for s in shapes}
    B = len(lens)
    counted = (spec_loop, compaction._compact, compaction._take)
    before = [_cache_size(f) for f in counted]

    state = _prefill_jit(target, drafter, jnp.asarray(tokens), jnp.asarray(lens), seed,
                    spec=spec, max_len=max_len)
    sizes = compaction_sizes(B) if compacting else []
    done = [0]
    with token_bar(progress, len(specs) * (1 + len(sizes)), "warm-up", "loop") as update:

        def loops(state, size):  # every shape's loop at this size, one round each
            floor = np.int32(size // 2) if compacting else None
            for one in specs.values():
                state = spec_loop(target, drafter, state, seed, np.int32(state.step + 1),
                                  floor, spec=one)
                jax.block_until_ready(state)
                done[0] += 1
                update(done[0])
            return state

        state = _compile_sizes(state, drafter, B, sizes, loops)
    after = [_cache_size(f) for f in counted]
    grown = sum(a - b for a, b in zip(after, before, strict=True))
    programs = -1 if min(before + after) < 0 else grown
    del state
    return {"seconds": time.perf_counter() - t0, "programs": int(programs),
            "batch_sizes": [B] + sizes,
            "shapes": [shape_name(s) if s is not None else "tree" if spec.tree is not None
                       else f"gamma{spec.gamma}" for s in shapes]}
