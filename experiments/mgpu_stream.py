"""Can a persistent Mosaic GPU kernel stream a Qwen3-0.6B draft forward at ~8-9 us a layer?

  python experiments/mgpu_stream.py --out=experiments/results        # H200

The floor study of a persistent draft forward's matvec phases, in Mosaic GPU. One
`plgpu.kernel` of P blocks (one per SM) walks the layers itself. Every layer has the
draft's five dependent steps with their weight bytes (qkv 8 MiB, attention 3 MiB: a
768-key cache's K and V, wo 4 MiB, gate/up 12 MiB, down 6 MiB), then the 1024 x 151,936
LM head (311 MB). A block's share of every step is a run of 16 KB weight tiles
(`--tile_rows` x 128 bf16), laid out contiguously a block, so the whole forward is one
stream of T tiles a block. The block keeps `--depth` tiles in flight in a shared-memory
ring (TMA, one mbarrier a slot): a slot is refilled with tile t + depth as soon as
tile t is used, so the loads run ahead across the steps' barriers, never waiting for an
activation (weights do not depend on it). What does wait is the use of a step's tiles:
each step ends with the exchange a persistent step needs (`mgpu_barrier.py
--kinds=exchange`: the block stores its result row by TMA, passes a grid barrier on a
global semaphore with gpu-scope atomics, and the next step loads `--read_rows` rows
back by TMA, 8 = 4 KB: a 1024-wide f32 activation) before it may use its tiles.

`--compute`: what a block does with a tile once it is in shared memory:
  none  nothing (the stream and the steps' synchronisation alone);
  fma   every weight read from shared memory into registers and multiply-added into an
        f32 accumulator with a factor from the step's activation (a matvec's reads and
        FMAs a weight, without its cross-lane sums), reduced to the row it stores.
Variants (flags, each a list to sweep): where the exchange's rows go (`--exchange`: TMA,
plain global stores and loads, or none: the barrier alone), when a used slot is refilled
(`--refill`), a second warpgroup issuing every load (`--producer`), barrier-separated
steps a layer (`--steps`: the draft's five, one, one a tile), L2 prefetches further ahead
than the ring (`--l2_ahead`), and each barrier replaced by a block-local delay with no
memory traffic (`--spin`: whether the stream goes on while a block waits).
The per-layer cost is the difference of the 28- and 14-layer kernels over 14 (medians
of the kernels' device times from a profiler trace); `stream` runs the same tiles with
no barrier and no exchange (the bytes alone); the full forward (28 layers + LM head) is
timed whole. It is a floor study of weight traffic and synchronisation: the values
computed are not the draft's (the draft's numerics never change jspec's output), and a
slot may be refilled while its last reads are still in flight under `fma` (values, not
timing, would differ). Writes `mgpu_stream[_tag].json`.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
from absl import app, flags
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from mgpu_sync import grid_barrier, restore  # noqa: E402
from receipts import write_receipt  # noqa: E402
from timing import copy_bandwidth, median_time  # noqa: E402
from trace_tools import device_events, traced  # noqa: E402

_DEPTHS = flags.DEFINE_list("depth", ["12"], "tiles in flight a block (ring slots)")
_COMPUTE = flags.DEFINE_list("compute", ["none"], "none | fma (module docstring)")
_BLOCKS = flags.DEFINE_string("blocks", "sms", "blocks: a number or 'sms' (the SM count)")
_ROWS = flags.DEFINE_integer("tile_rows", 64, "rows of a 128-wide bf16 weight tile")
_READ_ROWS = flags.DEFINE_integer("read_rows", 8, "f32 rows of 128 a step loads back")
_EXCHANGE = flags.DEFINE_list("exchange", ["none", "tma"], "how a step's rows move: tma (TMA store "
                               "and load), lsu (plain global stores and loads), none (the "
                               "barrier alone)")
_REFILL = flags.DEFINE_list("refill", ["early"], "when a used tile's slot is refilled: early "
                            "(as soon as it is used) or late (after the step's row is stored)")
_PRODUCER = flags.DEFINE_list("producer", ["0"], "0: the consuming warpgroup issues the "
                              "loads; 1: a second warpgroup does (compute none only)")
_STEPS = flags.DEFINE_list("steps", ["draft", "two", "one"], "barrier-separated steps a "
                           "layer: draft (its five), two, one, tile (one a tile): what a "
                           "barrier costs under the stream")
_L2_AHEAD = flags.DEFINE_list("l2_ahead", ["0"], "tiles ahead of use a block prefetches into "
                              "the L2 (0: none; else > depth)")
_SPIN = flags.DEFINE_list("spin", ["0"], "N > 0: each barrier replaced by N dependent "
                          "multiply-adds in the block (a delay without memory traffic)")
_SCOPE = flags.DEFINE_string("scope", "gpu", "memory scope of the barrier's atomics")
_LAYERS = flags.DEFINE_integer("layers", 28, "layers of the full forward (Qwen3-0.6B: 28)")
_ITERS = flags.DEFINE_integer("iters", 20, "timed calls per kernel (median)")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")

COLS = 128  # a tile's columns (bf16: 256 bytes, two 128-byte TMA rows)
SMEM_BYTES = 227 * 1024  # shared memory a block may use on an H100 / H200 (sm_90)
MIB = 1 << 20
STEPS = (("qkv", 8 * MIB), ("attention", 3 * MIB), ("wo", 4 * MIB), ("gate_up", 12 * MIB),
         ("down", 6 * MIB))  # a Qwen3-0.6B layer's five dependent steps and their bytes
HEAD_BYTES = 1024 * 151936 * 2
# us a layer a draft forward in today's kernel-per-op draft (bench_e2e, 2026-12-01)
DRAFT_LAYER_US_NOW = 28.0


def schedule(blocks: int, head: bool, tile_bytes: int) -> tuple[list[int], int]:
    """(tiles a block for each of a layer's steps, tiles a block for the LM head)."""
    per = [math.ceil(b / (blocks * tile_bytes)) for _, b in STEPS]
    return per, (math.ceil(HEAD_BYTES / (blocks * tile_bytes)) if head else 0)


def regroup(per: list[int], steps: str) -> list[int]:
    """A layer's tiles a block regrouped into barrier-separated steps: draft (the five
    steps), two (attention's three, then the MLP's two: the fewest grid-wide syncs a
    layer with clusters inside a head group), one (a single step a layer), tile (a step a
    tile)."""
    if steps == "draft":
        return per
    if steps == "two":
        return [sum(per[:3]), sum(per[3:])]
    if steps == "one":
        return [sum(per)]
    if steps == "tile":
        return [1] * sum(per)
    raise ValueError(f"steps must be draft, two, one or tile; got {steps!r}")


def stream_kernel(blocks: int, layers: int, head: bool, depth: int, compute: str, *,
                  rows: int = 64, read_rows: int = 8, scope: str = "gpu", sync: bool = True,
                  exchange: str = "tma", refill: str = "early", producer: bool = False,
                  steps: str = "draft", l2_ahead: int = 0, spin: int = 0):
    """A jitted fn(w [blocks, T, rows, COLS] bf16) -> (exchange buffer [2, blocks, COLS] f32,
    [blocks, COLS] f32 per-block result): one persistent forward's weight stream (module
    docstring); sync=False drops every barrier and exchange (the stream alone); producer:
    a second warpgroup issues every load (it waits for the slot's release by the first),
    so the thread that passes the grid barriers never issues a weight load; l2_ahead = A >
    depth: tile t + A is also prefetched into the L2 (TMA prefetch, no shared memory) as
    tile t is used, so the DRAM stream need not wait for the ring's slots; spin = N > 0:
    each grid barrier (and exchange) replaced by a block-local delay of N dependent
    multiply-adds, no memory traffic (does the stream go on while a block waits?)."""
    if compute not in ("none", "fma"):
        raise ValueError(f"compute must be none or fma; got {compute!r}")
    if exchange not in ("tma", "lsu", "none") or refill not in ("early", "late"):
        raise ValueError(f"exchange must be tma, lsu or none and refill early or late; "
                         f"got {exchange!r}, {refill!r}")
    if producer and (compute != "none" or refill != "early"):
        raise ValueError("producer runs with compute none (its sums over all axes are not "
                         "lowered with two warpgroups) and refill early")
    if not 1 <= read_rows <= min(blocks, 256):
        raise ValueError(f"read_rows must lie in [1, {min(blocks, 256)}]; got {read_rows}")
    per, head_tiles = schedule(blocks, head, rows * COLS * 2)
    per = regroup(per, steps)
    tpl = sum(per)
    total = layers * tpl + head_tiles
    depth = min(depth, total)
    smem = depth * rows * COLS * 2 + (read_rows + 1) * COLS * 4
    if smem > SMEM_BYTES:
        raise ValueError(f"the ring ({depth} x {rows * COLS * 2} B) and the exchange rows "
                         f"({read_rows + 1} x {COLS * 4} B) need {smem} B of shared memory, "
                         f"more than a block's {SMEM_BYTES}: lower --depth or --read_rows")
    if l2_ahead and l2_ahead <= depth:
        raise ValueError(f"l2_ahead must exceed depth ({depth}) or be 0; got {l2_ahead}")
    barrier = sync and not spin
    rounds = layers * len(per) if barrier else 0
    f32 = jnp.float32
    tile_layout = plgpu.Layout.WG_STRIDED((rows, COLS), 8)

    def body(w_ref, act_ref, res_ref, ring, bars, x_smem, row_smem, xbar, *consumed):
        block = lax.axis_index("x")
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR) if barrier else None
        done = pl.get_global(plgpu.SemaphoreType.REGULAR) if barrier else None
        consumed = consumed[0] if producer else None

        def refill_slot(t):
            """Releases tile t's slot: to the producer, or loads tile t + depth into it;
            [prefetches tile t + l2_ahead into the L2]."""
            if l2_ahead:
                @pl.when(t + l2_ahead < total)
                def _():
                    plgpu.async_prefetch(w_ref.at[block, t + l2_ahead])
            if producer:
                plgpu.barrier_arrive(consumed.at[lax.rem(t, depth)])
                return

            @pl.when(t + depth < total)
            def _():
                slot = lax.rem(t, depth)
                plgpu.copy_gmem_to_smem(w_ref.at[block, t + depth], ring.at[slot],
                                        bars.at[slot])

        def use(t, acc, s, now=True):
            """Waits for tile t, [multiply-adds it into acc], [refills its slot]."""
            slot = lax.rem(t, depth)
            plgpu.barrier_wait(bars.at[slot])
            if compute == "fma":
                w = plgpu.load(ring.at[slot], layout=tile_layout)
                acc = acc + w.astype(f32) * s
            if now:
                refill_slot(t)
            return acc

        def zeros():
            return plgpu.layout_cast(jnp.zeros((rows, COLS), f32), tile_layout)

        def row_of(acc, s):
            """The [COLS] row a step stores: its sum (fma) or its factor (none)."""
            return (jnp.sum(acc) if compute == "fma" else s) + jnp.zeros((COLS,), f32)

        def exchange_in(r):
            """After barrier r: load the first read_rows rows of the step's output; the
            step's factor: their sum (a [COLS] vector of the first row with a producer)."""
            if not sync or spin or exchange == "none":
                return jnp.float32(1.0)
            half = act_ref.at[lax.rem(r, 2)]
            if exchange == "tma":
                plgpu.copy_gmem_to_smem(half.at[pl.ds(0, read_rows)], x_smem, xbar.at[0])
                plgpu.barrier_wait(xbar.at[0])
                src = x_smem
            else:
                src = half.at[pl.ds(0, read_rows)]
            if producer:  # no sums over all axes with two warpgroups
                x = plgpu.load(src.at[0], layout=plgpu.Layout.WG_STRIDED((COLS,), 1))
                return x * 1e-6 + 1.0
            x = plgpu.load(src, layout=plgpu.Layout.WG_STRIDED((read_rows, COLS), 1))
            return jnp.sum(x) * 1e-6 + 1.0

        def exchange_out(r, row, refills):
            """Store this block's row, [refill the step's slots,] then pass barrier r."""
            row_smem[...] = row
            if spin:
                row_smem[...] = lax.fori_loop(0, spin, lambda i, x: x * 0.999 + 0.5,
                                              row + jnp.float32(r))
            elif sync and exchange == "tma":
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(row_smem, act_ref.at[lax.rem(r, 2), block])
                plgpu.wait_smem_to_gmem(0)
            elif sync and exchange == "lsu":
                act_ref[lax.rem(r, 2), block] = row
            for t in refills:
                refill_slot(t)
            if barrier:
                grid_barrier(sem, blocks, r, scope)

        def layer(li, s):
            t0 = li * tpl
            for k, n in enumerate(per):  # the five steps, unrolled
                r = li * len(per) + k
                off = sum(per[:k])
                acc = zeros() if compute == "fma" else None
                ts = [t0 + off + j for j in range(n)]
                for t in ts:
                    acc = use(t, acc, s, now=refill == "early")
                exchange_out(r, row_of(acc, s), ts if refill == "late" else [])
                s = exchange_in(r)
            return s

        def consume():
            s0 = (jnp.zeros((COLS,), f32) + 1.0 if producer and barrier and exchange != "none"
                  else jnp.float32(1.0))
            s = lax.fori_loop(0, layers, layer, s0)
            if head_tiles:
                def head_tile(j, acc):
                    return use(layers * tpl + j, acc, s)
                acc = lax.fori_loop(0, head_tiles, head_tile,
                                    zeros() if compute == "fma" else jnp.float32(0.0))
                row_smem[...] = row_of(acc if compute == "fma" else None, s)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(row_smem, res_ref.at[block])
            plgpu.wait_smem_to_gmem(0)
            if barrier:  # leave the semaphore at 0 for the next launch
                restore(sem, done, block, blocks, rounds, scope)

        if not producer:
            for i in range(depth):  # fill the ring
                plgpu.copy_gmem_to_smem(w_ref.at[block, i], ring.at[i], bars.at[i])
            consume()
            return
        wg = lax.axis_index("wg")

        @pl.when(wg == 1)
        def _():  # the producer: every load, each once its slot is released
            def load(t, carry):
                slot = lax.rem(t, depth)

                @pl.when(t >= depth)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])
                plgpu.copy_gmem_to_smem(w_ref.at[block, t], ring.at[slot], bars.at[slot])
                return carry
            lax.fori_loop(0, total, load, jnp.int32(0))

        pl.when(wg == 0)(consume)

    call = plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((2, blocks, COLS), f32),
                        jax.ShapeDtypeStruct((blocks, COLS), f32)),
        scratch_types=[plgpu.SMEM((depth, rows, COLS), jnp.bfloat16),
                       plgpu.Barrier(num_arrivals=1, num_barriers=depth),
                       plgpu.SMEM((read_rows, COLS), f32), plgpu.SMEM((COLS,), f32),
                       plgpu.Barrier(num_arrivals=1, num_barriers=1)]
        + ([plgpu.Barrier(num_arrivals=1, num_barriers=depth)] if producer else []),
        grid=(blocks,), grid_names=("x",), kernel_name="mgpu_stream",
        **(dict(num_threads=2, thread_name="wg") if producer else {}))
    return jax.jit(call), total


