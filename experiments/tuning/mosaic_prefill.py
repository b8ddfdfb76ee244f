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

--write=FILE keeps, for each weight, the fastest bit-equal variant as the table's prefill
tile where it beats the library launch by MIN_GAIN summed over --rows (the table then
needs a parity matrix run with it before it is proven: `proven_by`). Writes
mosaic_prefill[_tag].json under --out after every weight. --smoke: tiny shapes in Pallas's
GPU interpret mode on the CPU, a test of the script (its timings mean nothing).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
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
from pallas_kernels.mosaic.prefill_matmul import PrefillConfig, prefill_matmul, prefill_matmul_glu

MIN_GAIN = 0.03  # a variant must beat the library launch by this much to be written

SHAPES = {"wqkv": (4096, 6144), "w_gate_up": (4096, 24576), "w_down": (12288, 4096),
          "wo": (4096, 4096)}
SMOKE = {"wqkv": (128, 256), "w_gate_up": (128, 512), "w_down": (256, 256), "wo": (128, 256)}

_SHAPES = flags.DEFINE_list("shapes", list(SHAPES), "weights, in this order")
_ROWS = flags.DEFINE_list("rows", ["511", "2048"], "row counts M timed (the largest: bits)")
_ALONE = flags.DEFINE_list("alone", ["0", "1", "63", "64", "510", "2047"],
                           "rows computed alone by the decode launch and compared")
_CONFIGS = flags.DEFINE_list(
    "configs", ["128:128:128:2:n", "128:128:64:4:n", "128:128:64:4:m", "128:64:64:5:n",
                "64:128:64:4:m", "128:256:64:3:m"],
    "variants tile_m:tile_n:bk:stages:split[:minor:band] (split: the two compute "
    "warpgroups along m or n; the GLU runs each with tile_n halved)")
_ITERS = flags.DEFINE_integer("iters", 10, "timed calls a measurement (median)")
_REPS = flags.DEFINE_integer("reps", 10, "launches a timed call")
_WRITE = flags.DEFINE_string("write", "", "a data file: keep each weight's winner as its "
                             "prefill tile (the Mosaic table)")
_BUDGET = flags.DEFINE_float("budget_s", 240.0, "no new weight is started after this many s")
_SMOKE = flags.DEFINE_bool("smoke", False, "CPU: tiny shapes, interpret mode")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def parse(spec: str, glu: bool) -> PrefillConfig:
    """tile_m:tile_n:bk:stages:split[:minor:band] -> PrefillConfig (the GLU: tile_n halved)."""
    parts = spec.split(":")
    if len(parts) not in (5, 7):
        raise ValueError(f"--configs: {spec!r} is not tile_m:tile_n:bk:stages:split"
                         "[:minor:band]")
    tm, tn, bk, st, split, *rest = parts
    try:
        extra = {} if not rest else {"minor": rest[0], "band": int(rest[1])}
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

    rows, alone = ints("rows", _ROWS.value), ints("alone", _ALONE.value)
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


def winner(rep: dict, rows: list[int]) -> tuple[str, float, float] | None:
    """The fastest passing variant summed over rows, if MIN_GAIN faster than the library."""
    def total(meth):
        ts = [rep["time"][str(m)].get(meth, {}).get("us") for m in rows]
        return sum(ts) if all(t is not None for t in ts) else None

    lib = total("mosaic")
    best = min(((total(f"ws[{s}]"), s) for s, v in rep["variants"].items()
                if v.get("passes") and total(f"ws[{s}]") is not None), default=None)
    if lib is None or best is None or best[0] > lib * (1 - MIN_GAIN):
        return None
    return best[1], lib, best[0]


def write_table(path: str, report: dict, rows: list[int], receipt: str) -> list[str]:
    """Each weight's `winner` as its table entry's prefill tile, and a provenance record."""
    with open(path) as f:
        data = json.load(f)
    written = []
    for name, rep in report["shapes"].items():
        win = winner(rep, rows)
        if win is None:
            continue
        spec, lib_us, ws_us = win
        for e in data["tuned"]:
            if (e["K"], e["N"], e["dtype"]) == (rep["K"], rep["N"], "bfloat16"):
                cfg = rep["variants"][spec]["config"]
                e["prefill"] = {"design": "ws", **cfg}
                e["prefill_us"] = {"rows": rows, "config": lib_us, "prefill": ws_us}
                written.append(name)
    if written:
        data.setdefault("provenance", []).append({  # (the receipt holds date and device)
            "jax": report["jax"], "prefill_ws": written,
            "command": report.get("command", " ".join(sys.argv)), "receipt": receipt,
            "finding": "warp-specialized prefill tiles (design ws), each bit-equal to the "
                       "library launch and to decode rows alone, the fastest summed over "
                       f"M = {', '.join(map(str, rows))} and faster than the library launch"})
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
    return written


def main(argv):
    del argv
    interpret = _SMOKE.value
    shapes = SMOKE if interpret else SHAPES
    rows, alone, specs = check_flags(interpret)
    if interpret:
        rows = [min(r, 130) for r in rows[:1]] + [200]
    report = {"device": str(jax.devices()[0].device_kind),
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
        report["written"] = write_table(_WRITE.value, report, rows, path or "")
        path = write_receipt(_OUT.value, "mosaic_prefill", _TAG.value, report)
        print("written:", report["written"])
    print("receipt:", path)


if __name__ == "__main__":
    cli.run(main)
