"""Split-K on the Mosaic GPU matmul (`MosaicMatmulConfig(splits=S)`) on the CPU.

A split config cuts K (zero-padded to a multiple of S * bk) into S equal contiguous
chunks, walks each in one program of a third grid axis into an f32 partial and adds the
partials left to right: bitwise `add_partials(matmul_partials(...))` of its chunks, the
row-parallel partials' arithmetic. As in tests/test_mosaic_swapped.py, the interpreter's
wgmma is numpy's product: a token alone is compared with the same token among others
with that product formed one token's column at a time (`column_by_column_wgmma`), as
the hardware forms every column alike (the device sweep checks it there:
`tuning/mosaic_matmul.py --configs=s:128:4:k4`).
"""

import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_mosaic import _inputs
from test_mosaic_swapped import _lower, _sweep, column_by_column_wgmma  # noqa: F401

from pallas_kernels._common import pad_axis
from pallas_kernels.matmul import add_partials
from pallas_kernels.mosaic import MosaicMatmulConfig, matmul, matmul_glu, matmul_partials
from pallas_kernels.mosaic.matmul import _read_entries

SWAPPED = MosaicMatmulConfig(bn=64, bk=64, stages=2, swapped=True)
PLAIN = MosaicMatmulConfig(bn=64, bk=64, stages=2)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


# The swapped design's f32 output (stored column-major) and the plain design's bf16 one;
# the other two in the slow run.
@pytest.mark.parametrize("base,out_dtype", [
    (SWAPPED, jnp.float32), (PLAIN, jnp.bfloat16),
    pytest.param(SWAPPED, jnp.bfloat16, marks=pytest.mark.slow),
    pytest.param(PLAIN, jnp.float32, marks=pytest.mark.slow)],
    ids=["swapped-f32", "plain-bf16", "swapped-bf16", "plain-f32"])
def test_a_split_is_its_chunks_added_left_to_right(base, out_dtype):
    x, w = _inputs(5, k=256, n=128)
    split = dataclasses.replace(base, splits=2)
    got = matmul(x, w, out_dtype=out_dtype, interpret=True, config=split)
    parts = matmul_partials(x, w, splits=2, interpret=True, config=base)  # [2, 5, 128]
    assert got.shape == (5, 128) and got.dtype == out_dtype
    assert np.array_equal(_bits(got), _bits(add_partials(parts, out_dtype)))


def test_k_is_padded_to_whole_chunks_of_whole_steps():
    # K = 200, bk = 64, 2 chunks: K padded to 256, chunks of 128 (the second ends in 56
    # zero terms), not 100 each.
    x, w = _inputs(3, k=200, n=64)
    got = matmul(x, w, out_dtype=jnp.float32, interpret=True,
                 config=dataclasses.replace(SWAPPED, splits=2))
    xp, wp = pad_axis(x, 1, 256), pad_axis(w, 0, 256)
    want = add_partials(matmul_partials(xp, wp, splits=2, interpret=True, config=SWAPPED),
                        jnp.float32)
    assert np.array_equal(_bits(got), _bits(want))


def test_a_split_is_another_sum():
    # Control: the checks here can fail; a split's bits are its own (R11), not the walk's.
    x, w = _inputs(16, k=512, n=64, seed=3)
    one = matmul(x, w, out_dtype=jnp.float32, interpret=True, config=SWAPPED)
    four = matmul(x, w, out_dtype=jnp.float32, interpret=True,
                  config=dataclasses.replace(SWAPPED, splits=4))
    np.testing.assert_allclose(np.asarray(one), np.asarray(four), rtol=1e-5, atol=1e-5)
    assert not np.array_equal(_bits(one), _bits(four))


def test_a_token_alone_equals_the_token_among_others(column_by_column_wgmma):  # noqa: F811
    x, w = _inputs(40, k=256, n=128, seed=1)
    cfg = dataclasses.replace(SWAPPED, splits=4)
    mm = functools.partial(matmul, out_dtype=jnp.bfloat16, interpret=True, config=cfg)
    among = _bits(mm(x, w))
    for r in (0, 9, 17, 39):
        assert np.array_equal(_bits(mm(x[r:r + 1], w))[0], among[r]), r
    assert np.array_equal(_bits(mm(x[:17], w)), among[:17])


def test_splits_are_checked():
    for bad in (0, 17, True, 2.0):
        with pytest.raises(ValueError, match="splits"):
            dataclasses.replace(SWAPPED, splits=bad)
    # numpy ints are ints (a config built from a sweep's arrays), stored as ints
    cfg = dataclasses.replace(SWAPPED, splits=np.int64(2), bk=np.int32(64))
    assert cfg == dataclasses.replace(SWAPPED, splits=2) and type(cfg.splits) is int
    x, w = _inputs(2, k=128, n=256)
    # K = 128 is 2 steps of 64: a third chunk would be padding only (5 steps: 2 a chunk
    # leave a fourth chunk of padding)
    for k, splits in ((128, 3), (320, 4)):
        with pytest.raises(ValueError, match="chunks of padding only"):
            matmul(x[:, :k] if k <= 128 else jnp.tile(x, (1, 3))[:, :k],
                   jnp.tile(w, (3, 1))[:k], interpret=True,
                   config=dataclasses.replace(SWAPPED, splits=splits))
    with pytest.raises(ValueError, match="no split config"):
        matmul_glu(x, w, activation="silu", interpret=True,
                   config=dataclasses.replace(SWAPPED, splits=2))
    with pytest.raises(ValueError, match="matmul_partials .* no split config"):
        matmul_partials(x, w, splits=2, interpret=True,
                        config=dataclasses.replace(SWAPPED, splits=2))


