"""Is the `Sample` sampler row-invariant on this device? Bitwise, by row count.

Serial decoding samples [B, V] logits; a speculative verify samples the same rows
flattened to [B * (gamma + 1), V]. `gumbel_coupled` is token-exact only if a row's
filtered logits, and so its token, do not depend on how many rows were sampled with
it. Temperature, top-k (a selection), the Gumbel noise (keyed per row) and argmax
(lowest index on ties) are row-local by construction. Top-p sums a softmax over the
vocabulary and a cumulative sum: with XLA's `softmax` and `cumsum` their order is XLA's
choice from the whole shape (design rule R1); jspec counts the kept tokens in a Pallas
kernel with a fixed order instead (`pallas_kernels/top_p.py`).

For each sampler setting this samples `--rows` rows of random logits at once, then
the first n rows alone for each n in `--counts`, and compares every shared row
bitwise: XLA's top-p mass before each sorted token (the computation jspec used to cut
with; the baseline that shows the problem), the kernel's count of kept tokens, and the
library's filtered logits and sampled token.

    python experiments/sampling_invariance.py --out=$OUT      # one GPU, ~1 min

It exits non-zero if jspec's kept count, filtered logits or token differ anywhere.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from timing import median_time  # noqa: E402

from jspec.sampling import Sample, _top_p_kept  # noqa: E402

_VOCAB = flags.DEFINE_integer("vocab", 151_936, "vocabulary size")
_ROWS = flags.DEFINE_integer("rows", 40, "rows of the reference call")
_COUNTS = flags.DEFINE_list("counts", ["1", "2", "5", "8", "9", "16"], "row counts compared")
_SETTINGS = flags.DEFINE_list(
    "settings", ["0.8:0:0.9", "0.8:0:0.95", "1.0:0:0.5", "0.8:40:0.9", "0.8:40:1.0"],
    "temperature:top_k:top_p")
_SCALE = flags.DEFINE_float("scale", 4.0, "std of the random logits")
_SEED = flags.DEFINE_integer("seed", 0, "logits and noise seed")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "output dir")
_TAG = flags.DEFINE_string("tag", "", "suffix of the receipt's file name")
_TIME_ITERS = flags.DEFINE_integer(
    "time_iters", 20, "timed calls (median, host-timed after a warm-up) of the top-p filter, "
    "XLA's against jspec's, at each row count for the first setting; 0: no timing")


def top_p_mass(sorted_x, top_p: float):
    """XLA's top-p mass before each sorted entry [N, V] (softmax, cumsum)."""
    if top_p >= 1.0:
        return jnp.zeros_like(sorted_x)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    return jnp.cumsum(probs, axis=-1) - probs


def kernel_kept(sorted_x, top_p: float):
    """jspec's count of kept sorted entries [N] (the Pallas kernel)."""
    if top_p >= 1.0:
        return jnp.full(sorted_x.shape[:1], sorted_x.shape[1], jnp.int32)
    return _top_p_kept(sorted_x, top_p)


def scaled_logits(sampler: Sample, x):
    """x / T with the top-k cut applied, as `Sample` does before top-p: [N, V]."""
    scaled = x / jnp.float32(sampler.temperature)
    if sampler.top_k:
        kth = jax.lax.top_k(scaled, sampler.top_k)[0][:, -1:]
        scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
    return scaled


def xla_filter(sampler: Sample, x):
    """The top-p filter as XLA would do it (softmax, cumsum): the timing baseline."""
    scaled = scaled_logits(sampler, x)
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    sorted_x = jnp.take_along_axis(scaled, order, axis=-1)
    keep_sorted = top_p_mass(sorted_x, sampler.top_p) < sampler.top_p
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(x.shape[0])[:, None], order].set(
        keep_sorted)
    return jnp.where(keep, scaled, -jnp.inf)


def time_filters(sampler: Sample, logits, counts, iters: int):
    """Median ms of XLA's and jspec's top-p filter at each row count."""
    fns = {"xla_ms": jax.jit(lambda x: xla_filter(sampler, x)),
           "jspec_ms": jax.jit(sampler.filtered_logits)}
    return {str(n): {k: 1e3 * median_time(f, logits[:n], iters=iters) for k, f in fns.items()}
            for n in counts}


def parse_setting(s: str) -> Sample:
    t, k, p = s.split(":")
    return Sample(temperature=float(t), top_k=int(k), top_p=float(p))


