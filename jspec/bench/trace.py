"""Device timelines from `jax.profiler` traces: the kernels a run launched and their cost.

Used by the kernel benchmark and the tuning sweeps (`experiments/bench_kernels.py`,
`experiments/tuning/`) to time kernels device-side; `summarize` gives per-step figures
of a decode loop or speculative rounds.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os

import jax


def kind_of(name: str) -> str:
    """Coarse class of a device event by its name."""
    low = name.lower()
    if low.startswith("jspec_"):
        return "pallas"
    if "memcpy" in low or "memset" in low:
        return "copy"
    if any(s in low for s in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_")):
        return "gemm"
    return "xla"


def device_events(trace: dict) -> list[dict]:
    """Kernel/memcpy events of the first GPU's streams: [{name, ts, dur, op, stream}] (us;
    stream: the timeline line's name, e.g. "Stream #14(Compute)")."""
    procs, threads = {}, {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    gpus = sorted(p for p, n in procs.items() if "/device:GPU" in n)
    if not gpus:
        return []
    pid = gpus[0]
    names = {t: n for (p, t), n in threads.items() if p == pid}
    streams = {t for t, n in names.items() if n.lower().startswith("stream")}
    if not streams:  # unknown layout: every line except derived (module/op) lines
        streams = {t for t, n in names.items()
                   if not any(s in n for s in ("XLA", "Framework", "Step", "Module", "Op"))}
    return [{"name": e["name"], "ts": float(e["ts"]), "dur": float(e.get("dur", 0.0)),
             "op": _op_of(e.get("args") or {}), "stream": names.get(e["tid"], "")}
            for e in trace["traceEvents"]
            if e.get("ph") == "X" and e.get("pid") == pid and e.get("tid") in streams]


def _op_of(args: dict) -> str:
    """The framework op a kernel came from (JAX's name stack, e.g. ".../dot_general"), as
    far as the profiler recorded it: maps XLA's fusion names back to the model's ops."""
    for key in ("tf_op", "long_name", "hlo_op"):
        if args.get(key):
            return str(args[key])[:200]
    return ""


def summarize(events: list[dict], per: int, top: int) -> dict:
    """Per-step figures of a device timeline (`per` steps or rounds in it). `idle_gaps`:
    where the device sat between kernels, the costliest (kernel before, kernel after)
    pairs with their gaps and microseconds a step."""
    if not events:
        return {"device_events": 0, "note": "no device timeline in the trace (CPU run, or the "
                "profiler saw no GPU activity)"}
    events = sorted(events, key=lambda e: e["ts"])
    start = events[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in events)
    busy, cur_s, cur_e, last = 0.0, None, None, None
    gaps = collections.defaultdict(lambda: [0, 0.0])  # (before, after) -> [count, us]
    for e in events:  # union of intervals
        s, t = e["ts"], e["ts"] + e["dur"]
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
                g = gaps[(last[:80], e["name"][:80])]
                g[0] += 1
                g[1] += s - cur_e
            cur_s, cur_e, last = s, t, e["name"]
        elif t >= cur_e:
            cur_e, last = t, e["name"]
    busy += cur_e - cur_s
    by_kind, by_name = collections.Counter(), collections.defaultdict(lambda: [0, 0.0])
    count_kind = collections.Counter()
    ops = collections.defaultdict(collections.Counter)
    for e in events:
        k = kind_of(e["name"])
        by_kind[k] += e["dur"]
        count_kind[k] += 1
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += e["dur"]
        if e.get("op"):
            ops[e["name"]][e["op"]] += 1
    total = sum(e["dur"] for e in events)
    span = end - start
    costly = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "device_events": len(events), "per": per,
        "events_per_step": len(events) / per,
        "kernel_us_per_step": total / per, "busy_us_per_step": busy / per,
        "span_us_per_step": span / per, "idle_frac": 1.0 - busy / span if span else 0.0,
        "us_per_step_by_kind": {k: v / per for k, v in by_kind.most_common()},
        "events_per_step_by_kind": {k: v / per for k, v in count_kind.most_common()},
        "top": [{"name": n[:120], "kind": kind_of(n), "calls_per_step": c / per,
                 "us_per_step": t / per, "us_per_call": t / c,
                 "op": ops[n].most_common(1)[0][0] if ops[n] else ""}
                for n, (c, t) in costly],
        "idle_gaps": [{"before": b, "after": a, "gaps_per_step": c / per,
                       "us_per_step": t / per}
                      for (b, a), (c, t) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:12]],
    }


def traced(fn, log_dir: str):
    """Runs fn() (which must block) under jax.profiler; returns the parsed trace json."""
    jax.profiler.start_trace(log_dir)
    try:
        fn()
    finally:
        jax.profiler.stop_trace()
    paths = sorted(glob.glob(os.path.join(log_dir, "plugins", "profile", "*",
                                          "*.trace.json.gz")), key=os.path.getmtime)
    if not paths:
        return {}, None
    with gzip.open(paths[-1], "rb") as f:
        return json.load(f), paths[-1]
