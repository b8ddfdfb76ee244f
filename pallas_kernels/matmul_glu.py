"""The gate/up projection and the GLU in one row-invariant kernel.

jspec keeps the MLP's gate and up weights fused as w [K, 2F] (gate columns first).
Unfused, the MLP runs `matmul(x, w)` [M, 2F], splits it, and runs `glu`: two
kernels with a split and pads between them. Here program (i, j) computes the
gate tile j and the up tile j of rows block i, each with exactly the K loop of
`matmul` (the same tiles, `matmul_config(K, 2F)`, the same sequential order, one
loop after the other), rounds both to the dtype as `matmul` does, and applies
the GLU arithmetic of `glu`, so the result equals `glu(matmul(x, w) split)`
bit for bit on the CPU (tests/test_matmul_glu.py). Weight shapes whose tuned
config splits K, or whose F is not a multiple of the column tile, use the
unfused path (the same bits by definition).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import pad_axis, round_up, triton_params
from pallas_kernels.glu import ACTIVATIONS, _activation, glu, glu_reference, gpt_oss_glu
from pallas_kernels.matmul import (
    TUNED_FILE,
    _check_shapes,
    _k_loop,
    _k_loop_rows,
    _row_mask,
    _store_rows,
    matmul,
    matmul_config,
    matmul_reference,
    parse_schedules,
    read_tuned_file,
    row_group_size,
    scheduled,
)

# Scheduling overrides of this kernel for launches of more than one row tile
# (`schedule=True`), keyed like `matmul.MULTI_TILE` by the fused weight [K, 2F]: the
# kernel runs two K loops a program, so its best warps / stages / column tile are its
# own. Scheduling fields only (see matmul.SCHEDULE_FIELDS).
# Read from matmul_tuned.json ("multi_tile_glu").
_TABLES = read_tuned_file()
MULTI_TILE_GLU: dict[tuple[int, int, str], dict[str, int]] = parse_schedules(
    _TABLES["multi_tile_glu"], TUNED_FILE)
# Launches of more than matmul.TALL_ROWS rows: this kernel's tall overrides
# ("tall_tile_glu"; see matmul.TALL_TILE); of more than matmul.PREFILL_ROWS, its prefill
# overrides ("prefill_tile_glu"; else `matmul.prefill_rule` with bn dividing F).
TALL_TILE_GLU: dict[tuple[int, int, str], dict[str, int]] = parse_schedules(
    _TABLES.get("tall_tile_glu", []), TUNED_FILE)
PREFILL_TILE_GLU: dict[tuple[int, int, str], dict[str, int]] = parse_schedules(
    _TABLES.get("prefill_tile_glu", []), TUNED_FILE)


def _kernel(x_ref, wg_ref, wu_ref, o_ref, *, bk: int, nk: int, activation: str,
            m: int | None = None):
    # x_ref [bm, Kp]; wg_ref, wu_ref [Kp, bn] (gate and up columns of tile j); o_ref [bm, bn].
    # m: rows that exist (the last row tile may reach past them; None: all do).
    dtype = o_ref.dtype
    bm, bn = o_ref.shape
    first = pl.program_id(0) * bm
    gate = _k_loop(x_ref, wg_ref, bk=bk, nk=nk, first_row=first, m=m).astype(dtype)
    up = _k_loop(x_ref, wu_ref, bk=bk, nk=nk, first_row=first, m=m).astype(dtype)
    _store_rows(o_ref, _glu_tile(gate, up, activation), _row_mask(first, bm, m, bn))


def _glu_tile(gate, up, activation: str):
    """`glu`'s arithmetic on one tile of gate and up already rounded to the dtype."""
    dtype = gate.dtype
    if activation == "gpt_oss":
        return gpt_oss_glu(gate.astype(jnp.float32), up.astype(jnp.float32), dtype).astype(dtype)
    act = _activation(gate.astype(jnp.float32), activation).astype(dtype).astype(jnp.float32)
    return (act * up.astype(jnp.float32)).astype(dtype)


def _rows_kernel(x_ref, wg_ref, wu_ref, o_ref, *, bm: int, bk: int, nk: int, g: int,
                 activation: str, m: int | None = None):
    # x_ref [g * bm, Kp]; wg_ref, wu_ref [Kp, bn]; o_ref [g * bm, bn]: `_kernel` for g
    # row tiles at once, each weight block loaded once for all of them.
    first = pl.program_id(0) * (g * bm)
    bn = o_ref.shape[1]
    gates = _k_loop_rows(x_ref, wg_ref, bm=bm, bk=bk, nk=nk, g=g, first_row=first, m=m)
    ups = _k_loop_rows(x_ref, wu_ref, bm=bm, bk=bk, nk=nk, g=g, first_row=first, m=m)
    dtype = o_ref.dtype
    for r, (gate, up) in enumerate(zip(gates, ups, strict=True)):
        _store_rows(o_ref.at[pl.ds(r * bm, bm), :],
                    _glu_tile(gate.astype(dtype), up.astype(dtype), activation),
                    _row_mask(first + r * bm, bm, m, bn))


