"""Where a forward step's time goes: the device kernels of one step, from a profiler trace.

  python experiments/tuning/profile_step.py --preset=qwen3-30b-a3b --T=1 --out=$OUT   # H200
  python experiments/tuning/profile_step.py --preset=tiny-qwen3-moe --interpret \
      --dtype=float32 --context=16                                     # CPU smoke run

Builds the preset with random weights, prefills --context tokens, then traces one call of
the timed step loop of the benchmarks (`device_steps`: STEP_REPS forwards of a block of
--T tokens on the same cache) with `jax.profiler` (a Perfetto trace, the GPU's activity
through CUPTI). Every kernel event on the device's tracks is grouped by name; per forward
step the receipt holds each name's launches and microseconds, the kernels' busy time and
the step's span on the device (first kernel's start to last kernel's end, over
STEP_REPS), so `span - busy` is the time the device sat between kernels. Prints the top
kernels; writes profile_step_<preset>[_<tag>].json under --out (and keeps the trace's
.json.gz beside it with --keep_trace). On a CPU the trace has no device kernels: the run
only checks that the script works.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jspec.bench.receipts import write_receipt
from jspec.bench.timing import STEP_REPS, device_steps, median_time
from jspec.cache import init_cache
from jspec.cli import options_record
from jspec.model import forward_nodonate
from jspec.random_model import PRESETS, random_model

_PRESET = flags.DEFINE_string("preset", "qwen3-30b-a3b", "a random-model preset")
_LAYERS = flags.DEFINE_integer("layers", 0, "layers (0: the preset's)")
_B = flags.DEFINE_integer("batch", 1, "rows")
_T = flags.DEFINE_integer("T", 1, "block size (1: a decode step)")
_CONTEXT = flags.DEFINE_integer("context", 512, "tokens already in the cache")
_BACKEND = flags.DEFINE_enum("backend", "pallas", ["pallas", "xla"], "kernel backend")
_INTERPRET = flags.DEFINE_bool("interpret", False, "CPU smoke run")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "weights and activations")
_TOP = flags.DEFINE_integer("top", 25, "kernel names printed")
_KEEP = flags.DEFINE_bool("keep_trace", False, "copy the Perfetto trace next to the receipt")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_TAG = flags.DEFINE_string("tag", "", "receipt file name suffix")


def device_kernels(trace: dict) -> tuple[list[dict], list[str]]:
    """Complete events ("ph": "X") on the device's stream tracks of a Perfetto / Chrome
    trace (processes whose name names a GPU, "/device:GPU:0 ..."; of their threads those
    named "Stream ..." when there are any, so derived lines such as "XLA Ops" that
    repeat the kernels' time are left out), and the names of the tracks kept."""
    events = trace.get("traceEvents", [])
    meta = [e for e in events if e.get("ph") == "M"]
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in meta
             if e.get("name") == "process_name"}
    gpu = {pid for pid, n in procs.items() if "GPU" in n or "gpu" in n}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in meta
               if e.get("name") == "thread_name" and e["pid"] in gpu}
    streams = {key for key, n in threads.items() if n.startswith("Stream")}
    keep = (lambda e: (e["pid"], e.get("tid")) in streams) if streams else (
        lambda e: e["pid"] in gpu)
    kept = [e for e in events if e.get("ph") == "X" and "dur" in e and e.get("pid") in gpu
            and keep(e)]
    tracks = sorted({f"{procs[e['pid']]} / {threads.get((e['pid'], e.get('tid')), '')}"
                     for e in kept})
    return kept, tracks


def summarize(events: list[dict], steps: int) -> dict:
    """Per forward step: each kernel name's launches and microseconds (largest first), the
    kernels' busy time and the span from the first start to the last end."""
    if not events:
        return {"kernels": [], "busy_us": 0.0, "span_us": 0.0, "launches": 0.0}
    by = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        by[e["name"]][0] += 1
        by[e["name"]][1] += float(e["dur"])
    start = min(float(e["ts"]) for e in events)
    end = max(float(e["ts"]) + float(e["dur"]) for e in events)
    kernels = sorted(({"name": n, "launches": c / steps, "us": us / steps}
                      for n, (c, us) in by.items()), key=lambda r: -r["us"])
    return {"kernels": kernels, "busy_us": sum(r["us"] for r in kernels),
            "span_us": (end - start) / steps, "launches": len(events) / steps}


def main(argv):
    del argv
    if _PRESET.value not in PRESETS:
        raise app.UsageError(f"--preset={_PRESET.value!r}: choose from {sorted(PRESETS)}")
    if min(_B.value, _T.value, _CONTEXT.value) < 1:
        raise app.UsageError("--batch, --T and --context must be >= 1")
    kw = dict(interpret=_INTERPRET.value, dtype=_DTYPE.value)
    if _LAYERS.value:
        kw["num_layers"] = _LAYERS.value
    model = random_model(_PRESET.value, **kw).with_backend(_BACKEND.value)
    cfg = model.config
    B, T, C = _B.value, _T.value, _CONTEXT.value
    rng = np.random.default_rng(0)
    cache = init_cache(model, B, C + T + 16)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, C)).astype(np.int32))
    _, cache = forward_nodonate(model, prompt, cache)
    block = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32))
    step_s = median_time(device_steps, model, block, cache, iters=5, warmup=2) / STEP_REPS
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(device_steps(model, block, cache))
        paths = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        if not paths:
            sys.exit(f"no perfetto_trace.json.gz under the trace directory {d}")
        with gzip.open(paths[0], "rt") as f:
            trace = json.load(f)
        kept = None
        if _KEEP.value:
            os.makedirs(_OUT.value, exist_ok=True)
            kept = os.path.join(_OUT.value, f"profile_step_{_PRESET.value}"
                                f"{'_' + _TAG.value if _TAG.value else ''}.trace.json.gz")
            with open(paths[0], "rb") as src, open(kept, "wb") as dst:
                dst.write(src.read())
    kernels, tracks = device_kernels(trace)
    summary = summarize(kernels, STEP_REPS)
    report = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": jax.devices()[0].device_kind,
        "jax": jax.__version__, "preset": _PRESET.value, "layers": cfg.num_layers,
        "batch": B, "T": T, "context": C, "dtype": _DTYPE.value,
        "speed_options": options_record(model)["kernel"], "step_ms": step_s * 1e3,
        "steps_traced": STEP_REPS, "tracks": tracks, "trace": kept, **summary}
    path = write_receipt(_OUT.value, f"profile_step_{_PRESET.value}", _TAG.value, report)
    print(f"{_PRESET.value} ({cfg.num_layers} layers), B={B} T={T} context {C}, "
          f"{_BACKEND.value}: step {step_s * 1e3:.3f} ms timed; traced per step: "
          f"{summary['launches']:.0f} kernels, busy {summary['busy_us']:.0f} us, "
          f"span {summary['span_us']:.0f} us")
    print(f"{'us/step':>9s} {'launches':>8s} {'us each':>8s}  kernel")
    for r in summary["kernels"][:_TOP.value]:
        print(f"{r['us']:9.1f} {r['launches']:8.1f} {r['us'] / r['launches']:8.2f}  "
              f"{r['name'][:110]}")
    print(f"receipt: {path}")


if __name__ == "__main__":
    app.run(main)