def weights(blocks: int, total: int, rows: int):
    """[blocks, total, rows, COLS] bf16 of small values (made on the device)."""
    return jnp.full((blocks, total, rows, COLS), 2.0 ** -10, jnp.bfloat16)


def device_seconds(fn, w, iters: int) -> tuple[float, float]:
    """(median device time of the kernel over `iters` traced calls, median host time):
    the device's own timeline, so neither launch nor host sync is in the first."""
    host = median_time(fn, w, iters=iters, warmup=2)
    with tempfile.TemporaryDirectory() as d:
        trace, _ = traced(lambda: [jax.block_until_ready(fn(w)) for _ in range(iters)], d)
    durs = [e["dur"] for e in device_events(trace) if "mgpu_stream" in e["name"]]
    if len(durs) < iters:  # the kernel's name not in the trace: its longest events
        durs = sorted(e["dur"] for e in device_events(trace))[-iters:]
    return (statistics.median(durs) * 1e-6 if durs else float("nan")), host


def measure(blocks: int, depth: int, compute: str, exchange: str, refill: str, layers: int,
            bw: float, stream: bool, producer: bool = False, steps: str = "draft",
            l2_ahead: int = 0, spin: int = 0) -> dict:
    """One variant's row: us a layer (28- minus 14-layer kernel), the full forward, and with
    `stream` the same tiles without barriers or exchanges."""
    rows = _ROWS.value
    tile = rows * COLS * 2
    per, head_tiles = schedule(blocks, True, tile)
    layer_bytes = blocks * sum(per) * tile
    kw = dict(rows=rows, read_rows=_READ_ROWS.value, scope=_SCOPE.value, exchange=exchange,
              refill=refill, producer=producer, steps=steps, l2_ahead=l2_ahead, spin=spin)
    half = layers // 2
    kernels = {"full": (layers, True, True), "layers": (layers, False, True),
               "half": (half, False, True)}
    if stream:
        kernels.update(stream=(layers, False, False), stream_half=(half, False, False))
    times, host = {}, {}
    for name, (n, head, sync) in kernels.items():
        fn, total = stream_kernel(blocks, n, head, depth, compute, sync=sync, **kw)
        w = weights(blocks, total, rows)
        times[name], host[name] = device_seconds(fn, w, _ITERS.value)
        del w
    us_layer = (times["layers"] - times["half"]) / (layers - half) * 1e6
    row = {"blocks": blocks, "depth": depth, "compute": compute, "exchange": exchange,
           "refill": refill, "producer": producer, "steps": steps, "l2_ahead": l2_ahead,
           "spin": spin,
           "barriers_a_layer": len(regroup(per, steps)), "read_rows": _READ_ROWS.value,
           "tile_bytes": tile,
           "tiles_a_layer_a_block": per, "head_tiles_a_block": head_tiles,
           "layer_bytes": layer_bytes, "seconds": times, "host_seconds": host,
           "us_a_layer": us_layer, "layer_tb_s": layer_bytes / us_layer / 1e6,
           "fraction_of_copy_bandwidth": layer_bytes / (us_layer * 1e-6) / bw,
           "full_forward_us": times["full"] * 1e6}
    extra = ""
    if stream:
        row["us_a_layer_stream_only"] = (times["stream"] - times["stream_half"]) / (
            layers - half) * 1e6
        extra = f"  stream only {row['us_a_layer_stream_only']:6.2f}"
    print(f"{compute:4s} depth {depth:2d} exchange {exchange:4s} refill {refill:5s} "
          f"{'producer ' if producer else ''}{'' if steps == 'draft' else 'steps ' + steps + ' '}"
          f"{f'l2 {l2_ahead} ' if l2_ahead else ''}{f'spin {spin} ' if spin else ''}"
          f"{us_layer:6.2f} us a layer ({row['layer_tb_s']:.2f} TB/s, "
          f"{row['fraction_of_copy_bandwidth']:.0%} of copy)  full forward "
          f"{times['full'] * 1e6:7.1f} us{extra}", flush=True)
    return row


