"""Do a matmul's column tile, warps and stages change its bits? And which is fastest
for a multi-tile launch (a batch-8 verify block)?

  python experiments/tuning/sweep_schedule.py --out=experiments/results  # H200
  python experiments/tuning/sweep_schedule.py --tall --out=$OUT \
      --write=pallas_kernels/matmul_tuned.json                            # H200, tall tier
  python experiments/tuning/sweep_schedule.py --interpret --preset=tiny-qwen3 --rows=1,40 \
      --max_candidates=2 --out=/tmp                                      # CPU smoke

A row's sum order in `pallas_kernels.matmul` is set by its split-K count and, in
interpret mode, its K tile (bk); bn, num_warps and num_stages only decide which program
computes which output columns and how loads are pipelined, and on the GPU bk only how
far each load reaches (`matmul.SCHEDULE_FIELDS`). If, on the device, every variant of a
weight's table config with the same split-K gives the table config's bits, then a
launch of several row tiles may use its own tiles without touching property P, as row
groups do. This script checks exactly that for each weight of
--preset: for every variant it compares the logits bitwise with the table config at each
M of --rows (row groups of --row_group, as the model runs them) and times it at the Ms
of --timed (default the largest of --rows), device-side (the busy time of a profiler
trace of a jitted loop over enough weight copies to miss the L2). Writes
`sweep_schedule.json` (`sweep_schedule_tall.json`, `..._prefill.json`): per weight,
the table config's time, every variant's bits_equal and time, and the fastest variant
with equal bits. `--bm=32,64` first tries the config
with other row tiles (same bk): does a larger dot give every row the config's bits? (On
the H200 it did, so MULTI_TILE may set bm; the crosses then include the two best row
tiles too.)

--tall sweeps the tier of launches of more than `matmul.TALL_ROWS` rows (a verify block
at batch 32-64): bits at M = 1, 40, 160, 320 and 2048, time summed at 160 and 320, over a
grid of row tiles (64, 128) x column tiles (the config's, twice it) x warps (4, 8), with
--bk also at those K tiles (64-row tiles at 4 warps, 128-row at 8), then the winner at 2-4
pipeline stages; the schedule such launches run with today is timed first. --prefill
sweeps the tier of more than `matmul.PREFILL_ROWS` rows (prefill chunks, B x C rows):
bits at M = 1, 40, 160 and 2048, time at --timed (default 2048, 8192), over compute-bound
tiles (`PREFILL_GRID`, `prefill_rule`'s first), then the winner at 2-5 stages. With
--tall --row_groups=2,3 the fastest bit-equal schedule is then tried with g row tiles a
program (`matmul.ROW_GROUP_FIELD`: each weight block read once for g x bm rows), at its
column tile and half of it; --nogrid skips the grid and the stages (today's schedule and
its row groups only). A variant
with another bk is the claim of `matmul.SCHEDULE_FIELDS` (Triton accumulates each block's
dot into the running sum, so bk does not set bits on the GPU), checked here bitwise like
every other field. --write=FILE merges each weight's winner into a tile data file
(tall_tile[_glu] with --tall, prefill_tile[_glu] with --prefill, else multi_tile[_glu]),
only where every variant of the weight gave the config's bits and the winner beats the
config.
"""

from __future__ import annotations

import dataclasses
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

from jspec import cli
from jspec.bench.receipts import write_receipt
from jspec.bench.timing import median_time
from jspec.bench.trace import device_events, summarize, traced
from jspec.random_model import weight_shapes
from pallas_kernels.matmul import (
    MULTI_TILE,
    PREFILL_ROWS,
    PREFILL_TILE,
    ROW_GROUP_FIELD,
    TALL_TILE,
    TUNED_FILE,
    MatmulConfig,
    k_tile_ok,
    matmul,
    matmul_config,
    parse_schedules,
    read_tuned_file,
    scheduled,
    scheduled_row_group,
)
from pallas_kernels.matmul_glu import (
    MULTI_TILE_GLU,
    PREFILL_TILE_GLU,
    TALL_TILE_GLU,
    fusable,
    matmul_glu,
)

