"""Does reading the next weights into the L2 beside the draft's kernel chain speed it up?

  python experiments/draft_prefetch.py --out=$OUT                          # H200
  python experiments/draft_prefetch.py --preset=tiny-qwen3 --context=16 --steps=2 \
      --iters=2 --out=/tmp/pf                                              # CPU smoke

A draft forward at batch 1 is a chain of ~650 small dependent kernels: each waits for
DRAM before its bytes (WORKSPACE_NOTES, launch floor). `ModelConfig.l2_prefetch = n`
adds, as each projection starts, a side reduction over the weight n projections ahead;
under XLA's CONCURRENT command-buffer scheduling nothing waits for it, so it can run
beside the chain and leave that weight in the L2 for its own matmul.

For each command-buffer scheduling mode (--modes; one child process each, since the mode
is an XLA flag), and each prefetch distance (--prefetch): a random-weight --preset model
on --backend, a cache filled to --context, and one jitted call of --steps one-token
forwards (each token the argmax of the last logits, the cache donated and rolled back
to --context at the start, so every call sees the same context), timed by its median
over --iters calls after a warm-up. Logits are checked bitwise against prefetch 0 in
the same mode and across modes (a hash). Receipt: draft_prefetch[_tag].json.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from receipts import write_receipt  # noqa: E402
from timing import median_time  # noqa: E402

import jspec  # noqa: E402
from jspec.cache import rollback  # noqa: E402
from jspec.loading import default_interpret  # noqa: E402
from jspec.model import _forward  # noqa: E402
from jspec.random_model import random_model  # noqa: E402

MODES = ("LHS", "CONCURRENT", "SERIALIZE")

_PRESET = flags.DEFINE_string("preset", "qwen3-0.6b", "random-weight preset[:layers]")
_BACKEND = flags.DEFINE_enum("backend", "xla", ["xla", "pallas"], "backend of the forward")
_CONTEXT = flags.DEFINE_integer("context", 768, "tokens in the cache before each call")
_STEPS = flags.DEFINE_integer("steps", 8, "one-token forwards per timed call")
_ITERS = flags.DEFINE_integer("iters", 30, "timed calls (median)")
_MODES = flags.DEFINE_list("modes", ["LHS", "CONCURRENT"],
                           f"XLA command-buffer scheduling modes, of {MODES}")
_PREFETCH = flags.DEFINE_list("prefetch", ["0", "1", "2"], "l2_prefetch distances")
_CHILD = flags.DEFINE_string("child", "", "internal: run one mode and print its JSON")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "output dir")
_TAG = flags.DEFINE_string("tag", "", "suffix of the receipt's file name")


def _digest(x) -> str:
    return hashlib.sha256(np.asarray(x).tobytes()).hexdigest()[:16]


class _Caller:
    """fn(model, tok, cache) called again and again on the cache it last returned."""

    def __init__(self, fn, model, tok, cache):
        self.fn, self.model, self.tok, self.cache = fn, model, tok, cache

    def __call__(self):
        out, self.cache = self.fn(self.model, self.tok, self.cache)
        return out


def run_mode() -> dict:
    """One process, one scheduling mode: every prefetch distance, timed and hashed."""
    name, _, layers = _PRESET.value.partition(":")
    kw = {"num_layers": int(layers)} if layers else {}
    base = random_model(name, seed=0, dtype="bfloat16", interpret=default_interpret(), **kw)
    base = base.with_backend(_BACKEND.value)
    V, C, N = base.config.vocab_size, _CONTEXT.value, _STEPS.value
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, V, (1, C)), jnp.int32)
    tok = jnp.asarray(rng.integers(0, V, (1, 1)), jnp.int32)
    prefilled = jax.jit(_forward)(base, prompt, jspec.init_cache(base, 1, C + N))[1]
    lens = prefilled.lengths

    def steps(model, t, cache):
        cache = rollback(cache, lens)
        for _ in range(N):  # unrolled: straight-line code, as the drafter's steps are
            logits, cache = _forward(model, t, cache)
            t = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
        return logits, cache

    fn = jax.jit(steps, donate_argnums=(2,))
    rows = []
    for p in (int(v) for v in _PREFETCH.value):
        model = base.replace(config=base.config.replace(l2_prefetch=p))
        cache = jax.tree.map(jnp.copy, prefilled)
        logits, cache = fn(model, tok, cache)
        digest = _digest(logits)
        sec = median_time(_Caller(fn, model, tok, cache), iters=_ITERS.value)
        rows.append({"prefetch": p, "ms_per_call": 1e3 * sec, "us_per_forward": 1e6 * sec / N,
                     "logits_sha": digest})
        print(f"  prefetch {p}: {1e6 * sec / N:8.1f} us a forward  logits {digest}", flush=True)
    return {"rows": rows}


def main(argv):
    del argv
    if _CHILD.value:
        print("JSON " + json.dumps(run_mode()), flush=True)
        return
    for m in _MODES.value:
        if m not in MODES:
            raise ValueError(f"--modes: {m!r} is not one of {MODES}")
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "preset": _PRESET.value, "backend": _BACKEND.value,
              "context": _CONTEXT.value, "steps": _STEPS.value, "modes": {}}
    for mode in _MODES.value:
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                            + f" --xla_gpu_command_buffer_scheduling_mode={mode}").strip()
        print(f"== mode {mode}", flush=True)
        argv = [sys.executable, __file__, f"--child={mode}"] + [
            a for a in sys.argv[1:] if not a.startswith("--child")]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if not ln.startswith("JSON ")]
        print("\n".join(lines), flush=True)
        got = [ln[5:] for ln in proc.stdout.splitlines() if ln.startswith("JSON ")]
        if proc.returncode or not got:
            print(proc.stderr[-3000:], flush=True)
            report["modes"][mode] = {"error": proc.stderr[-2000:], "rc": proc.returncode}
            continue
        report["modes"][mode] = json.loads(got[0])
    ref = None
    print(f"\n{'mode':<12}{'prefetch':>9}{'us/forward':>12}{'vs LHS p0':>11}  bits")
    for mode, res in report["modes"].items():
        for r in res.get("rows", []):
            ref = ref or r
            r["bits_equal_first"] = r["logits_sha"] == ref["logits_sha"]
            ratio = r["us_per_forward"] / ref["us_per_forward"]
            print(f"{mode:<12}{r['prefetch']:>9}{r['us_per_forward']:>12.1f}{ratio:>11.3f}  "
                  f"{'equal' if r['bits_equal_first'] else 'DIFFER'}")
    print("receipt:", write_receipt(_OUT.value, "draft_prefetch", _TAG.value, report))


if __name__ == "__main__":
    app.run(main)
