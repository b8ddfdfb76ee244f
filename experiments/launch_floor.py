"""The floor under a latency-bound forward: what a chain of dependent kernels costs.

  python experiments/launch_floor.py --out=experiments/results           # H200
  python experiments/launch_floor.py --interpret --mb=0,1 --chain=4 --out=/tmp  # CPU smoke

A B=1 draft forward (Qwen3-0.6B: 28 layers, ~31 MB of weights a layer) is a chain of
kernels each of which must wait for the one before. Its time is bounded below by
(kernels in the chain) x (the cost of one kernel that reads its share of the weights),
whatever the kernels compute. This script measures that cost: for each size in --mb it
jits a chain of --chain Pallas kernels, each streaming its own weight array of that
size (distinct arrays, so nothing is served from the L2) with enough programs to fill
the GPU and passing a value on to the next kernel (a true dependency), and reads the
device time of the chain from a profiler trace. Size 0 is an empty kernel: the launch
and drain alone. Writes `launch_floor.json` (per kind and size: us per kernel,
effective TB/s) and prints a table.

Kinds (`--kinds`), measured side by side in one run:
- `triton`: Pallas on Triton, `--block_rows` x 1024 weight rows a program (jspec's kernels
  are of this kind);
- `mgpu`: Pallas on Mosaic GPU, one 128-thread block per `--mgpu_tile_rows` x 256 weight
  tile, copied into shared memory by the TMA;
- `mgpu_pdl`: the same kernel with programmatic dependent launch: it issues its weight
  copy, lets the next kernel launch (`griddepcontrol.launch_dependents`) and only then
  waits for the previous kernel (`griddepcontrol.wait`) before it reads that kernel's
  output. Kernels of a chain may then overlap their launch and their weight streaming
  with the kernel before. (Interpret mode has no grid dependencies: it leaves the two
  instructions out.)
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from timing import median_time  # noqa: E402
from trace_tools import device_events, summarize, traced  # noqa: E402

from pallas_kernels._common import triton_params  # noqa: E402

_MB = flags.DEFINE_list("mb", ["0", "1", "2", "4", "8", "16"], "weight MB read per kernel")
_KINDS = flags.DEFINE_list("kinds", ["triton", "mgpu", "mgpu_pdl"],
                           "kernel kinds: triton, mgpu, mgpu_pdl")
_MGPU_ROWS = flags.DEFINE_integer("mgpu_tile_rows", 32, "Mosaic GPU: weight rows a block "
                                  "(x 256 columns)")
_CHAIN = flags.DEFINE_integer("chain", 64, "dependent kernels per chain")
_ROWS = flags.DEFINE_integer("block_rows", 16, "weight rows per program (x 1024 columns)")
_ITERS = flags.DEFINE_integer("iters", 5, "traced chains per size")
_INTERPRET = flags.DEFINE_bool("interpret", False, "CPU smoke run (timings mean nothing)")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")

COLS = 1024
KINDS = ("triton", "mgpu", "mgpu_pdl")
MGPU_COLS, MGPU_VEC = 256, 128  # weight tile columns; floats passed from kernel to kernel


def _read_kernel(prev_ref, w_ref, o_ref):
    """o[1, COLS] = prev's first row + the column sums of this program's weight block."""
    s = jnp.sum(w_ref[...].astype(jnp.float32), axis=0, keepdims=True)  # [1, COLS]
    o_ref[...] = s + prev_ref[...]


def _empty_kernel(prev_ref, o_ref):
    o_ref[...] = prev_ref[...] + 1.0


@functools.partial(jax.jit, static_argnames=("interpret",))
def chain(ws, prev, *, interpret: bool):
    """ws: C separate [R, COLS] bf16 arrays (R = 0: empty kernels; separate buffers, since
    a slice of one stacked array would be copied out first), prev [P, COLS] f32 ->
    [P', COLS] f32 after C dependent kernels (each reads the previous one's first row)."""
    for w in ws:
        if w.shape[0] == 0:
            prev = pl.pallas_call(
                _empty_kernel,
                in_specs=[pl.BlockSpec((1, COLS), lambda: (0, 0))],
                out_specs=pl.BlockSpec((1, COLS), lambda: (0, 0)),
                out_shape=jax.ShapeDtypeStruct((1, COLS), jnp.float32),
                interpret=interpret, name="floor_empty")(prev)
            continue
        rows = w.shape[0]
        br = min(_ROWS.value, rows)
        out = pl.pallas_call(
            _read_kernel,
            grid=(rows // br,),
            in_specs=[pl.BlockSpec((1, COLS), lambda i: (0, 0)),
                      pl.BlockSpec((br, COLS), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((1, COLS), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct((rows // br, COLS), jnp.float32),
            compiler_params=triton_params(4, 1),
            interpret=interpret,
            name="floor_read",
        )(prev, w)  # [programs, COLS]
        prev = out  # the next kernel reads its first row: a true dependency, no glue
    return prev


def _mgpu_body(pdl: bool, interpret: bool, empty: bool):
    """One block: copy its weight tile into shared memory (TMA), [let the next kernel
    launch, wait for the previous one,] read the previous kernel's first row, and write
    that row plus the sum of the tile's first row as this block's row of the output."""
    def body(prev_ref, *refs):
        if empty:
            o_ref, p_smem, o_smem, bar = refs
        else:
            w_ref, o_ref, w_smem, p_smem, o_smem, bar = refs
        pid = jax.lax.axis_index("p")
        if not empty:
            plgpu.copy_gmem_to_smem(w_ref.at[pid], w_smem, bar.at[0])
        if pdl and not interpret:
            plgpu.griddepcontrol_launch_dependents()
            plgpu.griddepcontrol_wait()
        plgpu.copy_gmem_to_smem(prev_ref.at[0], p_smem, bar.at[1])
        plgpu.barrier_wait(bar.at[1])
        p = plgpu.load(p_smem, layout=plgpu.Layout.WG_STRIDED((MGPU_VEC,), 1))
        if not empty:
            plgpu.barrier_wait(bar.at[0])
            row = plgpu.load(w_smem.at[0], layout=plgpu.Layout.WG_STRIDED((MGPU_COLS,), 2))
            p = p + jnp.sum(row.astype(jnp.float32))
        o_smem[...] = p
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[pid])
        plgpu.wait_smem_to_gmem(0)
    return body


@functools.partial(jax.jit, static_argnames=("pdl", "interpret"))
def mgpu_chain(ws, prev, *, pdl: bool, interpret: bool):
    """ws: C separate [P, R, MGPU_COLS] bf16 arrays (P blocks; P = 0: empty kernels),
    prev [P', MGPU_VEC] f32 -> [P'', MGPU_VEC] f32 after C dependent Mosaic GPU kernels."""
    ip = plgpu.InterpretGPUParams() if interpret else None
    for w in ws:
        blocks, rows = max(w.shape[0], 1), w.shape[1]
        empty = w.shape[0] == 0
        scratch = [] if empty else [plgpu.SMEM((rows, MGPU_COLS), jnp.bfloat16)]
        scratch += [plgpu.SMEM((MGPU_VEC,), jnp.float32), plgpu.SMEM((MGPU_VEC,), jnp.float32),
                    plgpu.Barrier(num_arrivals=1, num_barriers=2)]
        call = plgpu.kernel(
            _mgpu_body(pdl, interpret, empty),
            out_type=jax.ShapeDtypeStruct((blocks, MGPU_VEC), jnp.float32),
            scratch_types=scratch, grid=(blocks,), grid_names=("p",),
            kernel_name="floor_mgpu_pdl" if pdl else "floor_mgpu", interpret=ip)
        prev = call(prev) if empty else call(prev, w)
    return prev


def _inputs(kind: str, mb: float, n: int):
    if kind == "triton":
        rows = int(mb * 2**20 // (COLS * 2))
        ws = [jnp.full((rows, COLS), i % 7, jnp.bfloat16) for i in range(n)]
        return ws, jnp.zeros((1, COLS), jnp.float32), rows * COLS * 2
    r = _MGPU_ROWS.value
    blocks = int(mb * 2**20 // (r * MGPU_COLS * 2))
    if mb > 0 and blocks == 0:
        raise app.UsageError(f"--mb={mb} is less than one {r} x {MGPU_COLS} tile")
    ws = [jnp.full((blocks, r, MGPU_COLS), i % 7, jnp.bfloat16) for i in range(n)]
    return ws, jnp.zeros((1, MGPU_VEC), jnp.float32), blocks * r * MGPU_COLS * 2


def measure(kind: str, mb: float, n: int, interp: bool) -> dict:
    ws, prev, nbytes = _inputs(kind, mb, n)
    if kind == "triton":
        fn = functools.partial(chain, interpret=interp)
    else:
        fn = functools.partial(mgpu_chain, pdl=kind == "mgpu_pdl", interpret=interp)
    jax.block_until_ready(fn(ws, prev))
    with tempfile.TemporaryDirectory() as d:
        trace, _ = traced(lambda: [jax.block_until_ready(fn(ws, prev))
                                   for _ in range(_ITERS.value)], d)
    events = device_events(trace)
    if not events:  # CPU: host time
        us = 1e6 * median_time(fn, ws, prev, iters=_ITERS.value) / n
        return {"kind": kind, "mb": mb, "kernels": n, "us_per_kernel": us, "source": "host"}
    s = summarize(events, _ITERS.value, 1)
    # The chain's kernels (named floor_*; every device event if the trace names them
    # otherwise: nothing else runs).
    mine = [e for e in events if e["name"].startswith("floor_")] or list(events)
    mine = sorted(mine, key=lambda e: e["ts"])
    # Each chain's own span (first start to last end): the host's dispatch between the
    # traced chains is not the chain's.
    spans = [max(e["ts"] + e["dur"] for e in mine[i:i + n]) - mine[i]["ts"]
             for i in range(0, len(mine) - n + 1, n)]
    us = float(np.median(spans)) / n
    return {"kind": kind, "mb": mb, "kernels": n, "events_per_chain": s["events_per_step"],
            "us_per_kernel": us, "chain_spans_us": spans,
            "kernel_us_per_kernel": sum(e["dur"] for e in mine) / (_ITERS.value * n),
            "tb_s": nbytes / (us * 1e-6) / 1e12 if nbytes else 0.0,
            "event_names": sorted({e["name"] for e in mine})[:4],
            "source": "device trace"}


def main(_):
    interp = _INTERPRET.value
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "chain": _CHAIN.value, "block_rows": _ROWS.value,
              "mgpu_tile_rows": _MGPU_ROWS.value, "kinds": _KINDS.value, "sizes": []}
    bad = [k for k in _KINDS.value if k not in KINDS]
    if bad:
        raise app.UsageError(f"--kinds: unknown {bad}; choose from {list(KINDS)}")
    sizes = [float(m) for m in _MB.value]
    if any(mb < 0 for mb in sizes):
        raise app.UsageError(f"--mb: sizes must be >= 0; got {sizes}")
    os.makedirs(_OUT.value, exist_ok=True)
    path = os.path.join(_OUT.value, "launch_floor.json")
    for mb in sizes:
        for kind in _KINDS.value:  # kinds side by side at each size
            report["sizes"].append(measure(kind, mb, _CHAIN.value, interp))
            with open(path, "w") as f:  # rewritten after every measurement
                json.dump(report, f, indent=1)
    print(f"\n{report['device']}, jax {jax.__version__}: chains of {_CHAIN.value} dependent "
          f"kernels")
    print(f"{'kind':>9s} {'MB':>5s} {'us/kernel':>10s} {'in kernel':>10s} {'TB/s':>6s}  "
          "(us/kernel: the chain's span / kernels; in kernel: the kernels' own durations)")
    for r in report["sizes"]:
        print(f"{r['kind']:>9s} {r['mb']:5.1f} {r['us_per_kernel']:10.2f} "
              f"{r.get('kernel_us_per_kernel', float('nan')):10.2f} {r.get('tb_s', 0):6.2f}")
    print(f"receipt: {path}")


if __name__ == "__main__":
    app.run(main)
