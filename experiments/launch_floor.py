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
and drain alone. Writes `launch_floor.json` (per size: us per kernel, effective TB/s)
and prints a table.
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from timing import median_time  # noqa: E402
from trace_tools import device_events, summarize, traced  # noqa: E402

from pallas_kernels._common import triton_params  # noqa: E402

_MB = flags.DEFINE_list("mb", ["0", "1", "2", "4", "8", "16"], "weight MB read per kernel")
_CHAIN = flags.DEFINE_integer("chain", 64, "dependent kernels per chain")
_ROWS = flags.DEFINE_integer("block_rows", 16, "weight rows per program (x 1024 columns)")
_ITERS = flags.DEFINE_integer("iters", 5, "traced chains per size")
_INTERPRET = flags.DEFINE_bool("interpret", False, "CPU smoke run (timings mean nothing)")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")

COLS = 1024


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


def measure(mb: float, n: int, interp: bool) -> dict:
    rows = int(mb * 2**20 // (COLS * 2))
    ws = [jnp.full((rows, COLS), i % 7, jnp.bfloat16) for i in range(n)]
    prev = jnp.zeros((1, COLS), jnp.float32)
    fn = functools.partial(chain, interpret=interp)
    jax.block_until_ready(fn(ws, prev))
    with tempfile.TemporaryDirectory() as d:
        trace, _ = traced(lambda: [jax.block_until_ready(fn(ws, prev))
                                   for _ in range(_ITERS.value)], d)
    events = device_events(trace)
    if not events:  # CPU: host time
        us = 1e6 * median_time(fn, ws, prev, iters=_ITERS.value) / n
        return {"mb": mb, "kernels": n, "us_per_kernel": us, "source": "host"}
    s = summarize(events, _ITERS.value, 1)
    mine = sorted((e for e in events if e["name"].startswith("floor_")), key=lambda e: e["ts"])
    # Each chain's own span (first start to last end): the host's dispatch between the
    # traced chains is not the chain's.
    spans = [max(e["ts"] + e["dur"] for e in mine[i:i + n]) - mine[i]["ts"]
             for i in range(0, len(mine) - n + 1, n)]
    us = float(np.median(spans)) / n
    return {"mb": mb, "kernels": n, "events_per_chain": s["events_per_step"],
            "us_per_kernel": us, "chain_spans_us": spans,
            "kernel_us_per_kernel": sum(e["dur"] for e in mine) / (_ITERS.value * n),
            "tb_s": (rows * COLS * 2) / (us * 1e-6) / 1e12 if rows else 0.0,
            "source": "device trace"}


def main(_):
    interp = _INTERPRET.value
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
              "chain": _CHAIN.value, "block_rows": _ROWS.value, "sizes": []}
    for mb in (float(m) for m in _MB.value):
        if mb < 0:
            raise app.UsageError(f"--mb: sizes must be >= 0; got {mb}")
        report["sizes"].append(measure(mb, _CHAIN.value, interp))
    os.makedirs(_OUT.value, exist_ok=True)
    path = os.path.join(_OUT.value, "launch_floor.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{report['device']}, jax {jax.__version__}: chains of {_CHAIN.value} dependent "
          f"kernels")
    print(f"{'MB':>5s} {'us/kernel':>10s} {'in kernel':>10s} {'TB/s':>6s}  (us/kernel: the "
          "chain's span / kernels; in kernel: the kernels' own durations)")
    for r in report["sizes"]:
        print(f"{r['mb']:5.1f} {r['us_per_kernel']:10.2f} "
              f"{r.get('kernel_us_per_kernel', float('nan')):10.2f} {r.get('tb_s', 0):6.2f}")
    print(f"receipt: {path}")


if __name__ == "__main__":
    app.run(main)
