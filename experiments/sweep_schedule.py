"""Do a matmul's column tile, warps and stages change its bits? And which is fastest
for a multi-tile launch (a batch-8 verify block)?

  python experiments/sweep_schedule.py --out=experiments/results         # H200
  python experiments/sweep_schedule.py --interpret --preset=tiny-qwen3 --rows=1,40 \
      --max_candidates=2 --out=/tmp                                       # CPU smoke

A row's sum order in `pallas_kernels.matmul` is set by its K tile (bk) and split-K
count; bn, num_warps and num_stages only decide which program computes which output
columns and how loads are pipelined. If, on the device, every variant of a weight's
table config with the same bm, bk and split-K gives the table config's bits, then a
launch of several row tiles may use its own (bn, warps, stages) without touching
property P, as row groups do. This script checks exactly that for each weight of
--preset: for every variant it compares the logits bitwise with the table config at
each M of --rows (row groups of --row_group, as the model runs them) and times it at
the largest M, device-side (the busy time of a profiler trace of a jitted loop over
enough weight copies to miss the L2). Writes `sweep_schedule.json`: per weight, the
table config's time, every variant's bits_equal and time, and the fastest variant
with equal bits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from timing import median_time  # noqa: E402
from trace_tools import device_events, summarize, traced  # noqa: E402

from jspec.random_model import weight_shapes  # noqa: E402
from pallas_kernels.matmul import MatmulConfig, matmul, matmul_config  # noqa: E402

_PRESET = flags.DEFINE_string("preset", "qwen3-8b", "model shape preset")
_SHAPES = flags.DEFINE_list("shapes", ["wo", "w_down", "wqkv", "w_gate_up", "lm_head"],
                            "weights, in this order")
_ROWS = flags.DEFINE_list("rows", ["1", "40"], "row counts compared bitwise; the largest is timed")
_ROW_GROUP = flags.DEFINE_integer("row_group", 4, "row tiles per program (the model's default)")
_MAX = flags.DEFINE_integer("max_candidates", 12, "variants per weight")
_ITERS = flags.DEFINE_integer("iters", 5, "timed loops per variant")
_COLD = flags.DEFINE_float("cold_mb", 256.0, "weight bytes cycled per timed loop (MB)")
_BUDGET = flags.DEFINE_float("budget_s", 200.0, "no new variant is started after this")
_INTERPRET = flags.DEFINE_bool("interpret", False, "CPU smoke run (timings mean nothing)")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")


def variants(base: MatmulConfig, N: int, limit: int) -> list[MatmulConfig]:
    """The base config with other bn / warps / stages (same bm, bk, split_k): bn first."""
    out = []
    for bn in (base.bn // 2, base.bn * 2, base.bn // 4, base.bn * 4):
        if bn >= 16 and N % bn == 0:
            out.append(dataclasses.replace(base, bn=bn))
    for w in (2, 4, 8):
        if w != base.num_warps:
            out.append(dataclasses.replace(base, num_warps=w))
    for s in (2, 3, 4, 5):
        if s != base.num_stages:
            out.append(dataclasses.replace(base, num_stages=s))
    return out[:limit]


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def sweep_weight(name: str, K: int, N: int, rows: list[int], rg: int, key, t0: float,
                 interp: bool) -> dict:
    """The table config of a [K, N] weight and its variants: bits at each M, time at max M."""
    dt = jnp.bfloat16
    base = matmul_config(K, N, dt, interp)
    copies = max(1, int(np.ceil(_COLD.value * 2**20 / (K * N * 2)))) if not interp else 1
    k1, k2 = jax.random.split(key)
    ws = (jax.random.normal(k1, (copies, K, N), jnp.float32) * K**-0.5).astype(dt)
    xs = {m: jax.random.normal(jax.random.fold_in(k2, m), (m, K), jnp.float32).astype(dt)
          for m in rows}

    def run(cfg, m):
        return matmul(xs[m], ws[0], out_dtype=dt, interpret=interp, config=cfg, row_group=rg)

    def per_call_us(cfg) -> float:
        m = rows[-1]
        fn = jax.jit(lambda w: [matmul(xs[m], w[c], out_dtype=dt, interpret=interp,
                                       config=cfg, row_group=rg) for c in range(copies)])
        jax.block_until_ready(fn(ws))
        with tempfile.TemporaryDirectory() as d:
            trace, _ = traced(lambda: [jax.block_until_ready(fn(ws))
                                       for _ in range(_ITERS.value)], d)
        events = device_events(trace)
        if not events:  # CPU: host time
            return 1e6 * median_time(fn, ws, iters=_ITERS.value) / copies
        return summarize(events, _ITERS.value * copies, 1)["busy_us_per_step"]

    want = {m: bits(run(base, m)) for m in rows}
    entry = {"weight": name, "K": K, "N": N, "base": vars(base), "copies": copies,
             "base_us": per_call_us(base), "variants": []}
    for cfg in tqdm(variants(base, N, _MAX.value), desc=name):
        if time.time() - t0 > _BUDGET.value:
            entry["variants"].append({"config": vars(cfg), "skipped": "budget"})
            continue
        try:
            equal = {str(m): bool(np.array_equal(bits(run(cfg, m)), want[m])) for m in rows}
            us = per_call_us(cfg)
        except Exception as e:  # a config Triton cannot build: recorded
            entry["variants"].append({"config": vars(cfg), "error": str(e).splitlines()[0][:200]})
            continue
        entry["variants"].append({"config": vars(cfg), "bits_equal": equal, "us": us})
    ran = [v for v in entry["variants"] if "us" in v]
    same = [v for v in ran if all(v["bits_equal"].values())]
    entry["all_bits_equal"] = len(same) == len(ran)
    entry["fastest_equal"] = min(same, key=lambda v: v["us"]) if same else None
    return entry


def main(_):
    interp = _INTERPRET.value
    rows = sorted(int(r) for r in _ROWS.value)
    rg = _ROW_GROUP.value
    t0 = time.time()
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
              "preset": _PRESET.value, "rows": rows, "row_group": rg, "weights": []}
    all_shapes = weight_shapes(_PRESET.value)
    for i, name in enumerate(_SHAPES.value):
        K, N = all_shapes[name]
        report["weights"].append(sweep_weight(name, K, N, rows, rg, jax.random.key(i), t0,
                                              interp))
        os.makedirs(_OUT.value, exist_ok=True)
        with open(os.path.join(_OUT.value, "sweep_schedule.json"), "w") as f:
            json.dump(report, f, indent=1)

    print(f"\n{report['device']}, jax {jax.__version__}, {_PRESET.value}, M = {rows}, "
          f"row groups of {rg}; us per call at M = {rows[-1]}")
    print(f"{'weight':10s} {'table us':>9s} {'variants':>8s} {'bits equal':>10s} "
          f"{'best equal us':>13s}  best equal config")
    for e in report["weights"]:
        ran = [v for v in e["variants"] if "us" in v]
        n_eq = sum(all(v["bits_equal"].values()) for v in ran)
        b = e["fastest_equal"]
        print(f"{e['weight']:10s} {e['base_us']:9.2f} {len(ran):8d} {n_eq:10d} "
              f"{(b['us'] if b else float('nan')):13.2f}  {b['config'] if b else '-'}")
    print(f"receipt: {os.path.join(_OUT.value, 'sweep_schedule.json')}")


if __name__ == "__main__":
    app.run(main)
