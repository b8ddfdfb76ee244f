"""The swapped design of the Mosaic GPU matmul (`MosaicMatmulConfig(swapped=True)`) on the
CPU: the weight's 64 columns as the wgmma's M, 16 tokens as its N, both operands
transposed views of the TMA-loaded blocks, a 16-bit output stored through a transposed
view, an f32 one column-major and transposed back.

Pallas's GPU interpret mode computes each wgmma as numpy's `acc + a @ b`, here
a = w block^T [64, bk] and b = x block^T [bk, 16]; as in tests/test_mosaic.py, numpy's
BLAS may give an output element bits that depend on its place in the block, so a
token's bits are checked across token counts at the same place in its tile, and, with
the interpreter's product replaced by one token's column at a time (as the hardware
computes every column alike), a token alone equals that token among others at any
place. Whether the H200's wgmma does is proven on the device
(`experiments/tuning/mosaic_matmul.py --swapped`).
"""

import dataclasses
import functools
import importlib
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from test_mosaic import _inputs as mosaic_inputs

from pallas_kernels.matmul import matmul_reference
from pallas_kernels.matmul_glu import _glu_tile, matmul_glu_reference
from pallas_kernels.mosaic import MosaicMatmulConfig, matmul, matmul_glu
from pallas_kernels.mosaic.matmul import (
    TOKEN_TILES,
    mosaic_matmul_config,
    pipeline_stages,
    read_tuned_file,
    swapped_stages,
)

K, N = 128, 128  # one K step, two 64-column blocks
SWAPPED = MosaicMatmulConfig(bn=64, bk=128, stages=4, swapped=True)


def mm(x, w, config=SWAPPED):  # bf16 outputs (f32 ones are stored column-major)
    return np.asarray(matmul(x, w, out_dtype=jnp.bfloat16, interpret=True, config=config))


_inputs = functools.partial(mosaic_inputs, k=K, n=N)  # x [m, k], w [k, n] bf16


class _ColumnByColumn:
    """numpy, except that matmul forms each column of a @ b on its own (one token's
    column: the same matrix-vector product whatever its place among the 16)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def matmul(a, b, dtype):
        a = np.asarray(a, dtype)
        return np.stack([a @ np.asarray(col, dtype) for col in np.asarray(b).T], axis=1)


@pytest.fixture
def column_by_column_wgmma(monkeypatch):
    monkeypatch.setattr(gpu_callbacks, "np", _ColumnByColumn())


def test_swapped_config_is_checked():
    with pytest.raises(ValueError, match="swapped=True"):
        MosaicMatmulConfig(bn=32, bk=128, stages=4, swapped=True)
    with pytest.raises(ValueError, match="bk >= 64"):
        MosaicMatmulConfig(bn=64, bk=32, stages=4, swapped=True)
    with pytest.raises(TypeError, match="swapped"):
        MosaicMatmulConfig(bn=64, bk=128, stages=4, swapped=1)
    # Shared memory at the most token tiles: x's [64, bk] and the weight's [bk, 64] blocks.
    assert pipeline_stages(128, 64, jnp.bfloat16) == 4
    assert pipeline_stages(128, 64, jnp.bfloat16, 2) == 4
    assert pipeline_stages(256, 64, jnp.bfloat16, 2) == 2


def test_swapped_matches_reference_and_casts_once():
    x, w = _inputs(70)  # two programs of token tiles (4 + 1), the last one partial
    yb = matmul(x, w, out_dtype=jnp.bfloat16, interpret=True, config=SWAPPED)
    assert yb.dtype == jnp.bfloat16 and yb.shape == (70, N)
    # The f32 sum rounded once: the reference's f32 product in bf16, within its rounding.
    ref = matmul_reference(x, w)
    np.testing.assert_allclose(np.asarray(yb, np.float32), np.asarray(ref), rtol=8e-3, atol=1e-3)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_tokens_keep_their_bits_across_token_counts(out_dtype):
    x, w = _inputs(80, seed=2)
    full = np.asarray(matmul(x, w, out_dtype=out_dtype, interpret=True, config=SWAPPED))
    for m in (1, 16, 17, 65):  # one tile; a full one; a second; a second program
        got = np.asarray(matmul(x[:m], w, out_dtype=out_dtype, interpret=True, config=SWAPPED))
        assert got.shape == (m, N) and np.array_equal(got, full[:m]), m


def test_more_token_tiles_a_program_keep_every_tokens_bits():
    """token_tiles is scheduling: 10 tiles take 160 tokens in one program (its weight
    blocks read once), and every token's bits are those of 4 tiles a program."""
    x, w = _inputs(170, seed=4)
    ten = dataclasses.replace(SWAPPED, token_tiles=10)
    four = mm(x, w)
    for m in (1, 17, 65, 160, 170):  # one tile; two; five; one program of ten; two programs
        assert np.array_equal(mm(x[:m], w, config=ten), four[:m]), m
    y = np.asarray(matmul(x, w, out_dtype=jnp.float32, interpret=True, config=ten))
    assert np.array_equal(y, np.asarray(matmul(x, w, out_dtype=jnp.float32, interpret=True,
                                               config=SWAPPED)))
    glu = matmul_glu(x, w, activation="silu", interpret=True, config=ten)
    assert np.array_equal(np.asarray(glu), np.asarray(
        matmul_glu(x, w, activation="silu", interpret=True, config=SWAPPED)))


