"""The warp-specialized Mosaic GPU prefill matmul on the device: bits and speed.

  python experiments/tuning/mosaic_prefill.py --out=$OUT                 # H200, ~4 minutes
  python experiments/tuning/mosaic_prefill.py --smoke --out=/tmp/r       # CPU, interpret mode

For the Qwen3-8B weights (wqkv, the fused w_gate_up + GLU, w_down, wo; random bf16) and
each variant of --configs (`pallas_kernels.mosaic.prefill_matmul.PrefillConfig`s):

1. Bits. At the largest of --rows, the variant's output must be bitwise the library
   launch's (`pallas_kernels.mosaic.matmul` as the model runs a prefill chunk, i.e. the
   table's prefill tile), its first 1,000 rows bitwise its own output at M = 1,000 (a
   CTA tile past the array's end), and each
   of --alone rows bitwise the row computed alone by the decode step's launch (M = 1,
   the library's decode config): a prefill row equals a decode row (property P).
2. Speed: each variant against the library launch, the Triton lowering (its prefill
   schedule) and XLA's dot, at every M of --rows: one jitted loop of dependent launches
   over two weight copies, median of --iters calls after warm-up, us a launch and
   TFLOP/s.

--write=FILE keeps, for each weight, the fastest bit-equal variant as the table's tile of
--tier (`prefill`: launches past PREFILL_ROWS rows; `tall`: TALL_ROWS < M <= PREFILL_ROWS,
verify blocks at batch 16-64) where it is no slower than the library launch at any of
--rows and beats it by MIN_GAIN summed over them (the table then needs a parity matrix
run with it before it is proven: `proven_by`).

  python experiments/tuning/mosaic_prefill.py --tier=tall --out=$OUT  # rows 80 / 160 / 320 Writes
mosaic_prefill[_tag].json under --out after every weight. --smoke: tiny shapes in Pallas's
GPU interpret mode on the CPU, a test of the script (its timings mean nothing).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
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
from pallas_kernels import mosaic
from pallas_kernels.matmul import matmul as triton_matmul
from pallas_kernels.matmul import matmul_reference
from pallas_kernels.matmul_glu import matmul_glu as triton_glu
from pallas_kernels.matmul_glu import matmul_glu_reference
from pallas_kernels.mosaic.matmul import PREFILL_ROWS, TALL_ROWS
from pallas_kernels.mosaic.prefill_matmul import PrefillConfig, prefill_matmul, prefill_matmul_glu

mosaic_matmul = importlib.import_module("pallas_kernels.mosaic.matmul")  # (the package's
# `matmul` attribute is the function)
MIN_GAIN = 0.03  # a variant must beat the library launch by this much to be written

SHAPES = {"wqkv": (4096, 6144), "w_gate_up": (4096, 24576), "w_down": (12288, 4096),
          "wo": (4096, 4096)}
SMOKE = {"wqkv": (128, 256), "w_gate_up": (128, 512), "w_down": (256, 256), "wo": (128, 256)}

TIER_ROWS = {"prefill": (["511", "2048"], ["0", "1", "63", "64", "510", "2047"]),
             "tall": (["80", "160", "320"], ["0", "1", "63", "64", "79", "159", "319"])}

_SHAPES = flags.DEFINE_list("shapes", list(SHAPES), "weights, in this order")
_TIER = flags.DEFINE_enum("tier", "prefill", list(TIER_ROWS),
                          "the launches swept and written: prefill (past PREFILL_ROWS rows) or "
                          "tall (TALL_ROWS < M <= PREFILL_ROWS, verify blocks)")
_ROWS = flags.DEFINE_list("rows", None, "row counts M timed (the largest: bits; default: the "
                          "tier's, 511,2048 or 80,160,320)")
_ALONE = flags.DEFINE_list("alone", None, "rows computed alone by the decode launch and "
                           "compared (default: the tier's)")
_CONFIGS = flags.DEFINE_list(
    "configs", ["128:128:128:2:n", "128:128:64:4:n", "128:128:64:4:m", "128:64:64:5:n",
                "64:128:64:4:m", "128:256:64:3:m"],
    "variants tile_m:tile_n:bk:stages:split[:minor:band][:c2] (split: the two compute "
    "warpgroups along m or n; the GLU runs each with tile_n halved; c2: CTA pairs sharing "
    "x's block)")
_ITERS = flags.DEFINE_integer("iters", 10, "timed calls a measurement (median)")
_REPS = flags.DEFINE_integer("reps", 10, "launches a timed call")
_WRITE = flags.DEFINE_string("write", "", "a data file: keep each weight's winner as its "
                             "prefill tile (the Mosaic table)")
_BUDGET = flags.DEFINE_float("budget_s", 240.0, "no new weight is started after this many s")
_SMOKE = flags.DEFINE_bool("smoke", False, "CPU: tiny shapes, interpret mode")
_FROM = flags.DEFINE_string("from_receipt", "", "no device work: decide --write's tiles from "
                            "this receipt of an earlier sweep (its tier and rows)")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def parse(spec: str, glu: bool) -> PrefillConfig:
    """tile_m:tile_n:bk:stages:split[:minor:band][:c2] -> PrefillConfig (the GLU: tile_n
    halved; c2: two CTAs a cluster sharing x's block)."""
    parts = spec.split(":")
    cluster = 1
    if len(parts) in (6, 8) and parts[-1].startswith("c"):
        cluster = parts.pop()[1:]
    if len(parts) not in (5, 7):
        raise ValueError(f"--configs: {spec!r} is not tile_m:tile_n:bk:stages:split"
                         "[:minor:band][:c2]")
    tm, tn, bk, st, split, *rest = parts
    try:
        extra = {} if not rest else {"minor": rest[0], "band": int(rest[1])}
        extra["cluster_n"] = int(cluster)
        tn = int(tn) // (2 if glu else 1)  # two accumulators a warpgroup
        return PrefillConfig(tile_m=int(tm), tile_n=tn, bk=int(bk), stages=int(st),
                             wg_split=split, epi_m=64, epi_n=min(64, tn), **extra)
    except ValueError as e:
        raise ValueError(f"--configs: {spec!r}: {e}") from None


def check_flags(interpret: bool) -> tuple[list[int], list[int], list[str]]:
    """(rows, alone, variant specs), each flag checked before any work."""
    def ints(flag, values):
        try:
            out = [int(v) for v in values]
        except ValueError:
            raise ValueError(f"--{flag}={','.join(values)} must be integers") from None
        if not out or min(out) < (1 if flag == "rows" else 0):
            raise ValueError(f"--{flag}={','.join(values)} must name at least one row "
                             f"count >= {1 if flag == 'rows' else 0}")
        return out

    tier_rows, tier_alone = TIER_ROWS[_TIER.value]
    rows = sorted(set(ints("rows", tier_rows if _ROWS.value is None else _ROWS.value)))
    alone = ints("alone", tier_alone if _ALONE.value is None else _ALONE.value)
    lo, hi = (PREFILL_ROWS, None) if _TIER.value == "prefill" else (TALL_ROWS, PREFILL_ROWS)
    if not interpret and any(m <= lo or (hi and m > hi) for m in rows):
        raise ValueError(f"--rows={','.join(map(str, rows))}: the {_TIER.value} tier serves "
                         f"launches of {lo + 1}" + (f"..{hi}" if hi else " or more") + " rows")
    unknown = [s for s in _SHAPES.value if s not in SHAPES]
    if unknown or not _SHAPES.value:
        raise ValueError(f"--shapes={','.join(_SHAPES.value)}: choose from {', '.join(SHAPES)}")
    given = flags.FLAGS["configs"].present
    specs = _CONFIGS.value if given or not interpret else ["64:128:64:2:n", "64:64:64:2:m"]
    if not specs:
        raise ValueError("--configs names no variant")
    for spec in specs:
        parse(spec, glu=False)  # (a GLU's halved tile may still fail: recorded per variant)
    if _WRITE.value:
        if interpret:
            raise ValueError("--write takes a device sweep's winners; --smoke times nothing")
        if not os.path.isfile(_WRITE.value):
            raise ValueError(f"--write={_WRITE.value}: no such table file")
    return rows, alone, specs


def methods(glu: bool, interpret: bool) -> dict:
    """name -> fn(x, w): the launches a prefill chunk may run for this weight."""
    if glu:
        return {"xla": lambda x, w: matmul_glu_reference(x, w, activation="silu"),
                "triton": lambda x, w: triton_glu(x, w, activation="silu", schedule=True,
                                                  interpret=interpret),
                "mosaic": lambda x, w: mosaic.matmul_glu(x, w, activation="silu",
                                                         schedule=True, interpret=interpret)}
    dt = jnp.bfloat16
    return {"xla": lambda x, w: matmul_reference(x, w, out_dtype=dt),
            "triton": lambda x, w: triton_matmul(x, w, out_dtype=dt, schedule=True,
                                                 interpret=interpret),
            "mosaic": lambda x, w: mosaic.matmul(x, w, out_dtype=dt, schedule=True,
                                                 interpret=interpret)}


def variant(cfg: PrefillConfig, glu: bool, interpret: bool):
    sms = 4 if interpret else None
    if glu:
        return lambda x, w: prefill_matmul_glu(x, w, activation="silu", config=cfg,
                                               interpret=interpret, num_sms=sms)
    return lambda x, w: prefill_matmul(x, w, config=cfg, out_dtype=jnp.bfloat16,
                                       interpret=interpret, num_sms=sms)


def decode_row(glu: bool, interpret: bool):
    """The decode step's launch (M = 1: the library's decode config)."""
    if glu:
        return lambda x, w: mosaic.matmul_glu(x, w, activation="silu", interpret=interpret)
    return lambda x, w: mosaic.matmul(x, w, out_dtype=jnp.bfloat16, interpret=interpret)


def time_us(fn, x, ws) -> dict:
    def run(x, *ws):
        def body(_, c):
            for w in ws:
                c = c + fn(x + c.astype(x.dtype), w)[0, 0].astype(jnp.float32) * 0.0
            return c
        return jax.lax.fori_loop(0, max(1, _REPS.value // len(ws)), body, jnp.float32(0.0))

    t0 = time.perf_counter()
    try:
        compiled = jax.jit(run).lower(x, *ws).compile()
        compile_s = time.perf_counter() - t0
        launches = max(1, _REPS.value // len(ws)) * len(ws)
        t = median_time(compiled, x, *ws, iters=_ITERS.value, warmup=2) / launches
    except Exception as e:  # noqa: BLE001 - a variant that cannot build or run is a result
        return {"error": f"{type(e).__name__}: {str(e)[:600]}"}
    return {"us": t * 1e6, "compile_s": compile_s}


def check_bits(fn, lib, row, x, w, alone) -> dict:
    """The variant against the library launch at the largest M, its own prefix of 1,000
    rows (a CTA tile past the array's end: TMA's zero fill, a clipped store), and rows
    computed alone by the decode launch."""
    try:
        full = bits(fn(x, w))
        out = {"equals_library": bool(np.array_equal(full, bits(lib(x, w))))}
        m = min(1000, x.shape[0] - 1)
        out["prefix_mismatch_rows"] = int((bits(fn(x[:m], w)) != full[:m]).any(axis=1).sum())
        bad = [r for r in alone if r < x.shape[0]
               and (bits(row(x[r:r + 1], w))[0] != full[r]).any()]
        out["alone_mismatch"] = bad
        out["passes"] = out["equals_library"] and not out["prefix_mismatch_rows"] and not bad
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:600]}", "passes": False}
    return out


def run_shape(name, K, N, rows, alone, specs, interpret) -> dict:
    glu = name == "w_gate_up"
    dt = jnp.bfloat16
    w = (jax.random.normal(jax.random.key(len(name)), (K, N), jnp.float32)
         * K ** -0.5).astype(dt)
    ws = [w] if interpret else [w, w + jnp.zeros((), dt)]  # two buffers: L2 not reused
    x = jax.random.normal(jax.random.key(1), (max(rows), K), jnp.float32).astype(dt)
    fns = methods(glu, interpret)
    rep = {"K": K, "N": N, "glu": glu, "variants": {}, "time": {}}
    lib, row = fns["mosaic"], decode_row(glu, interpret)
    for spec in specs:
        try:
            cfg = parse(spec, glu)
        except ValueError as e:
            rep["variants"][spec] = {"error": str(e), "passes": False}
            continue
        fns[f"ws[{spec}]"] = variant(cfg, glu, interpret)
        rep["variants"][spec] = {"config": dataclasses.asdict(cfg),
                                 **check_bits(fns[f"ws[{spec}]"], lib, row, x, w, alone)}
    flops = 2 * K * N
    for m in rows:
        for meth, fn in fns.items():
            r = time_us(fn, x[:m], ws)
            if "us" in r:
                r["tflops"] = flops * m / (r["us"] * 1e-6) / 1e12
            rep["time"].setdefault(str(m), {})[meth] = r
    return rep


def winner(rep: dict, rows: list[int], tier: str = "prefill"
           ) -> tuple[str, float, float, int | None] | None:
    """(variant, library us, its us, above) of the passing variant that saves the most time
    over the rows it would serve, if no slower than the library launch at any of them and
    MIN_GAIN faster summed. The prefill tier serves every timed row (above: None); a tall
    tile serves the rows past `above`: the timed rows from some row count up (above the
    timed row below it, or TALL_ROWS)."""
    def times(meth):
        ts = [rep["time"][str(m)].get(meth, {}).get("us") for m in rows]
        return ts if all(t is not None for t in ts) else None

    lib = times("mosaic")
    if lib is None:
        return None
    best = None
    starts = range(len(rows)) if tier == "tall" else [0]
    for spec, v in rep["variants"].items():
        ws = times(f"ws[{spec}]")
        if not v.get("passes") or ws is None:
            continue
        for i in starts:
            lib_i, ws_i = sum(lib[i:]), sum(ws[i:])
            if (any(t > t_lib for t, t_lib in zip(ws[i:], lib[i:], strict=True))
                    or ws_i > lib_i * (1 - MIN_GAIN)):
                continue
            if best is None or lib_i - ws_i > best[1] - best[2]:
                above = None if tier != "tall" else (rows[i - 1] if i else TALL_ROWS)
                best = (spec, lib_i, ws_i, above)
    return best


def read_table(path: str) -> dict:
    """The table at --write, loaded as the library loads it (every entry checked)."""
    try:
        with open(path) as f:
            data = json.load(f)
        mosaic_matmul._read_entries.__wrapped__(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"--write={path}: not a loadable Mosaic tile table ({e})") from None
    if not isinstance(data.get("provenance", []), list):
        raise ValueError(f"--write={path}: its provenance is not a list")
    return data


def _same_tile(a, b) -> bool:
    """Two written tiles alike once PrefillConfig's defaults are filled in."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    fields = {f.name for f in dataclasses.fields(PrefillConfig)}

    def norm(t):
        cfg = PrefillConfig(**{k: v for k, v in t.items() if k in fields})
        return dataclasses.asdict(cfg), {k: v for k, v in t.items() if k not in fields}
    try:
        return norm(a) == norm(b)
    except (TypeError, ValueError):
        return False


def write_table(path: str, report: dict, rows: list[int], receipt: str,
                tier: str = "prefill") -> list[str]:
    """Each weight's `winner` as its table entry's tile of `tier` (prefill or tall), and a
    provenance record; the weights whose tile changed. The new table is read back as the
    library reads it before it replaces the file, so a tile the library would refuse is
    never written; a winner already in the table changes nothing (no new record)."""
    data = read_table(path)
    written = []
    for name, rep in report["shapes"].items():
        win = winner(rep, rows, tier)
        if win is None:
            continue
        spec, lib_us, ws_us, above = win
        for e in data["tuned"]:
            if (e["K"], e["N"], e["dtype"]) == (rep["K"], rep["N"], "bfloat16"):
                tile = {**rep["variants"][spec]["config"], "design": "ws",
                        **({} if above is None else {"above": above}),
                        **({"glu": True} if rep.get("glu") else {})}
                if _same_tile(e.get(tier), tile):
                    continue
                e[tier] = tile
                served = rows if above is None else [m for m in rows if m > above]
                e[f"{tier}_us"] = {"rows": served, "config": lib_us, tier: ws_us}
                written.append(name)
    if written:
        data.setdefault("provenance", []).append({  # (the receipt holds date and device)
            "jax": report["jax"], f"{tier}_ws": written,
            "command": report.get("command", " ".join(sys.argv)), "receipt": receipt,
            "finding": f"warp-specialized {tier} tiles (design ws), each bit-equal to the "
                       "library launch and to decode rows alone at "
                       f"M = {', '.join(map(str, rows))}, the most time saved over the rows "
                       "it serves (a tall tile: past its `above`), no slower than the "
                       "library launch at any of them"})
        text = json.dumps(data, indent=1, allow_nan=False) + "\n"
        fd, check = tempfile.mkstemp(suffix=".json", dir=os.path.dirname(path) or ".")
        try:  # read back as the library will, then moved in place
            with os.fdopen(fd, "w") as f:
                f.write(text)
            mosaic_matmul._read_entries.__wrapped__(check)
        except (TypeError, ValueError, KeyError) as e:
            os.remove(check)
            raise ValueError(f"--write={path}: the new tiles would not load "
                             f"({str(e).replace(check, path)}); nothing written") from None
        os.replace(check, path)
    return written


def check_receipt(path: str, table: dict) -> dict:
    """A sweep's receipt for --from_receipt, checked as a device run checks its flags."""
    def bad(why):
        return ValueError(f"--from_receipt={path}: {why}")

    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        raise bad(f"not a readable receipt ({e})") from None
    if not isinstance(report, dict) or not all(k in report for k in ("rows", "shapes", "jax")):
        raise bad("not a mosaic_prefill receipt (rows, shapes and jax)")
    if report.get("smoke"):
        raise bad("a --smoke receipt times nothing")
    tier, rows, shapes = report.get("tier", "prefill"), report["rows"], report["shapes"]
    if not isinstance(tier, str) or tier not in TIER_ROWS:
        raise bad(f"tier={tier!r} is not one of {', '.join(TIER_ROWS)}")
    lo, hi = (PREFILL_ROWS, 1 << 30) if tier == "prefill" else (TALL_ROWS, PREFILL_ROWS)
    if (not isinstance(rows, list) or not rows
            or not all(isinstance(m, int) and not isinstance(m, bool) for m in rows)
            or rows != sorted(set(rows)) or rows[0] <= lo or rows[-1] > hi):
        raise bad(f"rows={rows!r} must be ascending row counts of the {tier} tier "
                  f"({lo + 1}.." + (f"{hi})" if tier == "tall" else ")"))
    if not isinstance(shapes, dict) or not shapes:
        raise bad("names no weights")
    keys = {(e["K"], e["N"]) for e in table["tuned"] if e["dtype"] == "bfloat16"}
    fields = {f.name for f in dataclasses.fields(PrefillConfig)}
    seen = set()
    for name, rep in shapes.items():
        ok = (isinstance(rep, dict) and isinstance(rep.get("variants"), dict)
              and isinstance(rep.get("time"), dict)
              and all(isinstance(rep["time"].get(str(m)), dict) for m in rows))
        if not ok:
            raise bad(f"weight {name!r} lacks its variants or a time at every row")
        key = (rep.get("K"), rep.get("N"))
        if not all(isinstance(v, int) for v in key) or key not in keys:
            raise bad(f"weight {name!r} (K={key[0]!r}, N={key[1]!r}) has no bfloat16 entry "
                      "in the table")
        if key in seen:
            raise bad(f"weight {name!r}: a second weight of K={key[0]}, N={key[1]}")
        seen.add(key)
        for spec, v in rep["variants"].items():
            if not isinstance(v, dict) or not isinstance(v.get("passes", False), bool):
                raise bad(f"weight {name!r}, variant {spec!r}: passes must be a bool")
            if v.get("passes") and (not isinstance(v.get("config"), dict)
                                    or set(v["config"]) - fields):
                raise bad(f"weight {name!r}, variant {spec!r}: its config must hold "
                          "PrefillConfig's fields only")
        for m in rows:
            for meth, t in rep["time"][str(m)].items():
                us = t.get("us") if isinstance(t, dict) else None
                if not (isinstance(t, dict) and ("error" in t or (
                        isinstance(us, (int, float)) and not isinstance(us, bool)
                        and math.isfinite(us) and us > 0))):
                    raise bad(f"weight {name!r}, M={m}, {meth}: a time must be a positive "
                              f"finite us (or an error); got {t!r}")
    return report


def from_receipt(path: str) -> None:
    """--from_receipt: the table's tiles re-decided from a sweep's receipt (the rule may have
    changed since it ran), written with --write; the receipt's own tier and rows."""
    given = [f"--{n}" for n in ("smoke", "tier", "rows", "alone", "configs", "shapes")
             if flags.FLAGS[n].present]
    if given:
        raise ValueError(f"--from_receipt takes the receipt's tier, rows and variants; "
                         f"{', '.join(given)} would be ignored")
    if not _WRITE.value:
        raise ValueError("--from_receipt decides --write's tiles: name the table with --write")
    if not os.path.isfile(_WRITE.value):
        raise ValueError(f"--write={_WRITE.value}: no such table file")
    report = check_receipt(path, read_table(_WRITE.value))
    report["command"] = " ".join(sys.argv)
    try:
        written = write_table(_WRITE.value, report, report["rows"], path,
                              report.get("tier", "prefill"))
    except (TypeError, KeyError, AttributeError) as e:  # a receipt shape check_receipt
        raise ValueError(f"--from_receipt={path}: not a sweep's receipt ({e!r}); nothing "
                         "written") from None  # did not foresee
    print("written:", written)


def main(argv):
    del argv
    if _FROM.value:
        return from_receipt(_FROM.value)
    interpret = _SMOKE.value
    shapes = SMOKE if interpret else SHAPES
    rows, alone, specs = check_flags(interpret)
    if interpret:
        rows = [min(r, 130) for r in rows[:1]] + [200]
    report = {"device": str(jax.devices()[0].device_kind), "tier": _TIER.value,
              "jax": jax.__version__, "rows": rows, "alone": alone, "smoke": interpret,
              "shapes": {}}
    t0 = time.perf_counter()
    path = None
    for name in tqdm(_SHAPES.value, desc="weights"):
        if time.perf_counter() - t0 > _BUDGET.value:
            report.setdefault("skipped", []).append(name)
            continue
        K, N = shapes[name]
        report["shapes"][name] = run_shape(name, K, N, rows, alone, specs, interpret)
        path = write_receipt(_OUT.value, "mosaic_prefill", _TAG.value, report)
        rep = report["shapes"][name]
        for m in rows:
            line = "  ".join(f"{k}={v['us']:.1f}" if "us" in v else f"{k}=ERR"
                             for k, v in rep["time"][str(m)].items())
            print(f"{name} M={m}: {line}")
        print(f"{name} bits: " + "  ".join(f"{s}={v.get('passes')}"
                                          for s, v in rep["variants"].items()))
    if _WRITE.value and not interpret:
        report["written"] = write_table(_WRITE.value, report, rows, path or "", _TIER.value)
        path = write_receipt(_OUT.value, "mosaic_prefill", _TAG.value, report)
        print("written:", report["written"])
    print("receipt:", path)


if __name__ == "__main__":
    cli.run(main)
