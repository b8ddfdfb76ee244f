"""Do split-KV attention's warps, stages, V-tail masking and a program per fold group
(--group_split) change its bits? Which is fastest for a batch-8 verify block?

  python experiments/tuning/sweep_attention.py --out=experiments/results   # H200
  python experiments/tuning/sweep_attention.py --interpret --preset=tiny-qwen3 --context=48 \
      --warps=4 --stages=1 --out=/tmp                                      # CPU smoke

A row's reduction order in `pallas_kernels.attention` is set by the key block
(block_k), the split-KV partition (split) and the fold order; num_warps and num_stages
only decide how a tile's work is spread over threads and how loads are pipelined, and
`v_masked_load` only how the V rows past the tile's last key become zeros. Whether the
compiler keeps every row's bits under those changes (the softmax's row max and row sum
reduce across threads of a tile) is a question for the device: this script runs every
variant of the Qwen3-8B attention shape at each (batch, tokens) of --batches x --tokens,
compares its output bitwise with the reference config (the kernel's GPU config with
the select after a plain load, as jspec ran it before masked loads), and times phase 1
and the fold device-side (profiler events of a jitted loop over enough cache copies to
miss the L2). Writes `sweep_attention[_tag].json` and prints a table.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from tqdm import tqdm

from jspec import cli
from jspec.bench.receipts import write_receipt
from jspec.bench.timing import median_time
from jspec.bench.trace import device_events, summarize, traced
from jspec.random_model import preset_config
from pallas_kernels.attention import AttentionConfig, attention, attention_config

_PRESET = flags.DEFINE_string("preset", "qwen3-8b", "model shape preset (heads, head_dim)")
_BATCHES = flags.DEFINE_list("batches", ["1", "8"], "batch sizes")
_TOKENS = flags.DEFINE_list("tokens", ["1", "5"], "query tokens per sequence (decode, verify)")
_CONTEXT = flags.DEFINE_integer("context", 512, "keys before the first query")
_WARPS = flags.DEFINE_list("warps", ["2", "4", "8"], "num_warps values")
_STAGES = flags.DEFINE_list("stages", ["1", "2", "3"], "num_stages values (phase 1)")
_MASKED = flags.DEFINE_list("masked", ["0", "1"], "v_masked_load values (0: select)")
_SPLIT_ROWS = flags.DEFINE_list("split_rows", [], "split row tiles (default: the config's)")
_SUBTILES = flags.DEFINE_list("serial_subtiles", [], "serial_subtiles values (default: the "
                              "config's): row tiles a program of the serial split (prefill "
                              "chunks, e.g. --tokens=2048) sharing its K/V loads")
_GROUP = flags.DEFINE_list("group_split", [], "group_split_programs values (default: the "
                           "config's; 1: a program per fold group whenever a call has two)")
_COLD = flags.DEFINE_integer("cold_mb", 256, "cache bytes cycled per timed loop (> L2; "
                             "at most 32 copies)")
_ITERS = flags.DEFINE_integer("iters", 5, "timed loops per variant")
_BUDGET = flags.DEFINE_float("budget_s", 400.0, "skip the variants left after this long")
_INTERPRET = flags.DEFINE_bool("interpret", False, "CPU smoke run (timings mean nothing)")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def inputs(cfg, batch: int, tokens: int, context: int, copies: int, block_k: int, key):
    """q [B, T, H, D], `copies` distinct (k, v) caches [B, Hkv, S, D] (random values past
    the last position too, as rejected drafts leave them), q_pos [B, T]."""
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    S = -(-(context + tokens + 16) // block_k) * block_k
    kq, kk = jax.random.split(key)
    q = jax.random.normal(kq, (batch, tokens, H, D), jnp.float32).astype(jnp.bfloat16)
    caches = []
    for c in range(copies):
        k1, k2 = jax.random.split(jax.random.fold_in(kk, c))
        caches.append(tuple(jax.random.normal(k, (batch, Hkv, S, D), jnp.float32)
                            .astype(jnp.bfloat16) for k in (k1, k2)))
    pos = context + jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))
    return q, caches, pos


def main(_):
    interp = _INTERPRET.value
    mcfg = preset_config(_PRESET.value)
    group = mcfg.num_heads // mcfg.num_kv_heads
    base = attention_config(mcfg.head_dim, group, jnp.bfloat16, interp)
    if not base.split:  # interpret mode's default is one pass: sweep the split path
        base = dataclasses.replace(base, split=2 * base.block_k)
    ref = dataclasses.replace(base, v_masked_load=False)
    rows_opts = [int(r) for r in _SPLIT_ROWS.value] or [base.split_rows]
    group_opts = [int(g) for g in _GROUP.value] or [base.group_split_programs]
    sub_opts = [int(g) for g in _SUBTILES.value] or [base.serial_subtiles]
    variants = [dataclasses.replace(base, num_warps=int(w), num_stages=int(s),
                                    v_masked_load=bool(int(m)), split_rows=r,
                                    group_split_programs=g, serial_subtiles=u)
                for m, w, s, r, g, u in itertools.product(
                    _MASKED.value, _WARPS.value, _STAGES.value, rows_opts, group_opts,
                    sub_opts)]
    variants = [ref] + [v for v in variants if v != ref]
    shapes = [(int(b), int(t)) for b in _BATCHES.value for t in _TOKENS.value]
    scale = float(mcfg.attn_scale)
    t0 = time.time()
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
              "preset": _PRESET.value, "context": _CONTEXT.value, "reference": vars(ref),
              "shapes": shapes, "variants": []}
    data, want = {}, {}
    for b, t in shapes:
        kv_bytes = 2 * b * mcfg.num_kv_heads * (_CONTEXT.value + t + 16) * mcfg.head_dim * 2
        copies = 1 if interp else min(32, max(1, int(np.ceil(_COLD.value * 2**20 / kv_bytes))))
        data[b, t] = inputs(mcfg, b, t, _CONTEXT.value, copies, base.block_k,
                            jax.random.key(b * 100 + t))

    def call(cfg: AttentionConfig, q, k, v, pos):
        return attention(q, k, v, pos, jnp.int32(0), scale=scale, interpret=interp,
                         config=cfg)

    def timed(cfg: AttentionConfig, b: int, t: int) -> dict:
        q, caches, pos = data[b, t]
        fn = jax.jit(lambda cs: [call(cfg, q, k, v, pos) for k, v in cs])
        jax.block_until_ready(fn(caches))
        with tempfile.TemporaryDirectory() as d:
            trace, _ = traced(lambda: [jax.block_until_ready(fn(caches))
                                       for _ in range(_ITERS.value)], d)
        events = [e for e in device_events(trace) if e["name"].startswith("jspec_attention")]
        n = _ITERS.value * len(caches)
        if not events:  # CPU: host time per call
            return {"us": 1e6 * median_time(fn, caches, iters=_ITERS.value) / len(caches)}
        out = {"us": summarize(events, n, 1)["kernel_us_per_step"]}
        for name in ("split", "combine", "group_split", "serial_split"):
            ev = [e for e in events if e["name"].startswith(f"jspec_attention_{name}")]
            out[f"{name}_us"] = sum(e["dur"] for e in ev) / n
        return out

    for cfg in tqdm(variants, desc="attention variants"):
        row = {"config": vars(cfg), "by_shape": {}}
        if time.time() - t0 > _BUDGET.value:
            report["variants"].append(row | {"skipped": "budget"})
            continue
        try:
            for b, t in shapes:
                q, caches, pos = data[b, t]
                got = bits(call(cfg, q, *caches[0], pos))
                if cfg == ref:
                    want[b, t] = got
                row["by_shape"][f"B{b}T{t}"] = {"bits_equal": bool(np.array_equal(
                    got, want[b, t]))} | timed(cfg, b, t)
        except Exception as e:  # a config Triton cannot build: recorded
            row["error"] = str(e).splitlines()[0][:200]
        report["variants"].append(row)

    ran = [v for v in report["variants"] if v["by_shape"] and "error" not in v]
    for v in ran:
        v["bits_equal"] = all(s["bits_equal"] for s in v["by_shape"].values())
    report["all_bits_equal"] = all(v["bits_equal"] for v in ran)
    path = write_receipt(_OUT.value, "sweep_attention", _TAG.value, report)
    print(f"{report['device']}, jax {jax.__version__}, {_PRESET.value} attention at "
          f"{_CONTEXT.value} keys; us per call (phase 1 + fold); bits vs the reference "
          f"(first row)")
    keys = [f"B{b}T{t}" for b, t in shapes]
    print(f"{'masked':>6s} {'warps':>5s} {'stages':>6s} {'rows':>4s} {'group':>5s} "
          f"{'subt':>4s} {'bits':>5s} "
          + " ".join(f"{k:>16s}" for k in keys))
    for v in report["variants"]:
        c = v["config"]
        head = (f"{int(c['v_masked_load']):6d} {c['num_warps']:5d} {c['num_stages']:6d} "
                f"{c['split_rows']:4d} {c['group_split_programs']:5d} "
                f"{c['serial_subtiles']:4d} ")
        if "error" in v or "skipped" in v:
            print(head + (v.get("error") or v.get("skipped"))[:80])
            continue
        cells = []
        for k in keys:
            s = v["by_shape"][k]
            cells.append(f"{s['us']:7.2f}" + (f" ({s['split_us']:5.2f})" if "split_us" in s
                                               else " " * 8))
        print(head + f"{str(v['bits_equal']):>5s} " + " ".join(f"{c_:>16s}" for c_ in cells))
    print(f"receipt: {path}")


if __name__ == "__main__":
    cli.run(main)
