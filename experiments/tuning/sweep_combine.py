"""Tiles of the mixture-of-experts combine kernel (`pallas_kernels.route.combine_kernel`).

  python experiments/tuning/sweep_combine.py --out=$OUT                  # H200, Qwen3-30B-A3B
  python experiments/tuning/sweep_combine.py --interpret --preset=tiny-qwen3-moe --Ts=1,2 \
      --max_candidates=2 --iters=1 --reps=2                               # CPU smoke run

At blocks of --Ts tokens (k routed outputs each, in shuffled slots of a [S, D] f32 array,
as the down kernel leaves them) it times `combine_kernel` under each tiling (tokens and
columns a program, warps) and the XLA ops it replaces (the gather back, `combine`, the
cast and the zero rows), each as one jitted loop of --reps dependent launches (each
launch's weights take the previous output's first element times zero, so no launch can
be merged or hoisted), the median of --iters calls after warm-up, each ended by
`block_until_ready`. The winner has the smallest sum over --Ts (a tiling may not depend
on the token count, R1).

On the device every candidate's output is checked against the default tiling's, bitwise
(the arithmetic per element is the same whatever the tiling), and every token of the
largest block computed alone against the block. Writes sweep_combine[_tag].json; a new
default goes into `pallas_kernels.route.COMBINE` by hand, with the MoE matrix run on it.
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
from pallas_kernels.route import COMBINE, CombineConfig, combine, combine_kernel

_PRESET = flags.DEFINE_string("preset", "qwen3-30b-a3b", "a mixture-of-experts preset")
_TS = flags.DEFINE_list("Ts", ["1", "2", "5", "8"], "tokens a block; the winner minimises "
                        "the sum")
_MAX = flags.DEFINE_integer("max_candidates", 12, "tilings timed (the default first)")
_ITERS = flags.DEFINE_integer("iters", 5, "timed calls per measurement (median)")
_REPS = flags.DEFINE_integer("reps", 64, "dependent launches per timed call")
_INTERPRET = flags.DEFINE_bool("interpret", False, "CPU smoke run (timings mean nothing)")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")

# (bm, bn, warps) after the default: more, narrower programs first (the default's eight
# programs of 16 token rows gather mostly padding rows at one token).
HAND_LIST = ((16, 64, 4), (16, 128, 4), (8, 128, 4), (8, 64, 2), (4, 128, 2), (4, 64, 1),
             (16, 64, 2), (8, 256, 4), (4, 256, 4), (16, 32, 1), (2, 128, 1), (1, 256, 1))


def candidates() -> list[CombineConfig]:
    out = [COMBINE] + [CombineConfig(bm, bn, w) for bm, bn, w in HAND_LIST]
    seen, unique = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return unique[:max(_MAX.value, 1)]


def block(rng, T: int, k: int, D: int, pad_to: int):
    """(y [S, D] f32 with the T k outputs in shuffled slots and NaN in the rest, dest
    [T k], weights [T, k], rows_out)."""
    S = T * k + 16  # a layout's empty slots, never read
    y = rng.standard_normal((S, D)).astype(np.float32)
    dest = rng.permutation(S)[: T * k].astype(np.int32)
    y[np.setdiff1d(np.arange(S), dest)] = np.nan
    w = rng.random((T, k)).astype(np.float32)
    return jnp.asarray(y), jnp.asarray(dest), jnp.asarray(w), -(-T // pad_to) * pad_to


def xla_path(y, dest, w, *, rows_out: int, out_dtype):
    """What the kernel replaces: the gather back, `combine`, the cast, the zero rows."""
    T, k = w.shape
    out = combine(y[dest].reshape(T, k, -1), w).astype(out_dtype)
    return jnp.pad(out, ((0, rows_out - T), (0, 0)))


def main(argv):
    del argv
    cfg = preset_config(_PRESET.value)
    if not cfg.num_experts:
        raise app.UsageError(f"--preset={_PRESET.value} has no experts")
    Ts = [int(t) for t in _TS.value]
    if min(Ts) < 1:
        raise app.UsageError("--Ts must be >= 1")
    k, D, dtype = cfg.experts_per_token, cfg.hidden_size, jnp.bfloat16
    rng = np.random.default_rng(0)
    blocks = {T: block(rng, T, k, D, 16) for T in Ts}
    cands = candidates()
    kernel = functools.partial(combine_kernel, out_dtype=dtype, interpret=_INTERPRET.value)
    rows = []
    jobs = [("xla", None)] + [("kernel", c) for c in cands]
    for kind, c in tqdm(jobs, desc="tilings", file=sys.stdout):
        times = {}
        for T, (y, dest, w, rows_out) in blocks.items():
            fn = (functools.partial(xla_path, rows_out=rows_out, out_dtype=dtype)
                  if kind == "xla" else functools.partial(kernel, rows_out=rows_out, config=c))
            loop = dependent_launches(fn, _REPS.value, carry=2)  # the weights carry
            times[T] = median_time(loop, y, dest, w, iters=_ITERS.value, warmup=1) \
                / _REPS.value * 1e6
        rows.append({"kind": kind, "config": None if c is None else vars(c),
                     "us_per_launch": times, "sum_us": sum(times.values())})
    # Bits: every tiling gives the default's; a token alone gives its row of the block.
    T = max(Ts)
    y, dest, w, rows_out = blocks[T]
    ref = np.asarray(kernel(y, dest, w, rows_out=rows_out, config=COMBINE))
    for r, c in zip(rows[1:], cands, strict=True):
        got = np.asarray(kernel(y, dest, w, rows_out=rows_out, config=c))
        r["same_bits_as_default"] = bool(np.array_equal(got.view(np.uint16),
                                                        ref.view(np.uint16)))
        alone = [np.asarray(kernel(y, dest[t * k:(t + 1) * k], w[t:t + 1], rows_out=1,
                                   config=c))[0] for t in range(T)]
        r["token_alone_is_its_row"] = bool(np.array_equal(
            np.stack(alone).view(np.uint16), got[:T].view(np.uint16)))
    ok = [r for r in rows[1:] if r["same_bits_as_default"] and r["token_alone_is_its_row"]]
    best = min(ok, key=lambda r: r["sum_us"]) if ok else None
    report = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": jax.devices()[0].device_kind,
        "jax": jax.__version__, "preset": _PRESET.value, "k": k, "D": D, "Ts": Ts,
        "reps": _REPS.value, "iters": _ITERS.value, "interpret": _INTERPRET.value,
        "default": vars(COMBINE), "rows": rows, "best": best}
    out = write_receipt(_OUT.value, "sweep_combine", _TAG.value, report)
    print(f"{_PRESET.value}: k={k} D={D}, us a launch at T = {Ts}")
    for r in sorted(rows, key=lambda r: r["sum_us"]):
        name = "xla ops" if r["kind"] == "xla" else "bm={bm} bn={bn} warps={num_warps}".format(
            **r["config"])
        bits = "" if r["kind"] == "xla" else (
            "" if r["same_bits_as_default"] and r["token_alone_is_its_row"] else "  BITS DIFFER")
        print(f"  {name:28s} " + " ".join(f"{r['us_per_launch'][t]:7.2f}" for t in Ts)
              + f"  sum {r['sum_us']:7.2f}{bits}")
    print(f"receipt: {out}")


if __name__ == "__main__":
    cli.run(main)
