"""Which kernels one forward step runs, what each costs, and which HLO op it came from.

  python experiments/hlo_kernels.py --preset=qwen3-0.6b --tokens=1 --out=$OUT      # H200
  python experiments/hlo_kernels.py --preset=tiny-qwen3 --context=32 --iters=2 \
      --backends=xla --out=/tmp/hlo                                                  # CPU smoke

For each backend: a random-weight model, a cache filled to --context by a prefill,
then one jitted forward of --tokens new tokens per row, timed (median of --iters
device-side repetitions) and traced once. Each costly kernel of the trace is matched
to its instruction in the compiled program's optimized HLO (kernel names are
instruction names with '.' turned into '_') and printed with the instruction's line
and the root of its fused computation, so "input_reduce_fusion_106" reads as, say, a
reduce over [1, 8, 2, 1, 576] of a multiply: the profile says what is slow, the HLO
says what it is. The optimized HLO of each backend is saved beside the JSON receipt.
The traced forward does not donate its cache (it runs again on the same one), so each
layer also shows two device copies of its K/V buffers that the generation loops,
which donate, do not have.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from trace_tools import device_events, summarize, traced  # noqa: E402

import jspec  # noqa: E402
from jspec.loading import default_interpret  # noqa: E402
from jspec.model import (
    _forward,  # noqa: E402
    with_options,  # noqa: E402
)
from jspec.random_model import random_model  # noqa: E402

_PRESET = flags.DEFINE_string("preset", "tiny-qwen3", "random-weight preset[:layers]")
_BACKENDS = flags.DEFINE_list("backends", ["xla", "pallas"], "backends to compile and trace")
_OPTIONS = flags.DEFINE_list("options", [], "speed options (x, no_x, plain, attn_split=N)")
_BATCH = flags.DEFINE_integer("batch", 1, "rows")
_TOKENS = flags.DEFINE_integer("tokens", 1, "new tokens per row in the traced forward")
_CONTEXT = flags.DEFINE_integer("context", 512, "tokens already in the cache")
_ITERS = flags.DEFINE_integer("iters", 20, "timed forwards (median)")
_TOP = flags.DEFINE_integer("top", 16, "costliest kernels listed per backend")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "output dir")
_TAG = flags.DEFINE_string("tag", "", "suffix of the receipt's file name")


def hlo_index(text: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(instruction name with '.'->'_' -> its line, computation name -> its body lines)."""
    lines, comps, cur = {}, {}, None
    for raw in text.splitlines():
        line = raw.strip()
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\([^)]*\)\s*->.*)?\{$", line)
        if head and "=" not in line.split("{")[0]:
            cur = head.group(1)
            comps[cur] = []
            continue
        if line == "}":
            cur = None
            continue
        m = re.match(r"^(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
        if m:
            lines[m.group(1).replace(".", "_").replace("-", "_")] = line
            if cur is not None:
                comps[cur].append(line)
    return lines, comps


def describe(name: str, lines: dict[str, str], comps: dict[str, list[str]]) -> dict:
    """The HLO instruction a kernel came from and the root of its fused computation."""
    key = name.replace(".", "_").replace("-", "_")
    line = lines.get(key, "")
    op = re.search(r'op_name="([^"]*)"', line)
    out = {"instruction": line.split(", metadata=")[0][:400], "op_name": op.group(1) if op else ""}
    called = re.search(r"calls=%?([\w.\-]+)", line)
    if called and called.group(1) in comps:
        body = comps[called.group(1)]
        out["root"] = next((b for b in body if b.startswith("ROOT")), "")[:400]
        out["ops"] = sorted({m.group(1) for b in body
                             for m in [re.search(r"=\s*\S+\s+([a-z\-]+)\(", b)] if m})
    return out


def run_backend(backend: str, tmp: str) -> dict:
    name, _, layers = _PRESET.value.partition(":")
    kw = {"num_layers": int(layers)} if layers else {}
    model = random_model(name, seed=0, dtype="bfloat16", interpret=default_interpret(), **kw)
    model = with_options(model, *_OPTIONS.value)
    model = model.with_backend(backend)
    B, T, C = _BATCH.value, _TOKENS.value, _CONTEXT.value
    V = model.config.vocab_size
    rng = np.random.default_rng(0)
    cache = jspec.init_cache(model, B, C + T)
    prompt = jnp.asarray(rng.integers(0, V, (B, C)), jnp.int32)
    _, cache = jax.jit(_forward)(model, prompt, cache)
    toks = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)

    step = jax.jit(lambda m, t, c: _forward(m, t, c)[0])  # the cache is not advanced
    compiled = step.lower(model, toks, cache).compile()
    text = compiled.as_text()
    jax.block_until_ready(compiled(model, toks, cache))
    times = []
    for _ in range(_ITERS.value):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(model, toks, cache))
        times.append(time.perf_counter() - t0)
    trace, _ = traced(lambda: jax.block_until_ready(compiled(model, toks, cache)),
                      os.path.join(tmp, backend))
    summary = summarize(device_events(trace), 1, _TOP.value)
    lines, comps = hlo_index(text)
    for e in summary.get("top", []):
        e["hlo"] = describe(e["name"], lines, comps)
    return {"backend": backend, "ms_host": 1e3 * float(np.median(times)), "trace": summary,
            "hlo_text": text}


def main(argv):
    del argv
    os.makedirs(_OUT.value, exist_ok=True)
    stem = os.path.join(_OUT.value, "hlo_kernels_" + _PRESET.value.replace(":", "-")
                        + (f"_{_TAG.value}" if _TAG.value else ""))
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "preset": _PRESET.value, "batch": _BATCH.value, "tokens": _TOKENS.value,
              "context": _CONTEXT.value, "options": _OPTIONS.value, "runs": []}
    tmp = tempfile.mkdtemp(prefix="jspec_hlo_")
    for backend in _BACKENDS.value:
        run = run_backend(backend, tmp)
        with gzip.open(f"{stem}_{backend}.hlo.txt.gz", "wt") as f:
            f.write(run.pop("hlo_text"))
        report["runs"].append(run)
        t = run["trace"]
        print(f"\n== {backend}: {run['ms_host']:.3f} ms per forward (host-timed median), "
              + (f"{t['events_per_step']:.0f} kernels, busy {t['busy_us_per_step']:.1f} us"
                 if t.get("device_events") else "no device timeline"))
        for e in t.get("top", []):
            h = e["hlo"]
            print(f"  {e['us_per_step']:8.1f} us {e['calls_per_step']:4.0f}x "
                  f"{e['us_per_call']:7.2f} us  {e['name'][:40]}")
            print(f"      {h.get('op_name', '')[-100:]}  {h.get('instruction', '')[:240]}")
            if h.get("root"):
                print(f"      root: {h['root'][:200]}")
                print(f"      ops: {' '.join(h.get('ops', []))}")
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    print(f"receipt: {stem}.json")


if __name__ == "__main__":
    app.run(main)
