"""Mixture-of-experts numerics: a row-invariant grouped matmul over the routed experts.

Rule R9 (docs/design.md): a token's router logits go through the invariant matmul; top-k
breaks ties by the lowest expert id; each expert's output for a row is a function of that
row and the expert's weights only, whatever other rows share the expert; a token's
weighted sum over its experts is formed in one fixed order in f32. Routing and the
combine are `pallas_kernels.route`'s; this file keeps the experts.
`tile_layout_kernel` is `tile_layout`'s counting sort in one program, for small blocks.

`grouped_matmul(x [R, K], w [E, K, N], expert [R])`: row r is x[r] @ w[expert[r]]. The
rows are laid out by expert (a counting sort in integer arithmetic: exact), each expert's
rows in whole row tiles of bm slots, the group's last tile padded with empty slots, so
no tile mixes two experts. One program per (row tile, column block) reads its tile's
expert id, gathers its rows of x (empty slots read as exact zeros) and walks K from 0
upward in bk-wide blocks into an f32 accumulator, reading only that expert's weight
blocks; the rows are then gathered back to their original order. The tiling (bm, bn,
bk, warps, stages) is `matmul_config(K, N)`'s without its split: a function of the
weight shape, dtype and interpret flag only (R1), never of R or of the routing. The tile
count is static, ceil(R / bm) + min(E, R) (an upper bound on the tiles the groups need);
the tiles past the used ones hold expert id -1 and do nothing (their outputs are never
read). So a row's result is one [bm, bk] x [bk, bn] dot per K step in a fixed order,
whatever slot and tile it lands in: as for `matmul`, a row's bits do not depend on the
other rows of its tile (interpret mode on the CPU and Triton's `tl.dot` on the GPU compute
each row of a fixed-shape tile the same way; the tests check it on the CPU, and run
compiled on the device with JSPEC_PALLAS_INTERPRET=0). A one-token step with k experts
reads k experts' weights, not E.

`grouped_matmul_glu(x, w [E, K, 2F], expert)` runs the gate and up column blocks of a
tile with that loop, rounds both to the dtype and applies `glu`'s arithmetic in the same
program: bitwise `glu` of `grouped_matmul`'s halves (as `matmul_glu` is of `matmul`).

Expert biases (gpt-oss): `bias` [E, N] (`b_gate_up`, `b_down` of the MLPs): the tile's
expert's bias row is added to the f32 accumulator after the K loop, before the product's
one rounding (the gate/up's before the GLU; the f32 down output's in f32), in the kernel.
Without a bias the kernels trace exactly as before: no operand, no op.

MXFP4 experts (gpt-oss kept packed, `scales=`): w is then uint8 codes [E, K / 2, N] with
scales [E, K / 32, N] (`pallas_kernels.mxfp4`'s layout), and each K step decodes its
[bk, bn] weight block from the [bk / 2, bn] codes and [bk / 32, bn] scales it reads, in
integer ops, into the very values the dequantized weight holds; the dot, tiles and K
loop are the float weight's (the tiles of `grouped_config(E, K, N, x.dtype)`), so the
bits are those of the dequantized weight, and a step reads 4.25 bits a weight. Where the
tile's bk is not a multiple of 32 the weight is decoded before the launch (the same
bits).

`grouped_matmul_reference` is what a plain JAX MoE runs (the `xla` backend): the rows
sorted by a stable argsort, then `jax.lax.ragged_dot` with the group sizes. Its reduction
order is XLA's choice for the whole [R, K] x [E, K, N] problem, so a row's bits change
with the rows routed beside it (the tests show it on the CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import dot_f32, next_pow2, pad_axis, round_up, triton_params
from pallas_kernels.glu import ACTIVATIONS, glu, glu_reference
from pallas_kernels.matmul import TUNED_FILE, MatmulConfig, matmul_config, read_tuned_file
from pallas_kernels.matmul_glu import _glu_tile
from pallas_kernels.mxfp4 import GROUP, decode, decode_rows, decode_rows_prmt, odd_rows
from pallas_kernels.route import combine, combine_kernel


def _parse_grouped(rows, where: str) -> dict[tuple[int, int, int, str], MatmulConfig]:
    """JSON rows {E, K, N, dtype, config} -> {(E, K, N, dtype): MatmulConfig}."""
    try:
        table = {(int(r["E"]), int(r["K"]), int(r["N"]), str(r["dtype"])):
                 MatmulConfig(**r["config"]) for r in rows}
    except (KeyError, TypeError) as e:
        raise ValueError(f"{where}: not a grouped tuning table (rows of E, K, N, dtype, "
                         f"config): {e}") from e
    bad = [k for k, c in table.items() if c.split_k != 1]
    if bad:
        raise ValueError(f"{where}: grouped configs take no split-K; got one at {bad}")
    return table


# Per-weight-shape tiles of the grouped kernels, keyed by (E, K, N, dtype name): the
# "grouped" table of matmul_tuned.json (`experiments/tuning/sweep_grouped.py` fills it;
# its provenance names the sweep and the parity run). Shapes not listed take
# `matmul_config(K, N)`'s tiles without split-K.
GROUPED = _parse_grouped(read_tuned_file().get("grouped", []), TUNED_FILE)


def write_grouped_rows(rows: list[dict], path: str = TUNED_FILE) -> None:
    """Merges a grouped sweep's winners (rows {E, K, N, dtype, config}) into the data
    file's "grouped" table, replacing entries of the same key (next import)."""
    new = _parse_grouped(rows, "rows")
    data = read_tuned_file(path)
    table = _parse_grouped(data.get("grouped", []), path) | new
    data["grouped"] = [{"E": E, "K": K, "N": N, "dtype": d, "config": dataclasses.asdict(c)}
                       for (E, K, N, d), c in sorted(table.items())]
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def grouped_config(E: int, K: int, N: int, dtype, interpret: bool) -> MatmulConfig:
    """Tiles of a grouped matmul over [E, K, N] weights: the GROUPED table's entry, else
    the [K, N] matmul's tiles without split-K (a function of the weight shape only;
    deliberately takes no row count)."""
    if not interpret:
        tuned = GROUPED.get((E, K, N, jnp.dtype(dtype).name))
        if tuned is not None:
            return tuned
    return dataclasses.replace(matmul_config(K, N, dtype, interpret), split_k=1)


