"""Where a decode step and a speculative round spend their time, from a device trace.

  python experiments/profile_step.py --target=qwen3-8b --draft=qwen3-0.6b --out=$OUT   # H200
  python experiments/profile_step.py --target=tiny-qwen3 --draft=tiny-qwen3:1 \
      --prompt_len=16 --steps=4 --backends=pallas --out=/tmp/prof                  # CPU smoke

For each backend, three workloads run after their prefill, each compiled and
warmed up first, then timed (median of --iters, untraced) and traced once with
`jax.profiler`; the prefill is outside both the timing and the trace:
  serial     jspec's serial decode loop, --steps tokens;
  spec       the speculative loop, oracle drafter at --accept and --gamma, with the
             draft model really running (its proposals discarded);
  spec_nodraft  the same rounds without the draft model (verify + bookkeeping).
From each trace's device timeline (kernel and memcpy events on the GPU's
streams) it reports, per step or round: kernels launched, their summed time,
the busy time (union of intervals), the span from the first kernel to the last,
the idle share of the span (launch gaps, host syncs), time by kind (jspec Pallas
kernels, XLA fusions, library GEMMs, copies), and the costliest kernels.
XLA_FLAGS pass through (e.g. --xla_gpu_enable_command_buffer= to see every
kernel; with command buffers on, captured kernels may show as graph launches).
The JSON receipt holds the summaries; --keep_traces adds each run's device
timeline ([{name, ts, dur}] in us) to one tar.gz. On a CPU there is no device
timeline: the timings still run, the trace summaries say so.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import tarfile
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import jspec  # noqa: E402
from jspec.config import SPEED_OPTIONS  # noqa: E402
from jspec.generate import GREEDY, decode_loop  # noqa: E402
from jspec.generate import prefill as serial_prefill  # noqa: E402
from jspec.loading import default_interpret  # noqa: E402
from jspec.model import with_options  # noqa: E402
from jspec.random_model import random_model  # noqa: E402
from jspec.speculative import prefill as spec_prefill  # noqa: E402
from jspec.speculative import spec_loop  # noqa: E402
from pallas_kernels.matmul import TUNED, tuned_to_json  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from gpu_monitor import GpuMonitor  # noqa: E402
from trace_tools import device_events, summarize, traced  # noqa: E402

_TARGET = flags.DEFINE_string("target", "tiny-qwen3", "random-weight preset[:layers]")
_DRAFT = flags.DEFINE_string("draft", "tiny-qwen3:1", "random-weight preset[:layers]")
_BACKENDS = flags.DEFINE_list("backends", ["pallas", "xla"], "target backends")
_DRAFT_BACKEND = flags.DEFINE_enum("draft_backend", "xla", ["pallas", "xla"],
                                   "backend of the draft model (never changes the output)")
WORKLOADS = ("serial", "spec", "spec_nodraft")
_WORKLOADS = flags.DEFINE_list("workloads", list(WORKLOADS), "what to time and trace: "
                               + ", ".join(WORKLOADS))
flags.register_validator("workloads", lambda v: bool(v) and set(v) <= set(WORKLOADS),
                         message=f"--workloads takes a list of {', '.join(WORKLOADS)}")
_OPTIONS = flags.DEFINE_list("options", [], "speed options (x, no_x, plain) for target and draft")
_DRAFT_OPTIONS = flags.DEFINE_list("draft_options", ["draft"], "options for the draft alone, "
                                   "after --options ('draft': jspec.config.DRAFT_OPTIONS)")
_DRAFT_HEAD = flags.DEFINE_integer("draft_head", 0, "> 0: the draft's LM head keeps ids "
                                   "0..n-1 (ModelDrafter.pruned); 0: the full head")
_BATCH = flags.DEFINE_integer("batch", 1, "rows")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 512, "prompt tokens")
_STEPS = flags.DEFINE_integer("steps", 32, "tokens generated per row (serial and spec)")
_GAMMA = flags.DEFINE_integer("gamma", 4, "draft proposals per round")
_ACCEPT = flags.DEFINE_float("accept", 0.8, "oracle acceptance rate")
_ITERS = flags.DEFINE_integer("iters", 3, "untraced timed repetitions (median)")
_TOP = flags.DEFINE_integer("top", 12, "costliest kernels listed per workload")
_KEEP = flags.DEFINE_bool("keep_traces", False, "pack the raw traces into one tar.gz")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "output dir")
_TAG = flags.DEFINE_string("tag", "", "suffix of the receipt's file name")


def load(spec: str, seed: int, backend: str) -> jspec.Model:
    name, _, layers = spec.partition(":")
    kw = {"num_layers": int(layers)} if layers else {}
    m = random_model(name, seed=seed, dtype="bfloat16", interpret=default_interpret(), **kw)
    m = with_options(m, *_OPTIONS.value)
    return m.with_backend(backend)


def workloads(target: jspec.Model, draft: jspec.Model, B: int, P: int, N: int):
    """name -> (prep() -> state after the prefill, loop(state) -> steps or rounds run);
    only `loop` is timed and traced."""
    V = target.config.vocab_size
    prompts = jnp.asarray(np.random.default_rng(0).integers(0, V, (B, P)), jnp.int32)
    lens = jnp.full((B,), P, jnp.int32)
    max_len = P + N + _GAMMA.value + 1
    ref = jnp.concatenate([prompts, jnp.asarray(np.random.default_rng(1).integers(
        0, V, (B, N + _GAMMA.value + 1)), jnp.int32)], axis=1)
    spec = jspec.SpecConfig(gamma=_GAMMA.value, max_new_tokens=N).static()
    seed = jnp.int32(0)

    def serial_prep():
        cache = jspec.init_cache(target, B, max_len)
        return jax.block_until_ready(serial_prefill(target, prompts, lens, cache))

    def serial_loop(state):
        logits, cache = state
        st = jax.block_until_ready(decode_loop(target, cache, logits, seed, max_new_tokens=N,
                                               sampler=GREEDY, stop_tokens=()))
        return int(st.step)

    model_drafter = (jspec.ModelDrafter.pruned(draft, np.arange(_DRAFT_HEAD.value))
                     if _DRAFT_HEAD.value else jspec.ModelDrafter(draft))

    def make_spec(with_draft: bool):
        drafter = jspec.OracleDrafter(
            ref, corrupt_prob=jnp.float32(1.0 - _ACCEPT.value),
            draft=model_drafter if with_draft else None)

        def prep():
            return jax.block_until_ready(spec_prefill(target, drafter, prompts, lens, seed,
                                                      spec=spec, max_len=max_len))

        def loop(state):
            st = jax.block_until_ready(spec_loop(target, drafter, state, seed, spec=spec))
            return int(st.step)
        return prep, loop

    fns = {"serial": (serial_prep, serial_loop), "spec": make_spec(True),
           "spec_nodraft": make_spec(False)}
    return {w: fns[w] for w in _WORKLOADS.value}


def measure(prep, loop, iters: int, log_dir: str):
    """(warm-up s, median loop s, steps of the last run, trace of one more run, the
    GpuMonitor summary of the timed runs): every run starts from a fresh prep(); only
    loop(state) is timed and traced."""

    def once():
        state = prep()
        t0 = time.perf_counter()
        steps = loop(state)
        return time.perf_counter() - t0, steps

    warm = once()[0]  # compile + warm-up
    with GpuMonitor() as mon:  # what the GPU ran at during the timed runs
        runs = [once() for _ in range(iters)]
    state = prep()
    trace, _ = traced(lambda: loop(state), log_dir)
    return warm, float(np.median([t for t, _ in runs])), runs[-1][1], trace, mon.summary()


def main(argv):
    del argv
    B, P, N = _BATCH.value, _PROMPT_LEN.value, _STEPS.value
    os.makedirs(_OUT.value, exist_ok=True)
    stem = os.path.join(_OUT.value, "profile_step" + (f"_{_TAG.value}" if _TAG.value else ""))
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "matmul_tuned": tuned_to_json(TUNED),
              "target": _TARGET.value, "draft": _DRAFT.value,
              "draft_backend": _DRAFT_BACKEND.value, "options": _OPTIONS.value,
              "draft_options": _DRAFT_OPTIONS.value, "draft_head": _DRAFT_HEAD.value or None,
              "batch": B,
              "prompt_len": P, "steps": N, "gamma": _GAMMA.value, "accept": _ACCEPT.value,
              "runs": [], "complete": False}
    draft = load(_DRAFT.value, 1, _DRAFT_BACKEND.value)
    draft = with_options(draft, *_DRAFT_OPTIONS.value)
    report["speed_options"] = {f: getattr(draft.config, f) for f in SPEED_OPTIONS}
    tmp = tempfile.mkdtemp(prefix="jspec_profile_")
    kept = []
    todo = [(be, w) for be in _BACKENDS.value for w in _WORKLOADS.value]
    models = {}
    for be, w in tqdm(todo, desc="profile", unit="run"):
        if be not in models:
            models = {be: load(_TARGET.value, 0, be)}  # one target on the device at a time
        prep, loop = workloads(models[be], draft, B, P, N)[w]

        warm, loop_s, steps, trace, gpu = measure(prep, loop, _ITERS.value,
                                                  os.path.join(tmp, f"{be}_{w}"))
        events = device_events(trace)
        if _KEEP.value:  # the device timeline only: a full trace is mostly host events
            path = os.path.join(tmp, f"{be}_{w}.events.json.gz")
            with gzip.open(path, "wt") as f:
                json.dump(events, f)
            kept.append((path, os.path.basename(path)))
        row = {"backend": be, "workload": w, "steps": steps, "warmup_s": warm,
               "loop_s": loop_s, "ms_per_step": 1e3 * loop_s / max(steps, 1),
               "tokens_per_s": B * N / loop_s,
               "trace": summarize(events, max(steps, 1), _TOP.value), "gpu": gpu}
        report["runs"].append(row)
        with open(stem + ".json", "w") as f:
            json.dump(report, f, indent=1)
        tr = row["trace"]
        tqdm.write(f"{be:6s} {w:12s} {steps:4d} steps  {row['ms_per_step']:8.3f} ms/step  "
                   + (f"kernels {tr['events_per_step']:6.0f}/step  busy "
                      f"{tr['busy_us_per_step'] / 1e3:7.3f} ms  idle {tr['idle_frac']:.2f}"
                      if tr.get("device_events") else "(no device timeline)"))
    if kept:
        with tarfile.open(stem + "_traces.tar.gz", "w:gz") as tar:
            for path, name in kept:
                tar.add(path, arcname=name)
    report["complete"] = True
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    print_table(report)


def print_table(report: dict) -> None:
    print(f"\n{report['device']}, jax {report['jax']}, XLA_FLAGS={report['xla_flags']!r}")
    print("| backend | workload | ms/step | kernels/step | kernel ms | busy ms | span ms | idle "
          "| pallas ms | xla ms | gemm ms | copy ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in report["runs"]:
        t = r["trace"]
        if not t.get("device_events"):
            print(f"| {r['backend']} | {r['workload']} | {r['ms_per_step']:.3f} | - | - | - | "
                  "- | - | - | - | - | - |")
            continue
        k = t["us_per_step_by_kind"]
        print(f"| {r['backend']} | {r['workload']} | {r['ms_per_step']:.3f} | "
              f"{t['events_per_step']:.0f} | {t['kernel_us_per_step'] / 1e3:.3f} | "
              f"{t['busy_us_per_step'] / 1e3:.3f} | {t['span_us_per_step'] / 1e3:.3f} | "
              f"{t['idle_frac']:.2f} | "
              + " | ".join(f"{k.get(c, 0.0) / 1e3:.3f}" for c in ("pallas", "xla", "gemm", "copy"))
              + " |")
    for r in report["runs"]:
        for e in r["trace"].get("top", [])[:8]:
            print(f"  {r['backend']:6s} {r['workload']:12s} {e['us_per_step']:9.1f} us/step "
                  f"{e['calls_per_step']:6.1f} calls {e['us_per_call']:8.2f} us/call  "
                  f"{e['kind']:6s} {e['name'][:50]}  {e.get('op', '')[-60:]}")


if __name__ == "__main__":
    app.run(main)
