"""The Mosaic GPU top-p cut on the device: row invariance and speed against Triton.

  python experiments/tuning/mosaic_top_p.py --out=$OUT            # H200, ~1 minute
  python experiments/tuning/mosaic_top_p.py --smoke --out=/tmp/r  # CPU, interpret mode

Rows of V sorted f32 logits (random normal times --scale, every fourth row's tail
masked to -inf as top-k leaves it), at M in --rows and p in --ps:

1. Counts: `pallas_kernels.mosaic.top_p.top_p_kept` at max(rows) rows; at every other M
   each row's count must equal its count among max(rows) (`prefix_mismatch_rows`), and
   the --alone rows, each computed alone, too (`alone_mismatch_rows`).
   `differs_from_triton` / `differs_from_float64` count the rows whose count differs
   from the Triton kernel's / the float64 definition's (each lowering defines its own
   inclusive mass, rule R11: a row within rounding of p may be cut one token apart).
2. Speed: us a call, Mosaic against Triton, median of --iters jitted calls after warm-up
   with `block_until_ready`.

Writes the JSON receipt to --out/mosaic_top_p[_tag].json.
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
from pallas_kernels.mosaic.top_p import top_p_kept
from pallas_kernels.top_p import top_p_kept as triton_top_p_kept

_V = flags.DEFINE_integer("vocab", 151936, "vocabulary V (Qwen3's)")
_ROWS = flags.DEFINE_list("rows", ["1", "5", "40", "160"], "row counts M")
_ALONE = flags.DEFINE_list("alone", ["0", "3", "39", "159"], "rows checked alone")
_PS = flags.DEFINE_list("ps", ["0.5", "0.9", "0.99"], "top-p values")
_SCALE = flags.DEFINE_float("scale", 4.0, "logit scale (larger: peakier rows)")
_ITERS = flags.DEFINE_integer("iters", 20, "timed calls per measurement (median)")
_SMOKE = flags.DEFINE_bool("smoke", False, "CPU: a small vocabulary, interpret mode")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")


def sorted_rows(m: int, v: int) -> jax.Array:
    x = _SCALE.value * jax.random.normal(jax.random.key(0), (m, v), jnp.float32)
    x = x.at[::4, v // 3:].set(-jnp.inf)
    return -jnp.sort(-x, axis=1)


def kept64(x, p: float) -> np.ndarray:
    s = np.asarray(x, np.float64)
    e = np.exp(s - s[:, :1])
    incl = np.cumsum(e, axis=1)
    return np.minimum(1 + (incl < p * e.sum(axis=1, keepdims=True)).sum(axis=1), s.shape[1])


def main(argv):
    del argv
    smoke = _SMOKE.value
    v = 5000 if smoke else _V.value
    rows = [1, 3, 6] if smoke else sorted({int(m) for m in _ROWS.value})
    alone = [0, 5] if smoke else [int(i) for i in _ALONE.value]
    x = sorted_rows(max(rows), v)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d"), "vocab": v, "rows": rows,
              "scale": _SCALE.value, "smoke": smoke, "ps": []}
    path = receipt_stem(_OUT.value, "mosaic_top_p", _TAG.value) + ".json"
    for p in [float(p) for p in _PS.value]:
        mosaic = jax.jit(lambda a, p=p: top_p_kept(a, p, interpret=smoke))
        triton = jax.jit(lambda a, p=p: triton_top_p_kept(a, p, interpret=smoke))
        full = np.asarray(mosaic(x))
        entry = {"p": p, "kept": full.tolist()[:8],
                 "prefix_mismatch_rows": {m: int((np.asarray(mosaic(x[:m])) != full[:m]).sum())
                                          for m in rows[:-1]},
                 "alone_mismatch_rows": sum(int(np.asarray(mosaic(x[i:i + 1]))[0] != full[i])
                                            for i in alone if i < x.shape[0]),
                 "differs_from_triton": int((np.asarray(triton(x)) != full).sum()),
                 "differs_from_float64": int((kept64(x, p) != full).sum()), "us": {}}
        for m in rows:
            entry["us"][m] = {name: median_time(f, x[:m], iters=_ITERS.value, warmup=2) * 1e6
                              for name, f in (("mosaic", mosaic), ("triton", triton))}
            print(f"p {p}  M {m:>4}  mosaic {entry['us'][m]['mosaic']:8.1f} us  triton "
                  f"{entry['us'][m]['triton']:8.1f} us", flush=True)
        print(f"p {p}: prefix mismatches {entry['prefix_mismatch_rows']}, alone "
              f"{entry['alone_mismatch_rows']}, rows differing from triton "
              f"{entry['differs_from_triton']}, from float64 {entry['differs_from_float64']}")
        report["ps"].append(entry)
        write_receipt(_OUT.value, "mosaic_top_p", _TAG.value, report)
    print(f"receipt: {path}")


if __name__ == "__main__":
    cli.run(main)
