"""What a chunk of speculative rounds costs: seconds against rounds, per round shape.

  python experiments/tuning/chunk_cost.py --preset=qwen3-8b --layers=12 --batches=1,32,64 \
      --out=$OUT                                                         # H200
  python experiments/tuning/chunk_cost.py --preset=tiny-qwen3 --interpret --dtype=float32 \
      --batches=2 --context=16 --rounds=0,1,2 --iters=1                  # CPU smoke run

The adaptive engine (`jspec.adaptive`) runs a chunk of rounds of one shape at a time and
prices a shape by its seconds a round, less a chunk's fixed cost. This times that directly:
for each batch, a prefill of --context random tokens a row under an oracle drafter over a
feature head with random weights (the benchmarks' setup; its reference tokens are random,
so no draft is accepted and a round's cost does not depend on acceptance), then for each
shape of `Adaptive(gammas=--shapes)` (0: a plain decode step) one `spec_loop` call of n
rounds for each n of --rounds, from the same state copied outside the clock (median of
--iters). The receipt holds each (shape, n)'s seconds, the least-squares line through
n >= 1 (the slope is the shape's seconds a round, the intercept a chunk's fixed cost) and
the time of one forward step of a single token (`device_steps`: what a serial decode
step costs on the device); a plot of seconds against rounds goes beside it.

Then, as the engine meets them (--engine_runs, default 2): `jspec.warm_up` and that many
adaptive `speculative_generate` runs of the same shapes without given costs, each run's
chunks in order (shape, rounds, seconds, timed) and the costs it measured. On a GPU a
program's first call on a run's state updates its XLA command buffers; the runs show
where that lands (a shape's first chunk in a run, which `jspec.adaptive` leaves untimed).
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jspec
from jspec import cli
from jspec.adaptive import shape_name
from jspec.bench import flag_checks
from jspec.bench.receipts import write_receipt
from jspec.bench.timing import STEP_REPS, device_steps, median_time
from jspec.cache import init_cache
from jspec.chunked_prefill import prefill_jit
from jspec.cli import options_record
from jspec.feature_head import random_head
from jspec.random_model import PRESETS, random_model
from jspec.spec_config import MAX_GAMMA, shape_spec
from jspec.speculative import _setup as spec_setup
from jspec.speculative import prefill as spec_prefill
from jspec.speculative import spec_loop

_PRESET = flags.DEFINE_string("preset", "qwen3-8b", "a random-model preset")
_LAYERS = flags.DEFINE_integer("layers", 12, "layers (0: the preset's)")
_BATCHES = flags.DEFINE_list("batches", ["1", "32", "64"], "rows")
_CONTEXT = flags.DEFINE_integer("context", 512, "prompt tokens a row")
_SHAPES = flags.DEFINE_list("shapes", ["0", "1", "2", "4"], "chain shapes (0: decode)")
_ROUNDS = flags.DEFINE_list("rounds", ["0", "1", "2", "4", "8", "16"], "rounds a chunk")
_ITERS = flags.DEFINE_integer("iters", 5, "timed calls a point (median)")
_HEAD_VOCAB = flags.DEFINE_integer("head_vocab", 32768, "the head's draft vocabulary")
_CATCH_UP = flags.DEFINE_integer("catch_up", 8, "FeatureDrafter(catch_up=)")
_ENGINE_RUNS = flags.DEFINE_integer("engine_runs", 2, "adaptive runs after warm_up (0: none)")
_INTERPRET = flags.DEFINE_bool("interpret", False, "CPU smoke run")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "weights and activations")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_TAG = flags.DEFINE_string("tag", "", "receipt file name suffix")
flag_checks.require_counts(_BATCHES, nonempty=True)
flag_checks.require_counts(_ROUNDS, least=0, nonempty=True)
flag_checks.require_counts(_SHAPES, least=0, most=MAX_GAMMA, nonempty=True)
flag_checks.require_counts(_ITERS, _CONTEXT)
flag_checks.require_counts(_ENGINE_RUNS, least=0)


def fit(ns, ts):
    """(slope, intercept) of the least-squares line through (n, t), n >= 1."""
    pts = [(n, t) for n, t in zip(ns, ts, strict=True) if n >= 1]
    if len(pts) < 2:
        return None, None
    a, b = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
    return float(a), float(b)


def batch_costs(model, B: int, rng) -> dict:
    V, C = model.config.vocab_size, _CONTEXT.value
    shapes = [int(s) for s in _SHAPES.value]
    rounds = sorted({int(n) for n in _ROUNDS.value})
    warm = 2  # rounds run before the timed chunks: past the prefill's first round
    N = warm + max(rounds) + 8
    prompt = rng.integers(0, V, (B, C)).astype(np.int32)
    ref = jnp.asarray(np.concatenate([prompt, rng.integers(0, V, (B, N)).astype(np.int32)], 1))
    hv = _HEAD_VOCAB.value
    head = random_head(model, draft_vocab_size=hv if 0 < hv < V else None)
    drafter = jspec.OracleDrafter(ref, corrupt_prob=jnp.float32(0.2),
                                  draft=jspec.FeatureDrafter(head, catch_up=_CATCH_UP.value))
    spec = jspec.SpecConfig(max_new_tokens=N,
                            adaptive=jspec.Adaptive(gammas=tuple(shapes)))
    tokens, lens, max_len, spec = spec_setup(model, drafter, prompt, spec, None)
    seed, spec = jnp.int32(0), spec.static()
    state = spec_prefill(model, drafter, jnp.asarray(tokens), jnp.asarray(lens), seed,
                         spec=spec, max_len=max_len)
    loops = {s: spec_loop.lower(model, drafter, state, seed, jnp.int32(0), None,
                                spec=shape_spec(spec, s)).compile() for s in shapes}
    first = max(shapes)  # a chain's round: the drafter has nothing pending afterwards
    base = jax.block_until_ready(loops[first](model, drafter, state, seed, jnp.int32(warm), None))
    out = {"batch": B, "max_len": max_len, "shapes": {}}
    for s in shapes:
        ts = []
        for n in rounds:
            stop = jnp.int32(warm + n)
            times = []
            for _ in range(_ITERS.value + 1):  # the first call: the program's first launch
                args = jax.block_until_ready(jax.tree.map(jnp.copy, base))
                t0 = time.perf_counter()
                jax.block_until_ready(loops[s](model, drafter, args, seed, stop, None))
                times.append(time.perf_counter() - t0)
            ts.append(float(np.median(times[1:])))
        slope, icpt = fit(rounds, ts)
        out["shapes"][shape_name(s)] = {"rounds": rounds, "seconds": ts,
                                        "s_per_round": slope, "intercept_s": icpt}
    out["engine_runs"] = []
    if _ENGINE_RUNS.value:
        spec = jspec.SpecConfig(max_new_tokens=N,
                                adaptive=jspec.Adaptive(gammas=tuple(shapes)))
        jspec.warm_up(model, drafter, prompt, spec)
        for _ in range(_ENGINE_RUNS.value):
            ad = jspec.speculative_generate(model, drafter, prompt, spec).stats["adaptive"]
            out["engine_runs"].append({k: ad[k] for k in ("history", "measured_s_per_round",
                                                          "empty_chunks_s")})
    cache = init_cache(model, B, max_len)
    cache = prefill_jit(model, jnp.asarray(prompt), jnp.full((B,), C, jnp.int32), cache).cache
    block = jnp.asarray(rng.integers(0, V, (B, 1)).astype(np.int32))
    steps = device_steps.lower(model, block, cache).compile()
    out["step_s"] = median_time(steps, model, block, cache, iters=_ITERS.value,
                                warmup=2) / STEP_REPS
    return out


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = report["batches"]
    fig, axes = plt.subplots(1, len(rows), figsize=(4.5 * len(rows), 3.8), squeeze=False)
    for ax, r in zip(axes[0], rows, strict=True):
        for name, s in r["shapes"].items():
            ax.plot(s["rounds"], [t * 1e3 for t in s["seconds"]], marker="o", label=name)
        n = max(max(s["rounds"]) for s in r["shapes"].values())
        ax.plot([0, n], [0, n * r["step_s"] * 1e3], "k--", label="forward step x n")
        ax.set(title=f"batch {r['batch']}", xlabel="rounds in the chunk", ylabel="ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv):
    del argv
    if _PRESET.value not in PRESETS:
        raise app.UsageError(f"--preset={_PRESET.value!r}: choose from {sorted(PRESETS)}")
    kw = dict(interpret=_INTERPRET.value, dtype=_DTYPE.value)
    if _LAYERS.value:
        kw["num_layers"] = _LAYERS.value
    model = random_model(_PRESET.value, **kw)
    rng = np.random.default_rng(0)
    rows = []
    for b in _BATCHES.value:
        r = batch_costs(model, int(b), rng)
        rows.append(r)
        print(f"B={r['batch']:3d} forward step {r['step_s'] * 1e3:7.3f} ms", flush=True)
        for name, s in r["shapes"].items():
            pts = " ".join(f"{n}:{t * 1e3:.2f}"
                           for n, t in zip(s["rounds"], s["seconds"], strict=True))
            line = (f"ms/round {s['s_per_round'] * 1e3:7.3f} intercept "
                    f"{s['intercept_s'] * 1e3:6.2f} ms" if s["s_per_round"] is not None else "")
            print(f"  {name:7s} {line}  (rounds:ms {pts})", flush=True)
        for i, run in enumerate(r["engine_runs"]):
            chunks = " ".join(f"{h[0]}x{h[1]}:{h[2] * 1e3:.2f}{'' if h[3] else '(untimed)'}"
                              for h in run["history"][:10])
            print(f"  engine run {i}: {chunks}", flush=True)
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": jax.devices()[0].device_kind,
              "jax": jax.__version__, "preset": _PRESET.value, "layers": model.config.num_layers,
              "context": _CONTEXT.value, "head_vocab": _HEAD_VOCAB.value,
              "catch_up": _CATCH_UP.value, "iters": _ITERS.value,
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "speed_options": options_record(model)["kernel"], "batches": rows}
    path = write_receipt(_OUT.value, f"chunk_cost_{_PRESET.value}", _TAG.value, report)
    plot(report, path[:-5] + ".png")
    print(f"receipt: {path}")


if __name__ == "__main__":
    cli.run(main)