def fusable(K: int, F: int, dtype, interpret: bool) -> bool:
    """Whether [K, 2F] runs fused (else `matmul_glu` takes the unfused path)."""
    cfg = matmul_config(K, 2 * F, dtype, interpret)
    return cfg.split_k == 1 and F % cfg.bn == 0


def check_glu_weight(w: jax.Array, activation: str) -> None:
    """ValueError unless w is [K, 2F] (gate, then up) and the activation is known."""
    if w.shape[1] % 2:
        raise ValueError(f"matmul_glu wants w [K, 2F] (gate, then up); got {w.shape=}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"matmul_glu activation must be one of {ACTIVATIONS}; got "
                         f"{activation=}")


@functools.partial(jax.jit, static_argnames=("activation", "interpret", "row_group",
                                             "config", "schedule"))
def matmul_glu(x: jax.Array, w: jax.Array, *, activation: str,
               interpret: bool = False, row_group: int = 1, config=None,
               schedule: bool = False) -> jax.Array:
    """act(x @ w[:, :F]) * (x @ w[:, F:]) for x [M, K], w [K, 2F]; returns x.dtype.
    `row_group` as in `matmul` (scheduling only, the same bits). `config` overrides
    `matmul_config(K, 2F)` (sweeps and tests; it must not split K); `schedule` lets a
    launch of more than one row tile take its tier's overrides (MULTI_TILE_GLU,
    TALL_TILE_GLU, PREFILL_TILE_GLU or `matmul.prefill_rule`)."""
    _check_shapes(x, w)
    check_glu_weight(w, activation)
    m, k = x.shape
    f = w.shape[1] // 2
    if config is None and not fusable(k, f, w.dtype, interpret):
        gate, up = jnp.split(matmul(x, w, out_dtype=x.dtype, interpret=interpret,
                                    row_group=row_group, schedule=schedule), 2, axis=-1)
        return glu(gate, up, activation=activation, interpret=interpret)
    cfg = matmul_config(k, 2 * f, w.dtype, interpret) if config is None else config
    if schedule and config is None and not interpret:
        cfg, row_group = scheduled(cfg, m, k, 2 * f, w.dtype, row_group, MULTI_TILE_GLU,
                                   TALL_TILE_GLU, PREFILL_TILE_GLU, cols=f)
    if cfg.split_k != 1 or f % cfg.bn:
        raise ValueError(f"matmul_glu config must not split K and its bn must divide "
                         f"F={f}; got {cfg}")
    kp = round_up(k, cfg.bk)
    # Rows are not padded: tiles past M are masked (read as zeros, not stored), as in
    # `matmul`, which is the zero-padded tile's arithmetic without its copy.
    xp = pad_axis(x, 1, kp)  # [M, Kp]
    wp = pad_axis(w, 0, kp)  # [Kp, 2F]
    nf = f // cfg.bn  # column tiles of the gate half
    tiles = -(-m // cfg.bm)
    g = row_group_size(tiles, row_group)
    rows = g * cfg.bm  # rows per program: g row tiles (1: the grid kernel)
    ragged = m if m % rows else None  # the last program reaches past the rows
    if g == 1:
        kernel = functools.partial(_kernel, bk=cfg.bk, nk=kp // cfg.bk, activation=activation,
                                   m=ragged)
    else:
        kernel = functools.partial(_rows_kernel, bm=cfg.bm, bk=cfg.bk, nk=kp // cfg.bk, g=g,
                                   activation=activation, m=ragged)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, f), x.dtype),
        grid=(-(-tiles // g), nf),
        in_specs=[
            pl.BlockSpec((rows, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((kp, cfg.bn), lambda i, j: (0, j)),  # gate columns
            pl.BlockSpec((kp, cfg.bn), lambda i, j: (0, j + nf)),  # up columns
        ],
        out_specs=pl.BlockSpec((rows, cfg.bn), lambda i, j: (i, j)),
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="jspec_matmul_glu" if g == 1 else "jspec_matmul_glu_rows",
    )(xp, wp, wp)
    return out


def matmul_glu_reference(x: jax.Array, w: jax.Array, *, activation: str,
                         row_group: int = 1, schedule: bool = False,
                         config=None) -> jax.Array:
    """Plain jnp: the reference matmul rounded to x.dtype, split, the reference GLU."""
    del row_group, schedule, config
    gate, up = jnp.split(matmul_reference(x, w, out_dtype=x.dtype), 2, axis=-1)
    return glu_reference(gate, up, activation=activation)