def run_setting(sampler: Sample, logits, counts):
    """-> one row of the receipt: rows differing per count, for each quantity."""

    @jax.jit
    def sample(x):  # [N, V] -> mass [N, V], kept [N], filtered [N, V], tokens [N]
        n = x.shape[0]
        rows = jnp.arange(n, dtype=jnp.int32)
        positions = jnp.full((n,), 512, jnp.int32)
        seed = jnp.int32(_SEED.value)
        scaled = scaled_logits(sampler, x)
        sorted_x = jnp.take_along_axis(
            scaled, jnp.argsort(-scaled, axis=-1, stable=True), axis=-1)
        return (top_p_mass(sorted_x, sampler.top_p), kernel_kept(sorted_x, sampler.top_p),
                sampler.filtered_logits(x), sampler(x, seed, rows, positions))

    ref = [np.asarray(a) for a in sample(logits)]
    kept = (ref[2] > -np.inf).sum(axis=1)
    out = {"temperature": sampler.temperature, "top_k": sampler.top_k,
           "top_p": sampler.top_p, "kept_min": int(kept.min()), "kept_max": int(kept.max()),
           "counts": {}}
    for n in counts:
        got = [np.asarray(a) for a in sample(logits[:n])]
        diff = {}
        for name, g, r in zip(("xla_mass", "kept", "filtered", "tokens"), got, ref,
                              strict=True):
            ne = g.view(np.uint32) != r[:n].view(np.uint32) if g.dtype == np.float32 else g != r[:n]
            ne = ne.reshape(n, -1)
            diff[name + "_rows"] = int(ne.any(axis=1).sum())
            diff[name + "_elements"] = int(ne.sum())
        out["counts"][str(n)] = diff
    return out


def main(argv):
    del argv
    counts = [int(c) for c in _COUNTS.value]
    if max(counts) > _ROWS.value:
        raise ValueError(f"--counts {counts} must not exceed --rows={_ROWS.value}")
    dev = jax.devices()[0]
    logits = jax.random.normal(jax.random.key(_SEED.value), (_ROWS.value, _VOCAB.value),
                               jnp.float32) * _SCALE.value
    receipt = {"command": "python3 experiments/sampling_invariance.py " + " ".join(
        f"--{k}={v}" for k, v in (("rows", _ROWS.value), ("vocab", _VOCAB.value),
                                  ("scale", _SCALE.value), ("seed", _SEED.value))),
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": dev.device_kind,
               "platform": dev.platform, "jax": jax.__version__, "rows": _ROWS.value,
               "vocab": _VOCAB.value, "settings": []}
    print(f"{dev.device_kind}, jax {jax.__version__}: rows differing from the "
          f"{_ROWS.value}-row call (XLA's top-p mass / jspec: kept, filtered, token)")
    print(f"  {'T':>4} {'top_k':>5} {'top_p':>5} {'kept':>13}  " +
          "  ".join(f"n={n:<11}" for n in counts))
    for s in _SETTINGS.value:
        r = run_setting(parse_setting(s), logits, counts)
        receipt["settings"].append(r)
        cells = ["{xla_mass_rows} / {kept_rows},{filtered_rows},{tokens_rows}".format(
            **r["counts"][str(n)]) for n in counts]
        print(f"  {r['temperature']:>4} {r['top_k']:>5} {r['top_p']:>5} "
              f"{r['kept_min']:>6}-{r['kept_max']:<6}  " + "  ".join(f"{c:<13}" for c in cells))
    bad = sum(r["counts"][str(n)][k] for r in receipt["settings"] for n in counts
              for k in ("kept_rows", "filtered_rows", "tokens_rows"))
    receipt["jspec_rows_differing"] = bad
    print(f"jspec (kernel cut): {bad} rows differing in all settings and counts")
    if _TIME_ITERS.value:
        first = parse_setting(_SETTINGS.value[0])
        receipt["timing"] = {"setting": _SETTINGS.value[0], "iters": _TIME_ITERS.value,
                             "ms": time_filters(first, logits, counts, _TIME_ITERS.value)}
        print(f"top-p filter {_SETTINGS.value[0]}, median ms (host-timed): XLA / jspec")
        print("  " + "  ".join(f"n={n}: {t['xla_ms']:.3f} / {t['jspec_ms']:.3f}"
                               for n, t in receipt["timing"]["ms"].items()))
    os.makedirs(_OUT.value, exist_ok=True)
    path = os.path.join(_OUT.value, f"sampling_invariance{_TAG.value}.json")
    with open(path, "w") as f:
        json.dump(receipt, f, indent=1)
    print(f"receipt: {path}")
    if bad:
        raise SystemExit("jspec's sampler is not row-invariant here")


if __name__ == "__main__":
    app.run(main)
