"""Tests for the row-wise Pallas kernels (matmul, rmsnorm, rope, glu, softcap, logsumexp,
top-p).

Two kinds of check:
- accuracy: kernel vs its plain-jnp reference, with a tolerance (the only place a
  tolerance is allowed);
- row invariance: BITWISE, np.array_equal on whole outputs, never allclose. A row must give
  the same bits alone (M=1), inside blocks of 2..16 rows at different offsets, inside the
  whole batch, and among different random neighbours.

Runs on CPU with interpret=True. JSPEC_PALLAS_INTERPRET=0 runs the same tests compiled
(Triton) on a GPU.
"""

import dataclasses
import hashlib
import inspect
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import slow_except
from script_runner import run_script

from jspec.sampling import Sample
from pallas_kernels import (
    glu,
    glu_reference,
    logsumexp,
    logsumexp_reference,
    matmul,
    matmul_config,
    matmul_reference,
    rmsnorm,
    rmsnorm_reference,
    rope,
    rope_reference,
    softcap,
    softcap_reference,
)
from pallas_kernels._common import next_pow2, pow2_tile
from pallas_kernels.matmul import (
    MULTI_TILE,
    TUNED,
    MatmulConfig,
    default_matmul_config,
    load_tuned,
    tuned_to_json,
)
from pallas_kernels.rmsnorm import rmsnorm_config
from pallas_kernels.top_p import top_p_config, top_p_kept, top_p_kept_reference

INTERPRET = os.environ.get("JSPEC_PALLAS_INTERPRET", "1") != "0"
DTYPES = (jnp.float32, jnp.bfloat16)
ROWS = (1, 7, 33)
# The values against the reference at 1 and 33 rows by default (7: the slow run); every
# row count's invariance: the *_row_invariant tests.
VALUE_ROWS = (1, pytest.param(7, marks=pytest.mark.slow), 33)

# Blocks (offset, length) of the ROW_TOTAL-row batch recomputed on their own.
ROW_TOTAL = 40
BLOCKS = ((0, 2), (3, 5), (13, 16), (31, 9), (38, 2))


def _rand(rng, shape, dtype=jnp.float32, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape), dtype)


def _tol(dtype):
    # One bf16 ulp is 2^-8 relative; the f32 paths differ only in summation order.
    return dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=2e-5, atol=2e-5)


def _np(x):
    return np.asarray(x.astype(jnp.float32)) if x.dtype == jnp.bfloat16 else np.asarray(x)


