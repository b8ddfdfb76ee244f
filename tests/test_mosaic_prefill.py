"""The warp-specialized Mosaic GPU prefill matmul (`pallas_kernels/mosaic/prefill_matmul.py`)
on the CPU, in Pallas's GPU interpret mode (its three warpgroups, the TMA pipeline and the
persistent tile loop), and lowered for CUDA at the Qwen3-8B shapes.

Interpreted, each wgmma is numpy's `acc + a @ b` on the [tile_m, bk] and [bk, tile_n]
blocks, so a variant whose warpgroup tile is the plain design's [64, bn] must give the
plain design's bits with the same bk: the same products in the same order. Whether the
H200's wgmma gives them for every variant (and rows alone equal decode rows) is proven on
the device by `experiments/tuning/mosaic_prefill.py` before the table may name one.
"""

import dataclasses
import functools
import importlib
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from script_runner import run_script

from pallas_kernels.mosaic import MosaicMatmulConfig, matmul, matmul_glu
from pallas_kernels.mosaic.prefill_matmul import (
    PrefillConfig,
    prefill_matmul,
    prefill_matmul_glu,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAIN = MosaicMatmulConfig(bn=64, bk=64, stages=2)
WS = PrefillConfig(tile_m=64, tile_n=64, bk=64, stages=2, wg_split="n", epi_m=64, epi_n=64)


def _bits(a):
    return np.asarray(a).view(np.uint16)


def _inputs(m, k, n, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    return x, w


@pytest.mark.parametrize("split", ["m", pytest.param("n", marks=pytest.mark.slow)])  # the GLU: n
def test_the_prefill_matmul_gives_the_plain_designs_bits(split):
    # 72 rows: a CTA tile past the array's end (TMA's zero fill, its store clipped); K of
    # 160: padded to 3 steps of 64 (zeros at the end of the sum); 4 SMs walk 2 + tiles.
    x, w = _inputs(72, 160, 256)
    got = prefill_matmul(x, w, config=PrefillConfig(**{**WS.__dict__, "wg_split": split}),
                         out_dtype=jnp.bfloat16, interpret=True, num_sms=2)
    want = matmul(x, w, out_dtype=jnp.bfloat16, interpret=True, config=PLAIN)
    assert got.shape == (72, 256) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_a_cta_pair_sharing_x_gives_the_same_bits():
    # cluster_n 2: two CTAs a cluster take neighbouring column tiles and x's block is
    # multicast to both (interpreted too): scheduling, the plain design's bits.
    x, w = _inputs(72, 160, 512, seed=2)
    cfg = PrefillConfig(**{**WS.__dict__, "cluster_n": 2})
    got = prefill_matmul(x, w, config=cfg, out_dtype=jnp.bfloat16, interpret=True, num_sms=4)
    want = matmul(x, w, out_dtype=jnp.bfloat16, interpret=True, config=PLAIN)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    with pytest.raises(ValueError, match="N=384 must be a multiple of the CTA's column tile "
                                         "128 x cluster_n 2"):
        prefill_matmul(x, w[:, :384], config=cfg, interpret=True)


def test_the_prefill_glu_gives_the_fused_glus_bits():
    x, w = _inputs(40, 128, 256, seed=1)  # F = 128: one CTA's two 64-column halves
    got = prefill_matmul_glu(x, w, activation="silu", config=WS, interpret=True, num_sms=3)
    want = matmul_glu(x, w, activation="silu", interpret=True, config=PLAIN)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_bad_configs_and_shapes_are_named():
    with pytest.raises(ValueError, match="tile_m=32 must be a multiple of 64"):
        PrefillConfig(tile_m=32)
    with pytest.raises(ValueError, match="wg_split='k' must be 'm' or 'n'"):
        PrefillConfig(wg_split="k")
    with pytest.raises(ValueError, match="epilogue tile 64x128 must divide"):
        PrefillConfig(tile_n=64, epi_n=128)
    with pytest.raises(ValueError, match="tile_n=32 and epi_m=64 must be >= 64"):
        PrefillConfig(tile_n=32, epi_n=32)  # runs interpreted, has no GPU layout
    with pytest.raises(ValueError, match="stages=True"):
        PrefillConfig(stages=True)
    for bad in (3, True, 2.0):
        with pytest.raises(ValueError, match=f"cluster_n={bad!r} must be 1 or 2"):
            PrefillConfig(cluster_n=bad)
    x, w = _inputs(8, 64, 96)
    with pytest.raises(ValueError, match="N=96 must be a multiple of the CTA's column tile 128"):
        prefill_matmul(x, w, config=WS, interpret=True)
    with pytest.raises(ValueError, match="N=96 must be a multiple"):  # given, not dropped
        matmul(x, w, config=WS, interpret=True)
    x, w = jax.ShapeDtypeStruct((512, 4096), jnp.bfloat16), jax.ShapeDtypeStruct(
        (4096, 6144), jnp.bfloat16)
    with pytest.raises(ValueError, match="needs 458752 bytes of shared memory"):
        jax.jit(functools.partial(prefill_matmul, config=PrefillConfig(bk=128, stages=4))
                ).trace(x, w)
    for bad in (0, -1, 2.5):  # -1 ran a grid of (-1,) and returned NaN
        with pytest.raises(ValueError, match=f"num_sms={bad!r} must be an int >= 1"):
            prefill_matmul(x, w, config=WS, interpret=True, num_sms=bad)
    with pytest.raises(TypeError, match="out_dtype=int8 must be float32"):
        prefill_matmul(x, w, config=WS, out_dtype=jnp.int8, interpret=True)
    with pytest.raises(TypeError, match="wants x and w of one dtype"):
        prefill_matmul(jnp.ones((8, 64), jnp.float32), jnp.ones((64, 128), jnp.float32),
                       config=WS, interpret=True)


def _lower(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("m,k,n,glu", [(2048, 4096, 6144, False), (511, 4096, 24576, True),
                                       (160, 12288, 4096, False), (160, 4096, 24576, True)])
def test_lowers_for_cuda_at_qwen3_shapes(m, k, n, glu):
    # The default config (an f32 output's epilogue included) and the table's tiles; 160
    # rows (a batch-32 verify block): tall tiles, 192 rows a warpgroup, CTA pairs.
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    if m == 160:
        cfg = PrefillConfig(tile_m=192 if glu else 64, tile_n=64 if glu else 128, bk=64,
                            stages=3 if glu else 4, wg_split="n" if glu else "m", cluster_n=2)
        fn = functools.partial(prefill_matmul_glu, activation="silu", config=cfg, num_sms=132) \
            if glu else functools.partial(prefill_matmul, config=cfg, out_dtype=jnp.bfloat16,
                                          num_sms=132)
    elif glu:
        cfg = PrefillConfig(tile_n=64, bk=64, stages=4)
        fn = functools.partial(prefill_matmul_glu, activation="silu", config=cfg, num_sms=132)
    else:
        cfg = PrefillConfig(bk=64, stages=4, wg_split="m")
        fn = functools.partial(prefill_matmul, config=cfg, out_dtype=jnp.bfloat16,
                               num_sms=132)
        _lower(functools.partial(prefill_matmul, config=PrefillConfig()), x, w)
    text = _lower(fn, x, w)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
    assert f"tensor<{m}x{n // 2 if glu else n}xbf16>" in text


def test_a_ws_prefill_tile_serves_prefill_launches_only(monkeypatch, tmp_path):
    """A table entry's prefill tile of design ws is read as a PrefillConfig and runs the
    launches past PREFILL_ROWS rows (schedule on, on the GPU); a weight whose width the
    CTA tile does not divide keeps the library config; an unknown design is refused."""
    mm = importlib.import_module("pallas_kernels.mosaic.matmul")
    pm = importlib.import_module("pallas_kernels.mosaic.prefill_matmul")
    ws = dict(tile_m=128, tile_n=128, bk=64, stages=4, wg_split="m")
    entry = {"K": 4096, "N": 6144, "dtype": "bfloat16",
             "config": dict(bn=64, bk=128, stages=4, swapped=True),
             "prefill": dict(design="ws", **ws)}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tuned": [entry]}))
    tile = PrefillConfig(**ws)
    assert mm.read_prefill_tiles(str(path)) == {(4096, 6144, "bfloat16"): tile}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tuned": [dict(entry, prefill=dict(design="fast", **ws))]}))
    with pytest.raises(ValueError, match="design='fast'"):
        mm.read_prefill_tiles(str(bad))
    for i, (n, fields, match) in enumerate((  # each names the file and the entry
            (6144, dict(ws, foo=1), "got an unexpected keyword argument 'foo'"),
            (6144, dict(ws, tile_m=64.0), "tile_m=64.0 must be a multiple of 64"),
            (6144, {}, "names design 'ws' without its tiles"),
            (6000, ws, r"column tile 128 \(x cluster_n 1\) does not divide N"),
            (6144, dict(ws, bk=256, stages=8), "bytes of shared memory"))):
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(json.dumps({"tuned": [dict(entry, N=n,
                                                  prefill=dict(design="ws", **fields))]}))
        with pytest.raises(ValueError, match=f"K=4096, N={n}.*{match}"):
            mm.read_prefill_tiles(str(bad))
    monkeypatch.setattr(mm, "read_prefill_tiles", lambda: {(4096, 6144, "bfloat16"): tile,
                                                           (4096, 6000, "bfloat16"): tile})
    monkeypatch.setattr(mm, "read_tall_tiles", dict)  # (the tall tier: its own test)
    seen = []
    real = pm._launch
    monkeypatch.setattr(pm, "_launch", lambda x, w, cfg, *a, **k: (seen.append(cfg),
                                                                   real(x, w, cfg, *a, **k))[1])
    for n, m, want in ((6144, 400, tile), (6144, 300, None), (6000, 400, None)):
        x, w = (jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16),
                jax.ShapeDtypeStruct((4096, n), jnp.bfloat16))
        _lower(functools.partial(matmul, out_dtype=jnp.bfloat16, schedule=True), x, w)
        assert (seen.pop() if seen else None) == want, (n, m)


def test_a_qwen3_prefill_chunk_lowers_with_the_prefill_kernels(h200):
    # A Qwen3-8B-shaped prefill chunk (2 layers, 2,048 rows, no LM head) with
    # lowering="mosaic" runs the table's ws tiles for wqkv, wo, w_down and the fused GLU;
    # a decode step of the same model runs none of them.
    from jspec.cache import init_cache
    from jspec.chunked_prefill import prefill
    from jspec.model import Model, apply
    from jspec.random_model import preset_config, random_params

    cfg = preset_config("qwen3-8b", num_layers=2)
    model = Model(config=cfg, params=jax.eval_shape(lambda: random_params(cfg)))
    model = model.replace(options=model.options.replace(lowering="mosaic"))
    cache = jax.eval_shape(lambda: init_cache(model, 1, 4096))
    tokens = jax.ShapeDtypeStruct((1, 2048), jnp.int32)
    lens = jax.ShapeDtypeStruct((1,), jnp.int32)
    text = _lower(prefill, model, tokens, lens, cache)
    assert text.count("jspec_mosaic_prefill_matmul_mosaic_gpu") == 3
    assert text.count("jspec_mosaic_prefill_matmul_glu_mosaic_gpu") == 1
    text = _lower(apply, model, jax.ShapeDtypeStruct((1, 1), jnp.int32), cache)
    assert "jspec_mosaic_prefill_matmul" not in text
    # A batch-32 verify block of 5 tokens (160 rows) takes the table's tall tiles where
    # their `above` lies below 160: all four weights' (wqkv's and wo's CTA pairs too).
    mm = importlib.import_module("pallas_kernels.mosaic.matmul")
    tall = mm.read_tall_tiles()
    assert len(tall) == 4 and all(above < 160 for above, _ in tall.values())
    cache = jax.eval_shape(lambda: init_cache(model, 32, 4096))
    text = _lower(apply, model, jax.ShapeDtypeStruct((32, 5), jnp.int32), cache)
    assert text.count("jspec_mosaic_prefill_matmul_mosaic_gpu") == 3  # a kernel a shape
    assert text.count("jspec_mosaic_prefill_matmul_glu_mosaic_gpu") == 1


def test_a_table_tile_fits_the_launchs_output_or_steps_aside(tmp_path):
    # The table's ws tiles were swept for a 16-bit output; an f32 output (matmul's
    # default) needs a bigger epilogue: the pipeline is made shallower (scheduling).
    mm = importlib.import_module("pallas_kernels.mosaic.matmul")
    tile = mm.read_prefill_tiles()[(4096, 6144, "bfloat16")]
    assert tile.smem_bytes(jnp.bfloat16, jnp.float32) > mm.SMEM_MAX
    fit = mm._fit_table_tile(tile, 6144, jnp.bfloat16, jnp.float32, 1)
    assert fit == dataclasses.replace(tile, stages=fit.stages) and fit.stages < tile.stages
    assert mm._fit_table_tile(tile, 6000, jnp.bfloat16, jnp.bfloat16, 1) is None  # width
    x, w = (jax.ShapeDtypeStruct((512, 4096), jnp.bfloat16),
            jax.ShapeDtypeStruct((4096, 6144), jnp.bfloat16))
    text = _lower(functools.partial(matmul, schedule=True), x, w)  # f32 out: lowers
    assert "jspec_mosaic_prefill_matmul" in text
    # The loader names the file and entry for a table's structure too.
    for i, (data, words) in enumerate((
            ([], "not a Mosaic tile table"),
            ({"tuned": ["x"]}, "entry 0: TypeError"),
            ({"tuned": [{"K": 64, "N": 64, "dtype": "float32", "config": {}}]},
             "dtype='float32' one of"),
            ({"tuned": [{"K": 64, "N": 64, "dtype": "bfloat16",
                         "config": dict(bn=64, bk=64, stages=2)}] * 2}, "two entries for"))):
        path = tmp_path / f"s{i}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=f"{path.name}: .*{words}"):
            mm.read_tuned_file(str(path))


def test_a_tall_tile_serves_the_rows_past_its_above_only(monkeypatch, tmp_path):
    """A table entry's `tall` tile (design ws) serves launches of above < M <=
    PREFILL_ROWS rows with schedule on; M past PREFILL_ROWS takes the prefill tier; a tall
    tile of another design or an `above` outside TALL_ROWS..PREFILL_ROWS - 1 is refused,
    naming the file and the entry."""
    mm = importlib.import_module("pallas_kernels.mosaic.matmul")
    ws = dict(tile_m=192, tile_n=64, bk=64, stages=4, wg_split="n")
    entry = {"K": 4096, "N": 6144, "dtype": "bfloat16",
             "config": dict(bn=64, bk=128, stages=4, swapped=True),
             "tall": dict(design="ws", above=160, **ws)}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tuned": [entry]}))
    tile = PrefillConfig(**ws)
    assert mm.read_tall_tiles(str(path)) == {(4096, 6144, "bfloat16"): (160, tile)}
    assert mm.read_prefill_tiles(str(path)) == {}
    glu = {**entry, "N": 24576, "tall": dict(design="ws", above=64, glu=True, **ws)}
    for i, (tall, match) in enumerate((
            (dict(ws, design="ws"), "above=None must be an int"),  # never a default
            ("ws", "must be an object of fields; got 'ws'"),
            (dict(ws, design="ws", above=80, tile_m=None) | {"tile_m": None},
             "tile_m=None must be a multiple of 64"),
            ({k: v for k, v in dict(ws, design="ws", above=80).items() if k != "bk"},
             "lacks bk"),
            (dict(glu["tall"], N=0) | {"glu": 1}, "glu=1 must be a bool"),
            (glu["tall"] | {"stages": 4}, "needs 262144 bytes of shared memory"),
            (dict(ws, above=80), "must name design 'ws'"),
            (dict(ws, design="plain"), "must name design 'ws'"),
            (dict(ws, design="ws", above=32), "above=32 must be an int in 64..319"),
            (dict(ws, design="ws", above=320), "above=320 must be an int"),
            (dict(ws, design="ws", above=True), "above=True must be an int"),
            (dict(ws, design="ws", above=80, tile_m=96), "tile_m=96 must be a multiple of 64"))):
        bad = tmp_path / f"bad{i}.json"
        base = glu if isinstance(tall, dict) and "glu" in tall else entry
        if isinstance(tall, dict):
            tall.pop("N", None)
        bad.write_text(json.dumps({"tuned": [dict(base, tall=tall)]}))
        where = f"{bad.name}: the tall tile of K=4096, N={base['N']}"
        with pytest.raises(ValueError, match=f"{where}.*{match}"):
            mm.read_tall_tiles(str(bad))
    prefill = PrefillConfig(tile_m=128, tile_n=128, bk=64, stages=4, wg_split="m")
    monkeypatch.setattr(mm, "read_tall_tiles", lambda: {(4096, 6144, "bfloat16"): (160, tile)})
    monkeypatch.setattr(mm, "read_prefill_tiles", lambda: {(4096, 6144, "bfloat16"): prefill})
    library = mm.mosaic_matmul_config(4096, 6144, jnp.bfloat16)
    for m, want in ((1, library), (64, library), (160, library), (161, tile), (320, tile),
                    (321, prefill)):
        assert mm.mosaic_launch_config(4096, 6144, jnp.bfloat16, m) == want, m
    assert mm.mosaic_launch_config(4096, 6144, jnp.bfloat16, 200, schedule=False) == library


def test_the_sweep_picks_each_tiers_winner_and_where_it_starts(tmp_path):
    """tuning/mosaic_prefill.py --from_receipt (the table re-decided from a sweep's receipt,
    no device work): a tall tile serves the timed rows from some count up where it is no
    slower at each and saves the most there (`above`: the timed row below, or TALL_ROWS);
    a prefill tile must win at every timed row; a variant whose bits failed is never
    written; a winner already in the table adds nothing; a receipt or flags that do not
    fit are refused before anything is written. (Run as the CLI: the script's absl flags
    clash with mosaic_matmul.py's.)"""
    def shape(K, N, rows, a, b, c=(1, 1, 1)):  # us at each row: library 40 / 60 / 90
        times = {str(m): {"mosaic": {"us": t}, "ws[a]": {"us": ta}, "ws[b]": {"us": tb},
                          "ws[c]": {"us": tc}}
                 for m, t, ta, tb, tc in zip(rows, (40, 60, 90), a, b, c, strict=True)}
        cfg = lambda tm: dict(tile_m=tm, tile_n=128, bk=64, stages=4, wg_split="m")  # noqa: E731
        return {"K": K, "N": N, "time": times, "variants": {
            "a": {"passes": True, "config": cfg(64)}, "b": {"passes": True, "config": cfg(128)},
            "c": {"passes": False, "config": cfg(192)}}}

    def shapes(rows):
        return {"wo": shape(4096, 4096, rows, (45, 40, 50), (39, 58, 88)),  # a from 160 up
                "wqkv": shape(4096, 6144, rows, (30, 40, 50), (39, 58, 88)),  # a everywhere
                "w_down": shape(12288, 4096, rows, (41, 61, 91), (41, 61, 91))}  # c failed

    def cli(receipt, table, *flags):
        return run_script([sys.executable, "experiments/tuning/mosaic_prefill.py",
                           f"--from_receipt={receipt}", f"--write={table}", *flags],
                          cwd=ROOT, timeout=300)

    def run(tier, rows, **extra):
        receipt, table = tmp_path / f"r_{tier}.json", tmp_path / f"t_{tier}.json"
        receipt.write_text(json.dumps({"jax": "0.11.2", "rows": rows, "tier": tier,
                                       "shapes": shapes(rows), **extra}))
        table.write_text(json.dumps({"tuned": [
            {"K": sh["K"], "N": sh["N"], "dtype": "bfloat16",
             "config": dict(bn=64, bk=128, stages=4)} for sh in shapes(rows).values()]}))
        return receipt, table

    receipt, table = run("tall", [80, 160, 320])
    r = cli(receipt, table)
    assert r.returncode == 0, r.stderr[-1500:]
    tuned = {(e["K"], e["N"]): e for e in json.loads(table.read_text())["tuned"]}
    cfg = shapes([80, 160, 320])["wo"]["variants"]["a"]["config"]
    assert tuned[4096, 4096]["tall"] == {"design": "ws", "above": 80, **cfg}
    assert tuned[4096, 4096]["tall_us"] == {"rows": [160, 320], "config": 150, "tall": 90}
    assert tuned[4096, 6144]["tall"]["above"] == 64
    assert "tall" not in tuned[12288, 4096] and "prefill" not in tuned[4096, 4096]
    mm = importlib.import_module("pallas_kernels.mosaic.matmul")
    assert mm.read_tall_tiles(str(table))[(4096, 4096, "bfloat16")][0] == 80
    before = table.read_text()
    r = cli(receipt, table)  # again: nothing new, no second provenance record
    assert r.returncode == 0 and "written: []" in r.stdout and table.read_text() == before
    receipt, table = run("prefill", [400, 800, 1600])
    assert cli(receipt, table).returncode == 0
    tuned = {(e["K"], e["N"]): e for e in json.loads(table.read_text())["tuned"]}
    assert "prefill" not in tuned[4096, 4096]  # a loses at 400, b gains under 3%
    assert tuned[4096, 6144]["prefill"] == {"design": "ws", **cfg}
    for tier, rows, extra, flags, words in (
            ("tall", [320, 160, 80], {}, (), "must be ascending row counts of the tall"),
            ("prefill", [80, 160, 320], {}, (), "row counts of the prefill tier (321..)"),
            ("tall", [80, 160, 320], {}, ("--smoke",), "--smoke would be ignored"),
            ("bogus", [80, 160, 320], {}, (), "tier='bogus' is not one of"),
            ("tall", [80, 160, 320], {"shapes": {
                "wo": shape(4096, 4096, [80, 160, 320], (45, 40, 50), (1, 1, 1)),
                "wqkv": shape(4096, 4096, [80, 160, 320], (1, 1, 1), (1, 1, 1))}}, (),
             "weight 'wqkv': a second weight of K=4096, N=4096"),
            ("tall", [80, 160, 320], {"shapes": {
                "wo": shape(4096, 4096, [80, 160, 320], (45, float("nan"), 50), (1, 1, 1))}},
             (), "M=160, ws[a]: a time must be a positive finite us"),
            ("tall", [80, 160, 320], {"shapes": {"wo": {"K": 1, "N": 2, "time": {},
                                                        "variants": {}}}}, (),
             "weight 'wo' lacks its variants or a time at every row")):
        receipt, table = run(tier, rows, **extra)
        before = table.read_text()
        r = cli(receipt, table, *flags)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, \
            r.stderr[-1500:]
        assert table.read_text() == before
