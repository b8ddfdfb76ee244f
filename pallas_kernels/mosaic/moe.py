"""Mixture-of-experts grouped matmuls on Mosaic GPU (rule R9 on the R11 lowering).

The Mosaic GPU lowering of `pallas_kernels/moe.py`'s grouped kernels, whose docstring
says what R9 asks; the layout (`tile_layout`: a counting sort in integer arithmetic,
exact) and the combine (`combine`: left to right in f32) are that module's, the routing
`mosaic/route.py`'s, so a mixture of experts on this lowering runs no Triton kernel.

The rows are laid out by expert in tiles of 16 slots (one wgmma N), each expert's rows in
whole tiles, the group's last tile padded with empty slots, so no tile mixes two
experts. A plain gather puts each slot's row in place (empty slots: zero rows). One
program per (tile, 64 weight columns) reads its tile's expert id from memory and runs the
swapped design of `mosaic/matmul.py` (`_kernel_swapped`: acc [64, 16] = w block^T @
x block^T) over that expert's weight, K walked from 0 upward in bk-wide steps: a slot's
column of the product is the same sum in the same order whatever the other slots hold,
which expert's tile it sits in or how many tiles there are, as for `matmul`'s swapped
design (the claim the device checks for that design: `tuning/mosaic_matmul.py
--swapped`). Tiles past the used ones (expert id -1) do nothing; their outputs are never
read. The configuration (`grouped_config`) is a function of the weight shape only
(bk the largest of 128 and 64 dividing K, else K padded to 64 with exact zeros):
the tile count and the routing change only the grid (R1).

`grouped_matmul_glu` runs the gate and up column blocks of a tile in one program (two
accumulators) and applies `matmul_glu`'s GLU arithmetic to the two rounded tiles, as
`mosaic.matmul_glu` does. f32 outputs are stored column-major, as the accumulators lie,
and transposed back (Mosaic GPU has no layout for an f32 tile's transposed store).

Expert biases (gpt-oss; `bias` [E, N]): the program loads its expert's 64 bias entries
of each column block it runs straight from memory, one per accumulator row, and adds them
to the f32 accumulator in the epilogue, before the rounding and the GLU (as the Triton
kernels do); without a bias nothing is loaded or added.

Only 16-bit operands (bf16, f16), as for `mosaic.matmul`. The two lowerings' bits differ
(R11); each is row-invariant on its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import pad_axis, round_up
from pallas_kernels.glu import ACTIVATIONS
from pallas_kernels.matmul_glu import _glu_tile
from pallas_kernels.moe import (
    _check_grouped,
    check_bias,
    check_combine_weights,
    check_mlp,
    tile_layout,
    token_layout,
)
from pallas_kernels.mosaic.matmul import (
    BM,
    BT,
    DTYPES,
    MAX_STAGES,
    MosaicMatmulConfig,
    _kernel_swapped,
)
from pallas_kernels.route import combine

__all__ = ["grouped_config", "grouped_matmul", "grouped_matmul_glu", "grouped_mlp",
           "grouped_mlp_combine"]


def grouped_config(E: int, K: int, N: int, dtype) -> MosaicMatmulConfig:
    """The swapped design's tiles for an [E, K, N] expert weight; deliberately takes no
    row count: bn 64 (the wgmma M), bk the largest of 128 and 64 dividing K (else 64,
    K padded with zeros), one 16-slot tile a program, MAX_STAGES pipeline steps."""
    del E, N, dtype  # the rule needs K only; kept so a table may key on the whole shape
    bk = 128 if K % 128 == 0 else 64
    return MosaicMatmulConfig(bn=BM, bk=bk, stages=MAX_STAGES, swapped=True, token_tiles=1)


def _check(x: jax.Array, w: jax.Array, expert: jax.Array, name: str) -> None:
    _check_grouped(x, w, expert)
    _check_16bit(x, name)


def _check_16bit(x: jax.Array, name: str) -> None:
    if x.dtype.name not in DTYPES:
        raise TypeError(f"{name} (Mosaic GPU) wants 16-bit x and w in {DTYPES} (an f32 "
                        f"wgmma multiplies in TF32); got {x.dtype=}")


def _bias_rows(b_gmem, e, block) -> jax.Array:
    """[64, 16] f32: expert e's bias entries of the weight's column block `block` (one per
    accumulator row of the swapped design), in every token column."""
    b = plgpu.load(b_gmem.at[e, pl.ds(block * BM, BM)], layout=plgpu.Layout.WGMMA.reduce(1),
                   optimized=False)  # [64]
    return lax.broadcast_in_dim(b.astype(jnp.float32), (BM, BT), [0])


def _grouped_kernel(te_gmem, x_gmem, w_gmem, *refs, o_smem, cfg: MosaicMatmulConfig,
                    nk: int, column_offsets: tuple[int, ...], epilogue, columns_major: bool):
    # te_gmem [T] int32: each tile's expert (-1: unused); x_gmem [T 16, Kp] the slots' rows;
    # w_gmem [E, Kp, Np]; refs: o_gmem [T 16, N'] (columns_major: [N', T 16]), after
    # b_gmem [E, Np] with a bias.
    *b_gmem, o_gmem = refs
    e = te_gmem[lax.axis_index("m")]

    @pl.when(e >= 0)
    def _():
        epi = epilogue
        if b_gmem:  # each accumulator (column offset c) plus its bias rows, in f32
            j = lax.axis_index("n")

            def epi(*accs):
                return epilogue(*(acc + _bias_rows(b_gmem[0], e, j + c)
                                  for acc, c in zip(accs, column_offsets, strict=True)))

        _kernel_swapped(x_gmem, w_gmem.at[e], o_gmem, o_smem, cfg=cfg, nk=nk, tiles=1,
                        column_offsets=column_offsets, epilogue=epi,
                        columns_major=columns_major)


def _launch_sorted(xs, w, tile_expert, cfg: MosaicMatmulConfig, n_out: int, out_dtype,
                   column_offsets: tuple[int, ...], epilogue, interpret: bool, name: str,
                   bias=None):
    """The kernel over tiles x (n_out / 64) column blocks of slot-ordered rows xs
    [T 16, K] (T = tile_expert's length) and w [E, K, N] (bias [E, N] or None) ->
    [T 16, n_out], slot order."""
    T, K = tile_expert.shape[0], xs.shape[1]
    kp = round_up(K, cfg.bk)  # extra K terms add exact zeros at the end of the sum
    xp = pad_axis(xs, 1, kp)
    wp = pad_axis(pad_axis(w, 1, kp), 2, round_up(w.shape[2], BM))
    out_dtype = jnp.dtype(out_dtype)
    columns_major = out_dtype.itemsize != 2
    kernel = functools.partial(_grouped_kernel, cfg=cfg, nk=kp // cfg.bk,
                               column_offsets=column_offsets, epilogue=epilogue,
                               columns_major=columns_major)
    o_tile, out_shape = (BT, BM), (T * BT, n_out)
    if columns_major:
        o_tile, out_shape = (BM, BT), (n_out, T * BT)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        scratch_types=dict(o_smem=plgpu.SMEM(o_tile, out_dtype)),
        grid=(T, n_out // BM),
        grid_names=("m", "n"),
        kernel_name=name,
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(tile_expert.astype(jnp.int32), xp, wp,
      *([] if bias is None else [pad_axis(bias, 1, wp.shape[2])]))
    return out.T if columns_major else out


def _slot_rows(x: jax.Array, src: jax.Array, row_div: int = 1) -> jax.Array:
    """[S, K]: slot s holds x row src[s] // row_div, or zeros where src[s] is -1."""
    rows = x[jnp.maximum(src, 0) // row_div]
    return jnp.where((src >= 0)[:, None], rows, jnp.zeros_like(rows))


def _layout(expert: jax.Array, E: int):
    return tile_layout(expert.astype(jnp.int32), E, BT)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "config",
                                             "table_experts"))