def _check_grouped(x: jax.Array, w: jax.Array, expert: jax.Array, scales=None) -> None:
    if scales is not None:
        _check_packed(x, w, scales)
        # the float weight the codes stand for, checked as one passed as floats
        w = jax.ShapeDtypeStruct((w.shape[0], x.shape[-1], w.shape[2]), x.dtype)
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_matmul wants x [R, K] and w [E, K, N]; got {x.shape=} "
                         f"{w.shape=}")
    if expert.shape != x.shape[:1]:
        raise ValueError(f"grouped_matmul wants expert [R] for x [R, K]; got "
                         f"{expert.shape=} {x.shape=}")
    if not jnp.issubdtype(expert.dtype, jnp.integer):
        raise ValueError(f"grouped_matmul: expert must be an integer array; got "
                         f"{expert.dtype=}")
    if x.dtype != w.dtype or x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"grouped_matmul wants x and w both float32 or both bfloat16; got "
                         f"{x.dtype=} {w.dtype=}")


def _check_packed(x: jax.Array, codes: jax.Array, scales: jax.Array) -> None:
    K = x.shape[-1]
    if codes.ndim != 3 or codes.dtype != jnp.uint8 or 2 * codes.shape[1] != K:
        raise ValueError(f"a grouped matmul with MXFP4 scales wants uint8 codes [E, K / 2, N] "
                         f"for x [R, K]; got {codes.shape=} {codes.dtype=} {x.shape=}")
    want = (codes.shape[0], K // GROUP, codes.shape[2])
    if K % GROUP or scales.shape != want or scales.dtype != jnp.uint8:
        raise ValueError(f"a grouped matmul with MXFP4 codes {codes.shape} wants uint8 scales "
                         f"{want} (K a multiple of {GROUP}); got {scales.shape=} "
                         f"{scales.dtype=}")


def _packed(w: jax.Array, scales, dtype) -> jax.Array:
    """w itself, or the float [E, K, N] its MXFP4 codes and scales stand for."""
    return w if scales is None else decode(w, scales, dtype)


def check_bias(bias, w: jax.Array, name: str) -> None:
    """ValueError unless bias is None or a float [E, N] for w [E, K, N]."""
    if bias is None:
        return
    want = (w.shape[0], w.shape[2])
    if bias.shape != want or not jnp.issubdtype(bias.dtype, jnp.floating):
        raise ValueError(f"{name} wants a float bias [E, N] = {want} for w {w.shape}; got "
                         f"{bias.shape=} {bias.dtype=}")


def num_tiles(R: int, E: int, bm: int) -> int:
    """Static row-tile count of a grouped launch: ceil(R / bm) + min(E, R) bounds
    sum over experts of ceil(rows_e / bm) for every routing of R rows."""
    return -(-R // bm) + min(E, R)


def tile_layout(expert: jax.Array, E: int, bm: int
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """expert [R] int32 -> (dest [R], tile_expert [T], src [T * bm]): a counting sort in
    integer arithmetic (exact; no sort, no loop: a few small fused XLA ops on the GPU).

    Expert e's rows, in their original order, fill whole tiles of bm slots from tile
    tile_start[e] on (experts in ascending id). dest[r]: row r's slot; tile_expert[t]:
    the expert of tile t, or -1 for the tiles past the used ones; src[s]: the row in
    slot s, or -1 for the slots after a group's last row."""
    R = expert.shape[0]
    T = num_tiles(R, E, bm)
    onehot = (expert[:, None] == jnp.arange(E, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    seen = jnp.cumsum(onehot, axis=0)  # [R, E]: rows of each expert among rows 0..r
    rank = jnp.sum(onehot * seen, axis=1) - 1  # [R]: earlier rows of row r's expert
    tiles = -(-seen[-1] // bm)  # [E]: whole tiles per expert
    tile_end = jnp.cumsum(tiles)  # [E]
    dest = (tile_end - tiles)[expert] * bm + rank  # [R]
    t = jnp.arange(T, dtype=jnp.int32)
    owner = jnp.sum(tile_end[None, :] <= t[:, None], axis=1, dtype=jnp.int32)  # [T]
    tile_expert = jnp.where(t < tile_end[-1], owner, -1)
    src = jnp.full((T * bm,), -1, jnp.int32).at[dest].set(jnp.arange(R, dtype=jnp.int32))
    return dest.astype(jnp.int32), tile_expert.astype(jnp.int32), src


def token_layout(expert: jax.Array, bm: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One token's layout, with no layout work: expert [k] (the token's k routed
    experts, distinct as top-k gives them) -> (dest [k], tile_expert [k], src [k bm],
    slots [k bm]) as `tile_layout_kernel` returns them: slot r routed row r sits alone in
    tile r, in slot 0 (dest = r bm, src[r bm] = r, slots[r bm] = r bm, every other slot
    -1), tile_expert is `expert` itself.

    `tile_layout` gives one token's k distinct experts the same tiles (one each, the row
    in slot 0), in ascending expert id and with one spare tile: the same programs on the
    same data in another grid order, so the same bits, without its ~7 integer XLA ops
    or a layout kernel (dest, src and slots are constants). Repeated ids still give
    each row its own tile (R9: a row's bits never depend on its slot)."""
    k = expert.shape[0]
    s = np.arange(k * bm)
    first = s % bm == 0
    src = np.where(first, s // bm, -1)
    return (jnp.asarray(np.arange(k) * bm, jnp.int32), expert.astype(jnp.int32),
            jnp.asarray(src, jnp.int32), jnp.asarray(np.where(first, s, -1), jnp.int32))


LAYOUT_SLOTS = 64  # `tile_layout_kernel` takes up to this many slots (one program)
LAYOUT_CHUNK = 4096  # slot x row compares a pass of its source loop
# grouped_mlp(layout_kernel=True) takes the kernel up to this many slots and the XLA ops
# above it (the same integers: scheduling only; where the kernel stops paying:
# docs/tuning.md, `moe_layout_kernel`).
LAYOUT_KERNEL_SLOTS = 16


def _layout_kernel(e_ref, dest_ref, te_ref, src_ref, slots_ref, *, E: int, bm: int, R: int):
    # e_ref [Rp] int32 (slots r >= R: any value, never used); dest_ref [Rp]; te_ref [Tp];
    # src_ref, slots_ref [Tp bm]. `tile_layout`'s integer arithmetic, in one program.
    Rp, Ep, Tp = e_ref.shape[0], next_pow2(E), te_ref.shape[0]
    r = lax.broadcasted_iota(jnp.int32, (Rp,), 0)
    expert = jnp.where(r < R, e_ref[...], -1)  # padding slots match no expert
    col = lax.broadcasted_iota(jnp.int32, (Rp, Ep), 1)
    onehot = (expert[:, None] == col).astype(jnp.int32)  # [Rp, Ep]
    seen = jnp.cumsum(onehot, axis=0)  # rows of each expert among rows 0..r
    rank = jnp.sum(onehot * seen, axis=1) - 1  # [Rp]
    tiles = lax.div(jnp.sum(onehot, axis=0) + (bm - 1), bm)  # [Ep] whole tiles an expert
    tile_end = jnp.cumsum(tiles, axis=0)  # [Ep]
    start = tile_end - tiles
    dest = jnp.where(r < R, jnp.sum(onehot * start[None, :], axis=1) * bm + rank, -1)
    dest_ref[...] = dest  # [Rp]: the slot each row goes to
    t = lax.broadcasted_iota(jnp.int32, (Tp, Ep), 0)
    owner = jnp.sum((tile_end[None, :] <= t).astype(jnp.int32), axis=1)  # [Tp]
    used = jnp.sum(tiles)
    te_ref[...] = jnp.where(lax.broadcasted_iota(jnp.int32, (Tp,), 0) < used, owner, -1)

    C = max(bm, min(Tp * bm, LAYOUT_CHUNK // Rp))  # slots a pass: C x Rp compares
    C = C if (Tp * bm) % C == 0 else bm

    def chunk(i, carry):  # slots i C .. i C + C - 1: the row in each, or -1
        s = i * C + lax.broadcasted_iota(jnp.int32, (C, Rp), 0)
        hit = dest[None, :] == s  # [C, Rp]: at most one row a slot
        rows = lax.broadcasted_iota(jnp.int32, (C, Rp), 1)
        src = jnp.sum(jnp.where(hit, rows + 1, 0), axis=1) - 1  # [C]
        src_ref[pl.ds(i * C, C)] = src
        slot = i * C + lax.broadcasted_iota(jnp.int32, (C,), 0)
        slots_ref[pl.ds(i * C, C)] = jnp.where(src >= 0, slot, -1)
        return carry

    lax.fori_loop(0, Tp * bm // C, chunk, 0)


@functools.partial(jax.jit, static_argnames=("E", "bm", "interpret"))
def tile_layout_kernel(expert: jax.Array, E: int, bm: int, *, interpret: bool = False
                       ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """`tile_layout` in one Pallas program, for up to LAYOUT_SLOTS slots (a decode step or
    a short verify block): expert [R] int32 -> (dest [Rp], tile_expert [Tp], src [Tp bm],
    slots [Tp bm]) with Rp, Tp the powers of two >= R and `num_tiles(R, E, bm)`. The first
    R, T, T bm entries are `tile_layout`'s values exactly (integer arithmetic: the same
    counting sort, whatever computes it); the rest are -1 (slots of no row, tiles of no
    expert). slots[s] = s where a row sits in slot s, else -1 (the down kernel's source,
    the gate/up output's rows in slot order). One launch for the ~7 small XLA ops of
    `tile_layout` (cumsums, reductions, a scatter, selects)."""
    R = expert.shape[0]
    if not 1 <= R <= LAYOUT_SLOTS:
        raise ValueError(f"tile_layout_kernel takes 1 to {LAYOUT_SLOTS} slots; got {R}")
    Rp, Tp = next_pow2(R), next_pow2(num_tiles(R, E, bm))
    out = pl.pallas_call(
        functools.partial(_layout_kernel, E=E, bm=bm, R=R),
        out_shape=(jax.ShapeDtypeStruct((Rp,), jnp.int32),
                   jax.ShapeDtypeStruct((Tp,), jnp.int32),
                   jax.ShapeDtypeStruct((Tp * bm,), jnp.int32),
                   jax.ShapeDtypeStruct((Tp * bm,), jnp.int32)),
        compiler_params=triton_params(4, 1),
        interpret=interpret,
        name="jspec_moe_layout",
    )(pad_axis(expert.astype(jnp.int32), 0, Rp))
    return out


def _expert_k_loop(e, src_ref, x_ref, w_ref, *, bk: int, nk: int, bn: int,
                   row_div: int = 1, s_ref=None, prmt: bool = False, depth: int = 1):
    """[bm, bn] f32: the tile's rows (src_ref) of x_ref [R, Kp] times expert e's block
    w_ref [E, Kp, bn], k = 0, 1, ..., nk-1 in bk blocks, sequentially (R2: the K order is
    fixed by K and bk). Empty slots (src -1) read exact zeros. row_div > 1: slot source s
    reads x row s // row_div (a token's k routed copies read the token's one row).
    s_ref [E, Kp / 32, bn] (MXFP4): x_ref is [R + 1, Kp], its last row zeros, which empty
    slots read (no select a step); w_ref holds codes [E, Kp / 2, bn], each [bk, bn] block
    decoded from its codes and scales (`mxfp4.decode_rows`: exact) before the same dot.
    Each row of the block loads its own byte and scale (rows r // 2 and r // 32 of the
    block's codes and scales, gathered; the repeats hit the cache), so the decode is
    elementwise in the layout the loads give: expanding [bk / 2, bn] codes by a broadcast
    and a reshape instead moved both operands through shared memory every step.

    The packed loop loads block k + 1's codes and scales while it decodes block k, so
    they reach the decode as loop-carried values. Triton lays a dot's operands out in
    registers (the MMA operand's kWidth) by the narrowest load it finds feeding them:
    decoded straight from a uint8 load, the operands took kWidth 8 where the float
    kernel's take 2, which assigns other K values to each MMA instruction's slots and
    rounds differently (docs/tuning.md `mxfp4_kernel`). A carried value ends that search,
    so the float kernel's layout and bits.
    prmt: decode by `mxfp4.decode_rows_prmt` (bf16, GPU), the same values. depth: blocks
    loaded ahead (`_packed_k_loop`)."""
    src = src_ref[...]  # [bm]
    rows, real = jnp.maximum(src, 0), (src >= 0)[:, None]  # [bm], [bm, 1]
    if row_div > 1:
        rows = rows // row_div

    def x_block(k, rows=rows, masked=True):  # [bm, bk] gathered: the tile's rows
        xs = x_ref[rows, pl.ds(k * bk, bk)]
        return jnp.where(real, xs, jnp.zeros_like(xs)) if masked else xs

    def dot(acc, xs, ws):
        return acc + jnp.dot(xs, ws, precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)

    acc = jnp.zeros((src.shape[0], bn), jnp.float32)
    if s_ref is None:
        return lax.fori_loop(  # [bk, bn] of the tile's expert only
            0, nk, lambda k, acc: dot(acc, x_block(k), w_ref[e, pl.ds(k * bk, bk), :]), acc)

    return _packed_k_loop(e, src, rows, x_ref, w_ref, s_ref, acc, bk=bk, nk=nk, prmt=prmt,
                          depth=depth)


def _packed_k_loop(e, src, rows, x_ref, w_ref, s_ref, acc, *, bk: int, nk: int,
                   prmt: bool = False, depth: int = 1) -> jax.Array:
    """`_expert_k_loop`'s MXFP4 loop: acc (zeros [bm, bn] f32) plus dot(x_k, decode(w
    block k)) for k = 0, 1, ..., nk - 1.

    depth: how many blocks ahead the codes and scales are loaded. They reach the decode
    as loop-carried values (see `_expert_k_loop`: the dot operands' layout), which
    Triton's pipeliner does not stage, so a step's loads have only the steps up to their
    use to arrive. With depth d the loop body runs d steps, each slot of the carried
    queue reloaded for the step d later right after its decode (no value moves between
    slots, so none waits for its load), so a block's bytes have d steps of work to arrive
    in; the last nk % d steps follow the loop. Scheduling only: the same dots in the same
    order, so the same bits. (A GLU's gate and up in one loop spilled registers at
    gpt-oss-120b's tiles: each keeps its own.)"""
    row = lax.broadcasted_iota(jnp.int32, (bk,), 0)
    # x_ref's last row is zeros (`_launch_sorted`): empty slots read it, no select a step
    zero_rows = jnp.where(src >= 0, rows, x_ref.shape[0] - 1)
    depth = max(1, min(depth, nk))

    def packed(k):  # block k's [bk, bn] row bytes and row scales
        return (w_ref[e, k * (bk // 2) + row // 2, :],
                s_ref[e, k * (bk // GROUP) + row // GROUP, :])

    odd = odd_rows((bk, acc.shape[1])) if prmt else None  # once, outside the loop

    def step(k, acc, block):  # block k's dot
        xs = x_ref[zero_rows, pl.ds(k * bk, bk)]
        ws = decode_rows_prmt(*block, odd) if prmt else decode_rows(*block, xs.dtype)
        return acc + jnp.dot(xs, ws, precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)

    def group(g, carry):  # steps g d .. g d + d - 1; slot j holds block g d + j
        acc, queue = carry
        queue = list(queue)
        for j in range(depth):
            k = g if depth == 1 else g * depth + j
            acc = step(k, acc, queue[j])
            queue[j] = packed(jnp.minimum(k + depth, nk - 1))
        return acc, tuple(queue)

    queue = tuple(packed(j) for j in range(depth))
    acc, queue = lax.fori_loop(0, nk // depth, group, (acc, queue))
    for j in range(nk % depth):  # slot j holds block (nk // depth) d + j
        acc = step((nk // depth) * depth + j, acc, queue[j])
    return acc


def _biased(acc: jax.Array, e, b_ref=None) -> jax.Array:
    """acc [bm, bn] f32 plus expert e's row of the bias block b_ref [E, bn], in f32 (no
    b_ref: acc itself, no op)."""
    if b_ref is None:
        return acc
    return acc + b_ref[e, :].astype(jnp.float32)[None, :]


def _grouped_kernel(e_ref, src_ref, x_ref, w_ref, *refs, bk: int, nk: int,
                    row_div: int = 1, packed: bool = False, prmt: bool = False,
                    prefetch: int = 0):
    # e_ref [1] int32: the tile's expert (-1: unused tile); src_ref [bm] int32: the row of
    # x in each slot (-1: none); x_ref [R, Kp]; w_ref [E, Kp, bn]; refs: o_ref [bm, bn],
    # after b_ref [E, bn] with a bias, after s_ref [E, Kp / 32, bn] when packed (w_ref
    # then holds MXFP4 codes [E, Kp / 2, bn]); prefetch > 0: packed blocks loaded that many
    # steps ahead.
    s_ref, refs = (refs[0], refs[1:]) if packed else (None, refs)
    *b_refs, o_ref = refs
    e = jnp.max(e_ref[...])

    @pl.when(e >= 0)
    def _():
        acc = _expert_k_loop(e, src_ref, x_ref, w_ref, bk=bk, nk=nk, bn=o_ref.shape[1],
                             row_div=row_div, s_ref=s_ref, prmt=prmt, depth=prefetch or 1)
        o_ref[...] = _biased(acc, e, *b_refs).astype(o_ref.dtype)


def _grouped_glu_kernel(e_ref, src_ref, x_ref, wg_ref, wu_ref, *refs, bk: int, nk: int,
                        activation: str, row_div: int = 1, packed: bool = False,
                        prmt: bool = False, prefetch: int = 0):
    # `_grouped_kernel` with the gate and up column blocks j of w [E, Kp, 2F] (refs: o_ref,
    # after their bias blocks bg_ref, bu_ref with a bias, after their scale blocks sg_ref,
    # su_ref when packed): each biased in f32, rounded to the dtype, then `glu`'s
    # arithmetic (`matmul_glu`'s tile). prefetch: as `_grouped_kernel`'s.
    (sg_ref, su_ref), refs = (refs[:2], refs[2:]) if packed else ((None, None), refs)
    *b_refs, o_ref = refs
    bg_ref, bu_ref = b_refs or (None, None)
    e = jnp.max(e_ref[...])
    bn, dtype = o_ref.shape[1], o_ref.dtype

    @pl.when(e >= 0)
    def _():
        loop = functools.partial(_expert_k_loop, e, src_ref, x_ref, bk=bk, nk=nk, bn=bn,
                                 row_div=row_div, prmt=prmt, depth=prefetch or 1)
        if prefetch:  # both loops, then both epilogues: the order the device proved
            g, u = loop(wg_ref, s_ref=sg_ref), loop(wu_ref, s_ref=su_ref)
            gate, up = _biased(g, e, bg_ref).astype(dtype), _biased(u, e, bu_ref).astype(dtype)
        else:
            gate = _biased(loop(wg_ref, s_ref=sg_ref), e, bg_ref).astype(dtype)
            up = _biased(loop(wu_ref, s_ref=su_ref), e, bu_ref).astype(dtype)
        o_ref[...] = _glu_tile(gate, up, activation)


def _launch(kernel, x, w, expert, cfg: MatmulConfig, n_out: int, out_dtype, w_blocks,
            interpret: bool, name: str, bias=None, scales=None, prmt: bool = False,
            prefetch: int | None = None):
    """Runs `kernel` over the expert-sorted row tiles x column blocks of n_out columns;
    w_blocks: the column-block index of each weight operand for column block j. Returns
    the [R, n_out] rows in their original order."""
    dest, tile_expert, src = tile_layout(expert.astype(jnp.int32), w.shape[0], cfg.bm)
    return _launch_sorted(kernel, x, w, tile_expert, src, cfg, n_out, out_dtype, w_blocks,
                          interpret, name, bias=bias, scales=scales, prmt=prmt,
                          prefetch=prefetch)[dest]


def _launch_sorted(kernel, x, w, tile_expert, src, cfg: MatmulConfig, n_out: int, out_dtype,
                   w_blocks, interpret: bool, name: str, row_div: int = 1,
                   tiles: int | None = None, bias=None, scales=None, prmt: bool = False,
                   prefetch: int | None = None):
    """`_launch` on a given layout (`tile_layout`'s tile_expert [T] and src [T bm], or
    longer arrays of which the first `tiles` tiles are used; slot s reads x row
    src[s] // row_div): the [T bm, n_out] rows in slot order. bias [E, N] (or None): its
    column blocks go to the kernel beside the weight's, one a weight operand. scales
    [E, K / 32, N] (or None): w holds MXFP4 codes [E, K / 2, N], their scale blocks go
    beside them (`packed` kernels); a bk that is no multiple of 32 decodes them here.
    prmt: the kernels decode bf16 blocks by `mxfp4.decode_rows_prmt` (not in interpret
    mode, which has no PTX: there `decode_rows`, the same values). prefetch d: the
    packed kernels' loop loads blocks d steps ahead (`_packed_k_loop`; scheduling only,
    the same bits); None: PRMT_PREFETCH where the PTX decode runs, else the loop's own
    form (one step ahead)."""
    if scales is not None and cfg.bk % GROUP:
        w, scales = _packed(w, scales, x.dtype), None
    K = x.shape[1]
    E = w.shape[0]
    bm = cfg.bm
    T = tile_expert.shape[0] if tiles is None else tiles
    kp = round_up(K, cfg.bk)
    # Zero padding: extra K terms add exact zeros at the end of the sum; the empty slots
    # after each group's last row read zero rows, and their outputs are never read.
    # (Packed: the code 0 is +0.0 whatever its padded scale.)
    xp = pad_axis(x, 1, kp)  # [R, Kp]
    if scales is not None:  # [R + 1, Kp]: a zero row for the packed loop's empty slots
        xp = pad_axis(xp, 0, xp.shape[0] + 1)
    per_row = 1 if scales is None else 2  # weight rows a stored row holds
    Np = round_up(w.shape[2], cfg.bn)
    wp = pad_axis(pad_axis(w, 1, kp // per_row), 2, Np)  # [E, Kp (/ 2), Np]
    w_specs = [pl.BlockSpec((E, kp // per_row, cfg.bn), lambda i, j, b=b: (0, 0, b(j)))
               for b in w_blocks]
    s_specs, s_args, extra = [], [], {}
    if scales is not None:
        s_specs = [pl.BlockSpec((E, kp // GROUP, cfg.bn), lambda i, j, b=b: (0, 0, b(j)))
                   for b in w_blocks]
        s_args = [pad_axis(pad_axis(scales, 1, kp // GROUP, 127), 2, Np, 127)] * len(w_blocks)
        extra["packed"] = True
        prmt = prmt and not interpret and x.dtype == jnp.bfloat16  # PTX: bf16, GPU
        if prmt:
            extra["prmt"] = True
        if prefetch is None and prmt:
            prefetch = PRMT_PREFETCH
        if prefetch:
            extra["prefetch"] = prefetch
    b_specs, b_args = [], []
    if bias is not None:
        b_specs = [pl.BlockSpec((E, cfg.bn), lambda i, j, b=b: (0, b(j))) for b in w_blocks]
        b_args = [pad_axis(bias, 1, wp.shape[2])] * len(w_blocks)  # [E, Np]
    if row_div > 1:
        extra["row_div"] = row_div
    return pl.pallas_call(
        functools.partial(kernel, bk=cfg.bk, nk=kp // cfg.bk, **extra),
        out_shape=jax.ShapeDtypeStruct((T * bm, n_out), out_dtype),
        grid=(T, n_out // cfg.bn),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (i,)),
            pl.BlockSpec((bm,), lambda i, j: (i,)),
            pl.BlockSpec((xp.shape[0], kp), lambda i, j: (0, 0)),
            *w_specs,
            *s_specs,
            *b_specs,
        ],
        out_specs=pl.BlockSpec((bm, cfg.bn), lambda i, j: (i, j)),
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=name,
    )(tile_expert, src, xp, *([wp] * len(w_blocks)), *s_args, *b_args)


# Blocks the packed loop loads ahead by default where the PTX decode runs (the depth a sweep
# chose; the integer decode spills at it, so it keeps the loop's own form: docs/tuning.md
# `mxfp4_prefetch`).
PRMT_PREFETCH = 4


def _prefetch(depth: int | None) -> int | None:
    """`mxfp4_prefetch` checked: None (the default by decode) or a depth of 1 to 8."""
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int)
                              or not 1 <= depth <= 8):
        raise ValueError(f"mxfp4_prefetch must be None or an int in [1, 8]; got {depth!r}")
    return depth


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "config",
                                             "table_experts", "mxfp4_prmt",
                                             "mxfp4_prefetch"))
def grouped_matmul(x: jax.Array, w: jax.Array, expert: jax.Array, *, out_dtype,
                   bias: jax.Array | None = None, interpret: bool = False,
                   config: MatmulConfig | None = None,
                   table_experts: int | None = None,
                   scales: jax.Array | None = None, mxfp4_prmt: bool = False,
                   mxfp4_prefetch: int | None = None) -> jax.Array:
    """x [R, K] @ w[expert] (+ bias[expert]) -> [R, N] in out_dtype (None: float32): row r
    is x[r] @ w[expert[r]], K reduced from 0 upward in an f32 accumulator, plus the
    expert's bias row in f32 (bias [E, N] or None), then one rounding; bitwise
    independent of the other rows and of which of them share its expert (R9).

    w [E, K, N] (x's dtype, float32 or bfloat16); expert [R] integer in [0, E) (traced
    values are not checked: an id outside it gives an undefined row). `config`
    overrides `grouped_config(E, K, N, ...)` (split_k must be 1); one weight must always
    use one config. `table_experts`: the E whose tiles to take, where w holds some of a
    model's experts gathered (`jspec.mxfp4`: the tiles of the model's whole weight).
    `scales` [E, K / 32, N] uint8: w is MXFP4 codes [E, K / 2, N] uint8 (`mxfp4.decode`'s
    layout) standing for a weight of x's dtype, decoded block by block in the kernel:
    the bits of that weight passed as floats. `mxfp4_prmt`: bf16 blocks decoded by
    `mxfp4.decode_rows_prmt` (`KernelOptions.mxfp4_prmt`), the same values.
    `mxfp4_prefetch` d: the packed loop loads blocks d steps ahead (None: PRMT_PREFETCH
    with the PTX decode, else one, in the loop's own form; `KernelOptions.mxfp4_prefetch`),
    the same bits."""
    _check_grouped(x, w, expert, scales)
    check_bias(bias, w, "grouped_matmul")
    out_dtype = jnp.dtype(jnp.float32 if out_dtype is None else out_dtype)
    R, K = x.shape
    E, _, N = w.shape
    cfg = (grouped_config(table_experts or E, K, N, x.dtype, interpret) if config is None
           else config)
    if cfg.split_k != 1:
        raise ValueError(f"grouped_matmul takes no split-K; got {cfg.split_k=}")
    if R == 0:
        return jnp.zeros((0, N), out_dtype)
    out = _launch(_grouped_kernel, x, w, expert, cfg, round_up(N, cfg.bn), out_dtype,
                  [lambda j: j], interpret, "jspec_grouped_matmul", bias=bias, scales=scales,
                  prmt=mxfp4_prmt, prefetch=_prefetch(mxfp4_prefetch))
    return out[:, :N]


@functools.partial(jax.jit, static_argnames=("activation", "interpret", "config",
                                             "table_experts", "mxfp4_prmt",
                                             "mxfp4_prefetch"))
def grouped_matmul_glu(x: jax.Array, w: jax.Array, expert: jax.Array, *, activation: str,
                       bias: jax.Array | None = None, interpret: bool = False,
                       config: MatmulConfig | None = None,
                       table_experts: int | None = None,
                       scales: jax.Array | None = None, mxfp4_prmt: bool = False,
                       mxfp4_prefetch: int | None = None) -> jax.Array:
    """act(x[r] @ w[e][:, :F]) * (x[r] @ w[e][:, F:]) for e = expert[r]: x [R, K],
    w [E, K, 2F] (gate columns first), bias [E, 2F] or None (the same halves) -> [R, F]
    x.dtype. Bitwise `glu` of `grouped_matmul(x, w, expert, out_dtype=x.dtype,
    bias=bias)`'s halves (the same tiles, `grouped_config(E, K, 2F)` unless `config`
    overrides it, and K loops), in one kernel; shapes whose column tile does not divide F
    take that unfused path. `table_experts`, `scales` (MXFP4 codes in w), `mxfp4_prmt`
    and `mxfp4_prefetch` as `grouped_matmul`'s."""
    _check_grouped(x, w, expert, scales)
    check_bias(bias, w, "grouped_matmul_glu")
    if w.shape[2] % 2:
        raise ValueError(f"grouped_matmul_glu wants w [E, K, 2F] (gate, then up); got "
                         f"{w.shape=}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"grouped_matmul_glu activation must be one of {ACTIVATIONS}; got "
                         f"{activation=}")
    E, K, F = w.shape[0], x.shape[1], w.shape[2] // 2
    cfg = (grouped_config(table_experts or E, K, 2 * F, x.dtype, interpret) if config is None
           else config)
    if cfg.split_k != 1:
        raise ValueError(f"grouped_matmul_glu takes no split-K; got {cfg.split_k=}")
    if F % cfg.bn or x.shape[0] == 0:
        gate, up = jnp.split(grouped_matmul(x, w, expert, out_dtype=x.dtype, bias=bias,
                                            interpret=interpret, config=cfg, scales=scales,
                                            mxfp4_prmt=mxfp4_prmt,
                                            mxfp4_prefetch=mxfp4_prefetch),
                             2, axis=-1)
        return glu(gate, up, activation=activation, interpret=interpret)
    nf = F // cfg.bn  # column blocks of the gate half
    kernel = functools.partial(_grouped_glu_kernel, activation=activation)
    return _launch(kernel, x, w, expert, cfg, F, x.dtype, [lambda j: j, lambda j: j + nf],
                   interpret, "jspec_grouped_matmul_glu", bias=bias, scales=scales,
                   prmt=mxfp4_prmt, prefetch=_prefetch(mxfp4_prefetch))


def check_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, expert: jax.Array,
              b_gate_up: jax.Array | None = None, b_down: jax.Array | None = None
              ) -> tuple[int, int, int, int, int]:
    """`grouped_mlp`'s operands checked -> (M, k, E, D, F): x [M, D] (M > 0), expert
    [M k], w_gate_up [E, D, 2F], w_down [E, F, D] in x's dtype, the biases [E, 2F] and
    [E, D] or None."""
    if x.ndim != 2 or expert.ndim != 1 or x.shape[0] == 0 or expert.shape[0] % x.shape[0]:
        raise ValueError(f"grouped_mlp wants x [M, D] (M > 0) and expert [M k]; got "
                         f"{x.shape=} {expert.shape=}")
    M = x.shape[0]
    _check_grouped(x, w_gate_up, expert[:M])
    E, D, F = w_gate_up.shape[0], w_gate_up.shape[1], w_gate_up.shape[2] // 2
    if w_down.shape != (E, F, D) or w_down.dtype != x.dtype:
        raise ValueError(f"grouped_mlp wants w_down [E, F, D] = {(E, F, D)} in {x.dtype}; got "
                         f"{w_down.shape=} {w_down.dtype=}")
    check_bias(b_gate_up, w_gate_up, "grouped_mlp (b_gate_up)")
    check_bias(b_down, w_down, "grouped_mlp (b_down)")
    return M, expert.shape[0] // M, E, D, F


def check_combine_weights(x: jax.Array, expert: jax.Array, weights: jax.Array
                          ) -> tuple[int, int]:
    """`grouped_mlp_combine`'s weights [M, k] checked against x [M, D] and expert [M k]
    -> (M, k)."""
    M, k = weights.shape if weights.ndim == 2 else (0, 0)
    if weights.ndim != 2 or M != x.shape[0] or M * k != expert.shape[0]:
        raise ValueError(f"grouped_mlp_combine wants weights [M, k] with x [M, D] and expert "
                         f"[M k]; got {weights.shape=} {x.shape=} {expert.shape=}")
    return M, k


def _grouped_mlp_slots(x, w_gate_up, w_down, expert, b_gate_up, b_down, *, activation: str,
                       interpret: bool, layout_kernel: bool
                       ) -> tuple[jax.Array, jax.Array | None]:
    """`grouped_mlp`'s work before its last gather: (y, dest), y [S, Dp] f32 in slot
    order and dest [M k] the slot of each routed row; or (y [M k, D], None) in row order
    when the two tilings differ in row tile (the composition)."""
    M, k, E, D, F = check_mlp(x, w_gate_up, w_down, expert, b_gate_up, b_down)
    R = M * k
    cfg_gu = grouped_config(E, D, 2 * F, w_gate_up.dtype, interpret)
    cfg_dn = grouped_config(E, F, D, w_down.dtype, interpret)
    if cfg_gu.bm != cfg_dn.bm:
        a = grouped_matmul_glu(jnp.repeat(x, k, axis=0), w_gate_up, expert,
                               activation=activation, bias=b_gate_up, interpret=interpret)
        return grouped_matmul(a, w_down, expert, out_dtype=jnp.float32, bias=b_down,
                              interpret=interpret), None
    T = num_tiles(R, E, cfg_gu.bm)
    if M == 1:  # one token (a batch-1 decode step): a tile per routed row, no layout ops
        dest, tile_expert, src, slots = token_layout(expert, cfg_gu.bm)
        T = k
    elif layout_kernel and R <= LAYOUT_KERNEL_SLOTS:
        dest, tile_expert, src, slots = tile_layout_kernel(expert, E, cfg_gu.bm,
                                                           interpret=interpret)
        dest = dest[:R]
    else:
        dest, tile_expert, src = tile_layout(expert.astype(jnp.int32), E, cfg_gu.bm)
        slots = jnp.where(src >= 0, jnp.arange(src.shape[0], dtype=jnp.int32), -1)
    if F % cfg_gu.bn == 0:  # gate/up and the GLU in one kernel (`grouped_matmul_glu`)
        nf = F // cfg_gu.bn
        a = _launch_sorted(functools.partial(_grouped_glu_kernel, activation=activation), x,
                           w_gate_up, tile_expert, src, cfg_gu, F, x.dtype,
                           [lambda j: j, lambda j: j + nf], interpret,
                           "jspec_grouped_matmul_glu", row_div=k, tiles=T,
                           bias=b_gate_up)  # [T bm, F], slot order
    else:  # its unfused path: the grouped matmul, then `glu` (row-local, elementwise)
        gu = _launch_sorted(_grouped_kernel, x, w_gate_up, tile_expert, src, cfg_gu,
                            round_up(2 * F, cfg_gu.bn), x.dtype, [lambda j: j], interpret,
                            "jspec_grouped_matmul", row_div=k, tiles=T,
                            bias=b_gate_up)[:, :2 * F]
        gate, up = jnp.split(gu, 2, axis=-1)
        a = glu(gate, up, activation=activation, interpret=interpret)  # [T bm, F]
    y = _launch_sorted(_grouped_kernel, a, w_down, tile_expert, slots, cfg_dn,
                       round_up(D, cfg_dn.bn), jnp.float32, [lambda j: j], interpret,
                       "jspec_grouped_matmul", tiles=T, bias=b_down)  # [T bm, Dp]
    return y, dest


@functools.partial(jax.jit, static_argnames=("activation", "interpret", "layout_kernel"))
def grouped_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, expert: jax.Array, *,
                activation: str, b_gate_up: jax.Array | None = None,
                b_down: jax.Array | None = None, interpret: bool = False,
                layout_kernel: bool = False) -> jax.Array:
    """A mixture of experts' expert MLPs: x [M, D] (tokens), expert [M k] (token m's k
    routed experts at m k .. m k + k - 1), w_gate_up [E, D, 2F], w_down [E, F, D] ->
    [M k, D] f32, bitwise `grouped_matmul(grouped_matmul_glu(repeat(x, k), w_gate_up,
    expert, bias=b_gate_up), w_down, expert, out_dtype=f32, bias=b_down)` (the biases
    [E, 2F], [E, D] or None): the same kernels, tiles and K loops, and a row's result
    never depends on the slot it sits in (R9). The rows are laid out by
    expert once: the gate/up kernel reads each slot's token row of x itself (no
    repeated copy of x), its output stays in slot order for the down kernel, and one
    gather puts the rows back. Shapes whose two tilings differ in row tile run the
    composition. One token (M = 1, a batch-1 decode step) takes `token_layout`: no
    layout work at all, the same bits. `layout_kernel`: other blocks of up to
    LAYOUT_KERNEL_SLOTS slots get their layout from `tile_layout_kernel` (one launch;
    the same integers)."""
    y, dest = _grouped_mlp_slots(x, w_gate_up, w_down, expert, b_gate_up, b_down,
                                 activation=activation, interpret=interpret,
                                 layout_kernel=layout_kernel)
    return y if dest is None else y[dest, :x.shape[1]]


@functools.partial(jax.jit, static_argnames=("activation", "rows_out", "interpret",
                                             "layout_kernel"))
def grouped_mlp_combine(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array,
                        expert: jax.Array, weights: jax.Array, *, activation: str,
                        rows_out: int, b_gate_up: jax.Array | None = None,
                        b_down: jax.Array | None = None, interpret: bool = False,
                        layout_kernel: bool = False) -> jax.Array:
    """A mixture of experts' whole expert half: `grouped_mlp`'s kernels (biases too), then
    `combine_kernel` straight from their slot-order output (no gather back, no separate
    product, sum, cast and padding launches): x [M, D], expert [M k], weights [M, k] ->
    [rows_out, D] in x.dtype, rows M .. rows_out - 1 exact zeros. Row-local (R9); the
    combine's arithmetic is its kernel's, so its bits are its own (see
    `combine_kernel`)."""
    M, k = check_combine_weights(x, expert, weights)
    y, dest = _grouped_mlp_slots(x, w_gate_up, w_down, expert, b_gate_up, b_down,
                                 activation=activation, interpret=interpret,
                                 layout_kernel=layout_kernel)
    if dest is None:
        dest = jnp.arange(M * k, dtype=jnp.int32)
    out = combine_kernel(y, dest, weights, rows_out=rows_out, out_dtype=x.dtype,
                         interpret=interpret)
    return out[:, :x.shape[1]]


def grouped_mlp_combine_reference(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array,
                                  expert: jax.Array, weights: jax.Array, *, activation: str,
                                  rows_out: int, b_gate_up: jax.Array | None = None,
                                  b_down: jax.Array | None = None,
                                  layout_kernel: bool = False) -> jax.Array:
    """The `xla` backend's `grouped_mlp_combine`: `grouped_mlp_reference`, `combine`, the
    cast and the zero rows (NOT row-invariant, through the reference grouped matmul)."""
    M, k = weights.shape
    y = grouped_mlp_reference(x, w_gate_up, w_down, expert, activation=activation,
                              b_gate_up=b_gate_up, b_down=b_down, layout_kernel=layout_kernel)
    out = combine(y.reshape(M, k, x.shape[1]), weights).astype(x.dtype)
    return pad_axis(out, 0, rows_out)


def grouped_mlp_reference(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array,
                          expert: jax.Array, *, activation: str,
                          b_gate_up: jax.Array | None = None, b_down: jax.Array | None = None,
                          layout_kernel: bool = False) -> jax.Array:
    """The `xla` backend's expert MLPs (NOT row-invariant): the reference grouped GLU and
    grouped matmul over the token rows repeated per slot (`layout_kernel` is the pallas
    backend's; ignored)."""
    del layout_kernel
    k = expert.shape[0] // x.shape[0]
    a = grouped_matmul_glu_reference(jnp.repeat(x, k, axis=0), w_gate_up, expert,
                                     activation=activation, bias=b_gate_up)
    return grouped_matmul_reference(a, w_down, expert, out_dtype=jnp.float32, bias=b_down)


def grouped_matmul_reference(x: jax.Array, w: jax.Array, expert: jax.Array, *, out_dtype,
                             bias: jax.Array | None = None, config=None,
                             table_experts: int | None = None,
                             scales: jax.Array | None = None) -> jax.Array:
    """What a plain JAX MoE runs (the `xla` backend; NOT row-invariant): rows sorted by
    expert, `jax.lax.ragged_dot` over the groups with f32 accumulation, unsorted, plus
    bias[expert] in f32 (bias [E, N] or None), then one rounding. MXFP4 codes (`scales`)
    are decoded first, all E experts."""
    del config  # the kernel's tiling; nothing to tile here
    _check_grouped(x, w, expert, scales)
    w = _packed(w, scales, x.dtype)
    check_bias(bias, w, "grouped_matmul")
    out_dtype = jnp.float32 if out_dtype is None else out_dtype
    E = w.shape[0]
    expert = expert.astype(jnp.int32)
    order = jnp.argsort(expert, stable=True)
    sizes = jnp.bincount(expert, length=E).astype(jnp.int32)
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = dot_f32(lax.ragged_dot, x[order], w, precision=precision, group_sizes=sizes)
    back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = y[back]
    if bias is not None:
        y = y + bias[expert].astype(jnp.float32)
    return y.astype(out_dtype)


def grouped_matmul_glu_reference(x: jax.Array, w: jax.Array, expert: jax.Array, *,
                                 activation: str, bias: jax.Array | None = None,
                                 table_experts: int | None = None,
                                 scales: jax.Array | None = None) -> jax.Array:
    """Plain jnp: the reference grouped matmul (biased) rounded to x.dtype, split, the
    reference GLU (NOT row-invariant)."""
    gate, up = jnp.split(grouped_matmul_reference(x, w, expert, out_dtype=x.dtype,
                                                  bias=bias, scales=scales), 2, axis=-1)
    return glu_reference(gate, up, activation=activation)
