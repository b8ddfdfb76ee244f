"""The Mosaic GPU matmul on the device: row invariance, bitwise, and speed against Triton.

  python experiments/tuning/mosaic_matmul.py --out=$OUT            # H200, ~3-4 minutes
  python experiments/tuning/mosaic_matmul.py --smoke --out=/tmp/r  # CPU, interpret mode

For the Qwen3-8B weights (wqkv 4096x6144, wo 4096x4096, w_gate_up 4096x24576, w_down
12288x4096, lm_head 4096x151936; random bf16 values; --shapes may also name the default
feature head's own, head_wqkv 8192x6144, head_fc 12288x4096 and head_lm_head 4096x32768,
bench_e2e.py's head vocabulary), or with --model=qwen3-30b-a3b the mixture of experts'
dense weights (wqkv 2048x5120, wo 4096x2048, router 2048x128, lm_head 2048x151936), and M
in --rows:

1. Bits (rule R1/R11): `pallas_kernels.mosaic.matmul` at max(rows) rows; at every other M
   the rows must be bitwise the first M rows of that (`prefix_mismatch_rows`), and the
   --alone rows, each computed alone (M = 1), must be bitwise the same row among
   max(rows) (`alone_mismatch_rows`): a row's bits do not depend on M nor on its place
   in the 64-row tile. For w_gate_up also the fused `matmul_glu` (the same two checks)
   and whether it equals the Triton `glu` kernel on the Mosaic matmul's halves (the
   unfused path's bits; informative: the two lowerings' exp may differ). And whether
   another column tile (bn) gives the same bits (informative: bk is fixed by K, so only
   the wgmma's N differs; tensor-parallel shards would need it).
2. Speed: Mosaic vs the Triton `pallas_kernels.matmul.matmul` (its tuned tiles and
   multi-tile schedule, as the model runs it) vs XLA's dot (`matmul_reference`), each
   timed as one jitted loop of >= --reps dependent launches cycling through enough
   weight copies to read --cold_mb (cold L2), median of --iters calls after warm-up
   with `block_until_ready`; us per launch and GB/s of weight bytes, and the fraction
   of a copy's bandwidth (`copy_bandwidth`, read + write of a 4 GiB array).

3. Split-K variants (--configs s:bk:stages:kS, the swapped design with K in S chunks added
   left to right: a weight of few column blocks): their own bits (R11), checked for row
   invariance as the swapped design is (`invariance`); --write may take one for the
   table (a parity matrix must then prove it).

4. Prefill tiles (--configs bn:bk:stages, plain): timed past 160 rows too (the fused GLU
   for w_gate_up), each's bits against the library config's at M = 1, 40 and the largest;
   --write_prefill keeps the fastest bit-equal one past PREFILL_ROWS as the weight's
   `prefill` tile where it beats the library config there.

Prints a table; writes the JSON receipt to --out/mosaic_matmul[_tag].json after every
shape. --smoke runs tiny shapes with every kernel in interpret mode on the CPU (the
Mosaic kernel in Pallas's GPU interpret mode): a test of the script, whose timings mean
nothing and whose row-alone check may report mismatches (the interpreter's wgmma is
numpy's BLAS, whose bits for a row depend on its place among the 64; see
tests/test_mosaic.py).
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
from jspec.bench.receipts import write_receipt
from jspec.bench.timing import copy_bandwidth, median_time
from pallas_kernels import mosaic
from pallas_kernels.glu import glu
from pallas_kernels.matmul import matmul as triton_matmul
from pallas_kernels.matmul import matmul_reference
from pallas_kernels.mosaic.matmul import PREFILL_ROWS, TOKEN_TILES, pipeline_stages

MIN_PREFILL_GAIN = 0.03  # a prefill tile must beat the library config by this much

_ROWS = flags.DEFINE_list("rows", ["1", "16", "17", "40", "64", "160", "320"], "row counts M")
_ALONE = flags.DEFINE_list("alone", ["0", "1", "7", "8", "31", "63", "64", "100", "319"],
                           "rows computed alone (M = 1) and compared with max(rows)")
_SHAPES = flags.DEFINE_list("shapes", ["wqkv", "wo", "w_gate_up", "w_down", "lm_head"],
                            "weights, in this order (--model=qwen3-30b-a3b: its four when "
                            "not given)")
_MODEL = flags.DEFINE_enum("model", "qwen3-8b", ["qwen3-8b", "qwen3-30b-a3b"],
                           "whose weight shapes")
_ITERS = flags.DEFINE_integer("iters", 20, "timed calls per measurement (median)")
_REPS = flags.DEFINE_integer("reps", 20, "kernel launches per timed call")
_COLD = flags.DEFINE_float("cold_mb", 256.0, "weight copies to read at least this many MB "
                           "per loop, so no weight is served from L2 (0: one copy)")
_CONFIGS = flags.DEFINE_list("configs", [], "extra Mosaic tiles bn:bk:stages (or "
                             "s:bk:stages[:token_tiles[:w]][:kS], the swapped design; w: the "
                             "program's tokens in one wide accumulator; kS: K in S chunks, "
                             "added left to right: its own bits) timed at M=1 and "
                             "17 (token_tiles: also at the largest M; a plain bn:bk:stages "
                             "also past 160 rows, with its bits against the library's "
                             "config) for every shape (scheduling study; bk changes bits)")
_SWAPPED = flags.DEFINE_bool("swapped", False, "also the swapped design (weight columns as the "
                             "wgmma M, 16 tokens as N): its bits checked like the plain "
                             "design's, timed at every M")
_PLAIN_BITS = flags.DEFINE_bool("plain_bits", True, "check the plain design's bits too "
                                 "(--noplain_bits: time it only; its bits are proven)")
_WRITE = flags.DEFINE_string("write", "", "with --swapped: a data file "
                             "(pallas_kernels/mosaic/matmul_tuned.json) that takes, for each "
                             "weight whose swapped bits pass every check, the fastest summed "
                             "over M = 1 and 17 of the swapped config and the s: --configs "
                             "with its bits (at M = 1, 40, max), where faster than the plain "
                             "design (the GLU's time for w_gate_up)")
_WRITE_PREFILL = flags.DEFINE_string(
    "write_prefill", "", "a data file (pallas_kernels/mosaic/matmul_tuned.json) that takes, "
    "for each weight, the plain bn:bk:stages --configs variant with the library config's bits "
    "(and bk) fastest past PREFILL_ROWS rows, as its prefill tile, where faster there than "
    "the library config by MIN_PREFILL_GAIN")
_BUDGET = flags.DEFINE_float("budget_s", 200.0, "no new shape is started after this many s")
_SMOKE = flags.DEFINE_bool("smoke", False, "CPU: tiny shapes, interpret mode")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")

QWEN3_8B = {"wqkv": (4096, 6144), "wo": (4096, 4096), "w_gate_up": (4096, 24576),
            "w_down": (12288, 4096), "lm_head": (4096, 151936),
            # the default feature head's own (`random_model.weight_shapes`, head vocab 32768)
            "head_wqkv": (8192, 6144), "head_fc": (12288, 4096), "head_lm_head": (4096, 32768)}
# The mixture of experts' dense weights (Qwen3-30B-A3B: hidden 2048, 32 + 2 x 4 heads of
# 128, 128 experts); its experts run the grouped kernels (`mosaic/moe.py`, no table).
QWEN3_30B_A3B = {"wqkv": (2048, 5120), "wo": (4096, 2048), "router": (2048, 128),
                 "lm_head": (2048, 151936)}
MODELS = {"qwen3-8b": QWEN3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}
SMOKE = {"wqkv": (128, 192), "wo": (128, 128), "w_gate_up": (128, 256), "w_down": (256, 128),
         "lm_head": (128, 320), "head_wqkv": (256, 192), "head_fc": (384, 128),
         "head_lm_head": (128, 256)}
SMOKES = {"qwen3-8b": SMOKE,  # --smoke: each model's weights, tiny
          "qwen3-30b-a3b": {"wqkv": (128, 192), "wo": (256, 128), "router": (128, 128),
                            "lm_head": (128, 320)}}


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def swapped_config(K: int, dtype, stages: int | None = None) -> mosaic.MosaicMatmulConfig:
    """The swapped design at the rule's K tile (at least 64)."""
    bk = max(64, mosaic.mosaic_matmul_config(K, 128, dtype, tuned=False).bk)
    return mosaic.MosaicMatmulConfig(bn=64, bk=bk, swapped=True,
                                     stages=stages or pipeline_stages(bk, 64, dtype))