def test_a_wide_accumulator_keeps_every_tokens_bits(column_by_column_wgmma):
    """wide: a program's tokens in one [64, 16 tiles] accumulator, one wgmma of N = 16
    tiles a step. With each column of the product formed alike (as the hardware is
    claimed to; the device sweep checks it), every token's bits are the narrow
    design's, for the matmul (both output dtypes) and the GLU."""
    x, w = _inputs(170, seed=4)
    wide = dataclasses.replace(SWAPPED, token_tiles=10, wide=True)
    narrow = mm(x, w)
    for m in (1, 17, 160, 170):  # N = 16, 32, 160; two programs (160 + 10)
        assert np.array_equal(mm(x[:m], w, config=wide), narrow[:m]), m
    for out_dtype in (jnp.float32,):
        assert np.array_equal(
            np.asarray(matmul(x, w, out_dtype=out_dtype, interpret=True, config=wide)),
            np.asarray(matmul(x, w, out_dtype=out_dtype, interpret=True, config=SWAPPED)))
    glu = matmul_glu(x[:40], w, activation="silu", interpret=True, config=wide)
    assert np.array_equal(np.asarray(glu), np.asarray(
        matmul_glu(x[:40], w, activation="silu", interpret=True, config=SWAPPED)))
    with pytest.raises(ValueError, match="wide"):
        MosaicMatmulConfig(bn=64, bk=128, stages=4, wide=True)  # the plain design has none


def test_token_tiles_are_checked_and_the_pipeline_shrinks_to_fit():
    for bad in (0, 17, 2.0):
        with pytest.raises(ValueError, match="token_tiles"):
            dataclasses.replace(SWAPPED, token_tiles=bad)
    with pytest.raises(ValueError, match="token_tiles"):  # the plain design has none
        MosaicMatmulConfig(bn=64, bk=128, stages=4, token_tiles=8)
    six = MosaicMatmulConfig(bn=64, bk=128, stages=6, swapped=True, token_tiles=16)
    bf16, f32 = jnp.bfloat16, jnp.float32
    assert swapped_stages(six, TOKEN_TILES, bf16, bf16) == 6  # the config's, as proven
    assert swapped_stages(six, 10, bf16, bf16) == 3  # [160, 128] x blocks: 3 fit
    assert swapped_stages(six, 10, bf16, f32, weights=2) == 2
    with pytest.raises(ValueError, match="pipeline steps"):
        swapped_stages(dataclasses.replace(six, bk=256), 16, bf16, bf16)


def test_f32_outputs_are_the_accumulators_stored_column_major():
    """An f32 output (the logits) is stored as the [64 columns, 16 tokens] accumulators lie
    and transposed back: the bf16 output is exactly its rounding, element for element."""
    x, w = _inputs(70, seed=3)  # two programs of token tiles (4 + 1), the last one partial
    y32 = matmul(x, w, out_dtype=jnp.float32, interpret=True, config=SWAPPED)
    assert y32.dtype == jnp.float32 and y32.shape == (70, N)
    yb = mm(x, w)
    assert np.array_equal(np.asarray(y32.astype(jnp.bfloat16)), yb)
    np.testing.assert_allclose(np.asarray(y32), np.asarray(matmul_reference(x, w)),
                               rtol=1e-5, atol=1e-5)