def test_a_table_entry_that_splits_takes_no_prefill_or_tall_tile(tmp_path):
    entry = {"K": 4096, "N": 2048, "dtype": "bfloat16",
             "config": dict(bn=64, bk=128, stages=4, swapped=True, splits=4)}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tuned": [entry]}))
    assert _read_entries(str(path))[(4096, 2048, "bfloat16")][0].splits == 4
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"tuned": [dict(entry, prefill=dict(bn=64, bk=128,
                                                                   stages=4))]}))
    with pytest.raises(ValueError, match="splits K"):
        _read_entries(str(bad))
    # Nor does a prefill tile of an entry without one split (the decode rows' bits).
    plain = dict(entry, config=dict(entry["config"], splits=1),
                 prefill=dict(bn=64, bk=128, stages=4, splits=2))
    bad.write_text(json.dumps({"tuned": [plain]}))
    with pytest.raises(ValueError, match="no split"):
        _read_entries(str(bad))
    bad.write_text(json.dumps({"tuned": [dict(entry, K=256)]}))  # 2 steps of 128, 4 chunks
    with pytest.raises(ValueError, match="chunks of padding only"):
        _read_entries(str(bad))


def test_a_split_lowers_for_cuda_in_one_kernel():
    x = jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
    for base in (MosaicMatmulConfig(bn=64, bk=128, stages=4, swapped=True),
                 MosaicMatmulConfig(bn=32, bk=128, stages=4)):
        for out_dtype in (jnp.bfloat16, jnp.float32):
            text = _lower(functools.partial(matmul, out_dtype=out_dtype,
                                            config=dataclasses.replace(base, splits=4)), x, w)
            assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1


def test_the_sweep_takes_a_split_variant_on_its_own_bits(tmp_path, monkeypatch):
    """tuning/mosaic_matmul.py --write: a split variant (never the swapped design's bits)
    enters the table where its own row-invariance checks pass and it is fastest."""
    sweep = _sweep()
    clean = {"prefix_mismatch_rows": {"1": 0, "160": 0}, "alone_mismatch_rows": 0}
    base = dict(bn=64, bk=128, stages=4, swapped=True)
    split = dict(base, splits=4)

    def shape(K, N, bits):
        t = {"mosaic": 30.0, "mosaic_swapped": 25.0, "mosaic[s:128:4:k4]": 10.0}
        return {"K": K, "N": N, "time": {m: {k: {"us": v} for k, v in t.items()}
                                         for m in ("1", "17")},
                "swapped": {"config": base, "bits": clean, "variants": {"s:128:4:k4": {
                    "config": split, "equals_swapped": False, "bits": bits}}}}

    report = {"jax": "j", "command": "python sweep --write", "shapes": {
        "wo": shape(4096, 2048, clean),
        "router": shape(2048, 128, dict(clean, alone_mismatch_rows=1))}}
    path = tmp_path / "t.json"
    assert sweep.write_tuned(str(path), report) == ["wo", "router"]
    got = {(e["K"], e["N"]): e["config"] for e in json.loads(path.read_text())["tuned"]}
    assert got == {(4096, 2048): split, (2048, 128): base}
    cfg, tiles = sweep.parse_config("s:128:4:k4", 4096, jnp.bfloat16)
    assert (cfg.splits, cfg.swapped, cfg.bk, tiles) == (4, True, 128, False)
    cfg, tiles = sweep.parse_config("s:128:6:10:w:k2", 4096, jnp.bfloat16)
    assert (cfg.splits, cfg.token_tiles, cfg.wide, tiles) == (2, 10, True, True)
    for bad in ("s:64:2:kx", "s:64:2:k2:k3", "s:64:2:4:x", "s:64", "64:64:2:k2",
                "s:64:2:4:w:junk", "s:64:2:k0"):
        with pytest.raises(ValueError, match=re.escape(f"--configs entry {bad!r}")):
            sweep.parse_config(bad, 4096, jnp.bfloat16)
    # A prefill tile never joins an entry that splits K (its bits are the split's).
    table = tmp_path / "p.json"
    table.write_text(json.dumps({"provenance": [], "tuned": [
        {"K": 4096, "N": 2048, "dtype": "bfloat16", "config": split}]}))
    plain_win = {"K": 4096, "N": 2048, "time": {}, "plain_variants": {}}
    monkeypatch.setattr(sweep, "prefill_winner", lambda rep: {
        "config": dict(bn=64, bk=128, stages=4), "rows": [511], "us": [2.0, 1.0]})
    assert sweep.write_prefill(str(table), {"jax": "j", "command": "c", "shapes": {
        "wo": plain_win}}) == []
    assert _read_entries(str(table))[(4096, 2048, "bfloat16")][0].splits == 4