def _close(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
    np.testing.assert_allclose(_np(got), _np(want), **_tol(dtype))


def _bits(x):
    """Bit pattern of an array, so that array_equal also tells -0.0 from 0.0 and NaNs apart."""
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _same_bits(a, b, what):
    assert np.array_equal(_bits(a), _bits(b)), f"{what}: bits differ"


def assert_row_invariant(fn, row_args, make_rows):
    """Bitwise: fn's row i never depends on M, on the row's offset, or on its neighbours.

    fn: maps arrays whose axis 0 is the row axis (row_args) to an output whose axis 0 is
    the row axis. make_rows(n): fresh random row_args with n rows.
    """
    m = row_args[0].shape[0]
    full = fn(*row_args)
    singles = [fn(*(a[i : i + 1] for a in row_args)) for i in range(m)]
    for i in range(m):  # each row alone (decode, M=1) vs inside the whole batch
        _same_bits(singles[i][0], full[i], f"row {i} alone vs in {m} rows")
    for off, n in BLOCKS:  # blocks of 2..16 rows at various offsets (verify, prefill chunks)
        part = fn(*(a[off : off + n] for a in row_args))
        _same_bits(part, full[off : off + n], f"rows {off}:{off + n} vs in {m} rows")
    # Different random neighbours around rows 0 and m-1, and the rows at other offsets.
    for src, dst, n in ((0, 5, 12), (m - 1, 0, 3), (m // 2, 20, 21)):
        other = make_rows(n)
        mixed = [o.at[dst].set(a[src]) for o, a in zip(other, row_args, strict=True)]
        _same_bits(fn(*mixed)[dst], full[src], f"row {src} placed at {dst} of {n} new rows")


# --------------------------------------------------------------------------- matmul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", VALUE_ROWS)
@pytest.mark.parametrize("k,n", [(64, 48), (100, 300), (1000, 513)])
def test_matmul_matches_reference(dtype, m, k, n):
    rng = np.random.default_rng(m * k + n)
    x = _rand(rng, (m, k), dtype)
    w = _rand(rng, (k, n), dtype, scale=k**-0.5)
    got, want = matmul(x, w, interpret=INTERPRET), matmul_reference(x, w)
    # bf16 products are exact in f32, so both dtypes differ only by f32 summation order.
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_matmul_out_dtype_is_one_rounding_of_the_f32_result():
    rng = np.random.default_rng(1)
    x, w = _rand(rng, (9, 200), jnp.bfloat16), _rand(rng, (200, 130), jnp.bfloat16)
    got = matmul(x, w, out_dtype=jnp.bfloat16, interpret=INTERPRET)
    assert got.dtype == jnp.bfloat16
    _same_bits(got, matmul(x, w, interpret=INTERPRET).astype(jnp.bfloat16), "out_dtype")


# One shape a dtype by default (the ragged one, K and N not multiples of a tile, in bf16)
@pytest.mark.parametrize("dtype,k,n", [
    pytest.param(d, k, n, marks=pytest.mark.slow) if (d is jnp.float32) == (k == 1000)
    else (d, k, n) for d in DTYPES for k, n in [(256, 512), (1000, 300)]])
def test_matmul_row_invariant(dtype, k, n):
    rng = np.random.default_rng(k + n)
    w = _rand(rng, (k, n), dtype, scale=k**-0.5)
    fn = lambda x: matmul(x, w, interpret=INTERPRET)  # noqa: E731
    make = lambda r: (_rand(rng, (r, k), dtype),)  # noqa: E731
    assert_row_invariant(fn, make(ROW_TOTAL), make)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="documents this CPU's XLA dot")
def test_plain_xla_matmul_is_not_row_invariant():
    """The parity check can fail: XLA's own f32 dot gives 1 row different bits than 8 rows."""
    rng = np.random.default_rng(0)
    x, w = _rand(rng, (8, 256)), _rand(rng, (256, 512))
    one = np.asarray(jnp.dot(x[:1], w))
    eight = np.asarray(jnp.dot(x, w))[:1]
    assert not np.array_equal(one, eight)
    # ...while the kernel gives the same bits.
    _same_bits(matmul(x[:1], w, interpret=True), matmul(x, w, interpret=True)[:1], "kernel")


def test_matmul_config_depends_on_weight_shape_only():
    assert list(inspect.signature(matmul_config).parameters) == ["K", "N", "dtype", "interpret"]
    for interpret in (True, False):
        for dtype in DTYPES:
            for k, n in [(64, 48), (1000, 513), (2304, 9216), (4096, 151936)]:
                cfg = matmul_config(k, n, dtype, interpret)
                assert cfg == matmul_config(k, n, dtype, interpret)
                for t in (cfg.bm, cfg.bn, cfg.bk):
                    assert t == next_pow2(t) and t >= 16, cfg
    gpu = matmul_config(4096, 4096, jnp.bfloat16, False)  # a tuned shape: the table's entry
    assert gpu == TUNED[(4096, 4096, "bfloat16")] and gpu.bm == 16
    other = matmul_config(2304, 9216, jnp.bfloat16, False)  # untuned: the default rule
    assert other == default_matmul_config(2304, 9216, jnp.bfloat16, False)


def test_matmul_config_has_no_m_and_defaults_to_no_split():
    for fn in (matmul_config, default_matmul_config):
        assert list(inspect.signature(fn).parameters) == ["K", "N", "dtype", "interpret"]
    for interpret in (True, False):
        for k, n in [(64, 48), (4096, 4096), (12288, 4096), (4096, 151936)]:
            assert default_matmul_config(k, n, jnp.bfloat16, interpret).split_k == 1
    for key, cfg in TUNED.items():  # the table itself: (K, N, dtype name) -> config
        assert len(key) == 3 and isinstance(cfg, MatmulConfig) and cfg.bm == 16, (key, cfg)
    with pytest.raises(ValueError, match="bn=48"):
        MatmulConfig(bm=16, bn=48, bk=64, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="split_k"):
        MatmulConfig(bm=16, bn=64, bk=64, num_warps=4, num_stages=2, split_k=0)


def test_tuned_tables_are_the_data_file_and_the_proven_table():
    # The tables the kernels use are the data file beside them, and the tile table is the
    # one the GPU parity matrix proved: the file records the sha256 of the table that
    # run reported (its receipt is named there), and the code's table must hash to it.
    from pallas_kernels.matmul import (
        TALL_TILE,
        TUNED_FILE,
        parse_schedules,
        parse_tuned,
        read_tuned_file,
    )
    from pallas_kernels.matmul_glu import MULTI_TILE_GLU, TALL_TILE_GLU

    data = read_tuned_file()
    import pallas_kernels

    assert TUNED_FILE == os.path.join(os.path.dirname(pallas_kernels.__file__),
                                      "matmul_tuned.json")
    assert parse_tuned(data["tuned"], TUNED_FILE) == TUNED
    assert parse_schedules(data["multi_tile"], TUNED_FILE) == MULTI_TILE
    assert parse_schedules(data["multi_tile_glu"], TUNED_FILE) == MULTI_TILE_GLU
    assert parse_schedules(data.get("tall_tile", []), TUNED_FILE) == TALL_TILE
    assert parse_schedules(data.get("tall_tile_glu", []), TUNED_FILE) == TALL_TILE_GLU
    prov = data["provenance"]
    assert prov["device"] and prov["jax"]
    for entry in prov["tuned"] + prov["multi_tile"] + prov["tall_tile"] + [prov["proven_by"]]:
        assert entry["date"] and entry["command"].startswith(("python ", "bash ")), entry
    rows = json.dumps(tuned_to_json(TUNED), sort_keys=True).encode()
    assert hashlib.sha256(rows).hexdigest() == prov["proven_by"]["tuned_sha256"]


@pytest.mark.slow  # a sweep script
def test_sweep_matmul_cli_smoke(tmp_path):
    # Interpret-mode smoke run of the GPU tuning sweep (its timings mean nothing here).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, os.path.join(root, "experiments/tuning/sweep_matmul.py"), "--interpret",
           "--presets=qwen3-0.6b", "--shapes=wo", "--rows=1,3", "--max_candidates=2",
           "--finalists=0", "--iters=1", "--reps=1", f"--out={tmp_path}"]
    r = run_script(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TUNED: dict[tuple[int, int, str], MatmulConfig] = {" in r.stdout
    with open(tmp_path / "sweep_matmul.json") as f:
        [shape] = json.load(f)["shapes"]
    assert (shape["K"], shape["N"]) == (2048, 1024) and shape["row_invariant"] is True
    splits = [c for c in shape["candidates"] if c["config"]["split_k"] > 1]
    assert splits and all(set(c["us"]) == {"1", "3"} for c in splits), shape["candidates"]
    # The selected winners (maybe none here) as a table file (write_tuned_rows merges it
    # into pallas_kernels/matmul_tuned.json).
    assert isinstance(load_tuned(str(tmp_path / "sweep_matmul_tuned.json")), dict)


def test_tuned_table_round_trips_through_a_data_file(tmp_path):
    from pallas_kernels.matmul import read_tuned_file, write_tuned_rows

    table = {(4096, 4096, "bfloat16"): MatmulConfig(bm=16, bn=32, bk=128, num_warps=4,
                                                    num_stages=4, split_k=2)}
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(tuned_to_json(table)))
    assert load_tuned(str(path)) == table
    data = tmp_path / "matmul_tuned.json"
    data.write_text(json.dumps(read_tuned_file()))
    write_tuned_rows(tuned_to_json(table), str(data))  # a sweep's winners into the file
    merged = load_tuned_file_table(str(data))
    assert merged[(4096, 4096, "bfloat16")] == table[(4096, 4096, "bfloat16")]
    assert {k: v for k, v in merged.items() if k not in table} == {
        k: v for k, v in TUNED.items() if k not in table}
    (tmp_path / "bad.json").write_text('[{"K": 1}]')
    with pytest.raises(ValueError, match="not a matmul tuning table"):
        load_tuned(str(tmp_path / "bad.json"))


def test_new_bits_drop_the_weights_schedules(tmp_path):
    # A schedule was proven for one bk / split_k: a winner that changes them drops the
    # weight's multi_tile / tall_tile rows; a schedule-only change keeps them.
    from pallas_kernels.matmul import read_tuned_file, write_tuned_rows

    key, other = (12288, 4096, "bfloat16"), (4096, 4096, "bfloat16")
    old = MatmulConfig(bm=16, bn=32, bk=512, num_warps=4, num_stages=3)
    rows = lambda fields: [{"K": k[0], "N": k[1], "dtype": k[2], "fields": fields}  # noqa: E731
                           for k in (key, other)]
    data = tmp_path / "matmul_tuned.json"
    data.write_text(json.dumps({"tuned": tuned_to_json({key: old, other: old}),
                                "multi_tile": rows({"num_warps": 2}),
                                "tall_tile": rows({"bm": 64})}))
    same_bits = dataclasses.replace(old, num_stages=4)
    assert write_tuned_rows(tuned_to_json({key: same_bits}), str(data)) == []
    new_bits = dataclasses.replace(old, bk=256, bm=64)
    dropped = write_tuned_rows(tuned_to_json({key: new_bits}), str(data))
    assert sorted(d["table"] for d in dropped) == ["multi_tile", "tall_tile"]
    after = read_tuned_file(str(data))
    for name in ("multi_tile", "tall_tile"):
        assert [(r["K"], r["N"]) for r in after[name]] == [other[:2]]  # the other stays
    assert load_tuned_file_table(str(data)) == {key: new_bits, other: old}


def load_tuned_file_table(path: str):
    from pallas_kernels.matmul import parse_tuned, read_tuned_file

    return parse_tuned(read_tuned_file(path)["tuned"], path)


def test_pow2_tile_prefers_divisors():
    assert pow2_tile(4096, 32, 128) == 128
    assert pow2_tile(2304, 32, 128) == 128  # 2304 = 18 * 128: no padding
    assert pow2_tile(96, 32, 128) == 32
    assert pow2_tile(100, 16, 512) == 128  # no divisor: cover and pad
    assert pow2_tile(1000, 16, 512) == 512


# --------------------------------------------------------------------------- rmsnorm


@pytest.mark.parametrize("dtype,m,d,offset", slow_except(
    [(jnp.float32, 1, 64, 0.0), (jnp.float32, 33, 300, 1.0), (jnp.bfloat16, 7, 300, 0.0),
     (jnp.bfloat16, 33, 64, 1.0)], DTYPES, ROWS, [64, 300], [0.0, 1.0]))
def test_rmsnorm_matches_reference(dtype, m, d, offset):
    rng = np.random.default_rng(m + d)
    x = _rand(rng, (m, d), dtype, scale=3.0)
    w = _rand(rng, (d,), dtype)
    got = rmsnorm(x, w, eps=1e-6, offset=offset, interpret=INTERPRET)
    _close(got, rmsnorm_reference(x, w, eps=1e-6, offset=offset), dtype)


def test_rmsnorm_wide_rows_loop_over_feature_blocks():
    d = 10000  # > 8192: several feature blocks, summed in ascending order
    assert rmsnorm_config(d, jnp.float32, INTERPRET).nd > 1
    rng = np.random.default_rng(2)
    x, w = _rand(rng, (5, d)), _rand(rng, (d,))
    got = rmsnorm(x, w, eps=1e-5, interpret=INTERPRET)
    _close(got, rmsnorm_reference(x, w, eps=1e-5), jnp.float32)
    fn = lambda x: rmsnorm(x, w, eps=1e-5, interpret=INTERPRET)  # noqa: E731
    _same_bits(fn(x[3:4])[0], got[3], "wide row alone vs in 5 rows")


# d: head_dim (q/k norm) and an odd model width
@pytest.mark.parametrize("dtype,offset,d", slow_except(
    [(jnp.float32, 0.0, 128), (jnp.bfloat16, 1.0, 300)], DTYPES, [0.0, 1.0], [128, 300]))
def test_rmsnorm_row_invariant(dtype, offset, d):
    rng = np.random.default_rng(d)
    w = _rand(rng, (d,), dtype)
    fn = lambda x: rmsnorm(x, w, eps=1e-6, offset=offset, interpret=INTERPRET)  # noqa: E731
    make = lambda r: (_rand(rng, (r, d), dtype, scale=3.0),)  # noqa: E731
    assert_row_invariant(fn, make(ROW_TOTAL), make)


# --------------------------------------------------------------------------- rope


def _tables(rng, m, half):
    """Per-row cos/sin at random positions, as the caller gathers them."""
    pos = rng.integers(0, 4096, size=(m, 1)).astype(np.float32)
    ang = pos * (10000.0 ** (-np.arange(half, dtype=np.float32) / half))
    return jnp.asarray(np.cos(ang)), jnp.asarray(np.sin(ang))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", VALUE_ROWS)
@pytest.mark.parametrize("h,d", [(4, 64), (3, 96)])  # pow2 half and padded half
def test_rope_matches_reference(dtype, m, h, d):
    rng = np.random.default_rng(m + d)
    x = _rand(rng, (m, h, d), dtype)
    cos, sin = _tables(rng, m, d // 2)
    _close(rope(x, cos, sin, interpret=INTERPRET), rope_reference(x, cos, sin), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_row_invariant(dtype):
    rng = np.random.default_rng(3)
    h, d = 3, 96

    def make(r):
        return (_rand(rng, (r, h, d), dtype), *_tables(rng, r, d // 2))

    assert_row_invariant(lambda *a: rope(*a, interpret=INTERPRET), make(ROW_TOTAL), make)


# --------------------------------------------------------------------------- glu


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", VALUE_ROWS)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gpt_oss"])
@pytest.mark.parametrize("f", [128, 700])
def test_glu_matches_reference(dtype, m, activation, f):
    rng = np.random.default_rng(m + f)
    gate, up = _rand(rng, (m, f), dtype, scale=3.0), _rand(rng, (m, f), dtype)
    got = glu(gate, up, activation=activation, interpret=INTERPRET)
    _close(got, glu_reference(gate, up, activation=activation), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gpt_oss"])
def test_glu_row_invariant(dtype, activation):
    rng = np.random.default_rng(4)
    f = 700

    def make(r):
        return (_rand(rng, (r, f), dtype, scale=3.0), _rand(rng, (r, f), dtype))

    fn = lambda g, u: glu(g, u, activation=activation, interpret=INTERPRET)  # noqa: E731
    assert_row_invariant(fn, make(ROW_TOTAL), make)


def _apply_gate(gate_up: np.ndarray, dtype) -> np.ndarray:
    """transformers' `GptOssExperts._apply_gate` in numpy, each torch op on dtype tensors
    computed in f32 and rounded to dtype (a no-op for f32); gate_up interleaved."""
    def r(v):
        return v.astype(dtype).astype(np.float32)

    gate, up = gate_up[..., ::2].astype(np.float32), gate_up[..., 1::2].astype(np.float32)
    gate = np.minimum(gate, np.float32(7.0))  # gate.clamp(min=None, max=limit)
    up = np.clip(up, np.float32(-7.0), np.float32(7.0))  # up.clamp(min=-limit, max=limit)
    glu = r(gate * r(np.float32(1) / (np.float32(1) + np.exp(-r(gate * np.float32(1.702))))))
    return r(r(up + np.float32(1)) * glu)  # (up + 1) * glu


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpt_oss_glu_is_transformers_apply_gate(dtype):
    """"gpt_oss" on the de-interleaved halves is transformers' arithmetic: in f32 within
    numpy's exp (not XLA's) of it, in bf16 bit for bit (every op's rounding); the clamps
    engage: a gate past 7 gives the bits of 7, an up past +-7 those of +-7."""
    rng = np.random.default_rng(3)
    gate_up = (6 * rng.standard_normal((40, 2 * 700))).astype(np.float32).astype(dtype)
    gate, up = jnp.asarray(gate_up[:, ::2]), jnp.asarray(gate_up[:, 1::2])
    assert (gate_up.astype(np.float32) > 7).any() and (gate_up.astype(np.float32) < -7).any()
    got = np.asarray(glu(gate, up, activation="gpt_oss", interpret=INTERPRET), np.float32)
    want = _apply_gate(gate_up, dtype)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert np.array_equal(got, want)
    ref = glu_reference(gate, up, activation="gpt_oss")
    assert np.array_equal(np.asarray(ref, np.float32), got)  # the same ops
    clamped = glu(jnp.minimum(gate, 7.0), jnp.clip(up, -7.0, 7.0), activation="gpt_oss",
                  interpret=INTERPRET)
    assert np.array_equal(np.asarray(clamped, np.float32), got)
    assert not np.array_equal(np.asarray(glu(gate, up, activation="silu",
                                             interpret=INTERPRET), np.float32), got)


# --------------------------------------------------------------------------- softcap


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n", [128, 1000])
def test_softcap_matches_reference(m, n):
    rng = np.random.default_rng(m + n)
    x = _rand(rng, (m, n), scale=50.0)
    _close(softcap(x, 30.0, interpret=INTERPRET), softcap_reference(x, 30.0), jnp.float32)


def test_softcap_row_invariant():
    rng = np.random.default_rng(5)
    make = lambda r: (_rand(rng, (r, 1000), scale=50.0),)  # noqa: E731
    assert_row_invariant(lambda x: softcap(x, 30.0, interpret=INTERPRET), make(ROW_TOTAL), make)


# --------------------------------------------------------------------------- logsumexp


def _logits(rng, m, v):
    """Logits with masked (-inf) vocabulary: a masked stripe, sparse holes, all-masked rows."""
    x = (10.0 * rng.standard_normal((m, v))).astype(np.float32)
    x[:, v // 3 : v // 2] = -np.inf
    x[rng.random((m, v)) < 0.05] = -np.inf
    x[::4] = -np.inf  # whole rows masked
    return jnp.asarray(x)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("v", [100, 1000, 5000])
def test_logsumexp_matches_reference(m, v):
    rng = np.random.default_rng(m + v)
    x = _logits(rng, m, v)
    got, want = logsumexp(x, interpret=INTERPRET), logsumexp_reference(x)
    assert got.shape == (m,) and not np.isnan(np.asarray(got)).any()
    assert np.isneginf(np.asarray(got)[::4]).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    finite = np.asarray(x)[1:2].astype(np.float64)
    if m > 1:  # also against float64 numpy on a row with live entries
        top = finite.max()
        want64 = top + np.log(np.exp(finite - top).sum())
        np.testing.assert_allclose(float(got[1]), want64, rtol=1e-6)


def test_logsumexp_all_masked_is_neg_inf_not_nan():
    x = jnp.full((3, 777), -jnp.inf, jnp.float32)
    got = np.asarray(logsumexp(x, interpret=INTERPRET))
    assert np.isneginf(got).all()


def test_logsumexp_row_invariant():
    rng = np.random.default_rng(6)
    make = lambda r: (_logits(rng, r, 5000),)  # noqa: E731
    assert_row_invariant(lambda x: logsumexp(x, interpret=INTERPRET), make(ROW_TOTAL), make)


# --------------------------------------------------------------------------- top-p


def _sorted(x):
    return -jnp.sort(-x, axis=1)  # each row descending, -inf last


def _kept64(sorted_x, p):
    """The top-p count in float64 numpy: 1 + #{j : mass up to and with token j < p}."""
    s = np.asarray(sorted_x, np.float64)
    live = np.isfinite(s[:, :1])
    e = np.exp(s - np.where(live, s[:, :1], 0.0))
    incl = np.cumsum(e, axis=1)
    return np.minimum(1 + (incl < p * e.sum(axis=1, keepdims=True)).sum(axis=1), s.shape[1])


@pytest.mark.parametrize("m,v,scale,p", slow_except(
    [(1, 100, 3.0, 0.5), (7, 1000, 10.0, 0.9), (33, 5000, 1.0, 0.5)],
    ROWS, [(100, 3.0), (1000, 10.0), (5000, 1.0)], [0.5, 0.9]))
def test_top_p_kept_matches_float64(m, v, scale, p):
    rng = np.random.default_rng(m + v)
    x = scale * _logits(rng, m, v) / 10.0  # masked stripes and all-masked rows
    got = np.asarray(top_p_kept(_sorted(x), p, interpret=INTERPRET))
    assert got.shape == (m,) and got.dtype == np.int32
    np.testing.assert_array_equal(got, _kept64(_sorted(x), p))
    assert (got[::4] == 1).all()  # an all-masked row keeps its first token only
    np.testing.assert_array_equal(got, np.asarray(top_p_kept_reference(_sorted(x), p)))


def test_top_p_kept_row_invariant():
    rng = np.random.default_rng(7)
    make = lambda r: (_sorted(_logits(rng, r, 5000) / 10.0),)  # noqa: E731
    assert_row_invariant(lambda x: top_p_kept(x, 0.9, interpret=INTERPRET), make(ROW_TOTAL), make)


def test_top_p_config_depends_on_vocabulary_only():
    assert list(inspect.signature(top_p_config).parameters) == ["V", "interpret"]


@pytest.mark.slow  # the top-p cut's rows: test_top_p_kept_row_invariant; a sampled verify
def test_sample_with_top_p_row_invariant():  # equal to serial: test_gumbel_coupled_...
    """The sampler itself (temperature, top-k, top-p, Gumbel noise, argmax): a row's
    filtered logits and token do not depend on the rows sampled with it."""
    rng = np.random.default_rng(8)
    sampler = Sample(temperature=0.8, top_k=0, top_p=0.9)

    def make(r):
        rows = jnp.asarray(rng.integers(0, 8, r), jnp.int32)
        return (_rand(rng, (r, 3000), scale=2.0), rows, rows + 100)

    def both(x, rows, positions):
        toks = sampler(x, jnp.int32(3), rows, positions)
        return jnp.concatenate([sampler.filtered_logits(x), toks[:, None].astype(x.dtype)], 1)

    assert_row_invariant(both, make(ROW_TOTAL), make)


# --------------------------------------------------------------------------- bad shapes


def _raises(match, fn, *args, **kw):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kw)


def test_bad_shapes_raise_value_error_naming_shapes():
    f32 = lambda *s: jnp.zeros(s, jnp.float32)  # noqa: E731
    kw = dict(interpret=INTERPRET)
    _raises(r"x\.shape=\(4, 8\) w\.shape=\(9, 3\)", matmul, f32(4, 8), f32(9, 3), **kw)
    _raises(r"x\.shape=\(8,\)", matmul, f32(8), f32(8, 3), **kw)
    _raises(r"x\.dtype=", matmul, f32(4, 8), f32(8, 3).astype(jnp.bfloat16), **kw)
    _raises(r"x\.dtype=.*int32", matmul, jnp.zeros((4, 8), jnp.int32), jnp.zeros((8, 3), jnp.int32))
    _raises(r"x\.shape=\(4, 8\) w\.shape=\(7,\)", rmsnorm, f32(4, 8), f32(7), eps=1e-6, **kw)
    _raises(r"offset=0\.5", rmsnorm, f32(4, 8), f32(8), eps=1e-6, offset=0.5, **kw)
    _raises(r"x\.shape=\(4, 2, 7\)", rope, f32(4, 2, 7), f32(4, 3), f32(4, 3), **kw)
    _raises(r"cos\.shape=\(4, 3\)", rope, f32(4, 2, 8), f32(4, 3), f32(4, 4), **kw)
    _raises(r"gate\.shape=\(4, 8\) up\.shape=\(4, 9\)", glu, f32(4, 8), f32(4, 9),
            activation="silu", **kw)
    _raises(r"activation='relu'", glu, f32(4, 8), f32(4, 8), activation="relu", **kw)
    _raises(r"x\.shape=\(4, 8, 2\)", softcap, f32(4, 8, 2), 30.0, **kw)
    _raises(r"x\.dtype=.*bfloat16", softcap, f32(4, 8).astype(jnp.bfloat16), 30.0, **kw)
    _raises(r"x\.shape=\(8,\)", logsumexp, f32(8), **kw)
    _raises(r"sorted_x\.shape=\(8,\)", top_p_kept, f32(8), 0.9, **kw)
    _raises(r"top_p=1\.5", top_p_kept, f32(4, 8), 1.5, **kw)
