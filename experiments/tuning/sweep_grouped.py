"""Per-weight-shape tuning of the grouped expert matmuls (`pallas_kernels/moe.py`).

  python experiments/tuning/sweep_grouped.py --out=$OUT                 # H200, Qwen3-30B-A3B
  python experiments/tuning/sweep_grouped.py --interpret --preset=tiny-qwen3-moe --Ts=1,2 \
      --max_candidates=2 --iters=1 --reps=2                              # CPU smoke run

For the expert gate/up (fused GLU) and down weights [E, K, N] of a mixture-of-experts
preset (real shapes, random bf16 values) it times tile configurations of the grouped
kernels at blocks of --Ts tokens routed at random (k distinct experts a token, a new
routing for every launch of a timed loop, so the reads are the union's experts and
mostly cold). A config must not depend on the routing or the row count (R1, R9): the
winner is the config with the smallest SUM of times over --Ts. The row tile stays 16
(both kernels of `grouped_mlp` share one row layout); bn, bk, warps and stages vary,
with no split-K. Every timed call is one jitted loop of --reps launches; the time is the
median of --iters calls after warm-up, each ended by `block_until_ready`.

Each winner is checked on the device: every routed row computed alone equals the same
row inside the block of max(--Ts) tokens, bitwise. Writes sweep_grouped[_tag].json (every
candidate's times) and sweep_grouped[_tag]_tuned.json (rows {E, K, N, dtype, config} of
winners that beat the rule by --min_gain and are row-invariant); --write merges those into
the "grouped" table of pallas_kernels/matmul_tuned.json.

--mxfp4 (gpt-oss presets): the experts as random MXFP4 codes read by the packed kernels
(decoded in the K loop). Candidates then keep bk a multiple of 32 (else the weight would
be decoded before every launch), and a winner must also equal, bitwise, the float kernels
with the same config on the dequantized weights (the packed = dequantized check of the MoE
matrix); the entry is keyed by the float weight's shape, so both paths take it.

On the GPU a winner with another bk keeps the K order (each block's dot accumulates into
the running sum, as in the dense matmul: `matmul.SCHEDULE_FIELDS`), other fields never
touch it; the MoE parity matrix runs with the table before it is committed all the same.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from tqdm import tqdm

from jspec import cli, mxfp4
from jspec.bench import flag_checks
from jspec.bench.receipts import write_receipt
from jspec.bench.timing import median_time
from jspec.random_model import preset_config
from pallas_kernels.matmul import MatmulConfig
from pallas_kernels.moe import (
    grouped_config,
    grouped_matmul,
    grouped_matmul_glu,
    write_grouped_rows,
)

_PRESET = flags.DEFINE_string("preset", "qwen3-30b-a3b", "a mixture-of-experts preset")
_TS = flags.DEFINE_list("Ts", ["1", "5"], "tokens per block (k slots each); the winner "
                        "minimises the sum")
_MAX = flags.DEFINE_integer("max_candidates", 14, "candidate configs per weight")
_ITERS = flags.DEFINE_integer("iters", 5, "timed calls per measurement (median)")
_REPS = flags.DEFINE_integer("reps", 48, "launches per timed call, each on a new routing")
_MIN_GAIN = flags.DEFINE_float("min_gain", 0.03, "min. relative gain over the rule")
_WRITE = flags.DEFINE_bool("write", False, "merge the winners into matmul_tuned.json")
_INTERPRET = flags.DEFINE_bool("interpret", False, "CPU smoke run (timings mean nothing)")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")
_MXFP4 = flags.DEFINE_bool("mxfp4", False, "experts as MXFP4 codes (gpt-oss presets)")
flag_checks.require_mxfp4_preset(_MXFP4, _PRESET)

# (bn, bk, num_warps, num_stages), most promising first: on the H200 (2026-12-02d) wider
# column tiles won at the Qwen3-30B-A3B experts (bn 64 over 32 over 16, the 16s 1.4-1.8x
# slower), so wider ones with shallower K blocks come first; then deeper pipelining.
HAND_LIST = ((64, 128, 4, 5), (128, 64, 4, 4), (128, 64, 8, 4), (64, 64, 4, 6),
             (128, 32, 4, 6), (256, 32, 8, 4), (64, 256, 4, 3), (64, 128, 8, 4),
             (128, 64, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (32, 128, 2, 5),
             (16, 128, 2, 4))
# Packed weights (--mxfp4; 2880-wide gpt-oss experts: bk 32 or 64 divide K): the decode
# is per weight element whatever the row count. The packed loop carries its blocks 4 ahead
# (`moe.PRMT_PREFETCH`), [bk, bn] codes and scales each: compiled for sm_90, the rule (bn 64,
# bk 64, 4 warps) spills ~72 registers a loop body at that depth, and half the elements a
# thread (bn 32, bk 32 or 8 warps) fit without spills; 2 warps spill more. So those come first.
PACKED_LIST = ((32, 64, 4, 4), (64, 64, 8, 4), (64, 32, 4, 4), (32, 32, 4, 4),
               (32, 64, 4, 3), (64, 64, 8, 3), (32, 64, 8, 4), (64, 32, 4, 6),
               (32, 32, 4, 6), (64, 64, 4, 5), (64, 64, 2, 4), (16, 64, 2, 4))


def candidates(E: int, K: int, N: int, dtype, interpret: bool, packed: bool = False,
               col: int | None = None) -> list[MatmulConfig]:
    """The current rule first, then HAND_LIST (packed: PACKED_LIST) entries with bm 16
    (shared memory within 200 KiB, at least 2 K steps, no tile wider than N; bk dividing K
    and bn dividing `col` (default N; a GLU's half) on the GPU, as a padded weight is
    copied every launch; packed: bk a multiple of 32)."""
    rule = grouped_config(E, K, N, dtype, interpret)
    out = [rule]
    item = jnp.dtype(dtype).itemsize
    for bn, bk, warps, stages in PACKED_LIST if packed else HAND_LIST:
        c = MatmulConfig(bm=rule.bm, bn=bn, bk=bk, num_warps=warps, num_stages=stages,
                         split_k=1)
        smem = stages * (c.bm * bk + 2 * bk * bn) * item
        fits = interpret or (K % bk == 0 and (col or N) % bn == 0)
        if (c not in out and smem <= 200 * 1024 and K // bk >= 2 and bn <= N and fits
                and (not packed or bk % 32 == 0)):
            out.append(c)
    return out[:max(_MAX.value, 1)]


def routings(rng, reps: int, T: int, E: int, k: int) -> np.ndarray:
    """[reps, T k] int32: each token's k distinct experts, uniformly at random."""
    return np.stack([np.concatenate([rng.choice(E, k, replace=False) for _ in range(T)])
                     for _ in range(reps)]).astype(np.int32)


def kernel_fn(kind: str, cfg: MatmulConfig, activation: str, interpret: bool):
    """fn(x, ws, expert): ws = (w,) float weights or (codes, scales) MXFP4."""
    if kind == "gate_up":
        f = functools.partial(grouped_matmul_glu, activation=activation,
                              interpret=interpret, config=cfg)
    else:
        f = functools.partial(grouped_matmul, out_dtype=jnp.float32, interpret=interpret,
                              config=cfg)
    return lambda x, ws, expert: f(x, ws[0], expert, scales=ws[1] if len(ws) > 1 else None)


def looped(fn):
    """One jitted loop of len(experts) launches, each on its own routing."""

    @jax.jit
    def run(x, ws, experts):
        def body(i, acc):
            y = fn(x + acc.astype(x.dtype), ws, experts[i])
            return acc + y[0, 0].astype(jnp.float32) * 0
        return jax.lax.fori_loop(0, experts.shape[0], body, jnp.float32(0))

    return run


def same_bits(fn_a, ws_a, fn_b, ws_b, x, expert) -> bool:
    """Two kernels (configs, or packed and float weights) give the block the same bits."""
    return (np.asarray(fn_a(x, ws_a, expert)).tobytes()
            == np.asarray(fn_b(x, ws_b, expert)).tobytes())


def row_invariant(fn, x, w, expert) -> bool:
    """Each row alone equals itself inside the whole block, bitwise."""
    full = np.asarray(fn(x, w, expert))
    for r in range(x.shape[0]):
        alone = np.asarray(fn(x[r:r + 1], w, expert[r:r + 1]))
        if alone.tobytes() != full[r:r + 1].tobytes():
            return False
    return True


def main(argv):
    del argv
    cfg = preset_config(_PRESET.value, num_layers=1)
    if not cfg.moe:
        raise app.UsageError(f"--preset={_PRESET.value} has no mixture-of-experts layer")
    Ts = [int(t) for t in _TS.value]
    if not Ts or min(Ts) < 1:
        raise app.UsageError(f"--Ts must be >= 1; got {_TS.value}")
    interpret = _INTERPRET.value
    dtype = jnp.dtype(jnp.float32 if interpret else jnp.bfloat16)  # CPU: f32 tiles
    E, k, D, F = cfg.num_experts, cfg.experts_per_token, cfg.hidden_size, cfg.expert_size
    rng = np.random.default_rng(0)
    weights = {"gate_up": (D, 2 * F), "down": (F, D)}
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "preset": _PRESET.value, "E": E, "k": k, "Ts": Ts, "dtype": dtype.name,
              "reps": _REPS.value, "mxfp4": _MXFP4.value, "weights": {}}
    tuned = []
    for kind, (K, N) in weights.items():
        if _MXFP4.value:  # codes and scales; the float weight they stand for beside
            p = mxfp4.random_packed(jax.random.key(len(report["weights"])), E, K, N)
            ws = (p["mx"], p["scale"])
            dense = (mxfp4.dequantize(p["mx"], p["scale"], dtype),)
        else:
            ws = (jnp.asarray(rng.standard_normal((E, K, N)) * K**-0.5, dtype),)
        xs = {T: jnp.asarray(rng.standard_normal((T * k, K)), dtype) for T in Ts}
        routes = {T: jnp.asarray(routings(rng, _REPS.value, T, E, k)) for T in Ts}
        rows = []
        cands = candidates(E, K, N, dtype, interpret, _MXFP4.value,
                           N // 2 if kind == "gate_up" else N)
        for c in tqdm(cands, desc=f"{kind} [{E}, {K}, {N}]", file=sys.stdout):
            row = {"config": dataclasses.asdict(c), "us": {}}
            try:
                run = looped(kernel_fn(kind, c, cfg.activation, interpret))
                for T in Ts:
                    t = median_time(run, xs[T], ws, routes[T], iters=_ITERS.value, warmup=1)
                    row["us"][T] = t / _REPS.value * 1e6
                row["sum_us"] = sum(row["us"].values())
            except Exception as e:  # noqa: BLE001 - a config that does not compile
                row["error"] = f"{type(e).__name__}: {e}"[:500]
            rows.append(row)
        ok = [r for r in rows if "sum_us" in r]
        rule = rows[0]
        best = min(ok, key=lambda r: r["sum_us"]) if ok else None
        entry = {"K": K, "N": N, "candidates": rows, "rule": rule["config"],
                 "best": best and best["config"]}
        if best is not None and best is not rule and "sum_us" in rule:
            gain = 1 - best["sum_us"] / rule["sum_us"]
            c = MatmulConfig(**best["config"])
            T = max(Ts)
            fn = kernel_fn(kind, c, cfg.activation, interpret)
            inv = row_invariant(fn, xs[T], ws, routes[T][0])
            rule_fn = kernel_fn(kind, MatmulConfig(**rule["config"]), cfg.activation,
                                interpret)
            entry.update(gain=gain, row_invariant=inv, same_bits_as_rule=same_bits(
                fn, ws, rule_fn, ws, xs[T], routes[T][0]))
            if _MXFP4.value:
                entry["packed_equals_dequantized"] = same_bits(fn, ws, fn, dense, xs[T],
                                                               routes[T][0])
                inv = inv and entry["packed_equals_dequantized"]
            if inv and gain >= _MIN_GAIN.value:
                tuned.append({"E": E, "K": K, "N": N, "dtype": dtype.name,
                              "config": best["config"]})
        report["weights"][kind] = entry
        write_receipt(_OUT.value, "sweep_grouped", _TAG.value, report)
        print(f"{kind} [{E}, {K}, {N}]: rule {rule.get('us')} -> best {best and best['us']} "
              f"{best and best['config']} gain {entry.get('gain', 0):.3f} "
              f"invariant {entry.get('row_invariant')} same bits as the rule "
              f"{entry.get('same_bits_as_rule')} packed = dequantized "
              f"{entry.get('packed_equals_dequantized')}", flush=True)
    report["tuned"] = tuned
    path = write_receipt(_OUT.value, "sweep_grouped", _TAG.value, report)
    with open(path[:-len(".json")] + "_tuned.json", "w") as f:
        json.dump(tuned, f, indent=1)
    if _WRITE.value and tuned:
        write_grouped_rows(tuned)
        print("merged into pallas_kernels/matmul_tuned.json (grouped):", tuned)
    print(f"receipt: {path}")


if __name__ == "__main__":
    cli.run(main)