def methods(out_dtype, interpret: bool) -> dict:
    """name -> fn(x [M, K], w [K, N]) -> [M, N]: the matmuls compared."""
    swapped = {} if not _SWAPPED.value else {"mosaic_swapped": lambda x, w: mosaic.matmul(
        x, w, out_dtype=out_dtype, interpret=interpret,
        config=swapped_config(w.shape[0], w.dtype))}
    return {
        **swapped,
        "mosaic": lambda x, w: mosaic.matmul(x, w, out_dtype=out_dtype, interpret=interpret),
        "triton": lambda x, w: triton_matmul(x, w, out_dtype=out_dtype, interpret=interpret,
                                             row_group=4, schedule=True),
        "xla": lambda x, w: matmul_reference(x, w, out_dtype=out_dtype),
    }


def looped(fn, loops: int):
    """loops x len(ws) dependent launches of fn in one jitted loop (the carry feeds the
    next input); each iteration walks the weight copies ws in order."""

    def run(x, *ws):
        def body(_, c):
            for w in ws:
                y = fn(x + c.astype(x.dtype), w)
                c = c + y[0, 0].astype(jnp.float32) * 0.0
            return c

        return jax.lax.fori_loop(0, loops, body, jnp.float32(0.0))

    return jax.jit(run)