_PRESET = flags.DEFINE_string("preset", "qwen3-8b", "model shape preset")
_SHAPES = flags.DEFINE_list("shapes", ["wo", "w_down", "wqkv", "w_gate_up:glu", "lm_head"],
                            "weights, in this order; NAME:glu runs a [K, 2F] weight through "
                            "the fused matmul_glu kernel (as the model does) instead of matmul; "
                            "head_wqkv, head_fc, head_lm_head: the feature head's own")
_HEAD_VOCAB = flags.DEFINE_integer("head_vocab", 32768, "the feature head's draft vocabulary "
                                   "(head_lm_head's N; bench_e2e.py's default)")
_BM = flags.DEFINE_list("bm", [], "also try these row tiles first (same bk, bn, warps, stages): "
                        "does a larger dot give every row the config's bits?")
_COMBOS = flags.DEFINE_bool("combos", True, "after the one-field variants, cross the two "
                            "fastest bit-equal values of each field")
_ROWS = flags.DEFINE_list("rows", [], "row counts compared bitwise (default 1, 40; with --tall "
                          "1, 40, 160, 320, 2048)")
_TIMED = flags.DEFINE_list("timed", [], "row counts timed (default: the largest of --rows); a "
                           "variant's time is the sum over them")
_TALL = flags.DEFINE_bool("tall", False, "the tall tier: --rows 1,40,160,320,2048, --timed "
                          "160,320, --bm 64,128 unless given, and the winners as the data "
                          "file's tall_tile / tall_tile_glu rows")
_PREFILL = flags.DEFINE_bool("prefill", False, "the prefill tier: --rows 1,40,160,2048, "
                             "--timed 2048,8192, the PREFILL_GRID tiles, and the winners as "
                             "the data file's prefill_tile / prefill_tile_glu rows")
_BK = flags.DEFINE_list("bk", [], "also these K tiles (bits checked like every other field; "
                        "see matmul.SCHEDULE_FIELDS)")
_WRITE = flags.DEFINE_string("write", "", "a tile data file (pallas_kernels/matmul_tuned.json) "
                             "to merge the winners into (multi_tile[_glu], or tall_tile[_glu] "
                             "with --tall), so later steps of the same call run with them")
_ROW_GROUP = flags.DEFINE_integer("row_group", 4, "row tiles per program (the model's default)")
_GROUPS = flags.DEFINE_list("row_groups", [], "with --tall: then the fastest bit-equal schedule "
                            "with these row groups (row tiles a program, the weight block read "
                            "once for them; the table's row_group field), at its column tile "
                            "and half of it, its warps and 8")
_GRID = flags.DEFINE_bool("grid", True, "the tier's grid of tiles and its stages (off: today's "
                          "schedule and, with --tall, --row_groups only)")
_MAX = flags.DEFINE_integer("max_candidates", 12, "variants per weight, and crosses after them")
_ITERS = flags.DEFINE_integer("iters", 5, "timed loops per variant")
_COLD = flags.DEFINE_float("cold_mb", 256.0, "weight bytes cycled per timed loop (MB)")
_BUDGET = flags.DEFINE_float("budget_s", 200.0, "no new variant is started after this")
_INTERPRET = flags.DEFINE_bool("interpret", False, "CPU smoke run (timings mean nothing)")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")


