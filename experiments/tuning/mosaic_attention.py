"""Split-KV attention on Mosaic GPU, on the device: bits and speed against Triton.

  python experiments/tuning/mosaic_attention.py --out=$OUT            # H200, ~1-2 minutes
  python experiments/tuning/mosaic_attention.py --smoke --out=/tmp/r  # CPU, interpret mode

At the Llama-3-8B attention shape (32 query heads, 8 kv heads, head_dim 128, bf16,
partitions of 128 keys) and each context c in --contexts (random K/V; past each token's
position the cache holds NaN keys and inf values, as a rejected draft's or an unused
slot's garbage might):

1. Bits: the outputs of the tokens at positions c - 33 .. c - 1 (a 33-token verify block)
   computed in blocks of every T in --Ts (block i of T covers tokens i*T ..), each token
   against the same token computed alone (T = 1, one decode step), beside 7 other batch
   rows, and in a cache of twice the capacity: `mismatching_tokens` counts the tokens
   whose output differs anywhere (0 is property P for this kernel).
2. Accuracy against `attention_reference` (f32): the largest difference.
3. Speed: `pallas_kernels.mosaic.attention.attention` against the Triton split path
   (`pallas_kernels.attention.attention`, split 128) at batch 1 and 8, T = 1 and 5: each
   a jitted loop of --reps dependent calls (the output feeds the next query), median of
   --iters rounds after warm-up with `block_until_ready`, the kernels taking turns in a
   round (a drifting clock favours none); us per call. With --variants, also
   the Mosaic kernels' scheduling variants (one K/V slot a split program: `KV_SLOTS` 1;
   the fold in one launch: `GROUP_PROGRAMS` False), each output checked bitwise against
   the default's (`variant_bits_equal`).
4. With --splits, other partition sizes (a numeric choice: each split is its own bits):
   for each, Mosaic's and Triton's kernels at that split timed beside the rest
   (`mosaic_split<S>`, `triton_split<S>`), and Mosaic's P check of 1. at that split
   (`mismatching_tokens_split<S>`).

Writes --out/mosaic_attention[_tag].json. --smoke: a tiny shape in interpret mode (a test
of the script; its timings mean nothing).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from jspec import cli
from jspec.bench.receipts import receipt_stem, write_receipt
from pallas_kernels.attention import attention as triton_attention
from pallas_kernels.attention import attention_reference
from pallas_kernels.mosaic import attention as mosaic_module
from pallas_kernels.mosaic.attention import attention as mosaic_attention

_CONTEXTS = flags.DEFINE_list("contexts", ["2048", "8192"], "cache positions of the block")
_TS = flags.DEFINE_list("Ts", ["1", "5", "17", "33"], "verify block sizes")
_ITERS = flags.DEFINE_integer("iters", 10, "timed calls per measurement (median)")
_REPS = flags.DEFINE_integer("reps", 20, "dependent attention calls per timed call")
_SMOKE = flags.DEFINE_bool("smoke", False, "CPU: a tiny shape, interpret mode")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")
_VARIANTS = flags.DEFINE_bool("variants", True, "also time the scheduling variants")
_SPLITS = flags.DEFINE_list("splits", [], "other keys-a-partition values to check and time")

# Scheduling variants: module settings of pallas_kernels.mosaic.attention (same bits).
VARIANTS = {"mosaic_kv_slots_1": {"KV_SLOTS": 1},
            "mosaic_fold_one_launch": {"GROUP_PROGRAMS": False},
            "mosaic_kv_slots_1_fold_one_launch": {"KV_SLOTS": 1, "GROUP_PROGRAMS": False}}


def with_settings(settings: dict, fn, *args):
    """fn(*args) compiled under the module settings (restored after; caches cleared)."""
    old = {name: getattr(mosaic_module, name) for name in settings}
    try:
        for name, value in settings.items():
            setattr(mosaic_module, name, value)
        jax.clear_caches()
        return fn(*args)
    finally:
        for name, value in old.items():
            setattr(mosaic_module, name, value)
        jax.clear_caches()

SPLIT = 128


def bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


def cache(key, batch, heads, length, d, valid):
    """K, V [batch, heads, length, d] bf16, slots >= valid: NaN keys, inf values."""
    kk, kv = jax.random.split(key)
    k = jax.random.normal(kk, (batch, heads, length, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (batch, heads, length, d), jnp.float32).astype(jnp.bfloat16)
    past = jnp.arange(length)[:, None] >= valid
    return jnp.where(past, jnp.nan, k).astype(k.dtype), jnp.where(past, jnp.inf, v).astype(v.dtype)


def run_bits(fn, *args) -> np.ndarray:
    return bits(jax.jit(fn)(*args))


def check_bits(run, q, k, v, c: int, Ts: list[int], key) -> dict:
    """Tokens c - n .. c - 1 (n = max Ts) in blocks of each T, in a batch of 8, in a cache
    of twice the capacity, against each token alone."""
    n = max(Ts)
    pos = jnp.arange(c - n, c, dtype=jnp.int32)
    alone = np.stack([bits(run(q[:, i:i + 1], k, v, pos[None, i:i + 1])[0, 0])
                      for i in range(n)])  # [n, H, D]
    out = {}
    for T in Ts:
        if T == 1:
            continue
        got = []
        for s in range(0, n, T):
            e = min(s + T, n)
            got.append(bits(run(q[:, s:e], k, v, pos[None, s:e])[0]))
        out[f"block_{T}"] = int((np.concatenate(got) != alone).any(axis=(1, 2)).sum())
    # Beside 7 other rows (their own tokens and caches), and in a cache of 2x capacity
    # whose extra slots hold garbage: each token in a block of n.
    ko, vo = cache(key, 7, k.shape[1], k.shape[2], k.shape[3], k.shape[2])
    qo = jax.random.normal(key, (7, n) + q.shape[2:], jnp.float32).astype(q.dtype)
    got = run(jnp.concatenate([q, qo]), jnp.concatenate([k, ko]), jnp.concatenate([v, vo]),
              jnp.concatenate([pos[None], jnp.broadcast_to(pos, (7, n))]))
    out["batch_of_8"] = int((bits(got[0]) != alone).any(axis=(1, 2)).sum())
    pad = [(0, 0), (0, 0), (0, k.shape[2]), (0, 0)]
    k2 = jnp.pad(k, pad, constant_values=jnp.nan)
    v2 = jnp.pad(v, pad, constant_values=jnp.inf)
    out["cache_x2"] = int((bits(run(q, k2, v2, pos[None])[0]) != alone).any(axis=(1, 2)).sum())
    out["tokens"] = n
    return out


def compile_loop(fn, q, k, v, pos):
    """fn as a jitted loop of --reps dependent calls (the output feeds the next query)."""
    reps = 2 if _SMOKE.value else _REPS.value

    def loop(q, k, v, pos):
        return jax.lax.fori_loop(0, reps, lambda _, q: fn(q, k, v, pos), q)

    return jax.jit(loop).lower(q, k, v, pos).compile()


def interleaved_us(compiled: dict, *args) -> dict:
    """us per call of each compiled loop: one warm-up each, then --iters rounds in which
    every loop runs once in turn (a drifting clock favours none); medians."""
    reps, iters = (2, 1) if _SMOKE.value else (_REPS.value, _ITERS.value)
    for fn in compiled.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in compiled}
    for _ in range(iters):
        for name, fn in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) / reps * 1e6 for name, ts in times.items()}


def main(argv):
    del argv
    smoke = _SMOKE.value
    heads, kv_heads, d = (8, 2, 64) if smoke else (32, 8, 128)
    contexts = [256] if smoke else [int(c) for c in _CONTEXTS.value]
    Ts = [1, 3, 5] if smoke else sorted({int(t) for t in _TS.value})
    scale = d ** -0.5
    win = jnp.int32(0)
    mosaic = functools.partial(mosaic_attention, scale=scale, split=SPLIT, interpret=smoke)
    triton = functools.partial(triton_attention, scale=scale, split=SPLIT, interpret=smoke)
    run = jax.jit(lambda q, k, v, pos: mosaic(q, k, v, pos, win))
    others, split_runs = {}, {}  # --splits: both kernels timed, Mosaic's bits checked
    for S in sorted({int(x) for x in _SPLITS.value} - {SPLIT}):
        others[f"mosaic_split{S}"] = functools.partial(mosaic_attention, scale=scale, split=S,
                                                       interpret=smoke)
        others[f"triton_split{S}"] = functools.partial(triton_attention, scale=scale, split=S,
                                                       interpret=smoke)
        split_runs[S] = jax.jit(lambda q, k, v, pos, f=others[f"mosaic_split{S}"]:
                                f(q, k, v, pos, win))
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "smoke": smoke,
              "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": d, "split": SPLIT},
              "Ts": Ts, "reps": _REPS.value, "iters": _ITERS.value, "contexts": []}
    path = receipt_stem(_OUT.value, "mosaic_attention", _TAG.value) + ".json"
    for c in contexts:
        key = jax.random.key(c)
        length = c + 64
        k, v = cache(key, 1, kv_heads, length, d, c)
        q = jax.random.normal(jax.random.fold_in(key, 1), (1, max(Ts), heads, d),
                              jnp.float32).astype(jnp.bfloat16)
        entry = {"context": c, "mismatching_tokens": check_bits(run, q, k, v, c, Ts,
                                                                  jax.random.fold_in(key, 2))}
        pos = jnp.arange(c - max(Ts), c, dtype=jnp.int32)[None]
        kc, vc = (jnp.nan_to_num(x, nan=0.0, posinf=0.0) for x in (k, v))
        ref = attention_reference(q, kc, vc, pos, win, scale=scale)
        entry["max_abs_err_vs_reference"] = float(jnp.max(jnp.abs(
            run(q, k, v, pos).astype(jnp.float32) - ref.astype(jnp.float32))))
        for S, run_s in split_runs.items():
            entry[f"mismatching_tokens_split{S}"] = check_bits(
                run_s, q, k, v, c, Ts, jax.random.fold_in(key, 2))
        entry["us"] = {}
        for B in ([1] if smoke else [1, 8]):
            for T in ([1] if smoke else [1, 5]):
                kb, vb = (jnp.broadcast_to(x, (B,) + x.shape[1:]) for x in (kc, vc))
                qb = jnp.broadcast_to(q[:, :T], (B, T, heads, d))
                pb = jnp.broadcast_to(jnp.arange(c - T, c, dtype=jnp.int32), (B, T))
                call = lambda q, k, v, p, f=mosaic: f(q, k, v, p, win)  # noqa: E731
                args = (qb, kb, vb, pb)
                loops = {name: compile_loop(lambda q, k, v, p, f=f: f(q, k, v, p, win),
                                            *args)
                         for name, f in (("mosaic", mosaic), ("triton", triton),
                                         *others.items())}
                if _VARIANTS.value:
                    want = run_bits(call, *args)
                    for name, settings in VARIANTS.items():
                        loops[name] = with_settings(settings, compile_loop, call, *args)
                        got = with_settings(settings, run_bits, call, *args)
                        entry.setdefault("variant_bits_equal", {})[
                            f"B{B}_T{T}_{name}"] = bool(np.array_equal(got, want))
                entry["us"][f"B{B}_T{T}"] = interleaved_us(loops, *args)
        report["contexts"].append(entry)
        print(json.dumps(entry))
        # after every context: a time-out keeps what ran
        write_receipt(_OUT.value, "mosaic_attention", _TAG.value, report)
    report["complete"] = True
    write_receipt(_OUT.value, "mosaic_attention", _TAG.value, report)
    print("receipt:", path)


if __name__ == "__main__":
    cli.run(main)