def time_us(fn, x, ws) -> dict:
    """us per launch of fn at x's M (AOT compile first, timed apart)."""
    loops = max(1, -(-_REPS.value // len(ws)))
    t0 = time.perf_counter()
    try:
        compiled = looped(fn, loops).lower(x, *ws).compile()
        compile_s = time.perf_counter() - t0
        t = median_time(compiled, x, *ws, iters=_ITERS.value, warmup=2) / (loops * len(ws))
    except Exception as e:  # noqa: BLE001 - a kernel that cannot build or run is a result
        return {"error": f"{type(e).__name__}: {str(e)[:600]}"}
    return {"us": t * 1e6, "compile_s": compile_s}


def invariance(fn, x, rows: list[int], alone: list[int]) -> dict:
    """Bitwise: fn(x[:m]) == fn(x)[:m] for m in rows; fn(x[r:r+1]) == fn(x)[r] for r in
    alone. Counts the mismatching rows."""
    f = jax.jit(fn)
    try:
        full = bits(f(x))
        prefix = {m: int((bits(f(x[:m])) != full[:m]).any(axis=1).sum()) for m in rows}
        lone = {r: bool((bits(f(x[r:r + 1]))[0] != full[r]).any()) for r in alone}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:600]}"}
    return {"prefix_mismatch_rows": prefix, "alone_mismatch_rows": sum(lone.values()),
            "alone_mismatch": [r for r, bad in lone.items() if bad]}


def glu_checks(x, w, rows, alone, interpret: bool, config=None) -> dict:
    """The fused Mosaic matmul_glu: row invariance, its timing is in the table; and
    whether it equals the Triton glu kernel on the Mosaic matmul's halves."""
    fused = lambda a, b: mosaic.matmul_glu(a, b, activation="silu", interpret=interpret,
                                           config=config)
    out = {"invariance": invariance(lambda a: fused(a, w), x, rows, alone)}
    try:
        gate, up = jnp.split(mosaic.matmul(x, w, out_dtype=x.dtype, interpret=interpret,
                                           config=config), 2, axis=-1)
        unfused = glu(gate, up, activation="silu", interpret=interpret)
        out["equals_triton_glu_of_halves"] = bool(np.array_equal(bits(fused(x, w)),
                                                                 bits(unfused)))
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    return out


