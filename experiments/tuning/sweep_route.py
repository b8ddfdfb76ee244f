"""Tiles of the mixture-of-experts routing kernel (`pallas_kernels.route.route_kernel`).

  python experiments/tuning/sweep_route.py --out=$OUT                    # H200, Qwen3-30B-A3B
  python experiments/tuning/sweep_route.py --interpret --preset=tiny-qwen3-moe --Ms=1,3 \
      --max_candidates=2 --iters=1 --reps=2                               # CPU smoke run

At blocks of --Ms token rows of random f32 router logits it times `route_kernel` under
each tiling (rows a program, warps) and the plain-jnp `route` (the xla backend's), each
as one jitted loop of --reps dependent launches (each launch's logits take the previous
weights' first element times zero), the median of --iters calls after warm-up, each
ended by `block_until_ready`. The winner has the smallest sum over --Ms (a tiling may
not depend on the row count, R1). Every candidate's weights and ids are checked against
the default tiling's, bitwise, and every row computed alone against the block. Writes
sweep_route[_tag].json; a new default goes into `pallas_kernels.route.ROUTE` by hand, with
the MoE matrix run on it. --mosaic also times the Mosaic GPU lowering
(`pallas_kernels.mosaic.route`, its own bits: every row alone against the block, and
whether its ids equal the Triton kernel's).
"""

from __future__ import annotations

import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from tqdm import tqdm

from jspec import cli
from jspec.bench.receipts import write_receipt
from jspec.bench.timing import dependent_launches, median_time
from jspec.random_model import preset_config
from pallas_kernels.route import ROUTE, RouteConfig, route, route_kernel

_PRESET = flags.DEFINE_string("preset", "qwen3-30b-a3b", "a mixture-of-experts preset")
_MS = flags.DEFINE_list("Ms", ["1", "5", "40"], "token rows a block; the winner minimises "
                        "the sum")
_MAX = flags.DEFINE_integer("max_candidates", 8, "tilings timed (the default first)")
_ITERS = flags.DEFINE_integer("iters", 5, "timed calls per measurement (median)")
_REPS = flags.DEFINE_integer("reps", 64, "dependent launches per timed call")
_INTERPRET = flags.DEFINE_bool("interpret", False, "CPU smoke run (timings mean nothing)")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")
_MOSAIC = flags.DEFINE_bool("mosaic", True, "also time the Mosaic GPU route kernel")

# (bm, warps) after the default: fewer warps first (a [16, 128] tile is 2,048 values; the
# k argmax rounds are reductions across the tile's columns), then smaller row tiles.
HAND_LIST = ((16, 1), (16, 2), (8, 1), (8, 2), (16, 8), (4, 1), (32, 4), (32, 2))


def candidates() -> list[RouteConfig]:
    out = [ROUTE] + [RouteConfig(bm, w) for bm, w in HAND_LIST if RouteConfig(bm, w) != ROUTE]
    return out[:max(_MAX.value, 1)]


def main(argv):
    del argv
    cfg = preset_config(_PRESET.value)
    if not cfg.num_experts:
        raise app.UsageError(f"--preset={_PRESET.value} has no experts")
    Ms = [int(m) for m in _MS.value]
    if min(Ms) < 1:
        raise app.UsageError("--Ms must be >= 1")
    E, k = cfg.num_experts, cfg.experts_per_token
    mode = dict(norm_topk_prob=cfg.norm_topk_prob, topk_softmax=cfg.topk_softmax)
    rng = np.random.default_rng(0)
    blocks = {M: jnp.asarray(rng.standard_normal((M, E)), jnp.float32) for M in Ms}
    cands = candidates()
    kernel = functools.partial(route_kernel, k=k, **mode, interpret=_INTERPRET.value)
    mosaic = None
    if _MOSAIC.value:
        from pallas_kernels.mosaic.route import route_kernel as mosaic_route_kernel

        mosaic = functools.partial(mosaic_route_kernel, k=k, **mode,
                                   interpret=_INTERPRET.value)
    rows = []
    kinds = [("xla", None)] + ([("mosaic", None)] if mosaic else [])
    for kind, c in tqdm(kinds + [("kernel", c) for c in cands], desc="tilings",
                        file=sys.stdout):
        fn = (functools.partial(route, k=k, **mode) if kind == "xla"
              else mosaic if kind == "mosaic" else functools.partial(kernel, config=c))
        times = {M: median_time(dependent_launches(fn, _REPS.value), x, iters=_ITERS.value,
                                warmup=1) / _REPS.value * 1e6 for M, x in blocks.items()}
        rows.append({"kind": kind, "config": None if c is None else vars(c),
                     "us_per_launch": times, "sum_us": sum(times.values())})
    M = max(Ms)
    x = blocks[M]
    ref_w, ref_i = (np.asarray(a) for a in kernel(x, config=ROUTE))

    def rows_alone(fn, w, i) -> bool:  # every row computed alone: the block's bits
        alone = [tuple(np.asarray(a)[0] for a in fn(x[m:m + 1])) for m in range(M)]
        return bool(np.array_equal(np.stack([a[0] for a in alone]).view(np.uint32),
                                   w.view(np.uint32))
                    and np.array_equal(np.stack([a[1] for a in alone]), i))

    if mosaic:
        w, i = (np.asarray(a) for a in mosaic(x))
        rows[1]["ids_equal_triton"] = bool(np.array_equal(i, ref_i))
        rows[1]["row_alone_is_its_row"] = rows_alone(mosaic, w, i)
    for r, c in zip(rows[1 + bool(mosaic):], cands, strict=True):
        fn = functools.partial(kernel, config=c)
        w, i = (np.asarray(a) for a in fn(x))
        r["same_bits_as_default"] = bool(np.array_equal(w.view(np.uint32),
                                                        ref_w.view(np.uint32))
                                         and np.array_equal(i, ref_i))
        r["row_alone_is_its_row"] = rows_alone(fn, w, i)
    ok = [r for r in rows if r["kind"] == "kernel" and r["same_bits_as_default"]
          and r["row_alone_is_its_row"]]
    best = min(ok, key=lambda r: r["sum_us"]) if ok else None
    report = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": jax.devices()[0].device_kind,
        "jax": jax.__version__, "preset": _PRESET.value, "E": E, "k": k, "Ms": Ms,
        "reps": _REPS.value, "iters": _ITERS.value, "interpret": _INTERPRET.value,
        "default": vars(ROUTE), "rows": rows, "best": best}
    out = write_receipt(_OUT.value, "sweep_route", _TAG.value, report)
    print(f"{_PRESET.value}: E={E} k={k}, us a launch at M = {Ms}")
    for r in sorted(rows, key=lambda r: r["sum_us"]):
        name = ("xla (route)" if r["kind"] == "xla" else "mosaic" if r["kind"] == "mosaic"
                else "bm={bm} warps={num_warps}".format(**r["config"]))
        if r["kind"] == "mosaic":
            bits = ("" if r["row_alone_is_its_row"] else "  ROWS DIFFER") + (
                "" if r["ids_equal_triton"] else "  (ids differ from Triton's)")
        else:
            bits = "" if r["kind"] == "xla" or (r["same_bits_as_default"]
                                                and r["row_alone_is_its_row"]) else "  BITS DIFFER"
        print(f"  {name:20s} " + " ".join(f"{r['us_per_launch'][m]:7.2f}" for m in Ms)
              + f"  sum {r['sum_us']:7.2f}{bits}")
    print(f"receipt: {out}")


if __name__ == "__main__":
    cli.run(main)