def test_token_alone_equals_token_among_others(column_by_column_wgmma):
    x, w = _inputs(80, seed=1)
    alone = {r: mm(x[r:r + 1], w)[0]
             for r in (0, 9, 16, 79)}
    for m in (16, 40, 80):
        among = mm(x[:m], w)
        for r, row in alone.items():
            if r < m:
                assert np.array_equal(among[r], row), (m, r)
    # Every token at another place in its tile (rolled by 5): the same bits.
    rolled = mm(jnp.roll(x[:40], 5, axis=0), w)
    assert np.array_equal(np.roll(rolled, -5, axis=0),
                          mm(x[:40], w))


def test_another_k_tile_is_another_sum():
    # Control for the checks above: the bits they compare can differ (R11: a
    # configuration has its own bits; in interpret mode the K tile sets the sum order).
    x, w = _inputs(64, k=1024, seed=3)
    a = mm(x, w)
    b = mm(x, w, MosaicMatmulConfig(bn=64, bk=64, stages=4, swapped=True))
    np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-2, atol=1e-2)
    assert not np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_swapped_glu_is_glu_of_the_swapped_halves():
    x, w = _inputs(17, n=256)  # F = 128: two 64-column blocks per half
    got = matmul_glu(x, w, activation="silu", interpret=True, config=SWAPPED)
    gate, up = jnp.split(matmul(x, w, out_dtype=x.dtype, interpret=True, config=SWAPPED), 2,
                         axis=-1)
    assert np.array_equal(np.asarray(got), np.asarray(_glu_tile(gate, up, "silu")))
    ref = matmul_glu_reference(x, w, activation="silu")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_the_tuned_file_picks_the_design_per_weight_shape(tmp_path, monkeypatch):
    module = importlib.import_module("pallas_kernels.mosaic.matmul")  # not the function
    path = tmp_path / "matmul_tuned.json"
    path.write_text(json.dumps({"tuned": [{"K": 4096, "N": 6144, "dtype": "bfloat16",
                                           "config": dict(bn=64, bk=128, stages=5,
                                                          swapped=True)}]}))
    monkeypatch.setattr(module, "TUNED_FILE", str(path))
    read_tuned_file.cache_clear()
    monkeypatch.setattr(module, "read_tuned_file",
                        functools.partial(read_tuned_file, str(path)))
    try:
        assert module.mosaic_matmul_config(4096, 6144, jnp.bfloat16) == MosaicMatmulConfig(
            bn=64, bk=128, stages=5, swapped=True)
        assert not module.mosaic_matmul_config(4096, 4096, jnp.bfloat16).swapped  # the rule
        assert not module.mosaic_matmul_config(4096, 6144, jnp.float16).swapped
        assert not module.mosaic_matmul_config(4096, 6144, jnp.bfloat16, tuned=False).swapped
    finally:
        read_tuned_file.cache_clear()
    # The library's own table, where there is one, holds only swapped configs it proved.
    assert all(c.swapped for c in read_tuned_file().values())
    assert mosaic_matmul_config(96, 4096, jnp.bfloat16).bk == 32