def other_bn_same_bits(x, w, out_dtype, interpret: bool) -> dict:
    """Informative: the default tiles vs the same bk with another column tile."""
    cfg = mosaic.mosaic_matmul_config(*w.shape, w.dtype)
    alt = dataclasses.replace(cfg, bn=64 if cfg.bn != 64 else 32)
    try:
        a = mosaic.matmul(x, w, out_dtype=out_dtype, interpret=interpret)
        b = mosaic.matmul(x, w, out_dtype=out_dtype, interpret=interpret, config=alt)
        return {"bn": [cfg.bn, alt.bn], "equal": bool(np.array_equal(bits(a), bits(b)))}
    except Exception as e:  # noqa: BLE001
        return {"bn": [cfg.bn, alt.bn], "error": f"{type(e).__name__}: {str(e)[:400]}"}


def same_bits(fn, ref, x, w, rows) -> bool | str:
    """Whether fn gives ref's bits at M = 1, 40 and the largest M (an error's text if it
    fails to run): the check a variant passes before the table may take it."""
    try:
        return all(np.array_equal(bits(fn(x[:m], w)), bits(ref(x[:m], w)))
                   for m in (1, 40, max(rows)))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:300]}"


CONFIG_SPEC = re.compile(r"(?P<bn>s|[0-9]+):(?P<bk>[0-9]+):(?P<stages>[0-9]+)"
                         r"(?::(?P<tiles>[0-9]+)(?P<wide>:w)?)?(?::k(?P<splits>[0-9]+))?")


def parse_config(spec: str, K: int, dtype) -> tuple[mosaic.MosaicMatmulConfig, bool]:
    """A --configs entry -> (config, whether it takes token tiles past the default).
    Grammar: bn:bk:stages (the plain design, a prefill tile candidate) or
    s:bk:stages[:token_tiles[:w]][:kS] (the swapped design; kS: K in S chunks)."""
    m = CONFIG_SPEC.fullmatch(spec)
    if m is None:
        raise ValueError(f"--configs entry {spec!r}: expected bn:bk:stages or "
                         "s:bk:stages[:token_tiles[:w]][:kS]")
    swapped = m["bn"] == "s"
    if not swapped and (m["tiles"] or m["splits"]):
        raise ValueError(f"--configs entry {spec!r}: token tiles and kS are the swapped "
                         "design's (s:...); a plain bn:bk:stages is a prefill tile candidate")
    try:
        cfg = (swapped_config(K, dtype, int(m["stages"])) if swapped else
               mosaic.MosaicMatmulConfig(bn=int(m["bn"]), bk=int(m["bk"]),
                                         stages=int(m["stages"])))
        cfg = dataclasses.replace(cfg, bk=int(m["bk"]), splits=int(m["splits"] or 1))
        if m["tiles"]:
            cfg = dataclasses.replace(cfg, token_tiles=int(m["tiles"]), wide=bool(m["wide"]))
    except ValueError as e:
        raise ValueError(f"--configs entry {spec!r}: {e}") from None
    return cfg, bool(m["tiles"])


def _check_configs(specs: list[str]) -> bool:
    for spec in specs:  # at flag parsing: a bad entry fails before anything runs
        try:
            parse_config(spec, 4096, jnp.bfloat16)
        except ValueError as e:
            raise flags.ValidationError(str(e)) from None
    return True


flags.register_validator("configs", _check_configs)


