"""Per-weight-shape tuning of the row-invariant matmul: candidates for `TUNED`.

  python experiments/tuning/sweep_matmul.py                # qwen3-8b + qwen3-0.6b, M=1,8,16
  python experiments/tuning/sweep_matmul.py --presets=qwen3-8b --shapes=w_down --bm=16,64 \
      --rows=1,40,160 --guard_rows=1 --max_candidates=40   # tall blocks, decode kept
  python experiments/tuning/sweep_matmul.py --interpret --presets=tiny-qwen3 --shapes=wo \
      --rows=1,3 --max_candidates=2 --iters=1 --reps=2     # CPU smoke run

For each weight of the presets (fused wqkv, wo, fused gate/up, down, lm head;
real shapes, random bf16 values) it times GPU tile configurations of
`pallas_kernels.matmul` (bm 16; bn, bk, warps, stages, fixed split-K) at every
row count in --rows. A config must not depend on M (rule R1), so the winner is
the config with the smallest SUM of times over the row counts. To keep the run
short, every candidate is timed at the largest row count first and only the
--finalists best (plus the default rule) are timed at the other row counts.
Configs that fail to compile (e.g. too much shared memory) are recorded.

Each timed call is one jitted loop of --reps dependent launches; the time is the
median of --iters calls after warm-up, each ended by `block_until_ready`.
For each shape's winner it checks row invariance on the device, bitwise: each
of the first max(rows) rows computed alone (M=1) equals the same row computed
inside every M of --rows. Writes a JSON receipt under --out after every shape,
prints a table and a ready-to-paste `TUNED` dict literal (winners that are
row-invariant, differ from the default rule and beat it by --min_gain).
Timings under --interpret mean nothing; that mode only smoke-tests the script.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from jspec import cli
from jspec.bench.receipts import receipt_stem, write_receipt
from jspec.bench.timing import copy_bandwidth, median_time
from jspec.random_model import weight_shapes
from pallas_kernels._common import round_up
from pallas_kernels.matmul import (
    TUNED_FILE,
    MatmulConfig,
    default_matmul_config,
    matmul,
    matmul_config,
    tuned_to_json,
    write_tuned_rows,
)

_PRESETS = flags.DEFINE_list("presets", ["qwen3-8b", "qwen3-0.6b"], "model shape presets")
_SHAPES = flags.DEFINE_list("shapes", ["wo", "w_down", "wqkv", "w_gate_up", "lm_head"],
                            "weights to tune, in this order")
_ROWS = flags.DEFINE_list("rows", ["1", "8", "16"], "row counts M; the winner minimises the sum")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "weight dtype")
_MAX_CANDIDATES = flags.DEFINE_integer("max_candidates", 16, "candidate configs per shape")
_FINALISTS = flags.DEFINE_integer(
    "finalists", 4, "candidates timed at every M (0: all of them)")
_ITERS = flags.DEFINE_integer("iters", 5, "timed calls per measurement (median)")
_REPS = flags.DEFINE_integer("reps", 20, "kernel launches per timed call")
_SMS = flags.DEFINE_integer("sms", 132, "streaming multiprocessors (H200: 132)")
_MIN_GAIN = flags.DEFINE_float("min_gain", 0.03, "min. relative gain over the default rule")
_BUDGET = flags.DEFINE_float("budget_s", 220.0, "no new shape is started after this many s")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")
_INTERPRET = flags.DEFINE_bool("interpret", False, "CPU smoke run (timings mean nothing)")
_APPLY = flags.DEFINE_bool("apply", False, "merge the winners into the kernels' data file "
                           "(pallas_kernels/matmul_tuned.json)")
_COLD = flags.DEFINE_float(
    "cold_mb", 256.0, "each timed loop cycles through enough copies of the weight to read at "
    "least this many MB, so small weights are not served from L2 (the H200 has 50 MB) as they "
    "never are inside a model step; 0: one copy (warm)")
_BMS = flags.DEFINE_list(
    "bm", ["16"], "row tiles to try (each candidate once per bm): a larger tile serves a "
    "40-row verify block (batch 8, gamma 4) in one pass over the weights but does more "
    "MMA work at M=1; any fixed bm is row-invariant, but the bits differ between bms")
_GUARD = flags.DEFINE_list(
    "guard_rows", [], "row counts (among --rows) at which the winner may be at most "
    "--min_gain slower than the config in force, e.g. 1: a tile chosen for tall verify "
    "blocks must not cost the one-token step; the sum picks among those that pass")
_KEEP_BITS = flags.DEFINE_bool(
    "keep_bits", False, "only candidates with the split-K of the config in force (on the GPU "
    "bn, bk, warps and stages schedule, so their bits are that config's), and a winner must "
    "give that config's bits at every M of --rows, checked on the device: a shape whose "
    "parity is proven keeps its proof")
_XLA_PROBE = flags.DEFINE_bool(
    "xla_probe", True, "also try the tiles XLA's autotuner picks for the same dot (read from "
    "its compiled HLO at M=1 and at the largest M), as bm-16 configs")

BM = 16  # decode rows; the row tile is one per weight shape (R1 forbids tying it to M)
SMEM_LIMIT = 200 * 1024  # H200 allows 227 KiB per block; keep some headroom

# (bn, bk, num_warps, num_stages, split_k), most promising first for a
# memory-bound decode (M <= 16): more programs for N = 4096 weights (bn 32,
# split-K), deeper K pipelining (bk x stages), and a few warp counts.
HAND_LIST: tuple[tuple[int, int, int, int, int], ...] = (
    (32, 128, 4, 4, 1),
    (64, 128, 4, 4, 2),
    (32, 128, 4, 4, 2),
    (64, 256, 4, 3, 1),
    (32, 256, 4, 3, 1),
    (64, 128, 4, 4, 4),
    (128, 128, 4, 4, 2),
    (128, 128, 4, 4, 1),
    (64, 256, 4, 3, 2),
    (128, 128, 4, 4, 4),
    (64, 128, 2, 5, 1),
    (32, 128, 2, 5, 2),
    (64, 128, 8, 4, 1),
    (128, 256, 8, 3, 1),
    (16, 256, 2, 4, 1),
    (64, 64, 4, 5, 1),
    (128, 64, 4, 5, 1),
    (32, 64, 2, 5, 4),
    (128, 256, 8, 3, 2),
    (64, 128, 4, 2, 1),
    (32, 128, 4, 4, 4),
    (16, 128, 2, 4, 2),
    (16, 128, 2, 4, 4),
    # Wider column tiles read longer contiguous runs of a [K, N] row-major weight;
    # split-K keeps the program count up.
    (128, 128, 8, 4, 2),
    (256, 128, 8, 4, 2),
    (256, 128, 8, 4, 4),
    (128, 256, 4, 3, 2),
    (256, 64, 4, 4, 4),
    (64, 512, 4, 2, 1),
    (32, 512, 4, 3, 1),
    (64, 256, 8, 4, 1),
)


def xla_configs(K: int, N: int, dtype, rows: list[int]) -> list[MatmulConfig]:
    """The tiles XLA's GPU autotuner picks for x [M, K] @ w [K, N] (M = 1 and max(rows)),
    read from the `triton_gemm_config` of its compiled HLO, as bm-16 MatmulConfigs
    (empty where XLA chose a library GEMM or on a CPU)."""
    out = []
    if jax.default_backend() != "gpu":
        return out
    for m in sorted({1, max(rows)}):
        x = jax.ShapeDtypeStruct((m, K), dtype)
        w = jax.ShapeDtypeStruct((K, N), dtype)
        try:
            text = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)
                           ).lower(x, w).compile().as_text()
        except Exception:  # noqa: BLE001 - a probe, not a result
            continue
        for hit in re.findall(r'"triton_gemm_config":(\{[^}]*\})', text):
            c = {k: int(v) for k, v in json.loads(hit).items() if str(v).isdigit()}
            try:
                cfg = MatmulConfig(bm=BM, bn=c["block_n"], bk=c["block_k"],
                                   num_warps=c["num_warps"], num_stages=c["num_stages"],
                                   split_k=c.get("split_k", 1))
            except (KeyError, ValueError):
                continue
            if cfg not in out:
                out.append(cfg)
    return out


def candidates(K: int, N: int, dtype, limit: int, sms: int,
               extra: list[MatmulConfig] = ()) -> list[MatmulConfig]:
    """The default rule, the current table entry, `extra` (XLA's picks), then HAND_LIST
    entries that make sense
    for [K, N]: shared memory within the limit, at least 2 K steps per program (else
    pipelining has nothing to overlap), at most 1/8 K padding, no split-K where the
    output tiles alone already give 4 programs per SM, no tile wider than N needs.
    Entries whose programs (at M <= 16) fill less than 3/4 of their last wave of SMs go
    after the others; otherwise HAND_LIST order is kept."""
    item = jnp.dtype(dtype).itemsize
    out = [default_matmul_config(K, N, dtype, False)]
    current = matmul_config(K, N, dtype, False)
    if current not in out:
        out.append(current)
    item_ok = lambda c: c.num_stages * (c.bm * c.bk + c.bk * c.bn) * item <= SMEM_LIMIT  # noqa: E731
    out += [c for c in extra if c not in out and item_ok(c) and round_up(K, c.split_k * c.bk)
            - K <= K // 8]
    pool = []
    for (bn, bk, warps, stages, s), bm in ((h, int(b)) for h in HAND_LIST for b in _BMS.value):
        cfg = MatmulConfig(bm=bm, bn=bn, bk=bk, num_warps=warps, num_stages=stages, split_k=s)
        kp = round_up(K, s * bk)
        if (cfg in out or not item_ok(cfg)
                or kp // (s * bk) < 2 or kp - K > K // 8
                or (s > 1 and math.ceil(N / bn) >= 4 * sms) or bn > max(16, N)):
            continue
        programs = math.ceil(N / bn) * s
        fill = programs / (math.ceil(programs / sms) * sms)
        pool.append((fill < 0.75, len(pool), cfg))
    out += [cfg for *_, cfg in sorted(pool)]
    return out[:max(limit, 1)]


def looped(cfg: MatmulConfig, out_dtype, loops: int, interpret: bool):
    """loops x len(ws) dependent launches in one jitted loop (the carry feeds the next
    input); each loop iteration walks the weight copies ws in order."""

    def run(x, *ws):
        def body(_, c):
            for w in ws:
                y = matmul(x + c.astype(x.dtype), w, out_dtype=out_dtype, interpret=interpret,
                           config=cfg)
                c = c + y[0, 0].astype(jnp.float32) * 0.0
            return c

        return jax.lax.fori_loop(0, loops, body, jnp.float32(0.0))

    return jax.jit(run)


def time_config(cfg, x, ws, out_dtype) -> dict:
    """Compile (AOT, so compile time is separate) and time one config at x's M: the
    time of one launch, from loops over the weight copies ws (>= --reps launches)."""
    t0 = time.perf_counter()
    loops = max(1, -(-_REPS.value // len(ws)))
    try:
        fn = looped(cfg, out_dtype, loops, _INTERPRET.value).lower(x, *ws).compile()
        compile_s = time.perf_counter() - t0
        t = median_time(fn, x, *ws, iters=_ITERS.value, warmup=2) / (loops * len(ws))
    except Exception as e:  # noqa: BLE001 - a config that cannot compile/run is a result
        return {"error": f"{type(e).__name__}: {str(e)[:400]}",
                "compile_s": time.perf_counter() - t0}
    return {"us": t * 1e6, "compile_s": compile_s}


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def row_invariant(cfg, w, out_dtype, rows: list[int], seed: int) -> bool:
    """Bitwise, on the device: row i alone (M=1) == row i inside each M of rows."""
    m = max(rows)
    x = jax.random.normal(jax.random.key(seed), (m, w.shape[0]), jnp.float32).astype(w.dtype)
    f = lambda a: matmul(a, w, out_dtype=out_dtype, interpret=_INTERPRET.value, config=cfg)
    singles = np.stack([bits(f(x[i : i + 1]))[0] for i in range(m)])
    return all(np.array_equal(bits(f(x[:r])), singles[:r]) for r in rows)


def same_bits(cfg, base, w, out_dtype, rows: list[int], seed: int) -> bool:
    """Bitwise, on the device: cfg's output equals base's at every M of rows."""
    x = jax.random.normal(jax.random.key(seed), (max(rows), w.shape[0]), jnp.float32
                          ).astype(w.dtype)
    f = lambda a, c: matmul(a, w, out_dtype=out_dtype, interpret=_INTERPRET.value,  # noqa: E731
                            config=c)
    return all(np.array_equal(bits(f(x[:r], cfg)), bits(f(x[:r], base))) for r in rows)


def cfg_str(c: MatmulConfig) -> str:
    return f"bn{c.bn} bk{c.bk} w{c.num_warps} s{c.num_stages} k{c.split_k}"


def sweep_shape(name, K, N, dtype, rows, bw, seed) -> dict:
    out_dtype = jnp.float32 if name.endswith("lm_head") else dtype
    w = (jax.random.normal(jax.random.key(seed), (K, N), jnp.float32) * K**-0.5).astype(dtype)
    wb = w.size * w.dtype.itemsize
    copies = (max(1, math.ceil(_COLD.value * 1e6 / wb))
              if _COLD.value > 0 and not _INTERPRET.value else 1)
    ws = [w] + [w + jnp.zeros((), dtype) * i for i in range(1, copies)]  # distinct buffers
    xs = {m: jax.random.normal(jax.random.key(seed + m), (m, K), jnp.float32).astype(dtype)
          for m in rows}
    probed = xla_configs(K, N, dtype, rows) if _XLA_PROBE.value else []
    in_force = matmul_config(K, N, dtype, False)
    cands = candidates(K, N, dtype, 10**6, _SMS.value, probed)
    if _KEEP_BITS.value:  # the default rule (first) stays, to report the gain over it
        cands = cands[:1] + [c for c in cands[1:] if c.split_k == in_force.split_k
                             or c == in_force]
    cands = cands[:max(_MAX_CANDIDATES.value, 1)]
    if in_force not in cands:
        cands.append(in_force)
    results = [{"config": dataclasses.asdict(c), "us": {}, "compile_s": 0.0,
                "xla_pick": c in probed} for c in cands]

    def run(i, m):
        r = time_config(cands[i], xs[m], ws, out_dtype)
        results[i]["compile_s"] += r["compile_s"]
        if "error" in r:
            results[i]["error"] = r["error"]
        else:
            results[i]["us"][m] = r["us"]

    first = max(rows)  # largest M first: every candidate
    for i in range(len(cands)):
        run(i, first)
    ok = [i for i in range(len(cands)) if first in results[i]["us"]]
    ok.sort(key=lambda i: results[i]["us"][first])
    n_fin = len(ok) if _FINALISTS.value <= 0 else _FINALISTS.value
    cur = cands.index(in_force)  # the config in force now
    finalists = sorted(set(ok[:n_fin]) | ({0, cur} & set(ok)))
    for i in finalists:
        for m in rows:
            if m != first and "error" not in results[i]:
                run(i, m)
    full = [i for i in finalists if len(results[i]["us"]) == len(rows)]
    for i in full:
        results[i]["sum_us"] = sum(results[i]["us"].values())
    report = {"name": name, "K": K, "N": N, "dtype": jnp.dtype(dtype).name,
              "out_dtype": jnp.dtype(out_dtype).name, "rows": rows, "candidates": results,
              "weight_bytes": wb, "weight_copies": copies,
              "xla_picks": [dataclasses.asdict(c) for c in probed]}
    if not full:
        report["error"] = "no candidate ran at every M"
        return report
    guard = [int(g) for g in _GUARD.value]
    for i in full:
        results[i]["guard_ok"] = cur not in full or all(
            results[i]["us"][g] <= results[cur]["us"][g] * (1.0 + _MIN_GAIN.value)
            for g in guard if g in results[i]["us"])
    passing = [i for i in full if results[i]["guard_ok"]] or [cur]
    best = min(passing, key=lambda i: results[i]["sum_us"])
    best_us = results[best]["us"]
    report |= {
        "default": results[0] if 0 in full else None,
        "current": results[cur] if cur in full else None,
        "best": results[best],
        "best_is_default": best == 0,
        "best_is_current": best == cur,
        "gain": (results[0]["sum_us"] / results[best]["sum_us"] - 1.0) if 0 in full else None,
        "gain_vs_current": (results[cur]["sum_us"] / results[best]["sum_us"] - 1.0)
        if cur in full else None,
        "best_GBps": {m: wb / (best_us[m] * 1e-6) / 1e9 for m in rows},
        "best_frac_of_copy": {m: wb / (best_us[m] * 1e-6) / bw for m in rows},
        "row_invariant": row_invariant(cands[best], w, out_dtype, rows, seed + 1000),
    }
    if _KEEP_BITS.value:
        report["same_bits"] = same_bits(cands[best], in_force, w, out_dtype, rows, seed + 2000)
    return report


def chosen(r: dict) -> dict | None:
    """The entry a swept shape should have: its winner if row-invariant and at least
    --min_gain faster than the config in force (or than the default rule when the one in
    force did not run), else the config in force; None if nothing ran."""
    if "best" not in r:
        return None
    base = r.get("current") or r["default"]
    gain = r.get("gain_vs_current") if r.get("current") else r["gain"]
    if r["row_invariant"] and r.get("same_bits", True) and (
            base is None or gain is None or gain >= _MIN_GAIN.value):
        return r["best"]
    return base


def selected(reports) -> list[tuple[dict, dict]]:
    """(report, chosen result) for every swept shape whose choice is not the default rule
    (the default needs no entry unless it replaces an older entry, which it then does)."""
    out = []
    for r in reports:
        c = chosen(r)
        if c is None:
            continue
        if c is r["default"] and r.get("current") in (None, r["default"]):
            continue
        out.append((r, c))
    return out


def tuned_literal(reports, rows) -> str:
    lines = ["TUNED: dict[tuple[int, int, str], MatmulConfig] = {"]
    for r, c in selected(reports):
        d = r["default"]["sum_us"] if r["default"] else float("nan")
        lines.append(f"    # {r['name']}: {d:.1f} -> {c['sum_us']:.1f} us "
                     f"(sum over M={','.join(map(str, rows))})")
        lines.append(f"    ({r['K']}, {r['N']}, \"{r['dtype']}\"): "
                     f"{MatmulConfig(**c['config'])!r},")
    lines.append("}")
    return "\n".join(lines)


def main(argv):
    del argv
    t_start = time.perf_counter()
    rows = sorted({int(r) for r in _ROWS.value})
    dtype = jnp.dtype(_DTYPE.value)
    bw = copy_bandwidth(max(_ITERS.value, 3))
    dev = jax.devices()[0].device_kind
    print(f"device {dev}, jax {jax.__version__}, copy {bw / 1e12:.2f} TB/s, rows {rows}")
    todo, seen = [], set()
    for p in _PRESETS.value:
        shapes = weight_shapes(p)
        for s in _SHAPES.value:
            K, N = shapes[s]
            if (K, N) not in seen:
                seen.add((K, N))
                todo.append((f"{p} {s}", K, N))
    receipt = {"device": dev, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
               "command": " ".join(sys.argv), "copy_TBps": bw / 1e12, "rows": rows,
               "reps": _REPS.value,
               "iters": _ITERS.value, "finalists": _FINALISTS.value, "interpret":
               _INTERPRET.value, "shapes": [], "skipped": []}
    stem = receipt_stem(_OUT.value, "sweep_matmul", _TAG.value)
    path, tuned_path = stem + ".json", stem + "_tuned.json"
    for n, (name, K, N) in enumerate(todo):
        if time.perf_counter() - t_start > _BUDGET.value:
            receipt["skipped"].append(name)
            continue
        t0 = time.perf_counter()
        r = sweep_shape(name, K, N, dtype, rows, bw, seed=17 * n)
        r["wall_s"] = time.perf_counter() - t0
        receipt["shapes"].append(r)
        receipt["elapsed_s"] = time.perf_counter() - t_start
        write_receipt(_OUT.value, "sweep_matmul", _TAG.value, receipt)
        table = {(r["K"], r["N"], r["dtype"]): MatmulConfig(**c["config"])
                 for r, c in selected(receipt["shapes"])}
        with open(tuned_path, "w") as f:  # rows for write_tuned_rows (--apply)
            json.dump(tuned_to_json(table), f, indent=1)
        errs = sum("error" in c for c in r["candidates"])
        best = cfg_str(MatmulConfig(**r["best"]["config"])) if "best" in r else r.get("error")
        print(f"[{receipt['elapsed_s']:6.1f}s] {name} [{K}, {N}]: {len(r['candidates'])} "
              f"candidates, {errs} failed, best {best}", flush=True)

    hdr = "  ".join(f"M={m:<3d} us" for m in rows)
    print(f"\n{'weight':22s} {'[K, N]':>14s} {'default us':>10s} {'best config':26s} "
          f"{'gain':>6s} {hdr}  {'GB/s@' + str(rows[0]):>9s} {'%copy':>5s} inv")
    for r in receipt["shapes"]:
        if "best" not in r:
            print(f"{r['name']:22s} {r.get('error')}")
            continue
        b = r["best"]
        d = f"{r['default']['sum_us']:.1f}" if r["default"] else "failed"
        g = f"{100 * r['gain']:+.0f}%" if r["gain"] is not None else "-"
        ts = "  ".join(f"{b['us'][m]:9.1f}" for m in rows)
        print(f"{r['name']:22s} {str((r['K'], r['N'])):>14s} {d:>10s} "
              f"{cfg_str(MatmulConfig(**b['config'])):26s} {g:>6s} {ts}  "
              f"{r['best_GBps'][rows[0]]:9.0f} {100 * r['best_frac_of_copy'][rows[0]]:5.0f} "
              f"{'yes' if r['row_invariant'] else 'NO'}"
              + ("" if "same_bits" not in r else f" same bits: {r['same_bits']}"))
    if receipt["skipped"]:
        print(f"skipped (over --budget_s): {', '.join(receipt['skipped'])}")
    print(f"(default us / best: sums over M; {time.perf_counter() - t_start:.0f} s in all)")
    print("\n" + tuned_literal(receipt["shapes"], rows))
    print(f"receipt: {path}; winners: {tuned_path}")
    if _APPLY.value:
        with open(tuned_path) as f:
            dropped = write_tuned_rows(json.load(f))
        for d in dropped:
            print(f"dropped {d['table']} entry of [{d['K']}, {d['N']}] (new bk / split_k): "
                  f"sweep its schedules again")
        print(f"merged into {TUNED_FILE} (used from the next import on; prove it with "
              "gpu_parity.py before committing it)")


if __name__ == "__main__":
    cli.run(main)
