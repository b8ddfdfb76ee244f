"""The Mosaic GPU norms on the device: row invariance, bitwise, and speed against Triton.

  python experiments/tuning/mosaic_norms.py --out=$OUT            # H200, ~1 minute
  python experiments/tuning/mosaic_norms.py --smoke --out=/tmp/r  # CPU, interpret mode

For each width in --widths (4096: Qwen3-8B / Llama-3-8B; 2560: Gemma-3-4B; random bf16
rows and weights) and M in --rows:

1. Bits: `pallas_kernels.mosaic.rmsnorm` and `add_rmsnorm` at max(rows) rows; at every
   other M the rows must be bitwise the first M rows of that (`prefix_mismatch_rows`),
   and the --alone rows, each computed alone, bitwise the same row among max(rows)
   (`alone_mismatch_rows`). Against the Triton lowering the bits may differ (its own sum
   order, rule R11): `differs_from_triton` counts the elements that do.
2. Speed: Mosaic against Triton (`pallas_kernels.rmsnorm`, `add_rmsnorm`), each timed as
   one jitted loop of --reps dependent launches (the output feeds the next input), median
   of --iters calls after warm-up with `block_until_ready`; us per launch, the loop's own
   per-step cost included (read the two lowerings' ratio, not the absolute figure).

Writes the JSON receipt to --out/mosaic_norms[_tag].json. --smoke runs tiny widths in
interpret mode on the CPU (a test of the script; its timings mean nothing).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from jspec import cli
from jspec.bench.receipts import receipt_stem, write_receipt
from jspec.bench.timing import median_time
from pallas_kernels import add_rmsnorm as triton_add_rmsnorm
from pallas_kernels import rmsnorm as triton_rmsnorm
from pallas_kernels.mosaic import add_rmsnorm, rmsnorm

_WIDTHS = flags.DEFINE_list("widths", ["4096", "2560"], "feature widths D")
_ROWS = flags.DEFINE_list("rows", ["1", "5", "40", "160", "2048"], "row counts M")
_ALONE = flags.DEFINE_list("alone", ["0", "1", "39", "159", "2047"], "rows checked alone")
_ITERS = flags.DEFINE_integer("iters", 10, "timed calls per measurement (median)")
_REPS = flags.DEFINE_integer("reps", 50, "kernel launches per timed call")
_SMOKE = flags.DEFINE_bool("smoke", False, "CPU: tiny widths, interpret mode")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")

EPS = 1e-6


def bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def kernels(interpret: bool) -> dict:
    """name -> f(x, o, w) -> the normed rows (the add + norm's h)."""
    return {
        "rmsnorm": lambda x, o, w: rmsnorm(x, w, eps=EPS, interpret=interpret),
        "add_rmsnorm": lambda x, o, w: add_rmsnorm(x, o, w, eps=EPS, interpret=interpret)[1],
        "triton_rmsnorm": lambda x, o, w: triton_rmsnorm(x, w, eps=EPS, interpret=interpret),
        "triton_add_rmsnorm": lambda x, o, w: triton_add_rmsnorm(x, o, w, eps=EPS,
                                                                 interpret=interpret)[1],
    }


def invariance(fn, x, o, w, rows: list[int], alone: list[int]) -> dict:
    full = bits(fn(x, o, w))
    prefix = {m: int((bits(fn(x[:m], o[:m], w)) != full[:m]).any(axis=1).sum())
              for m in rows[:-1]}
    lone = {i: bool((bits(fn(x[i:i + 1], o[i:i + 1], w))[0] != full[i]).any())
            for i in alone if i < x.shape[0]}
    return {"prefix_mismatch_rows": prefix, "alone_mismatch_rows": sum(lone.values()),
            "alone_checked": len(lone)}


def time_us(fn, x, o, w) -> float:
    def loop(x, o, w):
        def body(_, x):
            return fn(x, o, w)
        return jax.lax.fori_loop(0, _REPS.value, body, x)

    f = jax.jit(loop).lower(x, o, w).compile()
    return median_time(f, x, o, w, iters=_ITERS.value, warmup=2) / _REPS.value * 1e6


def main(argv):
    del argv
    smoke = _SMOKE.value
    widths = [64, 300] if smoke else [int(d) for d in _WIDTHS.value]
    rows = [1, 3, 7] if smoke else sorted({int(m) for m in _ROWS.value})
    alone = [0, 6] if smoke else [int(i) for i in _ALONE.value]
    fns = kernels(smoke)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d"), "rows": rows, "reps": _REPS.value,
              "iters": _ITERS.value, "smoke": smoke, "widths": []}
    path = receipt_stem(_OUT.value, "mosaic_norms", _TAG.value) + ".json"
    print(f"{'D':>5} {'kernel':<12} {'M':>5} {'mosaic us':>10} {'triton us':>10}")
    for d in widths:
        kx, ko, kw = jax.random.split(jax.random.key(d), 3)
        m = max(rows)
        x = (jax.random.normal(kx, (m, d), jnp.float32) * 3).astype(jnp.bfloat16)
        o = jax.random.normal(ko, (m, d), jnp.float32).astype(jnp.bfloat16)
        w = jax.random.normal(kw, (d,), jnp.float32).astype(jnp.bfloat16)
        entry = {"D": d, "kernels": {}}
        for name in ("rmsnorm", "add_rmsnorm"):
            mosaic, triton = fns[name], fns["triton_" + name]
            r = invariance(mosaic, x, o, w, rows, alone)
            r["differs_from_triton"] = int((bits(mosaic(x, o, w)) != bits(triton(x, o, w))).sum())
            r["us"] = {}
            for mm in rows:
                r["us"][mm] = {"mosaic": time_us(mosaic, x[:mm], o[:mm], w),
                               "triton": time_us(triton, x[:mm], o[:mm], w)}
                print(f"{d:>5} {name:<12} {mm:>5} {r['us'][mm]['mosaic']:>10.2f} "
                      f"{r['us'][mm]['triton']:>10.2f}", flush=True)
            entry["kernels"][name] = r
            print(f"      bits: prefix mismatches {r['prefix_mismatch_rows']}, alone "
                  f"{r['alone_mismatch_rows']} of {r['alone_checked']}, elements differing "
                  f"from Triton {r['differs_from_triton']}")
        report["widths"].append(entry)
        write_receipt(_OUT.value, "mosaic_norms", _TAG.value, report)
    print(f"receipt: {path}")


if __name__ == "__main__":
    cli.run(main)