def run_shape(name: str, K: int, N: int, rows: list[int], alone: list[int], bw: float,
              interpret: bool, seed: int = 0) -> dict:
    dtype = jnp.bfloat16
    out_dtype = jnp.float32 if name.endswith("lm_head") or name == "router" else dtype
    key = jax.random.key(seed)
    w = (jax.random.normal(key, (K, N), jnp.float32) * K**-0.5).astype(dtype)
    wb = K * N * 2
    copies = max(1, math.ceil(_COLD.value * 1e6 / wb)) if _COLD.value > 0 and not interpret else 1
    ws = [w] + [w + jnp.zeros((), dtype) * i for i in range(1, copies)]  # distinct buffers
    x = jax.random.normal(jax.random.key(1), (max(rows), K), jnp.float32).astype(dtype)
    fns = methods(out_dtype, interpret)
    rep = {"K": K, "N": N, "weight_bytes": wb, "weight_copies": copies,
           "config": dataclasses.asdict(mosaic.mosaic_matmul_config(K, N, dtype)),
           "bits": invariance(lambda a: fns["mosaic"](a, w), x, rows, alone)
           if _PLAIN_BITS.value else {},
           "other_bn": other_bn_same_bits(x[:16], w, out_dtype, interpret)
           if _PLAIN_BITS.value else {}, "time": {}}
    if _SWAPPED.value:
        sw = swapped_config(K, dtype)
        rep["swapped"] = {"config": dataclasses.asdict(sw),
                          "bits": invariance(lambda a: fns["mosaic_swapped"](a, w), x, rows,
                                             alone)}
        try:  # informative: does the swapped instruction give the plain design's bits?
            rep["swapped"]["equals_plain"] = bool(np.array_equal(
                bits(fns["mosaic_swapped"](x[:40], w)), bits(fns["mosaic"](x[:40], w))))
        except Exception as e:  # noqa: BLE001
            rep["swapped"]["equals_plain"] = f"{type(e).__name__}: {str(e)[:400]}"
    if name == "w_gate_up":
        fns["mosaic_glu"] = lambda a, b: mosaic.matmul_glu(a, b, activation="silu",
                                                           interpret=interpret)
        rep["glu"] = glu_checks(x, w, rows, alone, interpret) if _PLAIN_BITS.value else {}
        if _SWAPPED.value:
            fns["mosaic_swapped_glu"] = lambda a, b: mosaic.matmul_glu(
                a, b, activation="silu", interpret=interpret, config=sw)
            rep["swapped"]["glu"] = glu_checks(x, w, rows, alone, interpret, config=sw)
    tall = {}  # variants with more token tiles: timed at the largest M too
    for spec in _CONFIGS.value:
        cfg, tiles = parse_config(spec, K, dtype)
        if tiles:
            tall[f"mosaic[{spec}]"] = True
        fns[f"mosaic[{spec}]"] = (lambda c: lambda a, b: mosaic.matmul(
            a, b, out_dtype=out_dtype, interpret=interpret, config=c))(cfg)
        if not cfg.swapped:  # a plain tile for prefill launches: timed past 160 rows
            tall[f"mosaic[{spec}]"] = "tall"  # too, its bits against the library config's
            rep.setdefault("plain_variants", {})[spec] = {
                "config": dataclasses.asdict(cfg),
                "equals_library": same_bits(fns[f"mosaic[{spec}]"], fns["mosaic"], x, w, rows)}
            if "mosaic_glu" in fns:  # the fused GLU on that tile (the model's call)
                glu = f"mosaic_glu[{spec}]"
                fns[glu] = (lambda c: lambda a, b: mosaic.matmul_glu(
                    a, b, activation="silu", interpret=interpret, config=c))(cfg)
                tall[glu] = "tall"
                rep["plain_variants"][spec]["glu_equals_library"] = same_bits(
                    fns[glu], fns["mosaic_glu"], x, w, rows)
        if cfg.swapped and _SWAPPED.value:  # a candidate for the table: its bits checked
            same = same_bits(fns[f"mosaic[{spec}]"], fns["mosaic_swapped"], x, w, rows)
            rep["swapped"].setdefault("variants", {})[spec] = {
                "config": dataclasses.asdict(cfg), "equals_swapped": same}
            if cfg.splits > 1:  # its own bits: row invariance checked as the design's
                fn = fns[f"mosaic[{spec}]"]
                rep["swapped"]["variants"][spec]["bits"] = invariance(
                    lambda a, fn=fn: fn(a, w), x, rows, alone)
            if tiles and "mosaic_swapped_glu" in fns:  # the GLU at more token tiles
                glu = f"mosaic_glu[{spec}]"
                fns[glu] = (lambda c: lambda a, b: mosaic.matmul_glu(
                    a, b, activation="silu", interpret=interpret, config=c))(cfg)
                tall[glu] = True
                same = same_bits(fns[glu], fns["mosaic_swapped_glu"], x, w, rows)
                rep["swapped"].setdefault("glu_variants", {})[spec] = {
                    "config": dataclasses.asdict(cfg), "equals_swapped": same}
    for m in rows:
        for meth, fn in fns.items():
            if meth.startswith("mosaic_glu[") and m != max(rows) and not (
                    tall.get(meth) == "tall" and m > 160):  # token tiles; prefill tiles
                continue
            if meth.startswith("mosaic[") and m not in (1, 17) and not (
                    meth in tall and m == max(rows)) and not (tall.get(meth) == "tall"
                                                              and m > 160):
                continue
            r = time_us(fn, x[:m], ws)
            if "us" in r:
                r["GBps"] = wb / (r["us"] * 1e-6) / 1e9
                r["of_copy_bw"] = r["GBps"] * 1e9 / bw if bw else None
            rep["time"].setdefault(str(m), {})[meth] = r
    return rep