def _lower(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("m,k,n", [(1, 4096, 6144),
                                   pytest.param(40, 12288, 4096, marks=pytest.mark.slow),
                                   pytest.param(160, 4096, 151936, marks=pytest.mark.slow)])
def test_swapped_lowers_for_cuda(m, k, n):
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    cfg = MosaicMatmulConfig(bn=64, bk=128, stages=pipeline_stages(128, 64, jnp.bfloat16),
                             swapped=True)
    for out_dtype in (jnp.bfloat16, jnp.float32):
        text = _lower(functools.partial(matmul, out_dtype=out_dtype, config=cfg), x, w)
        assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
    glu_w = jax.ShapeDtypeStruct((4096, 24576), jnp.bfloat16)
    text = _lower(functools.partial(matmul_glu, activation="silu", config=cfg),
                  jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16), glu_w)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
    assert TOKEN_TILES * 16 == 64  # a program's tokens: one plain design's row tile
    if m == 160:  # 160 tokens in one program a column block
        ten = dataclasses.replace(cfg, token_tiles=10)
        for out_dtype in (jnp.bfloat16, jnp.float32):
            _lower(functools.partial(matmul, out_dtype=out_dtype, config=ten), x, w)
        _lower(functools.partial(matmul_glu, activation="silu", config=ten),
               jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16), glu_w)
        wide = dataclasses.replace(ten, wide=True)  # one wgmma of N = 160 a step
        for out_dtype in (jnp.bfloat16, jnp.float32):
            _lower(functools.partial(matmul, out_dtype=out_dtype, config=wide), x, w)
        _lower(functools.partial(matmul_glu, activation="silu", config=wide),
               jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16), glu_w)


def test_the_library_table_serves_both_output_dtypes():
    tuned = read_tuned_file()
    assert {(k, n) for k, n, _ in tuned} <= {(4096, 6144), (4096, 24576), (12288, 4096),
                                              (4096, 4096),  # Qwen3-8B weights, H200-proven
                                              (8192, 6144),  # its feature head's, H100
                                              # Qwen3-30B-A3B's wqkv, wo, router (H200)
                                              (2048, 5120), (4096, 2048), (2048, 128)}
    for k, n, _ in tuned:  # each entry's config lowers for one token and for a block of 5
        for m in (1, 5):
            _lower(matmul, jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                   jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
    x = jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 6144), jnp.bfloat16)
    assert mosaic_matmul_config(4096, 6144, jnp.bfloat16).swapped
    for out_dtype in (jnp.bfloat16, jnp.float32):  # f32: the column-major store lowers
        text = _lower(functools.partial(matmul, out_dtype=out_dtype), x, w)
        assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1


def test_an_f32_tile_transposed_store_finds_no_layout():
    """Why f32 outputs are stored column-major: the 16-bit outputs' transposed store, given
    an f32 tile, fails Mosaic GPU's layout inference (the check runs when lowering)."""
    module = importlib.import_module("pallas_kernels.mosaic.matmul")

    def transposed_store(x, w):
        return module._launch(x, w, SWAPPED, w.shape[1], jnp.float32, (0,), lambda a: a,
                              False, "t")

    with pytest.raises(ValueError, match="infer a possible set of layouts"):
        _lower(transposed_store, jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16),
               jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16))


