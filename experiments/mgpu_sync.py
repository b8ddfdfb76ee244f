"""Grid-wide synchronisation for persistent Mosaic GPU kernels (no flags: importable by
every experiment script).

A barrier is one global semaphore (`pl.get_global`) that only grows: barrier r has every
block add 1 and wait, without decrement, until it reads blocks x (r + 1). At the end of
the kernel `restore` brings it back to 0, since global semaphores persist from launch to
launch. Used by `mgpu_barrier.py` (the barrier alone and with a step's exchange) and
`mgpu_stream.py` (a persistent forward's weight stream).
"""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def grid_barrier(sem, blocks: int, r, scope: str):
    """Barrier r: arrive (add 1), then wait until all blocks have arrived r + 1 times."""
    plgpu.semaphore_signal(sem, 1, memory_scope=scope)
    plgpu.semaphore_wait(sem, blocks * (r + 1), decrement=False, memory_scope=scope)


def restore(sem, done, block, blocks: int, rounds: int, scope: str):
    """After the last barrier: block 0 waits for every other block's exit signal (which
    leaves `done` at 0) and takes blocks x rounds off `sem` (0 again for the next launch)."""

    @pl.when(block != 0)
    def _():
        plgpu.semaphore_signal(done, 1, memory_scope=scope)

    @pl.when(block == 0)
    def _():
        plgpu.semaphore_wait(done, blocks - 1, memory_scope=scope)
        plgpu.semaphore_signal(sem, -blocks * rounds, memory_scope=scope)