def invariant(c: dict) -> bool:
    """An `invariance` result with no error and no mismatching row."""
    return ("error" not in c and not any(c["prefix_mismatch_rows"].values())
            and c["alone_mismatch_rows"] == 0)


def swapped_passes(rep: dict) -> bool:
    """Every bit check of the swapped design clean (the GLU's too, for w_gate_up)."""
    checks = [rep["swapped"]["bits"]] + ([rep["swapped"]["glu"]["invariance"]]
                                         if "glu" in rep["swapped"] else [])
    return all(invariant(c) for c in checks)


def own_bits_pass(variant: dict) -> bool:
    """A split-K variant (its own bits, R11): every row-invariance check clean."""
    c = variant.get("bits")
    return (variant["config"].get("splits", 1) > 1 and isinstance(c, dict)
            and invariant(c))


def write_tuned(path: str, report: dict, receipt: str | None = None) -> list[str]:
    """Merges each passing, faster swapped config into the data file; returns the
    weights written. Its provenance entry records this run's command and `receipt`;
    the parity matrix that proves the table is added by hand once it has run."""
    data = json.load(open(path)) if os.path.exists(path) else {
        "about": "Per-weight-shape configs of pallas_kernels/mosaic/matmul.py (read at "
                 "import; shapes not listed use the plain design's rule). Written by "
                 "experiments/tuning/mosaic_matmul.py --swapped --write after its bit checks; "
                 "the provenance names the receipts and the parity matrix that proved it.",
        "provenance": [], "tuned": []}
    written = []
    for name, rep in report["shapes"].items():
        if "swapped" not in rep or not swapped_passes(rep):
            continue
        glu = "glu" in rep["swapped"]
        plain, swapped = ("mosaic_glu", "mosaic_swapped_glu") if glu else (
            "mosaic", "mosaic_swapped")
        configs = {swapped: rep["swapped"]["config"]}
        if not glu:  # the GLU's depth is capped by its two weight blocks: variants time
            configs.update({f"mosaic[{spec}]": v["config"]  # the plain matmul only
                            for spec, v in rep["swapped"].get("variants", {}).items()
                            if v["equals_swapped"] is True or own_bits_pass(v)})
        else:  # its token tiles: the GLU itself, timed at the largest M
            configs.update({f"mosaic_glu[{spec}]": v["config"]
                            for spec, v in rep["swapped"].get("glu_variants", {}).items()
                            if v["equals_swapped"] is True})
        t = {}
        for k in (plain, *configs):
            try:
                t[k] = sum(rep["time"][m][k]["us"] for m in ("1", "17"))
            except KeyError:
                pass
        # Token tiles past the default change nothing at M <= 64: chosen at the largest M
        # (among bit-equal variants of the winner's bk), the rest at M = 1 and 17.
        short = {k: c for k, c in configs.items()
                 if c.get("token_tiles", TOKEN_TILES) == TOKEN_TILES}
        best = min((k for k in short if k in t), key=t.get, default=None)
        if best is not None and plain in t and t[best] < t[plain]:
            config = dict(configs[best])
            m_max = str(max(int(m) for m in rep["time"]))
            at = {k: rep["time"][m_max][k]["us"] for k, c in configs.items()
                  if k in rep["time"][m_max] and "us" in rep["time"][m_max][k]
                  and c["bk"] == config["bk"]
                  and c.get("splits", 1) == config.get("splits", 1)}
            tiles = min(at, key=at.get, default=None)
            if tiles is not None and configs[tiles].get("token_tiles", TOKEN_TILES) != \
                    TOKEN_TILES:
                config["token_tiles"] = configs[tiles]["token_tiles"]
                if configs[tiles].get("wide"):
                    config["wide"] = True
            data["tuned"] = [e for e in data["tuned"]
                             if (e["K"], e["N"]) != (rep["K"], rep["N"])]
            data["tuned"].append({"K": rep["K"], "N": rep["N"], "dtype": "bfloat16",
                                  "config": config, "us_m1_m17": [t[plain], t[best]]})
            written.append(name)
    return _save(path, data, report, receipt, "weights", written)


