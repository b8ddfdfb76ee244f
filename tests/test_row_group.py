"""Row groups in the matmul kernels (`row_group`, `ModelConfig.matmul_row_group`).

One program computing g row tiles (each weight block loaded once for all of them) must
give the bits of the grid kernel, which computes each row tile in its own program:
(a) `matmul` and `matmul_glu` at 1 to 4 row tiles and groups of 2..4,
    bf16 and f32, against row_group=1, bitwise (split-K configs' partials too);
(b) the group size spreads the row tiles evenly over the fewest programs of at most
    row_group tiles (the last program's tiles past the rows are masked);
(c) a model with matmul_row_group=4 (the default): prefill and a verify block bitwise
    equal to the row_group=1 model's, so the option is scheduling only.
CPU, Pallas in interpret mode; JSPEC_PALLAS_INTERPRET=0 runs (a) compiled on a GPU.
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bits, model_and_tokens

from jspec import with_options
from jspec.cache import init_cache
from jspec.model import apply
from pallas_kernels.matmul import MatmulConfig, matmul, row_group_size
from pallas_kernels.matmul_glu import fusable, matmul_glu

INTERPRET = os.environ.get("JSPEC_PALLAS_INTERPRET", "1") != "0"


def _rand(shape, dtype, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def test_row_group_size():
    # 5 row tiles (a batch-8 verify block of gamma 8, 72 rows): two programs of 3 (the
    # second with one masked tile), not five of 1, so each weight is read twice, not 5x.
    assert [row_group_size(t, 4) for t in range(1, 11)] == [1, 2, 3, 4, 3, 3, 4, 4, 3, 4]
    assert row_group_size(3, 1) == 1 and row_group_size(12, 5) == 4
    assert row_group_size(33, 4) == 4 and row_group_size(32, 8) == 8
    with pytest.raises(ValueError, match="row_group must be >= 1"):
        row_group_size(3, 0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=pytest.mark.slow)])
@pytest.mark.parametrize("m", [1, 17, 40, 72, 96, 100])
def test_matmul_row_group_is_bitwise_the_grid_kernel(dtype, m):
    K, N = 96, 80
    x, w = _rand((m, K), dtype, 0), _rand((K, N), dtype, 1)
    base = matmul(x, w, out_dtype=dtype, interpret=INTERPRET)
    for g in (2, 3, 4):
        got = matmul(x, w, out_dtype=dtype, interpret=INTERPRET, row_group=g)
        assert np.array_equal(bits(got), bits(base)), (m, g)


@pytest.mark.parametrize("m", [17, 40, 100])
def test_split_k_row_groups_give_the_grid_kernels_bits(m):
    # A split config's partials of g row tiles a program (each chunk's weight blocks
    # loaded once for them): the bits of one row tile a program, and the launch does
    # group them (its grid has fewer row programs).
    x, w = _rand((m, 128), jnp.float32, 2), _rand((128, 48), jnp.float32, 3)
    cfg = MatmulConfig(bm=16, bn=16, bk=32, num_warps=4, num_stages=2, split_k=2)
    base = matmul(x, w, interpret=INTERPRET, config=cfg)
    for g in (2, 4):
        got = matmul(x, w, interpret=INTERPRET, config=cfg, row_group=g)
        assert np.array_equal(bits(got), bits(base)), (m, g)
    tiles = -(-m // 16)
    text = str(jax.make_jaxpr(functools.partial(matmul, interpret=INTERPRET, config=cfg,
                                                row_group=4))(x, w))
    programs = -(-tiles // row_group_size(tiles, 4))
    assert f"grid=({programs}, 3, 2)" in text.replace("grid_mapping=", ""), text[:2000]


@pytest.mark.parametrize("m", [1, 40, 72, 96, 100])
def test_matmul_glu_row_group_is_bitwise_the_grid_kernel(m):
    K = 64
    F = next(f for f in (32, 64, 128, 256, 512) if fusable(K, f, jnp.bfloat16, INTERPRET))
    x, w = _rand((m, K), jnp.bfloat16, 4), _rand((K, 2 * F), jnp.bfloat16, 5)
    base = matmul_glu(x, w, activation="silu", interpret=INTERPRET)
    for g in (2, 3, 4):
        got = matmul_glu(x, w, activation="silu", interpret=INTERPRET, row_group=g)
        assert np.array_equal(bits(got), bits(base)), (m, g)


@pytest.mark.slow  # the kernels' bits with any row group: the tests above, by default
def test_model_with_row_groups_gives_the_same_logits():
    model, seq = model_and_tokens("tiny-qwen3", 60, seed=7)
    assert model.options.matmul_row_group == 4  # the default
    grouped, model = model, with_options(model, matmul_row_group=1)

    def run(m):
        cache = init_cache(m, 2, 64)
        tokens = jnp.asarray(np.stack([seq[:48], seq[12:60]]))  # [2, 48]: 96 rows, 3 tiles
        pre, cache = apply(m, tokens, cache)
        block, _ = apply(m, jnp.asarray(np.stack([seq[48:53], seq[:5]])), cache)  # [2, 5]
        return np.asarray(pre), np.asarray(block)

    for a, b in zip(run(grouped), run(model), strict=True):
        assert np.array_equal(bits(a), bits(b))


def test_matmul_row_group_option_parses_and_validates():
    from jspec.cli import parse_options

    assert parse_options("matmul_row_group=2")[0].matmul_row_group == 2
    model, _ = model_and_tokens("tiny-qwen3", 4, seed=0)
    with pytest.raises(ValueError, match="matmul_row_group=0 must be an int >= 1"):
        with_options(model, matmul_row_group=0)


# Multi-tile schedules (`matmul(..., schedule=True)`, `ModelConfig.matmul_schedule`): a
# launch of more than one row tile may take another row tile / column tile / warps /
# stages / K tile than the table's entry (the K tile on the GPU only: see
# matmul.SCHEDULE_FIELDS), never another split_k.


def test_multi_tile_schedule_changes_scheduling_fields_only(monkeypatch):
    import importlib

    mm = importlib.import_module("pallas_kernels.matmul")  # the module, not the function

    for (K, N, dt), over in mm.MULTI_TILE.items():
        base = mm.matmul_config(K, N, jnp.dtype(dt), interpret=False)  # TUNED or the rule
        got = mm.multi_tile_config(base, K, N, jnp.dtype(dt))
        assert got.split_k == base.split_k and K % got.bk == 0
        assert set(over) <= set(mm.SCHEDULE_FIELDS) and got != base
    monkeypatch.setitem(mm.MULTI_TILE, (96, 80, "float32"), {"split_k": 2})
    with pytest.raises(ValueError, match="may set only"):
        mm.multi_tile_config(MatmulConfig(16, 16, 16, 4, 2), 96, 80, jnp.float32)
    # Another K tile: only unsplit, and only where both K tiles divide K (no padding).
    monkeypatch.setitem(mm.MULTI_TILE, (96, 80, "float32"), {"bk": 32})
    assert mm.multi_tile_config(MatmulConfig(16, 16, 16, 4, 2), 96, 80, jnp.float32).bk == 32
    with pytest.raises(ValueError, match="change bk only"):
        mm.multi_tile_config(MatmulConfig(16, 16, 16, 4, 2, split_k=2), 96, 80, jnp.float32)
    monkeypatch.setitem(mm.MULTI_TILE, (96, 80, "float32"), {"bk": 64})
    with pytest.raises(ValueError, match="change bk only"):
        mm.multi_tile_config(MatmulConfig(16, 16, 16, 4, 2), 96, 80, jnp.float32)
    mg = importlib.import_module("pallas_kernels.matmul_glu")
    for (K, N, dt), over in mg.MULTI_TILE_GLU.items():
        base = mm.matmul_config(K, N, jnp.dtype(dt), interpret=False)
        got = mm.multi_tile_config(base, K, N, jnp.dtype(dt), mg.MULTI_TILE_GLU)
        assert got.split_k == base.split_k and K % got.bk == 0
        assert set(over) <= set(mm.SCHEDULE_FIELDS) and got != base


def test_tall_launches_take_the_tall_schedule():
    # Launches of more than TALL_ROWS rows take the weight's tall overrides where it has
    # one, else the multi-tile ones; one row tile keeps the config (scheduling only).
    from pallas_kernels.matmul import TALL_ROWS, scheduled

    base = MatmulConfig(bm=16, bn=64, bk=64, num_warps=4, num_stages=2)
    multi = {(256, 128, "bfloat16"): {"bn": 32}}
    tall = {(256, 128, "bfloat16"): {"bm": 128, "num_warps": 8}}
    args = (256, 128, jnp.bfloat16, 4, multi, tall)
    assert scheduled(base, 16, *args) == (base, 4)
    assert scheduled(base, 17, *args)[0].bn == 32
    assert scheduled(base, TALL_ROWS, *args)[0].bn == 32
    cfg, g = scheduled(base, TALL_ROWS + 1, *args)
    assert (cfg.bm, cfg.bn, cfg.num_warps, cfg.bk, g) == (128, 64, 8, 64, 1)
    cfg, g = scheduled(base, 1024, 256, 128, jnp.bfloat16, 4, multi, {})
    assert (cfg.bn, g) == (32, 4)  # no tall entry: the multi-tile schedule
    # A table's row_group sets the launch's row group, at most the caller's.
    grouped = {(256, 128, "bfloat16"): {"bm": 64, "row_group": 3}}
    assert scheduled(base, 160, 256, 128, jnp.bfloat16, 4, multi, grouped) == (
        dataclasses.replace(base, bm=64), 3)
    assert scheduled(base, 160, 256, 128, jnp.bfloat16, 2, multi, grouped)[1] == 2
    assert scheduled(base, 40, 256, 128, jnp.bfloat16, 4, multi, grouped)[1] == 4
    # A split config's launch groups rows only where its entry names a row_group.
    split = dataclasses.replace(base, split_k=2)
    assert scheduled(split, 160, 256, 128, jnp.bfloat16, 4, multi, tall)[1] == 1
    assert scheduled(split, 40, 256, 128, jnp.bfloat16, 4, multi, tall)[1] == 1
    assert scheduled(split, 160, 256, 128, jnp.bfloat16, 4, multi, grouped)[1] == 3
    # The data file's own tables (the defaults), as the model calls it.
    for K, N, dt in (256, 128, jnp.bfloat16), (4096, 24576, jnp.bfloat16):
        for m in (17, 160, 2048):
            cfg, g = scheduled(base, m, K, N, dt, 4)
            assert cfg.split_k == base.split_k and g >= 1


def test_schedule_tables_check_the_row_group_field():
    from pallas_kernels.matmul import multi_tile_config, parse_schedules

    row = {"K": 256, "N": 128, "dtype": "bfloat16", "fields": {"bm": 64, "row_group": 2}}
    table = parse_schedules([row], "t")
    base = MatmulConfig(bm=16, bn=64, bk=64, num_warps=4, num_stages=2)
    assert multi_tile_config(base, 256, 128, jnp.bfloat16, table) == dataclasses.replace(
        base, bm=64)
    for bad in (0, 1.5, True, "2"):
        with pytest.raises(ValueError, match="row_group must be an int >= 1"):
            parse_schedules([{**row, "fields": {"row_group": bad}}], "t")
    with pytest.raises(ValueError, match="may set only"):
        parse_schedules([{**row, "fields": {"split_k": 2}}], "t")


def test_prefill_launches_take_the_prefill_tile():
    # More than PREFILL_ROWS rows: the weight's prefill entry, else prefill_rule's
    # compute-bound tile (bn dividing the columns: F for the GLU kernel), else (split K,
    # or a K that 64 does not divide) the tall / multi-tile schedule.
    from pallas_kernels.matmul import PREFILL_ROWS, prefill_rule, scheduled

    base = MatmulConfig(bm=16, bn=64, bk=512, num_warps=4, num_stages=3)
    tall = {(12288, 4096, "bfloat16"): {"num_warps": 2}}
    args = (12288, 4096, jnp.bfloat16, 4, {}, tall)
    assert scheduled(base, PREFILL_ROWS, *args)[0].num_warps == 2
    cfg, g = scheduled(base, PREFILL_ROWS + 1, *args, {})
    assert (cfg.bm, cfg.bn, cfg.bk, cfg.num_warps, cfg.num_stages, g) == (128, 128, 64, 8, 3, 1)
    mine = {(12288, 4096, "bfloat16"): {"bm": 64, "bk": 128}}
    assert scheduled(base, 2048, *args, mine)[0].bk == 128
    assert prefill_rule(base, 12288, 2 * 10240 + 64, cols=10240 + 32)["bn"] == 32
    assert prefill_rule(MatmulConfig(16, 64, 128, 4, 4, split_k=2), 4096, 4096) == {}
    assert prefill_rule(MatmulConfig(16, 64, 32, 4, 4), 96, 4096) == {}
    assert scheduled(MatmulConfig(16, 64, 32, 4, 4), 2048, 96, 4096, jnp.bfloat16, 4, {}, {},
                     {})[0].bm == 16
    f32 = MatmulConfig(16, 64, 64, 4, 4)  # f32 weights: the tables, never the rule
    assert scheduled(f32, 2048, 4096, 4096, jnp.float32, 4, {}, {}, {}) == (f32, 4)


@pytest.mark.parametrize("m", [1, 40, 160])
def test_a_scheduling_variant_keeps_the_bits(m):
    # The CPU side of the H200 sweep (experiments/sweep_schedule.py): other bm, bn, warps
    # and stages at the same bk and split_k, row groups on, bitwise the same rows.
    x, w = _rand((m, 256), jnp.bfloat16, 4), _rand((256, 128), jnp.bfloat16, 5)
    base = MatmulConfig(bm=16, bn=64, bk=64, num_warps=4, num_stages=2)
    want = matmul(x, w, out_dtype=jnp.bfloat16, interpret=INTERPRET, config=base, row_group=4)
    for var in (MatmulConfig(16, 32, 64, 2, 3), MatmulConfig(16, 128, 64, 8, 5),
                MatmulConfig(64, 64, 64, 4, 4), MatmulConfig(32, 64, 64, 4, 2),
                MatmulConfig(128, 64, 64, 8, 3)):
        got = matmul(x, w, out_dtype=jnp.bfloat16, interpret=INTERPRET, config=var, row_group=4)
        assert np.array_equal(bits(got), bits(want)), var


@pytest.mark.parametrize("m", [1, 40])
def test_a_glu_scheduling_variant_keeps_the_bits(m):
    x, w = _rand((m, 256), jnp.bfloat16, 6), _rand((256, 256), jnp.bfloat16, 7)  # F = 128
    base = MatmulConfig(bm=16, bn=64, bk=64, num_warps=4, num_stages=2)
    want = matmul_glu(x, w, activation="silu", interpret=INTERPRET, config=base, row_group=4)
    for var in (MatmulConfig(16, 32, 64, 2, 3), MatmulConfig(16, 128, 64, 8, 5)):
        got = matmul_glu(x, w, activation="silu", interpret=INTERPRET, config=var,
                         row_group=4)
        assert np.array_equal(bits(got), bits(want)), var
    with pytest.raises(ValueError, match="must not split K"):
        matmul_glu(x, w, activation="silu", interpret=True,
                   config=MatmulConfig(16, 64, 64, 4, 2, split_k=2))


def test_model_with_matmul_schedule_gives_the_same_logits():
    from jspec.cli import parse_options

    assert parse_options("matmul_schedule=0")[0].matmul_schedule is False
    model, seq = model_and_tokens("tiny-qwen3", 40, seed=9)
    assert model.options.matmul_schedule is True  # the default
    unscheduled = with_options(model, matmul_schedule=False)
    toks = jnp.asarray(np.stack([seq[:30], seq[10:40]]))  # [2, 30]: 60 rows, 4 tiles
    a, _ = apply(model, toks, init_cache(model, 2, 64))
    b, _ = apply(unscheduled, toks, init_cache(unscheduled, 2, 64))
    assert np.array_equal(bits(a), bits(b))
    with pytest.raises(ValueError, match="matmul_schedule=2 must be a bool"):
        with_options(model, matmul_schedule=2)


@pytest.mark.parametrize("m", [1, 5, 40, 48])
@pytest.mark.parametrize("row_group", [1, 4])
def test_ragged_rows_are_masked_not_padded(m, row_group):
    # The last row tile masks the rows past M (read as zeros, not stored): no pad or
    # slice of x or of the output, and the bits of a zero-padded input's rows.
    from conftest import eqn_counts

    x, w = _rand((m, 256), jnp.bfloat16, 6), _rand((256, 128), jnp.bfloat16, 7)
    cfg = MatmulConfig(bm=64, bn=64, bk=64, num_warps=4, num_stages=2)
    call = functools.partial(matmul, out_dtype=jnp.bfloat16, config=cfg, row_group=row_group)
    c = eqn_counts(jax.make_jaxpr(functools.partial(call, interpret=False))(x, w).jaxpr)
    assert c["pad"] == 0 and c["slice"] == 0 and c["pallas_call"] == 1, c
    got = call(x, w, interpret=INTERPRET)
    padded = call(jnp.pad(x, ((0, 128 - m), (0, 0))), w, interpret=INTERPRET)[:m]
    assert got.shape == (m, 128) and np.array_equal(bits(got), bits(padded))


@pytest.mark.parametrize("m", [5, 40, 72])
def test_glu_ragged_rows_are_masked_not_padded(m):
    # matmul_glu masks the rows past M like matmul: no pad or slice, a padded input's bits.
    from conftest import eqn_counts

    K = 64
    F = next(f for f in (32, 64, 128, 256, 512) if fusable(K, f, jnp.bfloat16, INTERPRET))
    x, w = _rand((m, K), jnp.bfloat16, 8), _rand((K, 2 * F), jnp.bfloat16, 9)
    call = functools.partial(matmul_glu, activation="silu", row_group=4)
    c = eqn_counts(jax.make_jaxpr(functools.partial(call, interpret=False))(x, w).jaxpr)
    assert c["pad"] == 0 and c["slice"] == 0 and c["pallas_call"] == 1, c
    got = call(x, w, interpret=INTERPRET)
    padded = call(jnp.pad(x, ((0, 80 - m), (0, 0))), w, interpret=INTERPRET)[:m]
    assert got.shape == (m, F) and np.array_equal(bits(got), bits(padded))
