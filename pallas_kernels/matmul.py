"""Row-invariant matmul: y = x @ w with a fixed, sequential K reduction.

Every projection of the model (q/k/v/o, MLP, lm head) goes through here. XLA's
own dot picks its algorithm from the full shape, M included (on CPU, f32
`jnp.dot` of 1 row differs in the last bits from the same row inside 8 rows),
so the logits of a token would depend on how many rows were computed with it.

Here the tiling (bm, bn, bk, warps, stages, split_k) is a pure function of the
weight shape, dtype and interpret flag (`matmul_config`): a per-shape table
(`TUNED`, read from `matmul_tuned.json`, filled by `experiments/tuning/sweep_matmul.py`
on the GPU) and a default rule. M only changes the grid: with split_k == 1 the last row
tile masks the rows past M (they load as exact zeros, the padded tile's values, and are
not stored), so no pad copy is made; split-K launches pad rows up to bm.

split_k == 1 (the default): each program owns one [bm, bn] output tile and
walks K from 0 upward in bk-wide blocks inside a `lax.fori_loop`, accumulating
in f32; the f32 result is cast to `out_dtype` inside the kernel.

split_k == s > 1 (rule R2: a split count fixed per weight shape, a fixed
combine order): K is zero-padded to a multiple of s * bk and cut into s
contiguous chunks of equal length, so the chunk boundaries depend on K, bk and
s only. A third grid axis runs over the chunks; program (i, j, c) reduces chunk
c sequentially in f32 exactly as above and writes the f32 partial p_c of its
tile to a [s, Mp, Np] buffer. A second Pallas kernel then forms
((p_0 + p_1) + p_2) + ... + p_{s-1} elementwise, left to right, and casts to
`out_dtype`. Every output element therefore sees the same additions in the
same order whatever M is. No atomics, no reduction across rows.

Row groups (`row_group` g > 1): one program computes g row tiles of one column tile
(with split-K: of one K chunk), loading each weight block once for all g of them, so a
block of 40 rows (a batch-8 verify) reads the weights once rather than once per
row tile. Row tile r's sum has the terms of `_k_loop` in its order, each the same [bm,
bk] x [bk, bn] dot, so the bits are the grid kernel's; g only changes which program
computes a tile. The row tiles are spread evenly over the fewest programs of at most
`row_group` tiles (`row_group_size`; 1 row tile: the grid kernel itself); tiles of the
last program past the rows are masked (split-K: rows padded to whole programs). A split
config takes row groups from the caller's config and row_group (the sweeps) or from a
schedule entry that names its row_group; else one row tile a program.

Schedules (`schedule=True`): a launch of more than one row tile may take other bm, bn,
warps, stages, row group and (on the GPU) bk than the config (`MULTI_TILE`; above
`TALL_ROWS` rows, `TALL_TILE`; above `PREFILL_ROWS` rows, `PREFILL_TILE` or
`prefill_rule`), never another split_k, so the same bits; the sweeps check every variant
on the device. bk is scheduling on the GPU only (see SCHEDULE_FIELDS): Triton
accumulates each block's dot into the running sum, so the K order is the same chain of
tensor-core steps whatever bk is.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    check_float,
    check_out_dtype,
    dot_f32,
    pad_axis,
    pad_rows,
    pow2_tile,
    round_up,
    triton_params,
)


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    bm: int  # rows per program tile (the last tile masks the rows past M)
    bn: int  # output columns per program
    bk: int  # K elements per step of the sequential K loop
    num_warps: int
    num_stages: int
    split_k: int = 1  # fixed number of contiguous K chunks (1: no split)

    def __post_init__(self):
        for name in ("bm", "bn", "bk"):
            t = getattr(self, name)
            if t < 16 or t & (t - 1):
                raise ValueError(f"MatmulConfig.{name}={t} must be a power of 2 >= 16")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"MatmulConfig needs split_k, num_warps, num_stages >= 1: {self}")


# Per-weight-shape GPU tiles, keyed by (K, N, dtype name), and the scheduling overrides
# of launches of several row tiles, read from `matmul_tuned.json` beside this file (its
# "provenance" names the sweeps that chose them and the parity run that proved them;
# docs/tuning.md has the figures). Shapes not listed use the default rule; interpret
# mode (CPU) has its own rule and ignores the tables. `experiments/tuning/sweep_matmul.py`
# writes a new table in the file's "tuned" format, checking each winner's bits for row
# invariance on the device.
TUNED_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "matmul_tuned.json")
# The only fields a schedule may set. bk is one of them because on the GPU it does not
# set bits: the Triton IR of the K loop is `acc + dot(x_blk, w_blk, 0)` with the dot used
# once, which Triton's combine pass folds into `dot(x_blk, w_blk, acc)`, so a row's K sum
# is one chain of tensor-core k-steps from k = 0 upward whatever the K tile is
# (tests/test_gpu_lowering.py checks that form; `sweep_schedule.py` checks the bits on the
# device). In interpret mode (XLA on the CPU) each block's dot is summed first, so bk sets
# bits there, and interpret mode never schedules. A schedule's bk must divide K, as the
# config's does (the same zero padding: none), and split-K configs keep their bk.
SCHEDULE_FIELDS = ("bm", "bn", "bk", "num_warps", "num_stages")
# A schedule table row may also set the row group of its launches (`ROW_GROUP_FIELD`: row
# tiles per program, each weight block loaded once for them), capped by the caller's
# `row_group`; like the fields above it decides only which program computes a tile.
ROW_GROUP_FIELD = "row_group"
TABLE_FIELDS = SCHEDULE_FIELDS + (ROW_GROUP_FIELD,)


def tuned_to_json(table: dict[tuple[int, int, str], MatmulConfig]) -> list[dict]:
    """A TUNED-style table as JSON rows {K, N, dtype, config}."""
    return [{"K": K, "N": N, "dtype": d, "config": dataclasses.asdict(c)}
            for (K, N, d), c in sorted(table.items())]


def parse_tuned(rows, where: str) -> dict[tuple[int, int, str], MatmulConfig]:
    """JSON rows {K, N, dtype, config} -> {(K, N, dtype): MatmulConfig}."""
    try:
        return {(int(r["K"]), int(r["N"]), str(r["dtype"])): MatmulConfig(**r["config"])
                for r in rows}
    except (KeyError, TypeError) as e:
        raise ValueError(f"{where}: not a matmul tuning table (rows of K, N, dtype, "
                         f"config): {e}") from e


def load_tuned(path: str) -> dict[tuple[int, int, str], MatmulConfig]:
    """Reads a table written by `experiments/tuning/sweep_matmul.py` (`*_tuned.json`)."""
    with open(path) as f:
        return parse_tuned(json.load(f), path)


def parse_schedules(rows, where: str) -> dict[tuple[int, int, str], dict[str, int]]:
    """JSON rows {K, N, dtype, fields} -> {(K, N, dtype): fields} of scheduling overrides."""
    out = {}
    for r in rows:
        fields = dict(r["fields"])
        bad = set(fields) - set(TABLE_FIELDS)
        if bad:
            raise ValueError(f"{where}: a schedule may set only {TABLE_FIELDS}; got "
                             f"{sorted(bad)} for K={r['K']}, N={r['N']}")
        g = fields.get(ROW_GROUP_FIELD, 1)
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"{where}: row_group must be an int >= 1; got {g!r} for "
                             f"K={r['K']}, N={r['N']}")
        out[(int(r["K"]), int(r["N"]), str(r["dtype"]))] = fields
    return out


def read_tuned_file(path: str = TUNED_FILE) -> dict:
    """The tuned-tile data file: {"provenance", "tuned", "multi_tile", "multi_tile_glu"}."""
    with open(path) as f:
        return json.load(f)


def write_tuned_rows(rows: list[dict], path: str = TUNED_FILE) -> list[dict]:
    """Merges a sweep's winners (JSON rows {K, N, dtype, config}) into the data file's
    "tuned" table, replacing entries of the same key; takes effect at the next import.

    A schedule (multi_tile, tall_tile and their _glu tables) was proven for one bk and
    split_k: where a winner changes a weight's bk or split_k (new bits), that weight's
    schedules are dropped, for a new schedule sweep to fill. Returns the dropped rows,
    each with its table name."""
    new = parse_tuned(rows, "rows")
    data = read_tuned_file(path)
    old = parse_tuned(data["tuned"], path)
    renumbered = {k for k, c in new.items()
                  if k in old and (old[k].bk, old[k].split_k) != (c.bk, c.split_k)}
    dropped = []
    for name in ("multi_tile", "multi_tile_glu", "tall_tile", "tall_tile_glu",
                 "prefill_tile", "prefill_tile_glu"):
        keep = []
        for r in data.get(name, []):
            key = (int(r["K"]), int(r["N"]), str(r["dtype"]))
            (dropped.append({"table": name, **r}) if key in renumbered else keep.append(r))
        if name in data:
            data[name] = keep
    data["tuned"] = tuned_to_json(old | new)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return dropped


_TABLES = read_tuned_file()
TUNED: dict[tuple[int, int, str], MatmulConfig] = parse_tuned(_TABLES["tuned"], TUNED_FILE)
# Scheduling overrides for launches of more than one row tile (`matmul(...,
# schedule=True)`: a verify block of several rows per sequence, a prefill), per weight
# shape: another row tile / column tile / K tile / warps / pipeline stages than its
# `matmul_config`, with the same split_k, so the same bits on the GPU (SCHEDULE_FIELDS;
# the sweeps checked every variant's bits at M = 1 and 40).
# Decode (one row tile) keeps the config.
MULTI_TILE: dict[tuple[int, int, str], dict[str, int]] = parse_schedules(
    _TABLES["multi_tile"], TUNED_FILE)
# Launches of more than TALL_ROWS rows (a batched verify block, a prefill chunk) take
# these overrides where the weight has one (else MULTI_TILE's): the tall row tiles (64,
# 128) of tensor-core instructions. Scheduling fields only, so the same bits; the sweep
# (`sweep_schedule.py --tall`) checked every variant at M = 1, 40, 160, 320 and 2048.
TALL_ROWS = 64
TALL_TILE: dict[tuple[int, int, str], dict[str, int]] = parse_schedules(
    _TABLES.get("tall_tile", []), TUNED_FILE)
# Launches of more than PREFILL_ROWS rows (prefill chunks: B x C rows) are compute-bound:
# they take these overrides where the weight has one, else `prefill_rule`'s tile
# (`sweep_schedule.py --prefill` checked their bits at M = 1, 40, 160 and 2048).
PREFILL_ROWS = 1024
PREFILL_TILE: dict[tuple[int, int, str], dict[str, int]] = parse_schedules(
    _TABLES.get("prefill_tile", []), TUNED_FILE)


def schedule_tables(path: str = TUNED_FILE) -> dict[str, list[dict]]:
    """The data file's schedule tables as JSON rows (for receipts: which schedules ran)."""
    data = read_tuned_file(path)
    return {k: data.get(k, []) for k in ("multi_tile", "multi_tile_glu", "tall_tile",
                                         "tall_tile_glu", "prefill_tile", "prefill_tile_glu")}