def main(_):
    sms = jax.devices()[0].core_count
    blocks = sms if _BLOCKS.value == "sms" else int(_BLOCKS.value)
    if not 1 <= blocks <= sms:
        raise ValueError(f"--blocks must lie in [1, {sms}] (one resident block an SM); "
                         f"got {blocks}")
    bw = copy_bandwidth(iters=5)
    print(f"{jax.devices()[0].device_kind}: {sms} SMs, copy bandwidth {bw / 1e12:.2f} TB/s; "
          f"today's draft ~{DRAFT_LAYER_US_NOW:.0f} us a layer, 2.3x needs ~12", flush=True)
    rows = []
    for c in _COMPUTE.value:
        for d in _DEPTHS.value:
            variants = [(x, r, p == "1", st, int(a), int(n)) for n in _SPIN.value
                        for a in _L2_AHEAD.value for st in _STEPS.value
                        for p in _PRODUCER.value for x in _EXCHANGE.value for r in _REFILL.value]
            for i, (x, r, p, st, a, n) in enumerate(variants):
                if (p and (c != "none" or r != "early")) or (a and a <= int(d)):
                    continue
                rows.append(measure(blocks, int(d), c, x, r, _LAYERS.value, bw,
                                    stream=i == 0, producer=p, steps=st, l2_ahead=a, spin=n))
    path = write_receipt(_OUT.value, "mgpu_stream", _TAG.value,
                         {"command": " ".join(["python3"] + sys.argv),
                          "device": jax.devices()[0].device_kind, "sms": sms,
                          "jax": jax.__version__, "copy_bandwidth": bw,
                          "iters": _ITERS.value, "results": rows})
    print("receipt:", path)


if __name__ == "__main__":
    app.run(main)