def _save(path: str, data: dict, report: dict, receipt: str | None, what: str,
          written: list[str]) -> list[str]:
    """Writes the data file with this run's provenance entry (`what`: the weights it
    wrote); returns them."""
    # No date or device in the library's data file: the receipt holds them, docs cite it.
    data["provenance"].append({"jax": report["jax"], what: written,
                               "command": report["command"], "receipt": receipt})
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    return written


def prefill_winner(rep: dict) -> dict | None:
    """The plain tile a weight's launches past PREFILL_ROWS take: among the variants whose
    bits equal the library config's (the fused GLU's too, for the GLU weight), the fastest
    summed over the timed row counts past PREFILL_ROWS, if faster there than the library
    config by MIN_PREFILL_GAIN; else None."""
    big = [m for m in rep["time"] if int(m) > PREFILL_ROWS]
    glu = any("mosaic_glu" in rep["time"][m] for m in big)
    base = "mosaic_glu" if glu else "mosaic"

    def total(meth):
        ts = [rep["time"][m].get(meth, {}).get("us") for m in big]
        return sum(ts) if big and all(t is not None for t in ts) else None

    best, best_t = None, None
    for spec, v in rep.get("plain_variants", {}).items():
        if v["equals_library"] is not True or (glu and v.get("glu_equals_library") is not True):
            continue
        t = total(f"mosaic_glu[{spec}]" if glu else f"mosaic[{spec}]")
        if t is not None and (best_t is None or t < best_t):
            best, best_t = v["config"], t
    t0 = total(base)
    if best is None or t0 is None or best_t > t0 * (1 - MIN_PREFILL_GAIN):
        return None
    return {"config": best, "us": [t0, best_t], "rows": sorted(int(m) for m in big)}


def write_prefill(path: str, report: dict, receipt: str | None = None) -> list[str]:
    """Sets each weight's `prefill` tile (`prefill_winner`) in the data file, adding an
    entry with the rule's config where the weight has none; returns the weights
    written. The provenance records the run; the matrix that proves it is added by hand."""
    with open(path) as f:
        data = json.load(f)
    written = []
    for name, rep in report["shapes"].items():
        win = prefill_winner(rep)
        if win is None:
            continue
        entry = next((e for e in data["tuned"] if (e["K"], e["N"]) == (rep["K"], rep["N"])),
                     None)
        if entry is None:
            rule = mosaic.mosaic_matmul_config(rep["K"], rep["N"], jnp.bfloat16, tuned=False)
            entry = {"K": rep["K"], "N": rep["N"], "dtype": "bfloat16",
                     "config": dataclasses.asdict(rule)}
            data["tuned"].append(entry)
        if entry["config"]["bk"] != win["config"]["bk"] or entry["config"].get("splits", 1) > 1:
            continue  # bk and a split set bits: a tile of another is never a schedule
        entry["prefill"] = {k: win["config"][k] for k in ("bn", "bk", "stages")}
        entry["prefill_us"] = {"rows": win["rows"], "config": win["us"][0],
                               "prefill": win["us"][1]}
        written.append(name)
    return _save(path, data, report, receipt, "prefill_tiles", written)


