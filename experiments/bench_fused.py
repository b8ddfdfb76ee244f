"""Tile sweep of the `fused` backend's kernels (pallas_kernels/fused_decode.py) on a GPU.

  python experiments/bench_fused.py --out=experiments/results          # H200
  python experiments/bench_fused.py --interpret --budget_s=30 --out=/tmp  # CPU smoke

At a draft shape (default Qwen3-0.6B: D 1024, 16 q / 8 kv heads of 128, F 3072) and
one or two rows, times every candidate `FusedConfig` of each fused kernel against the
xla ops it replaces (norm + dot, dot + add, norm + dot + GLU). Each timed call runs
the kernel over --copies weight copies (more bytes than the L2 holds, as in a
forward whose layers each bring their own weights), --iters times under the
profiler; the figure is device time (the busy span of the device events) per
kernel call, so host dispatch stays out of it (a CPU run, with no device timeline,
falls back to host timing). Prints the best config per kernel and writes a JSON
receipt.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from timing import median_time  # noqa: E402
from trace_tools import device_events, summarize, traced  # noqa: E402

from pallas_kernels import fused_decode as fd  # noqa: E402
from pallas_kernels.glu import glu_reference  # noqa: E402
from pallas_kernels.qk_rope import qk_norm_rope  # noqa: E402
from pallas_kernels.rmsnorm import rmsnorm_reference  # noqa: E402

_D = flags.DEFINE_integer("hidden", 1024, "hidden size")
_HQ = flags.DEFINE_integer("heads", 16, "query heads")
_HKV = flags.DEFINE_integer("kv_heads", 8, "kv heads")
_HD = flags.DEFINE_integer("head_dim", 128, "head dim")
_F = flags.DEFINE_integer("ffn", 3072, "MLP intermediate size")
_ROWS = flags.DEFINE_integer("rows", 1, "rows (B * T)")
_COPIES = flags.DEFINE_integer("copies", 8, "weight copies cycled per timed call")
_ITERS = flags.DEFINE_integer("iters", 10, "timed calls per candidate (median)")
_BUDGET = flags.DEFINE_float("budget_s", 200.0, "stop trying candidates after this")
_INTERPRET = flags.DEFINE_bool("interpret", False, "CPU smoke run (timings mean nothing)")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")


def _candidates(kind: str, interpret: bool):
    if interpret:
        return [None]
    if kind == "rope":
        grid = itertools.product([_HD.value], [64, 128, 256], [4, 8], [2, 4])
    elif kind == "residual":
        grid = itertools.product([16, 32], [128, 256, 512], [2, 4], [3])
    else:  # norm, glu
        grid = itertools.product([16, 32, 64], [128, 256, 512], [4], [3])
    return [None] + [fd.FusedConfig(bm=16, bn=bn, bk=bk, num_warps=w, num_stages=s)
                     for bn, bk, w, s in grid]


def main(_):
    interp = _INTERPRET.value
    D, H, Hkv, hd, F, M = _D.value, _HQ.value, _HKV.value, _HD.value, _F.value, _ROWS.value
    R = _COPIES.value
    dt = jnp.bfloat16
    key = iter(jax.random.split(jax.random.key(0), 64))

    def rnd(*shape, scale=1.0):
        return (jax.random.normal(next(key), shape, jnp.float32) * scale).astype(dt)

    x = rnd(M, D)
    nw = rnd(D)
    ang = jax.random.uniform(next(key), (M, hd // 2), jnp.float32, 0, 6)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    qw, kw = rnd(hd), rnd(hd)
    W = {"qkv": rnd(R, D, (H + 2 * Hkv) * hd, scale=D**-0.5),
         "gate_up": rnd(R, D, 2 * F, scale=D**-0.5),
         "wo": rnd(R, H * hd, D, scale=(H * hd) ** -0.5),
         "down": rnd(R, F, D, scale=F**-0.5)}
    a_o, a_f = rnd(M, H * hd), rnd(M, F)

    def over_copies(fn, w):
        return jax.jit(lambda w: [fn(w[r]) for r in range(R)])

    def per_call_us(fn, *args) -> float:  # device us per kernel call (host us on a CPU)
        jax.block_until_ready(fn(*args))
        with tempfile.TemporaryDirectory() as d:
            trace, _ = traced(lambda: [jax.block_until_ready(fn(*args))
                                       for _ in range(_ITERS.value)], d)
        events = device_events(trace)
        if not events:
            return 1e6 * median_time(fn, *args, iters=_ITERS.value) / R
        return summarize(events, _ITERS.value * R, 1)["busy_us_per_step"]

    KN = {"qkv": (D, hd), "gate_up": (D, F), "wo": (H * hd, D), "down": (F, D)}  # table keys
    kernels = {  # name: (kind, weight, fn(w, config), xla fn(w))
        "qkv+qk_rope": ("rope", "qkv",
                        lambda w, c: fd.norm_matmul_qk_rope(
                            x, nw, w, qw, kw, cos, sin, num_q=H, num_k=Hkv, eps=1e-6,
                            interpret=interp, config=c),
                        lambda w: fd.norm_matmul_qk_rope_reference(
                            x, nw, w, qw, kw, cos, sin, num_q=H, num_k=Hkv, eps=1e-6)),
        "qkv (norm_matmul)": ("norm", "qkv",
                              lambda w, c: fd.norm_matmul(x, nw, w, eps=1e-6, interpret=interp,
                                                          config=c),
                              lambda w: fd.norm_matmul_reference(x, nw, w, eps=1e-6)),
        "gate_up+glu": ("glu", "gate_up",
                        lambda w, c: fd.norm_matmul_glu(x, nw, w, eps=1e-6, activation="silu",
                                                        interpret=interp, config=c),
                        lambda w: glu_reference(*jnp.split(fd.norm_matmul_reference(
                            x, nw, w, eps=1e-6), 2, axis=-1), activation="silu")),
        "wo+residual": ("residual", "wo",
                        lambda w, c: fd.matmul_residual(a_o, w, x, interpret=interp, config=c),
                        lambda w: fd.matmul_residual_reference(a_o, w, x)),
        "down+residual": ("residual", "down",
                          lambda w, c: fd.matmul_residual(a_f, w, x, interpret=interp,
                                                          config=c),
                          lambda w: fd.matmul_residual_reference(a_f, w, x)),
    }
    heads = jnp.zeros((M, H + 2 * Hkv, hd), dt)
    hs = jnp.stack([heads] * R)
    qk_rope_us = per_call_us(over_copies(lambda h: qk_norm_rope(
        h, qw, kw, cos, sin, num_q=H, num_k=Hkv, eps=1e-6, interpret=interp), hs), hs)
    xs = jnp.stack([x] * R)
    norm_us = per_call_us(over_copies(lambda x: rmsnorm_reference(x, nw, eps=1e-6), xs), xs)

    t_start = time.time()
    rows = []
    total = sum(len(_candidates(k[0], interp)) for k in kernels.values())
    bar = tqdm(total=total, desc="candidates")
    for name, (kind, wname, fn, ref) in kernels.items():
        w = W[wname]
        xla_us = per_call_us(over_copies(ref, w), w)
        want = np.asarray(ref(w[0]), np.float32)
        for c in _candidates(kind, interp):
            bar.update(1)
            bar.set_postfix_str(name)
            if time.time() - t_start > _BUDGET.value:
                continue
            try:
                got = np.asarray(fn(w[0], c), np.float32)
                us = per_call_us(over_copies(lambda w_, c=c, fn=fn: fn(w_, c), w), w)
            except Exception as e:  # a config Triton cannot build: recorded, skipped
                rows.append({"kernel": name, "config": None if c is None else vars(c),
                             "error": str(e).splitlines()[0][:200]})
                continue
            err = float(np.abs(got - want).max())
            rows.append({"kernel": name, "config": None if c is None else vars(c), "us": us,
                         "xla_us": xla_us, "max_abs_err": err})
    bar.close()

    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, rows {M}; xla "
          f"rmsnorm {norm_us:.2f} us, pallas qk_norm_rope {qk_rope_us:.2f} us")
    print(f"{'kernel':20s} {'default us':>10s} {'best us':>8s} {'xla us':>7s}  best config")
    best = {}
    for name in kernels:
        ok = [r for r in rows if r["kernel"] == name and "us" in r]
        if not ok:
            print(f"{name:20s} no config ran")
            continue
        dflt = next((r["us"] for r in ok if r["config"] is None), float("nan"))
        b = min(ok, key=lambda r: r["us"])
        best[name] = b
        print(f"{name:20s} {dflt:10.2f} {b['us']:8.2f} {b['xla_us']:7.2f}  {b['config']}")
    os.makedirs(_OUT.value, exist_ok=True)
    # The winners that beat the default rule, as a table fused_decode.TUNED (or
    # $JSPEC_FUSED_TUNED) takes: (kind, K, N) -> config.
    tuned = []
    for name, b in best.items():
        kind, wname = kernels[name][0], kernels[name][1]
        if b["config"] is not None and kind != "norm":
            tuned.append({"kind": kind, "K": KN[wname][0], "N": KN[wname][1],
                          "config": b["config"], "us": b["us"], "xla_us": b["xla_us"]})
    with open(os.path.join(_OUT.value, "bench_fused_tuned.json"), "w") as f:
        json.dump(tuned, f, indent=1)
    path = os.path.join(_OUT.value, "bench_fused.json")
    with open(path, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                   "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
                   "shape": {"hidden": D, "heads": H, "kv_heads": Hkv, "head_dim": hd,
                             "ffn": F, "rows": M}, "copies": R, "xla_rmsnorm_us": norm_us,
                   "pallas_qk_norm_rope_us": qk_rope_us, "best": best, "rows": rows}, f,
                  indent=1)
    print(f"receipt: {path}")


if __name__ == "__main__":
    app.run(main)