@functools.cache
def _sweep():
    """experiments/tuning/mosaic_matmul.py as a module, loaded once (its absl flags)."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "_mosaic_matmul_sweep", os.path.join(root, "experiments/tuning/mosaic_matmul.py"))
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return sweep


def test_the_sweep_writes_only_passing_faster_configs(tmp_path):
    """tuning/mosaic_matmul.py --write: a weight enters the table only when every bit check
    of its swapped design passed and it (or a bit-equal variant) beat the plain design at
    M = 1 and 17; the provenance names the run's command and receipt."""
    sweep = _sweep()
    clean = {"prefix_mismatch_rows": {"1": 0, "160": 0}, "alone_mismatch_rows": 0}
    base = dict(bn=64, bk=128, stages=4, swapped=True)
    six = dict(base, stages=6)

    def shape(K, N, times, bits=clean, variant_equal=True):
        return {"K": K, "N": N, "time": {m: {k: {"us": t} for k, t in ts.items()}
                                         for m, ts in times.items()},
                "swapped": {"config": base, "bits": bits,
                            "variants": {"s:128:6": {"config": six,
                                                     "equals_swapped": variant_equal}}}}

    fast = {"1": {"mosaic": 50.0, "mosaic_swapped": 30.0, "mosaic[s:128:6]": 25.0},
            "17": {"mosaic": 50.0, "mosaic_swapped": 30.0, "mosaic[s:128:6]": 25.0}}
    slow = {m: {"mosaic": 20.0, "mosaic_swapped": 30.0} for m in ("1", "17")}
    report = {"device": "d", "jax": "j", "command": "python sweep --write", "shapes": {
        "a": shape(4096, 6144, fast),  # the 6-stage variant wins
        "b": shape(4096, 4096, fast, variant_equal="ValueError: smem"),  # base wins
        "c": shape(12288, 4096, slow),  # slower than the plain design
        "d": shape(4096, 1024, fast, bits=dict(clean, alone_mismatch_rows=1))}}
    # More token tiles: the same times at M <= 64, so chosen by the largest M alone.
    ten = dict(six, token_tiles=10)
    tall = shape(4096, 2048, {**fast, "160": {"mosaic": 90.0, "mosaic_swapped": 80.0,
                                              "mosaic[s:128:6:10]": 40.0}})
    tall["swapped"]["variants"]["s:128:6:10"] = {"config": ten, "equals_swapped": True}
    for m in ("1", "17"):
        tall["time"][m]["mosaic[s:128:6:10]"] = {"us": 20.0}  # faster by noise: not chosen
    report["shapes"]["e"] = tall
    wide = dict(ten, wide=True)  # one wide accumulator: chosen where faster at 160 rows
    tall_wide = shape(2048, 2048, {**fast, "160": {"mosaic": 90.0, "mosaic_swapped": 80.0,
                                                   "mosaic[s:128:6:10]": 40.0,
                                                   "mosaic[s:128:6:10:w]": 30.0}})
    tall_wide["swapped"]["variants"].update({
        "s:128:6:10": {"config": ten, "equals_swapped": True},
        "s:128:6:10:w": {"config": wide, "equals_swapped": True}})
    report["shapes"]["f"] = tall_wide
    # The fused GLU: its own token-tile variants, timed as the GLU at the largest M.
    glu = shape(4096, 24576, {m: {"mosaic_glu": 90.0, "mosaic_swapped_glu": 70.0}
                              for m in ("1", "17")})
    glu["time"]["160"] = {"mosaic_swapped_glu": {"us": 200.0},
                          "mosaic_glu[s:128:4:10]": {"us": 90.0}}
    glu["swapped"]["glu"] = {"invariance": clean}
    glu["swapped"]["glu_variants"] = {"s:128:4:10": {"config": dict(base, token_tiles=10),
                                                     "equals_swapped": True}}
    report["shapes"]["g"] = glu
    path = tmp_path / "t.json"
    assert sweep.write_tuned(str(path), report, receipt="r.json") == ["a", "b", "e", "f", "g"]
    data = json.loads(path.read_text())
    got = {(e["K"], e["N"]): e["config"] for e in data["tuned"]}
    assert got == {(4096, 6144): six, (4096, 4096): base, (4096, 2048): ten,
                   (2048, 2048): wide, (4096, 24576): dict(base, token_tiles=10)}
    assert data["provenance"][-1]["command"] == "python sweep --write"
    assert data["provenance"][-1]["receipt"] == "r.json"


def test_prefill_launches_take_the_prefill_tile_and_nothing_else_does(monkeypatch, tmp_path):
    """A table entry's `prefill` tile (the plain design, the entry's bk: scheduling) serves
    launches past PREFILL_ROWS rows with schedule on, never in interpret mode; a tile of
    another bk or of the swapped design is refused when the table is read."""
    mm = importlib.import_module("pallas_kernels.mosaic.matmul")
    entry = {"K": 4096, "N": 6144, "dtype": "bfloat16",
             "config": dict(bn=64, bk=128, stages=4, swapped=True),
             "prefill": dict(bn=128, bk=128, stages=4)}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tuned": [entry]}))
    tile = MosaicMatmulConfig(bn=128, bk=128, stages=4)
    assert mm.read_prefill_tiles(str(path)) == {(4096, 6144, "bfloat16"): tile}
    for i, bad in enumerate((dict(bn=128, bk=64, stages=4),
                             dict(bn=64, bk=128, stages=4, swapped=True))):
        path = tmp_path / f"bad{i}.json"  # (the table is read once a path)
        path.write_text(json.dumps({"tuned": [dict(entry, prefill=bad)]}))
        with pytest.raises(ValueError, match="must be the plain design with the entry's bk"):
            mm.read_prefill_tiles(str(path))
    monkeypatch.setattr(mm, "read_prefill_tiles", lambda: {(4096, 6144, "bfloat16"): tile})
    monkeypatch.setattr(mm, "read_tall_tiles", dict)  # (the tall tier: test_mosaic_prefill)
    library = mm.mosaic_matmul_config(4096, 6144, jnp.bfloat16)
    assert mm.mosaic_launch_config(4096, 6144, jnp.bfloat16, mm.PREFILL_ROWS + 1) == tile
    assert mm.mosaic_launch_config(4096, 6144, jnp.bfloat16, mm.PREFILL_ROWS) == library
    assert mm.mosaic_launch_config(4096, 6144, jnp.bfloat16, 2048, schedule=False) == library
    seen = []
    launch = mm._launch
    monkeypatch.setattr(mm, "_launch", lambda x, w, cfg, *a, **k: (seen.append(cfg),
                                                                   launch(x, w, cfg, *a, **k))[1])
    w = jax.ShapeDtypeStruct((4096, 6144), jnp.bfloat16)
    for m, schedule, interpret, want in ((400, True, False, tile), (401, False, False, library),
                                         (402, True, True, library), (17, True, False, library)):
        x = jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16)
        fn = functools.partial(matmul, out_dtype=jnp.bfloat16, schedule=schedule,
                               interpret=interpret)
        jax.jit(fn).trace(x, w) if interpret else _lower(fn, x, w)
        assert seen.pop() == want, (m, schedule, interpret)


