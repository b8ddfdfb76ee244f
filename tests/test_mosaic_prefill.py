"""The warp-specialized Mosaic GPU prefill matmul (`pallas_kernels/mosaic/prefill_matmul.py`)
on the CPU, in Pallas's GPU interpret mode (its three warpgroups, the TMA pipeline and the
persistent tile loop), and lowered for CUDA at the Qwen3-8B shapes.

Interpreted, each wgmma is numpy's `acc + a @ b` on the [tile_m, bk] and [bk, tile_n]
blocks, so a variant whose warpgroup tile is the plain design's [64, bn] must give the
plain design's bits with the same bk: the same products in the same order. Whether the
H200's wgmma gives them for every variant (and rows alone equal decode rows) is proven on
the device by `experiments/tuning/mosaic_prefill.py` before the table may name one.
"""

import functools
import importlib
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mosaic import MosaicMatmulConfig, matmul, matmul_glu
from pallas_kernels.mosaic.prefill_matmul import (
    PrefillConfig,
    prefill_matmul,
    prefill_matmul_glu,
)

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


@pytest.mark.parametrize("m,k,n,glu", [(2048, 4096, 6144, False), (511, 4096, 24576, True)])
def test_lowers_for_cuda_at_qwen3_shapes(m, k, n, glu):
    # The default config (an f32 output's epilogue included) and the table's tiles.
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    if glu:
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
            (6144, dict(ws, tile_m=64.0), "tile_m=64.0 must be a power of 2"),
            (6144, {}, "names design 'ws' without its tiles"),
            (6000, ws, "column tile 128 does not divide N"),
            (6144, dict(ws, bk=256, stages=8), "bytes of shared memory"))):
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(json.dumps({"tuned": [dict(entry, N=n,
                                                  prefill=dict(design="ws", **fields))]}))
        with pytest.raises(ValueError, match=f"K=4096, N={n}.*{match}"):
            mm.read_prefill_tiles(str(bad))
    monkeypatch.setattr(mm, "read_prefill_tiles", lambda: {(4096, 6144, "bfloat16"): tile,
                                                           (4096, 6000, "bfloat16"): tile})
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