def grouped_matmul(x: jax.Array, w: jax.Array, expert: jax.Array, *, out_dtype,
                   bias: jax.Array | None = None, interpret: bool = False,
                   config: MosaicMatmulConfig | None = None,
                   table_experts: int | None = None) -> jax.Array:
    """x [R, K] @ w[expert] (+ bias[expert]) -> [R, N] in out_dtype (None: float32), on
    Mosaic GPU: row r is x[r] @ w[expert[r]], K reduced from 0 upward in an f32
    accumulator, plus the expert's bias row in f32 (bias [E, N] or None), bitwise
    independent of the other rows and of which share its expert (R9). w [E, K, N] in
    x's 16-bit dtype; expert [R] integer in [0, E). `config` overrides `grouped_config`
    (a swapped design of one token tile a program); `table_experts`: the E whose config
    to take where w holds some of a model's experts gathered (`jspec.mxfp4`)."""
    _check(x, w, expert, "grouped_matmul")
    check_bias(bias, w, "grouped_matmul")
    out_dtype = jnp.dtype(jnp.float32 if out_dtype is None else out_dtype)
    E, K, N = w.shape
    if x.shape[0] == 0:
        return jnp.zeros((0, N), out_dtype)
    cfg = config or grouped_config(table_experts or E, K, N, w.dtype)
    dest, tile_expert, src = _layout(expert, E)
    out = _launch_sorted(_slot_rows(x, src), w, tile_expert, cfg, round_up(N, BM), out_dtype,
                         (0,), lambda acc: acc.astype(out_dtype), interpret,
                         "jspec_mosaic_grouped_matmul", bias=bias)
    return out[dest, :N]