def default_matmul_config(K: int, N: int, dtype, interpret: bool) -> MatmulConfig:
    """The rule used for shapes that have no `TUNED` entry; takes no M either."""
    if interpret:
        # Few, large grid steps: the interpreter pays per step, not per FLOP.
        return MatmulConfig(
            bm=32, bn=pow2_tile(N, 16, 512), bk=pow2_tile(K, 16, 512), num_warps=4, num_stages=1
        )
    # GPU: 16 rows keeps the decode step (M=1) cheap; tiles >= 16 for tl.dot.
    # f32 tiles cost twice the shared memory per pipeline stage, so halve bk.
    bk_max = 128 if jnp.dtype(dtype).itemsize <= 2 else 64
    return MatmulConfig(
        bm=16, bn=pow2_tile(N, 32, 64), bk=pow2_tile(K, 32, bk_max), num_warps=4, num_stages=4
    )


def matmul_config(K: int, N: int, dtype, interpret: bool) -> MatmulConfig:
    """Tiles for a [K, N] weight; deliberately takes no M."""
    if not interpret:
        tuned = TUNED.get((K, N, jnp.dtype(dtype).name))
        if tuned is not None:
            return tuned
    return default_matmul_config(K, N, dtype, interpret)


def _row_mask(first_row, bm: int, m: int | None, cols: int):
    """[bm, cols] bool: rows first_row + i < m (None: no mask, every row is real)."""
    if m is None:
        return None
    rows = first_row + lax.broadcasted_iota(jnp.int32, (bm, cols), 0)
    return rows < m