def table(report: dict) -> str:
    lines = []
    for name, rep in report["shapes"].items():
        b = rep["bits"]
        if "swapped" in rep:
            sb = rep["swapped"]["bits"]
            lines.append(f"{name} swapped {rep['swapped']['config']}  prefix mismatches "
                         f"{sb.get('prefix_mismatch_rows')}  alone mismatches "
                         f"{sb.get('alone_mismatch_rows')}  equals plain "
                         f"{rep['swapped'].get('equals_plain')}  glu "
                         f"{rep['swapped'].get('glu', {}).get('invariance')}")
        lines.append(f"{name} {rep['K']}x{rep['N']} {rep['config']}  prefix mismatches "
                     f"{b.get('prefix_mismatch_rows')}  alone mismatches "
                     f"{b.get('alone_mismatch_rows')}  other bn same bits "
                     f"{rep['other_bn'].get('equal')}" + (f"  glu {rep['glu']}"
                                                          if "glu" in rep else ""))
        for spec, v in rep.get("swapped", {}).get("variants", {}).items():
            if "bits" in v:  # a split variant: its own bits' checks
                lines.append(f"{name} {spec}: prefix mismatches "
                             f"{v['bits'].get('prefix_mismatch_rows')}  alone mismatches "
                             f"{v['bits'].get('alone_mismatch_rows')}")
        if rep.get("plain_variants"):
            lines.append(f"{name} plain variants' bits equal the library's: " + ", ".join(
                f"{k} {v['equals_library']}" for k, v in rep["plain_variants"].items()))
        for m, per in rep["time"].items():
            cells = [f"{k} {v['us']:8.1f}us {v['GBps']:6.0f}GB/s {v['of_copy_bw'] or 0:.2f}"
                     if "us" in v else f"{k} ERROR" for k, v in per.items()]
            lines.append(f"  M={m:>4}: " + " | ".join(cells))
    return "\n".join(lines)


def main(argv):
    del argv
    interpret = _SMOKE.value
    shapes = (SMOKES if interpret else MODELS)[_MODEL.value]
    names = (_SHAPES.value if flags.FLAGS["shapes"].present or _MODEL.value == "qwen3-8b"
             else list(shapes))
    if not names:
        raise SystemExit("--shapes: no weights named")
    unknown = [n for n in names if n not in shapes]
    if unknown:
        raise SystemExit(f"--shapes: {unknown} are not {_MODEL.value}'s weights "
                         f"({', '.join(shapes)})")
    rows = [int(r) for r in _ROWS.value]
    alone = [int(r) for r in _ALONE.value if int(r) < max(rows)]
    if interpret:  # the interpreter runs a grid step in ~0.1 s: keep the smoke short
        rows, alone = [1, 16, 17, 65], [0, 9, 64]
        flags.FLAGS.iters, flags.FLAGS.reps = 2, 1
    bw = copy_bandwidth(5)
    report = {"command": " ".join(["python"] + sys.argv), "date": time.strftime("%Y-%m-%d"),
              "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "smoke": interpret, "model": _MODEL.value, "rows": rows, "alone": alone,
              "copy_bw_GBps": bw / 1e9,
              "cold_mb": _COLD.value, "shapes": {}, "skipped": []}
    t0, path = time.perf_counter(), None
    for name in names:
        if time.perf_counter() - t0 > _BUDGET.value:
            report["skipped"].append(name)
            continue
        K, N = shapes[name]
        report["shapes"][name] = run_shape(name, K, N, rows, alone, bw, interpret,
                                           seed=list(shapes).index(name))
        report["shapes"][name]["elapsed_s"] = time.perf_counter() - t0
        path = write_receipt(_OUT.value, "mosaic_matmul", _TAG.value, report)
    if _WRITE_PREFILL.value and not interpret:
        report["prefill_written"] = write_prefill(_WRITE_PREFILL.value, report, receipt=path)
        path = write_receipt(_OUT.value, "mosaic_matmul", _TAG.value, report)
        print(f"{_WRITE_PREFILL.value}: prefill tiles written for {report['prefill_written']}")
    if _WRITE.value and _SWAPPED.value and not interpret:
        report["written"] = write_tuned(_WRITE.value, report, receipt=path)
        path = write_receipt(_OUT.value, "mosaic_matmul", _TAG.value, report)
        print(f"{_WRITE.value}: swapped config written for {report['written']}")
    print(table(report))
    print(f"receipt: {path}  (skipped: {report['skipped']})")


if __name__ == "__main__":
    cli.run(main)