def variants(base: MatmulConfig, N: int, K: int, limit: int, bms=(), bks=()
             ) -> list[MatmulConfig]:
    """The base config with other bn / warps / stages (same bm, bk, split_k): bn first;
    before them, the base with each row tile of `bms`, then at each K tile of `bks` that
    may replace the base's (`k_tile_ok`), at the base's row tile and those of `bms`.
    N: the columns bn must divide (F for the GLU kernel)."""
    out = [dataclasses.replace(base, bm=bm) for bm in bms if bm != base.bm]
    out += [dataclasses.replace(base, bm=bm, bk=bk) for bk in bks
            if bk != base.bk and k_tile_ok(base, bk, K) for bm in dict.fromkeys([base.bm, *bms])]
    for bn in (base.bn // 2, base.bn * 2, base.bn // 4, base.bn * 4):
        if bn >= 16 and N % bn == 0:
            out.append(dataclasses.replace(base, bn=bn))
    for w in (2, 4, 8):
        if w != base.num_warps:
            out.append(dataclasses.replace(base, num_warps=w))
    for s in (2, 3, 4, 5):
        if s != base.num_stages:
            out.append(dataclasses.replace(base, num_stages=s))
    return out[:limit]


def tall_variants(base: MatmulConfig, N: int, K: int, bms, bks=()) -> list[MatmulConfig]:
    """The tall tier's grid: each row tile of bms x bn (the base's, twice it) x warps
    (4, 8), at the base's bk, split_k and stages (N: the columns bn must divide); then
    each K tile of bks that may replace the base's (`k_tile_ok`) at those row and
    column tiles, 4 warps for 64-row tiles and 8 for taller ones."""
    bns = [b for b in (base.bn, base.bn * 2) if N % b == 0]
    out = [dataclasses.replace(base, bm=bm, bn=bn, num_warps=w)
           for bm in bms for bn in bns for w in (4, 8)]
    for bk in bks:
        if bk == base.bk or not k_tile_ok(base, bk, K):
            continue
        out += [dataclasses.replace(base, bm=bm, bn=bn, bk=bk, num_warps=4 if bm <= 64 else 8)
                for bm in bms for bn in bns]
    return out


# The prefill tier's tiles (bm, bn, bk, warps, stages): `prefill_rule`'s first, then the
# shapes of a compute-bound bf16 GEMM on a Hopper part.
PREFILL_GRID = ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4),
                (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 256, 32, 4, 4),
                (128, 128, 128, 8, 2), (256, 128, 64, 8, 3))


def prefill_variants(base: MatmulConfig, N: int, K: int) -> list[MatmulConfig]:
    """PREFILL_GRID's tiles at the base's split_k, where bn divides N and bk may replace
    the base's (N: the columns bn must divide; F for the GLU kernel)."""
    out = []
    for bm, bn, bk, w, st in PREFILL_GRID:
        if N % bn == 0 and base.split_k == 1 and k_tile_ok(base, bk, K):
            out.append(dataclasses.replace(base, bm=bm, bn=bn, bk=bk, num_warps=w,
                                           num_stages=st))
    return out