def _load_rows(ref, mask):
    """ref's block, rows past the array's end (mask False) read as exact zeros: the
    same tile a zero-padded array would give, without the pad copy."""
    if mask is None:
        return ref[...]
    return plgpu.load(ref, mask=mask, other=0)


def _k_loop(x_ref, w_ref, *, bk: int, nk: int, first_row=0, m: int | None = None):
    """f32 sum over k = 0, 1, ..., nk-1 of x_ref[:, k-th bk block] @ w_ref[k-th bk block, :].
    m: the rows that exist (rows first_row + i >= m are read as zeros)."""
    bm, bn = x_ref.shape[0], w_ref.shape[1]
    mask = _row_mask(first_row, bm, m, bk)

    def step(k, acc):  # acc [bm, bn] f32
        xs = _load_rows(x_ref.at[:, pl.ds(k * bk, bk)], mask)  # [bm, bk]
        ws = w_ref[pl.ds(k * bk, bk), :]  # [bk, bn]
        # HIGHEST: f32 tiles use exact f32 products (IEEE), never TF32, whatever
        # the global default precision; bf16 tiles are unaffected.
        prod = jnp.dot(xs, ws, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return acc + prod

    # Sequential k = 0, 1, ..., nk-1: the order of the K sum is fixed.
    return lax.fori_loop(0, nk, step, jnp.zeros((bm, bn), jnp.float32))


def _k_loop_rows(x_ref, w_ref, *, bm: int, bk: int, nk: int, g: int, first_row=0,
                 m: int | None = None):
    """`_k_loop` for the g row tiles x_ref[r * bm:(r + 1) * bm] at once: each weight block
    is loaded once per step and fed to g dots; tile r's f32 sum is `_k_loop`'s, term for
    term and in the same order. Returns g accumulators [bm, bn]."""
    bn = w_ref.shape[1]
    masks = [_row_mask(first_row + r * bm, bm, m, bk) for r in range(g)]

    def step(k, accs):
        ws = w_ref[pl.ds(k * bk, bk), :]  # [bk, bn], shared by the g row tiles
        out = []
        for r, acc in enumerate(accs):
            xs = _load_rows(x_ref.at[pl.ds(r * bm, bm), pl.ds(k * bk, bk)], masks[r])
            out.append(acc + jnp.dot(xs, ws, precision=lax.Precision.HIGHEST,
                                     preferred_element_type=jnp.float32))
        return tuple(out)

    zeros = tuple(jnp.zeros((bm, bn), jnp.float32) for _ in range(g))
    return lax.fori_loop(0, nk, step, zeros)


def _store_rows(ref, val, mask):
    """Stores val [bm, bn] into ref's block, skipping rows past the array's end."""
    if mask is None:
        ref[...] = val
    else:
        plgpu.store(ref, val, mask=mask)


def _matmul_rows_kernel(x_ref, w_ref, o_ref, *, bm: int, bk: int, nk: int, g: int,
                        m: int | None = None):
    # x_ref [g * bm, Kp], w_ref [Kp, bn], o_ref [g * bm, bn]
    first = pl.program_id(0) * (g * bm)
    bn = o_ref.shape[1]
    accs = _k_loop_rows(x_ref, w_ref, bm=bm, bk=bk, nk=nk, g=g, first_row=first, m=m)
    for r, acc in enumerate(accs):
        _store_rows(o_ref.at[pl.ds(r * bm, bm), :], acc.astype(o_ref.dtype),
                    _row_mask(first + r * bm, bm, m, bn))


def row_group_size(tiles: int, row_group: int) -> int:
    """Row tiles per program: the fewest programs of at most row_group tiles each, with
    the tiles spread evenly over them (cdiv(tiles, cdiv(tiles, row_group))). The last
    program may hold fewer real tiles: its tiles past the rows are masked (read as
    zeros, never stored), so every weight block is read once per program either way."""
    if row_group < 1:
        raise ValueError(f"row_group must be >= 1; got {row_group}")
    return -(-tiles // -(-tiles // row_group))


def _matmul_kernel(x_ref, w_ref, o_ref, *, bk: int, nk: int, m: int | None = None):
    # x_ref [bm, Kp] (split: [bm, Kp / s]), w_ref [Kp, bn] (split: [Kp / s, bn]),
    # o_ref [bm, bn]: the tile itself, or chunk c's f32 partial of it. m: rows that
    # exist (the unsplit kernel's last row tile may reach past them; None: all do).
    bm, bn = o_ref.shape[-2], o_ref.shape[-1]
    first = pl.program_id(0) * bm
    acc = _k_loop(x_ref, w_ref, bk=bk, nk=nk, first_row=first, m=m)
    _store_rows(o_ref, acc.astype(o_ref.dtype), _row_mask(first, bm, m, bn))


def _combine_kernel(p_ref, o_ref, *, splits: int):
    # p_ref [s, bm, bn] f32 partials, o_ref [bm, bn]: ((p0 + p1) + p2) + ..., unrolled.
    acc = p_ref[0]
    for c in range(1, splits):
        acc = acc + p_ref[c]
    o_ref[...] = acc.astype(o_ref.dtype)


def _check_shapes(x: jax.Array, w: jax.Array) -> None:
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"matmul wants x [M, K] and w [K, N]; got {x.shape=} {w.shape=}")
    if x.dtype != w.dtype:
        raise ValueError(f"matmul wants x and w of one dtype; got {x.dtype=} {w.dtype=}")
    check_float("x", x)


def k_tile_ok(cfg: MatmulConfig, bk: int, K: int) -> bool:
    """Whether a schedule may run cfg's [K, N] weight with K tile bk: the same bk, or
    (split_k == 1) another that divides K where cfg's does too (no zero padding either
    way, so the same terms in the same order)."""
    return bk == cfg.bk or (cfg.split_k == 1 and K % bk == 0 and K % cfg.bk == 0)


def check_k_tile(cfg: MatmulConfig, bk: int, K: int) -> None:
    """ValueError unless `k_tile_ok`."""
    if not k_tile_ok(cfg, bk, K):
        raise ValueError(f"a schedule may change bk only where the config does not split K "
                         f"and both K tiles divide K={K}; got bk={bk} for {cfg}")


def multi_tile_config(cfg: MatmulConfig, K: int, N: int, dtype,
                      table: dict | None = None) -> MatmulConfig:
    """`cfg` with the overrides of a [K, N] weight in `table` (default MULTI_TILE;
    scheduling fields only)."""
    table = MULTI_TILE if table is None else table
    over = dict(table.get((K, N, jnp.dtype(dtype).name), {}))
    over.pop(ROW_GROUP_FIELD, None)  # which program computes a tile: `scheduled` reads it
    if set(over) - set(SCHEDULE_FIELDS):
        raise ValueError(f"multi-tile overrides of {(K, N)} may set only {SCHEDULE_FIELDS}; "
                         f"got {over}")
    check_k_tile(cfg, over.get("bk", cfg.bk), K)
    return dataclasses.replace(cfg, **over)


def prefill_rule(cfg: MatmulConfig, K: int, N: int, cols: int | None = None
                 ) -> dict[str, int]:
    """The schedule of a launch of more than PREFILL_ROWS rows where the weight has no
    PREFILL_TILE entry: 128 x 128 output tiles over 64-wide K steps, 8 warps, 3 stages
    (a compute-bound GEMM's tile; bn halved until it divides `cols`, default N: the GLU
    kernel passes F, its halves' width). {} (the tall or multi-tile schedule) where the
    K tile of 64 may not replace the config's (`k_tile_ok`)."""
    if cfg.split_k != 1 or not k_tile_ok(cfg, 64, K):
        return {}
    cols = N if cols is None else cols
    bn = 128
    while cols % bn and bn > 16:
        bn //= 2
    return {"bm": 128, "bn": bn, "bk": 64, "num_warps": 8, "num_stages": 3}


def scheduled_row_group(base_bm: int, bm: int, row_group: int) -> int:
    """Row tiles a program may hold under a schedule's row tile bm: a program holds at
    most row_group x base_bm rows (its shared memory), as without the schedule."""
    return max(1, row_group * base_bm // bm)


def scheduled(cfg: MatmulConfig, m: int, K: int, N: int, dtype, row_group: int,
              table: dict | None = None, tall: dict | None = None,
              prefill: dict | None = None, cols: int | None = None
              ) -> tuple[MatmulConfig, int]:
    """(config, row_group) of a launch of m rows under the multi-tile schedules: cfg
    itself when m fits one of cfg's row tiles; when m > PREFILL_ROWS the `prefill`
    table's overrides (default PREFILL_TILE) or else `prefill_rule`'s; when m > TALL_ROWS
    the `tall` table's (default TALL_TILE) where the weight has an entry; else the
    `table`'s (default MULTI_TILE). Scheduling fields only: on the GPU the bits are cfg's
    whatever m is. The row group is the picked entry's `row_group` (at most the caller's
    row_group), else `scheduled_row_group`. cols: the columns a column tile must divide
    (the GLU kernel: F). The rule applies to 2-byte weights only (its tile was proven and
    fits for bf16)."""
    if round_up(m, cfg.bm) <= cfg.bm:
        return cfg, row_group
    table = MULTI_TILE if table is None else table
    tall = TALL_TILE if tall is None else tall
    prefill = PREFILL_TILE if prefill is None else prefill
    key = (K, N, jnp.dtype(dtype).name)
    # The rule's tile is proven for 2-byte weights (f32 ones take the tables' schedules).
    rule = m > PREFILL_ROWS and jnp.dtype(dtype).itemsize == 2 and prefill_rule(cfg, K, N, cols)
    if m > PREFILL_ROWS and key in prefill:
        pick = prefill
    elif rule:
        pick = {key: rule}
    elif m > TALL_ROWS and key in tall:
        pick = tall
    else:
        pick = table
    out = multi_tile_config(cfg, K, N, dtype, pick)
    group = pick.get(key, {}).get(ROW_GROUP_FIELD)
    if group is not None:
        return out, min(group, row_group)
    if cfg.split_k > 1:  # a split launch groups rows only where its entry says so
        return out, 1
    return out, scheduled_row_group(cfg.bm, out.bm, row_group)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "config", "row_group",
                                             "schedule"))
def matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    out_dtype=None,
    interpret: bool = False,
    config: MatmulConfig | None = None,
    row_group: int = 1,
    schedule: bool = False,
) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in out_dtype (default float32).

    `config` overrides `matmul_config(K, N, ...)` (the model never passes it; the
    tuning sweep and the tests do). Any fixed config is row-invariant, but two
    configs give different bits, so one weight must always use one config.
    `row_group` > 1 lets one program compute up to that many row tiles, each weight
    block loaded once for them (a split config: with `config` given, or a schedule
    entry's row_group); the bits do not change.
    `schedule` lets a launch of more than one row tile take the overrides of its tier
    (`scheduled`: MULTI_TILE, TALL_TILE, PREFILL_TILE or `prefill_rule`; the row tile,
    column tile, K tile, warps and stages: scheduling only on the GPU).
    """
    check_out_dtype("matmul", out_dtype)
    _check_shapes(x, w)
    out_dtype = jnp.dtype(jnp.float32 if out_dtype is None else out_dtype)
    m, k = x.shape
    n = w.shape[1]
    cfg = matmul_config(k, n, w.dtype, interpret) if config is None else config
    s = cfg.split_k
    split_group = row_group if config is not None else 1  # see the module docstring

    # Zero padding: extra K terms add exact zeros at the end of the (last chunk's)
    # sum; extra columns (and split-K's extra rows) are sliced away.
    if schedule and config is None and not interpret:
        cfg, row_group = scheduled(cfg, m, k, n, w.dtype, row_group)
        split_group = row_group  # 1 for a split config unless its entry names a group
    kp = round_up(k, s * cfg.bk)
    kc = kp // s  # K elements per chunk
    wp = pad_axis(pad_axis(w, 0, kp), 1, round_up(n, cfg.bn))  # [Kp, Np]
    np_ = wp.shape[1]
    params = triton_params(cfg.num_warps, cfg.num_stages)

    if s == 1:
        # Rows are not padded: the last row tile masks the rows past M (read as zeros,
        # not stored), which is the zero-padded tile's arithmetic without its copy.
        xp = pad_axis(x, 1, kp)  # [M, Kp]
        tiles = -(-m // cfg.bm)
        g = row_group_size(tiles, row_group)
        rows = g * cfg.bm  # rows per program: g row tiles (1: the grid kernel)
        ragged = m if m % rows else None  # the last program reaches past the rows
        if g > 1:
            kernel = functools.partial(_matmul_rows_kernel, bm=cfg.bm, bk=cfg.bk,
                                       nk=kc // cfg.bk, g=g, m=ragged)
        else:
            kernel = functools.partial(_matmul_kernel, bk=cfg.bk, nk=kc // cfg.bk, m=ragged)
        out = pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((m, np_), out_dtype),
            grid=(-(-tiles // g), np_ // cfg.bn),
            in_specs=[
                pl.BlockSpec((rows, kp), lambda i, j: (i, 0)),
                pl.BlockSpec((kp, cfg.bn), lambda i, j: (0, j)),
            ],
            out_specs=pl.BlockSpec((rows, cfg.bn), lambda i, j: (i, j)),
            compiler_params=params,
            interpret=interpret,
            name="jspec_matmul" if g == 1 else "jspec_matmul_rows",
        )(xp, wp)
        return out[:, :n]

    g = row_group_size(-(-m // cfg.bm), split_group)
    xp = pad_rows(pad_axis(x, 1, kp), g * cfg.bm)  # [Mp, Kp]: whole programs of g tiles
    mp = xp.shape[0]
    partials = _chunk_partials(xp, wp, cfg, s, kc, interpret, "jspec_matmul_splitk", g)
    # The combine is elementwise, so its column tile only sets the launch size.
    bnc = pow2_tile(np_, cfg.bn, max(cfg.bn, 1024))
    out = pl.pallas_call(
        functools.partial(_combine_kernel, splits=s),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // cfg.bm, np_ // bnc),
        in_specs=[pl.BlockSpec((s, cfg.bm, bnc), lambda i, j: (0, i, j))],
        out_specs=pl.BlockSpec((cfg.bm, bnc), lambda i, j: (i, j)),
        compiler_params=triton_params(4, 1),
        interpret=interpret,
        name="jspec_matmul_combine",
    )(partials)
    return out[:m, :n]


def matmul_partials(x: jax.Array, w: jax.Array, *, splits: int, interpret: bool = False,
                    config: MatmulConfig | None = None) -> jax.Array:
    """x [M, K] @ w [K, N] as `splits` f32 partials [splits, M, N], NOT summed: partial c
    is x[:, cK:(c+1)K] @ w[cK:(c+1)K] over the c-th of `splits` equal K chunks (K/splits
    each), each a sequential f32 K loop exactly as `matmul` runs it with
    `config` (default `matmul_config(K / splits, N)` without its split), zero-padded at
    the chunk's end. A caller adds the partials left to right, with others from other
    devices in between (row-parallel tensor parallelism): the chunk boundaries and each
    chunk's arithmetic are the same however the chunks are spread over devices."""
    _check_shapes(x, w)
    m, k = x.shape
    n = w.shape[1]
    if splits < 1 or k % splits:
        raise ValueError(f"matmul_partials: K={k} must split into {splits=} equal chunks")
    kc = k // splits
    cfg = config or dataclasses.replace(matmul_config(kc, n, w.dtype, interpret), split_k=1)
    kcp = round_up(kc, cfg.bk)  # each chunk padded at its own end
    xs = pad_axis(x.reshape(m, splits, kc), 2, kcp).reshape(m, splits * kcp)
    ws = pad_axis(w.reshape(splits, kc, n), 1, kcp).reshape(splits * kcp, n)
    xp = pad_rows(xs, cfg.bm)  # [Mp, s * Kcp]
    wp = pad_axis(ws, 1, round_up(n, cfg.bn))  # [s * Kcp, Np]
    partials = _chunk_partials(xp, wp, cfg, splits, kcp, interpret, "jspec_matmul_partials")
    return partials[:, :m, :n]


def _chunk_partials(xp, wp, cfg: MatmulConfig, chunks: int, kc: int, interpret: bool,
                    name: str, g: int = 1):
    """xp [Mp, chunks * kc] @ wp [chunks * kc, Np] as `chunks` f32 partials [chunks, Mp,
    Np]: partial c is the sequential K loop over the c-th kc-wide chunk (split-K's first
    kernel, and `matmul_partials`). g: row tiles a program (Mp a multiple of g * bm), each
    of the chunk's weight blocks loaded once for them (`_k_loop_rows`: the same sums)."""
    mp, np_ = xp.shape[0], wp.shape[1]
    rows = g * cfg.bm
    if g > 1:
        kernel = functools.partial(_matmul_rows_kernel, bm=cfg.bm, bk=cfg.bk, nk=kc // cfg.bk,
                                   g=g)
    else:
        kernel = functools.partial(_matmul_kernel, bk=cfg.bk, nk=kc // cfg.bk)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((chunks, mp, np_), jnp.float32),
        grid=(mp // rows, np_ // cfg.bn, chunks),
        in_specs=[
            pl.BlockSpec((rows, kc), lambda i, j, c: (i, c)),
            pl.BlockSpec((kc, cfg.bn), lambda i, j, c: (c, j)),
        ],
        out_specs=pl.BlockSpec((None, rows, cfg.bn), lambda i, j, c: (c, i, j)),
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=name,
    )(xp, wp)


def matmul_partials_reference(x: jax.Array, w: jax.Array, *, splits: int,
                              config=None) -> jax.Array:
    """Plain jnp: the same chunks' products with f32 accumulation (NOT row-invariant)."""
    del config
    m, k = x.shape
    kc = k // splits
    return jnp.stack([matmul_reference(x[:, c * kc:(c + 1) * kc], w[c * kc:(c + 1) * kc])
                      for c in range(splits)])


def add_partials(parts: jax.Array, out_dtype) -> jax.Array:
    """[S, M, N] f32 partials -> ((p0 + p1) + p2) + ... in out_dtype: left to right,
    written as S - 1 dependent adds (XLA keeps the order of float adds)."""
    acc = parts[0]
    for i in range(1, parts.shape[0]):
        acc = acc + parts[i]
    return acc.astype(out_dtype)


def matmul_reference(x: jax.Array, w: jax.Array, *, out_dtype=None,
                     row_group: int = 1, schedule: bool = False, config=None) -> jax.Array:
    """XLA's own dot with f32 accumulation (NOT row-invariant; the `xla` backend).

    bf16 operands take XLA's native bf16 path, as any JAX model would; f32
    operands ask for full f32 products so the tolerance checks stay tight.

    On a GPU a single row is computed as two (the second a zero row, sliced away):
    XLA's GPU simplifier rewrites a one-row dot whose operands hold fewer than 10M
    elements into a multiply and a reduce ("dot strength reduction"), which is far
    slower than a GEMM kernel (docs/tuning.md: what it cost a Qwen3-0.6B decode step).
    """
    del row_group, schedule, config  # the kernel's tiling knobs; nothing to tile here
    out_dtype = jnp.float32 if out_dtype is None else out_dtype
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None

    def dot(x):
        return dot_f32(jnp.dot, x, w, precision=precision)

    def two_rows(x):  # [1, K] -> [1, N] through a [2, K] GEMM
        return dot(jnp.pad(x, ((0, 1), (0, 0))))[:1]

    if x.ndim == 2 and x.shape[0] == 1:
        y = lax.platform_dependent(x, cuda=two_rows, rocm=two_rows, default=dot)
    else:
        y = dot(x)
    return y.astype(out_dtype)
