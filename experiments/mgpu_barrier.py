"""What one grid-wide barrier costs in a Mosaic GPU kernel on this GPU.

  python experiments/mgpu_barrier.py --out=experiments/results      # H200

A persistent draft forward would separate its dependent steps (five a layer) by grid
barriers; `barrier_check.py` measured Triton's (1.76 us a round at 132 programs, with a
row written and every row read back). This is the Mosaic GPU one, alone: one
`plgpu.kernel` of P blocks (all resident: P up to the SM count x 2) runs R rounds; in
round r every block signals one global semaphore (`pl.get_global`) and waits until it
reads P x (r + 1) (no decrement: the counter only grows), so no block starts round r + 1
before every block has arrived at round r. At the end block 0 waits for the other
blocks' exit signals and subtracts P x R, leaving the semaphore at 0 for the next launch
(global semaphores persist across launches). A round's cost is the difference of two
kernels' times (2R and R rounds, medians of --iters host-timed calls each, so launch and
host costs cancel) over R. Both memory scopes of the atomics ("gpu", "sys"). With
`--kinds=exchange` each round also moves data as a persistent step must: every block
stores a row by TMA, passes the barrier, loads all rows back by TMA and checks their sum
(`barrier_check.py`'s test, Mosaic GPU's fences), so its cost is a step's floor and its
bad rounds say whether the barrier orders TMA traffic. Writes `mgpu_barrier[_tag].json`.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from mgpu_sync import grid_barrier, restore  # noqa: E402
from receipts import write_receipt  # noqa: E402
from timing import median_time  # noqa: E402

_BLOCKS = flags.DEFINE_list("blocks", ["sms", "2sms"], "blocks per kernel: a number, "
                            "'sms' (the SM count) or '2sms'")
_SCOPES = flags.DEFINE_list("scopes", ["gpu", "sys"], "memory scopes of the atomics")
_KINDS = flags.DEFINE_list("kinds", ["barrier", "exchange"], "barrier: the barrier alone; "
                           "exchange: each round also stores a row and loads all rows back "
                           "(TMA), checked (blocks <= 256: one TMA box)")
_READ_ROWS = flags.DEFINE_list("read_rows", ["all"], "exchange: rows loaded back a round "
                               "('all', or a number: 8 = 4 KB, a 1024-wide f32 vector)")
_ROUNDS = flags.DEFINE_integer("rounds", 2000, "R: barriers in the shorter kernel")
_ITERS = flags.DEFINE_integer("iters", 20, "timed calls per kernel (median)")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")


def barrier_kernel(blocks: int, rounds: int, scope: str):
    """() -> [128] f32 (block 0 writes `rounds`): `rounds` grid barriers of `blocks`."""

    def body(out_ref):
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
        done = pl.get_global(plgpu.SemaphoreType.REGULAR)
        block = lax.axis_index("x")

        def one_round(r, carry):
            grid_barrier(sem, blocks, r, scope)
            return carry

        lax.fori_loop(0, rounds, one_round, jnp.int32(0))
        restore(sem, done, block, blocks, rounds, scope)

        @pl.when(block == 0)
        def _():  # after the restore: the kernel ran to its end
            out_ref[...] = jnp.full((128,), float(rounds), jnp.float32)

    return jax.jit(plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
                                grid=(blocks,), grid_names=("x",)))


def exchange_kernel(blocks: int, rounds: int, scope: str, read_rows: int | None = None):
    """() -> (buffer [2, blocks, 128], bad rounds [blocks, 128] f32): `rounds` barriers of
    `blocks`, each round with a data exchange, as `barrier_check.py` does for Triton:
    block b stores the row (r mod 7) x 1000 + b into half r mod 2 of a buffer (SMEM -> GMEM
    by TMA), passes barrier r, loads the whole half back (TMA) and compares the column sums
    with the exact one; every lane counts its bad rounds. (Half r mod 2: a block can only
    store round r + 2's row after every block has arrived at barrier r + 1, i.e. has
    loaded round r's half.) `read_rows`: load and check only the first rows (all: None),
    e.g. 8 rows = 4 KB, a 1024-wide f32 activation."""
    width = 128
    n = blocks if read_rows is None else read_rows
    if not 1 <= n <= min(blocks, 256):
        raise ValueError(f"read_rows must lie in [1, {min(blocks, 256)}]; got {n}")
    total = float(n * (n - 1) // 2)

    def body(buf_ref, bad_ref, row_smem, all_smem, bad_smem, tma_bar):
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
        done = pl.get_global(plgpu.SemaphoreType.REGULAR)
        block = lax.axis_index("x")
        bad_smem[...] = jnp.zeros((width,), jnp.float32)

        def one_round(r, carry):
            half = lax.rem(r, 2)
            tag = lax.rem(r, 7).astype(jnp.float32) * 1000.0
            row_smem[...] = jnp.full((width,), tag + block.astype(jnp.float32), jnp.float32)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(row_smem, buf_ref.at[half, block])
            plgpu.wait_smem_to_gmem(0)
            grid_barrier(sem, blocks, r, scope)
            plgpu.copy_gmem_to_smem(buf_ref.at[half, pl.ds(0, n)], all_smem, tma_bar)
            plgpu.barrier_wait(tma_bar)
            acc = jnp.zeros((width,), jnp.float32)
            for i in range(n):
                acc = acc + all_smem[i]
            want = jnp.full((width,), tag * n + total, jnp.float32)
            bad_smem[...] = bad_smem[...] + jnp.where(acc != want, 1.0, 0.0)
            return carry

        lax.fori_loop(0, rounds, one_round, jnp.int32(0))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(bad_smem, bad_ref.at[block])
        plgpu.wait_smem_to_gmem(0)
        restore(sem, done, block, blocks, rounds, scope)

    f32 = jnp.float32
    return jax.jit(plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((2, blocks, width), f32),
                        jax.ShapeDtypeStruct((blocks, width), f32)),
        scratch_types=[plgpu.SMEM((width,), f32), plgpu.SMEM((n, width), f32),
                       plgpu.SMEM((width,), f32), plgpu.Barrier()],
        grid=(blocks,), grid_names=("x",)))


def measure(kind: str, blocks: int, scope: str, R: int, read_rows: int | None) -> dict:
    if kind == "barrier":
        short, long_ = barrier_kernel(blocks, R, scope), barrier_kernel(blocks, 2 * R, scope)
    else:
        short, long_ = (exchange_kernel(blocks, r, scope, read_rows) for r in (R, 2 * R))
    t1, t2 = (median_time(k, iters=_ITERS.value, warmup=1) for k in (short, long_))
    row = {"kind": kind, "blocks": blocks, "scope": scope, "rounds": [R, 2 * R],
           "read_rows": read_rows or (blocks if kind == "exchange" else 0),
           "seconds": [t1, t2], "us_per_round": (t2 - t1) / R * 1e6}
    if kind == "barrier":
        outs = [float(np.asarray(k())[0]) for k in (short, long_)]
        row["ran_to_the_end"] = outs == [float(R), float(2 * R)]
        check = f"ran to the end: {row['ran_to_the_end']}"
    else:  # every lane of every block counts its bad rounds: all must be 0
        bad = [np.asarray(k()[1]) for k in (short, long_)]
        row["bad_lane_rounds"] = [int(x.sum()) for x in bad]
        check = (f"reads {row['read_rows']} rows; bad lane-rounds {row['bad_lane_rounds']} "
                 f"of {blocks * 128 * R} / {blocks * 256 * R}")
    print(f"{kind:8s} {blocks:4d} blocks  scope {scope:3s}  {row['us_per_round']:6.3f} us a round"
          f"  (kernel {t1 * 1e3:.3f} / {t2 * 1e3:.3f} ms; {check})", flush=True)
    return row


def main(_):
    sms = jax.devices()[0].core_count
    rows = []
    unknown = sorted(set(_KINDS.value) - {"barrier", "exchange"})
    if unknown:
        raise ValueError(f"--kinds: unknown {unknown}")
    for kind in _KINDS.value:
        for b in _BLOCKS.value:
            blocks = sms if b == "sms" else 2 * sms if b == "2sms" else int(b)
            if blocks < 1:
                raise ValueError(f"--blocks: {b} gives {blocks} blocks")
            if kind == "exchange" and blocks > 256:
                print(f"exchange: {blocks} blocks skipped (one TMA box holds 256 rows)")
                continue
            for scope in _SCOPES.value:
                for rr in _READ_ROWS.value if kind == "exchange" else ["all"]:
                    n = None if rr == "all" else int(rr)
                    rows.append(measure(kind, blocks, scope, _ROUNDS.value, n))
    path = write_receipt(_OUT.value, "mgpu_barrier", _TAG.value,
                         {"command": " ".join(["python3"] + sys.argv),
                          "device": jax.devices()[0].device_kind, "sms": sms,
                          "jax": jax.__version__, "iters": _ITERS.value, "results": rows})
    print("receipt:", path)


if __name__ == "__main__":
    app.run(main)