def test_the_sweep_writes_a_prefill_tile_only_where_bit_equal_and_faster(tmp_path):
    """tuning/mosaic_matmul.py --write_prefill: the fastest plain variant past PREFILL_ROWS
    whose bits (and the fused GLU's) equal the library config's, if it beats it there."""
    sweep = _sweep()
    cfg = lambda bn: dict(bn=bn, bk=128, stages=4, swapped=False, token_tiles=4, wide=False)  # noqa: E731

    def shape(K, N, times, equal=True, glu_equal=None):
        variants = {f"{bn}:128:4": {"config": cfg(bn), "equals_library": equal}
                    for bn in (64, 128)}
        if glu_equal is not None:
            for v in variants.values():
                v["glu_equals_library"] = glu_equal
        return {"K": K, "N": N, "plain_variants": variants,
                "time": {m: {k: {"us": t} for k, t in ts.items()} for m, ts in times.items()}}

    fast = {"17": {"mosaic": 10.0, "mosaic[128:128:4]": 1.0},  # short launches: not counted
            "512": {"mosaic": 100.0, "mosaic[64:128:4]": 80.0, "mosaic[128:128:4]": 60.0},
            "2048": {"mosaic": 400.0, "mosaic[64:128:4]": 300.0, "mosaic[128:128:4]": 250.0}}
    glu = {m: {k.replace("mosaic", "mosaic_glu"): v for k, v in ts.items()} | ts
           for m, ts in fast.items()}
    report = {"device": "d", "jax": "j", "command": "python sweep --write_prefill", "shapes": {
        "a": shape(4096, 6144, fast),  # bn 128 wins
        "b": shape(4096, 4096, fast, equal="ValueError: smem"),  # no variant ran
        "c": shape(12288, 4096, {m: dict(ts, mosaic=ts["mosaic[128:128:4]"] * 1.01)
                                 for m, ts in fast.items() if m != "17"}),  # within 3%
        "g": shape(4096, 24576, glu, glu_equal=False),  # its GLU's bits differ
        "n": shape(2048, 8192, fast)}}  # no entry yet: one with the rule's config
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"provenance": [], "tuned": [
        {"K": 4096, "N": 6144, "dtype": "bfloat16",
         "config": dict(bn=64, bk=128, stages=6, swapped=True)}]}))
    assert sweep.write_prefill(str(table), report, receipt="r.json") == ["a", "n"]
    data = json.loads(table.read_text())
    a, n = data["tuned"]
    assert a["prefill"] == dict(bn=128, bk=128, stages=4) and a["config"]["swapped"]
    assert a["prefill_us"] == {"rows": [512, 2048], "config": 500.0, "prefill": 310.0}
    assert n["config"]["bk"] == 128 and not n["config"]["swapped"] and "prefill" in n
    assert data["provenance"][-1]["prefill_tiles"] == ["a", "n"]