def _glu_epilogue(dtype, activation: str):
    def epilogue(gate, up):  # [64, 16] f32 each, rounded to the dtype as `matmul` does
        return _glu_tile(gate.astype(dtype), up.astype(dtype), activation)
    return epilogue


def _check_glu(w: jax.Array, activation: str, name: str) -> int:
    if w.shape[2] % 2:
        raise ValueError(f"{name} wants w [E, K, 2F] (gate, then up); got {w.shape=}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{name} activation must be one of {ACTIVATIONS}; got "
                         f"{activation=}")
    return w.shape[2] // 2


@functools.partial(jax.jit, static_argnames=("activation", "interpret", "config",
                                             "table_experts"))
def grouped_matmul_glu(x: jax.Array, w: jax.Array, expert: jax.Array, *, activation: str,
                       bias: jax.Array | None = None, interpret: bool = False,
                       config: MosaicMatmulConfig | None = None,
                       table_experts: int | None = None) -> jax.Array:
    """act(x[r] @ w[e][:, :F]) * (x[r] @ w[e][:, F:]) for e = expert[r] on Mosaic GPU:
    x [R, K], w [E, K, 2F] (gate columns first), bias [E, 2F] or None -> [R, F] x.dtype:
    `matmul_glu`'s GLU arithmetic on `grouped_matmul(x, w, expert, out_dtype=x.dtype,
    bias=bias)`'s halves (the same tiles and K order), in one kernel. F must be a
    multiple of 64; `table_experts` as `grouped_matmul`'s."""
    _check(x, w, expert, "grouped_matmul_glu")
    check_bias(bias, w, "grouped_matmul_glu")
    F = _check_glu(w, activation, "grouped_matmul_glu")
    if F % BM:
        raise ValueError(f"grouped_matmul_glu (Mosaic GPU): F={F} must be a multiple of "
                         f"{BM} (the swapped design's column block)")
    if x.shape[0] == 0:
        return jnp.zeros((0, F), x.dtype)
    E, K = w.shape[:2]
    cfg = config or grouped_config(table_experts or E, K, 2 * F, w.dtype)
    dest, tile_expert, src = _layout(expert, E)
    out = _launch_sorted(_slot_rows(x, src), w, tile_expert, cfg, F, x.dtype, (0, F // BM),
                         _glu_epilogue(x.dtype, activation), interpret,
                         "jspec_mosaic_grouped_matmul_glu", bias=bias)
    return out[dest]


def _mlp_slots(x, w_gate_up, w_down, expert, b_gate_up, b_down, *, activation: str,
               interpret: bool):
    """(y [S, Dp] f32 in slot order, dest [M k]): one layout for both kernels
    (`token_layout` for one token); slot s of the gate/up kernel reads token row
    src[s] // k (the token's k routed copies read its one row), its output stays in slot
    order for the down kernel."""
    M, k, E, D, F = check_mlp(x, w_gate_up, w_down, expert, b_gate_up, b_down)
    _check_16bit(x, "grouped_mlp")
    _check_glu(w_gate_up, activation, "grouped_mlp")
    if F % BM:
        raise ValueError(f"grouped_mlp (Mosaic GPU): the expert width F={F} must be a "
                         f"multiple of {BM}")
    if M == 1:  # one token: a tile per routed row, no layout ops (the same bits)
        dest, tile_expert, src, _ = token_layout(expert, BT)
    else:
        dest, tile_expert, src = _layout(expert, E)
    a = _launch_sorted(_slot_rows(x, src, k), w_gate_up, tile_expert,
                       grouped_config(E, D, 2 * F, x.dtype), F, x.dtype, (0, F // BM),
                       _glu_epilogue(x.dtype, activation), interpret,
                       "jspec_mosaic_grouped_matmul_glu", bias=b_gate_up)  # [S, F]
    y = _launch_sorted(a, w_down, tile_expert, grouped_config(E, F, D, x.dtype),
                       round_up(D, BM), jnp.float32, (0,), lambda acc: acc, interpret,
                       "jspec_mosaic_grouped_matmul", bias=b_down)  # [S, Dp] f32
    return y, dest


@functools.partial(jax.jit, static_argnames=("activation", "interpret", "layout_kernel"))
def grouped_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, expert: jax.Array, *,
                activation: str, b_gate_up: jax.Array | None = None,
                b_down: jax.Array | None = None, interpret: bool = False,
                layout_kernel: bool = False) -> jax.Array:
    """A mixture of experts' expert MLPs on Mosaic GPU: x [M, D], expert [M k], w_gate_up
    [E, D, 2F], w_down [E, F, D] (biases [E, 2F], [E, D] or None) -> [M k, D] f32, bitwise
    `grouped_matmul(grouped_matmul_glu(repeat(x, k), w_gate_up, expert, bias=b_gate_up),
    w_down, expert, out_dtype=f32, bias=b_down)` (the same kernels, tiles and K loops),
    the rows laid out by expert
    once. `layout_kernel` (the Triton lowering's layout kernel) is accepted and unused:
    the layout is `tile_layout`'s few integer XLA ops."""
    del layout_kernel
    y, dest = _mlp_slots(x, w_gate_up, w_down, expert, b_gate_up, b_down,
                         activation=activation, interpret=interpret)
    return y[dest, :x.shape[1]]


@functools.partial(jax.jit, static_argnames=("activation", "rows_out", "interpret",
                                             "layout_kernel"))
def grouped_mlp_combine(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array,
                        expert: jax.Array, weights: jax.Array, *, activation: str,
                        rows_out: int, b_gate_up: jax.Array | None = None,
                        b_down: jax.Array | None = None, interpret: bool = False,
                        layout_kernel: bool = False) -> jax.Array:
    """`grouped_mlp`, then `combine` (a token's k outputs weighted and added left to right
    in f32), the cast to x.dtype and zero rows to rows_out: [rows_out, D]."""
    M, k = check_combine_weights(x, expert, weights)
    y = grouped_mlp(x, w_gate_up, w_down, expert, activation=activation, b_gate_up=b_gate_up,
                    b_down=b_down, interpret=interpret, layout_kernel=layout_kernel)
    out = combine(y.reshape(M, k, x.shape[1]), weights).astype(x.dtype)
    return pad_axis(out, 0, rows_out)