def group_variants(best: MatmulConfig, N: int, groups, done: set
                   ) -> list[tuple[MatmulConfig, int]]:
    """(config, row group) pairs: `best` at each row group of `groups` (> 1), at its
    column tile and half of it (dividing N) and at its warps and 8."""
    out = []
    for g in groups:
        for bn in dict.fromkeys((best.bn, best.bn // 2)):
            for w in dict.fromkeys((best.num_warps, 8)):
                c = dataclasses.replace(best, bn=bn, num_warps=w)
                if g > 1 and bn >= 16 and N % bn == 0 and (c, g) not in done:
                    out.append((c, g))
    return out


def stage_variants(best: MatmulConfig, done: set) -> list[MatmulConfig]:
    """The tall grid's winner at other pipeline depths."""
    return [c for c in (dataclasses.replace(best, num_stages=s) for s in (2, 3, 4, 5))
            if c not in done]


FIELDS = ("bm", "bn", "bk", "num_warps", "num_stages")  # what a variant may change


def combos(base: MatmulConfig, ran: list[dict], done: set, base_us: float = 0.0,
           limit: int | None = None) -> list[MatmulConfig]:
    """Crosses of the two fastest bit-equal values of each field (the base's included),
    each field's values timed with the others at the base's; with `limit`, the `limit`
    crosses whose fields' one-field gains over base_us add up to the most."""
    ok = [(MatmulConfig(**v["config"]), v["us"]) for v in ran if all(v["bits_equal"].values())]
    best, gain = {}, {}
    for f in FIELDS:
        times = {getattr(base, f): float("inf")}
        for c, us in ok:
            if all(getattr(c, g) == getattr(base, g) for g in FIELDS if g != f):
                times[getattr(c, f)] = min(times.get(getattr(c, f), us), us)
        best[f] = sorted(times, key=times.get)[:2]
        gain[f] = {v: (base_us - t if t < float("inf") else 0.0) for v, t in times.items()}
    out = []
    for values in itertools.product(*(best[f] for f in FIELDS)):
        c = dataclasses.replace(base, **dict(zip(FIELDS, values, strict=True)))
        if c not in done and c != base:
            out.append((-sum(gain[f][v] for f, v in zip(FIELDS, values, strict=True)), c))
    out = [c for _, c in sorted(out, key=lambda p: p[0])]
    return out if limit is None else out[:limit]


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def sweep_weight(name: str, K: int, N: int, rows: list[int], timed: list[int], rg: int, key,
                 t0: float, interp: bool, bms: list[int], glu: bool = False,
                 current: list[MatmulConfig] | None = None, tall: bool = False,
                 prefill: bool = False, bks=(), groups=(), grid: bool = True) -> dict:
    """The table config of a [K, N] weight and its variants: bits at each M of rows, time
    summed over the Ms of timed. current: the schedules such launches run with today and
    before `prefill_rule`, each a config or (config, row group) (timed first, so a winner
    must beat them too). groups: row groups tried on the tall tier's winner.
    glu: the weight is [K, 2F] and runs through matmul_glu (silu)."""
    dt = jnp.bfloat16
    base = matmul_config(K, N, dt, interp)
    if glu and not fusable(K, N // 2, dt, interp):
        return {"weight": name, "kernel": "matmul_glu", "K": K, "N": N, "base": vars(base),
                "skipped": "not fusable with this config (the model runs matmul + glu)"}
    copies = max(1, int(np.ceil(_COLD.value * 2**20 / (K * N * 2)))) if not interp else 1
    k1, k2 = jax.random.split(key)
    w0 = (jax.random.normal(k1, (K, N), jnp.float32) * K**-0.5).astype(dt)
    ws = [w0] + [w0 + jnp.zeros((), dt) * i for i in range(1, copies)]  # distinct buffers
    xs = {m: jax.random.normal(jax.random.fold_in(k2, m), (m, K), jnp.float32).astype(dt)
          for m in sorted(set(rows) | set(timed))}

    def call(x, w, cfg, g=None):
        if g is None:  # as the model's schedule runs it without a row_group field (a
            # split config: one row tile a program)
            g = 1 if base.split_k > 1 else scheduled_row_group(base.bm, cfg.bm, rg)
        if glu:
            return matmul_glu(x, w, activation="silu", interpret=interp, config=cfg,
                              row_group=g)
        return matmul(x, w, out_dtype=dt, interpret=interp, config=cfg, row_group=g)

    def run(cfg, m, g=None):
        return call(xs[m], ws[0], cfg, g)

    def per_call_us(cfg, g=None) -> tuple[float, dict[str, float]]:
        at = {str(m): us_at(cfg, m, g) for m in timed}
        return sum(at.values()), at

    def us_at(cfg, m, g=None) -> float:
        # Separate weight buffers (a slice of one stacked array would be copied out for
        # every call and timed with it); only the kernel's own events are counted.
        fn = jax.jit(lambda w: [call(xs[m], w[c], cfg, g) for c in range(copies)])
        jax.block_until_ready(fn(ws))
        with tempfile.TemporaryDirectory() as d:
            trace, _ = traced(lambda: [jax.block_until_ready(fn(ws))
                                       for _ in range(_ITERS.value)], d)
        events = [e for e in device_events(trace) if e["name"].startswith("jspec_matmul")]
        if not events:  # CPU: host time
            return 1e6 * median_time(fn, ws, iters=_ITERS.value) / copies
        return summarize(events, _ITERS.value * copies, 1)["busy_us_per_step"]

    want = {m: bits(run(base, m)) for m in rows}
    entry = {"weight": name, "kernel": "matmul_glu" if glu else "matmul", "K": K, "N": N,
             "base": vars(base), "copies": copies, "variants": []}
    entry["base_us"], entry["base_us_at"] = per_call_us(base)

    def try_all(cfgs, desc):
        for item in tqdm(cfgs, desc=desc):
            cfg, g = item if isinstance(item, tuple) else (item, None)
            row = {"config": vars(cfg), "phase": desc} | (
                {ROW_GROUP_FIELD: g} if g is not None else {})
            if time.time() - t0 > _BUDGET.value:
                entry["variants"].append({**row, "skipped": "budget"})
                continue
            try:
                equal = {str(m): bool(np.array_equal(bits(run(cfg, m, g)), want[m]))
                         for m in rows}
                us, at = per_call_us(cfg, g)
            except Exception as e:  # a config Triton cannot build: recorded
                entry["variants"].append({**row, "error": str(e).splitlines()[0][:200]})
                continue
            entry["variants"].append({**row, "bits_equal": equal, "us": us, "us_at": at})

    # The schedules these launches run with today, and ran with before the prefill rule.
    first = [c for c in dict.fromkeys(current or ()) if c != base]
    cols = N // 2 if glu else N
    if not grid:
        tiles = []
    elif prefill:
        tiles = prefill_variants(base, cols, K)
    elif tall:
        tiles = tall_variants(base, cols, K, bms, bks)
    else:
        tiles = variants(base, cols, K, _MAX.value, bms, bks)
    try_all(first + [c for c in tiles if c not in first], name)

    def fastest_ungrouped():
        ok = [v for v in entry["variants"] if "us" in v and all(v["bits_equal"].values())
              and ROW_GROUP_FIELD not in v]
        return MatmulConfig(**min(ok, key=lambda v: v["us"])["config"]) if ok else base

    def ran_variants():  # (config, row group or None) of every variant so far
        return {(MatmulConfig(**v["config"]), v.get(ROW_GROUP_FIELD))
                for v in entry["variants"]}

    if tall or prefill:
        if grid:
            done = {c for c, g in ran_variants() if g is None}
            try_all(stage_variants(fastest_ungrouped(), done), name + " stages")
        if tall and groups:
            try_all(group_variants(fastest_ungrouped(), cols, groups, ran_variants()),
                    name + " row groups")
    elif _COMBOS.value and grid:
        ran = [v for v in entry["variants"] if "us" in v]
        done = {MatmulConfig(**v["config"]) for v in entry["variants"]}
        try_all(combos(base, ran, done, entry["base_us"], _MAX.value), name + " combos")
    ran = [v for v in entry["variants"] if "us" in v]
    same = [v for v in ran if all(v["bits_equal"].values())]
    entry["all_bits_equal"] = len(same) == len(ran)
    entry["fastest_equal"] = min(same, key=lambda v: v["us"]) if same else None
    return entry


def winners(report: dict) -> tuple[list[dict], list[dict]]:
    """(matmul rows, matmul_glu rows) {K, N, dtype, fields} of the data file: each weight's
    fastest bit-equal variant, as the fields where it differs from the table config."""
    out = ([], [])
    for e in report["weights"]:
        best = e.get("fastest_equal")
        if not best or not e.get("all_bits_equal") or best["us"] >= e["base_us"]:
            continue  # some variant changed bits, or none beats the config: keep it
        fields = {f: best["config"][f] for f in FIELDS if best["config"][f] != e["base"][f]}
        if best.get(ROW_GROUP_FIELD) is not None:
            fields[ROW_GROUP_FIELD] = best[ROW_GROUP_FIELD]
        out[e["kernel"] == "matmul_glu"].append(
            {"K": e["K"], "N": e["N"], "dtype": "bfloat16", "fields": fields})
    return out


def write_winners(report: dict, tier: str, path: str = TUNED_FILE) -> dict:
    """Merges the winners into the data file's schedule tables of `tier` ("multi", "tall"
    or "prefill"; replacing rows of the same key); returns the rows written."""
    data = read_tuned_file(path)
    names = (f"{tier}_tile", f"{tier}_tile_glu")
    written = {}
    for name, rows in zip(names, winners(report), strict=True):
        keep = {(r["K"], r["N"], r["dtype"]): r for r in data.get(name, [])}
        keep |= {(r["K"], r["N"], r["dtype"]): r for r in rows}
        data[name] = [keep[k] for k in sorted(keep)]
        parse_schedules(data[name], path)  # scheduling fields only
        written[name] = rows
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return written


def main(_):
    interp = _INTERPRET.value
    tall, prefill = _TALL.value, _PREFILL.value
    if tall and prefill:
        raise app.UsageError("--tall and --prefill are two sweeps: pass one")
    tier = "tall" if tall else "prefill" if prefill else "multi"
    default_rows = {"tall": "1,40,160,320,2048", "prefill": "1,40,160,2048", "multi": "1,40"}
    rows = sorted(int(r) for r in _ROWS.value or default_rows[tier].split(","))
    timed = sorted(int(r) for r in _TIMED.value or (
        ["160", "320"] if tall else ["2048", "8192"] if prefill else rows[-1:]))
    bms = [int(b) for b in _BM.value or (["64", "128"] if tall else [])]
    bks = [int(b) for b in _BK.value]
    groups = [int(g) for g in _GROUPS.value]
    if groups and (not tall or min(groups) < 2):
        raise app.UsageError(f"--row_groups are tried on the tall tier (--tall), each >= 2; "
                             f"got {groups}")
    if any(b < 16 or b & (b - 1) for b in bks):
        raise app.UsageError(f"--bk must be powers of 2 >= 16; got {bks}")
    if min(rows + timed) < 1 or any(b < 16 or b & (b - 1) for b in bms):
        raise app.UsageError(f"--rows / --timed must be >= 1 and --bm powers of 2 >= 16; got "
                             f"{rows=} {timed=} {bms=}")
    rg = _ROW_GROUP.value
    receipt_name = "sweep_schedule" if tier == "multi" else f"sweep_schedule_{tier}"
    t0 = time.time()
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
              "preset": _PRESET.value, "rows": rows, "timed": timed, "bm": bms, "bk": bks,
              "tier": tier, "row_group": rg, "weights": []}
    all_shapes = weight_shapes(_PRESET.value, _HEAD_VOCAB.value)
    for i, spec in enumerate(_SHAPES.value):
        name, _, kind = spec.partition(":")
        if name not in all_shapes or kind not in ("", "glu"):
            raise app.UsageError(f"--shapes: {spec!r} is not WEIGHT or WEIGHT:glu with "
                                 f"WEIGHT one of {sorted(all_shapes)}")
        K, N = all_shapes[name]
        glu = kind == "glu"
        base = matmul_config(K, N, jnp.bfloat16, interp)
        tables = ((MULTI_TILE_GLU, TALL_TILE_GLU, PREFILL_TILE_GLU) if glu
                  else (MULTI_TILE, TALL_TILE, PREFILL_TILE))
        # Today's schedule at the largest timed M, and (below the prefill tier) the one
        # such launches ran with before the prefill rule.
        # A schedule whose row group is its table's own travels as (config, row group).
        current = None if interp else [
            c if g == scheduled_row_group(base.bm, c.bm, rg) else (c, g)
            for c, g in (scheduled(base, m, K, N, jnp.bfloat16, rg, *tables,
                                   cols=N // 2 if glu else None)
                         for m in (max(timed), min(max(timed), PREFILL_ROWS)))]
        report["weights"].append(sweep_weight(spec, K, N, rows, timed, rg, jax.random.key(i),
                                              t0, interp, bms, glu=glu, current=current,
                                              tall=tall, prefill=prefill, bks=bks,
                                              groups=groups, grid=_GRID.value))
        write_receipt(_OUT.value, receipt_name, "", report)

    if _WRITE.value:
        report["written"] = write_winners(report, tier, _WRITE.value)
        write_receipt(_OUT.value, receipt_name, "", report)
    print(f"\n{report['device']}, jax {jax.__version__}, {_PRESET.value}, M = {rows}, "
          f"row groups of {rg}; us per call summed over M = {timed}")
    print(f"{'weight':14s} {'table us':>9s} {'variants':>8s} {'bits equal':>10s} "
          f"{'best equal us':>13s}  best equal config")
    for e in report["weights"]:
        if "skipped" in e:
            print(f"{e['weight']:14s} skipped: {e['skipped']}")
            continue
        ran = [v for v in e["variants"] if "us" in v]
        n_eq = sum(all(v["bits_equal"].values()) for v in ran)
        b = e["fastest_equal"]
        print(f"{e['weight']:14s} {e['base_us']:9.2f} {len(ran):8d} {n_eq:10d} "
              f"{(b['us'] if b else float('nan')):13.2f}  {b['config'] if b else '-'}"
              f"{', row group ' + str(b[ROW_GROUP_FIELD]) if b and ROW_GROUP_FIELD in b else ''}")
    if _WRITE.value:
        print(f"written to {_WRITE.value}: {json.dumps(report['written'])}")
    print(f"receipt: {os.path.join(_OUT.value, 'sweep_schedule.json')}")


if __name__ == "__main__":
    cli.run(main)
