"""Top-k routing on Mosaic GPU: router logits [M, E] f32 -> (weights [M, k], ids [M, k]).

The Mosaic GPU lowering of `pallas_kernels.route.route_kernel` (its docstring, and
`route`'s, give the formula: softmax over all E experts in f32, k rounds of argmax with
the lowest id winning a tie, the chosen probabilities renormalised left to right when
`norm_topk_prob`; with `topk_softmax`, gpt-oss's mode: the top k of the logits, then
`route.topk_softmaxed` of them). One program holds ROWS = 64 rows x all E experts
(padded with -inf to a multiple of 64) in the warpgroup's wgmma register layout, so a
routing is one launch where plain jnp is ~2k small XLA reductions.

Each reduction is along a row (max, the exp sum, the argmax as a max then the lowest
column holding it) in the layout's order, which is set by the tile's shape, a function
of E only: a row's weights and ids never depend on M or on the rows beside it (R9). The
exp sum is the layout's (a per-thread fold then a shuffle tree) where the Triton kernel
adds column halves pairwise, so the two lowerings' weights may differ in the last bit
(R11: a lowering is a configuration); the ids are the same unless two probabilities
sit within that rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import pad_axis, round_up
from pallas_kernels.route import _check_route, renormalised, topk_softmaxed

__all__ = ["ROWS", "route_kernel", "takes"]

ROWS = 64  # rows a program: one warpgroup's wgmma layout (fixed, never a function of M)
COLS = 64  # experts are padded to a multiple of this
MAX_EXPERTS = 256  # one TMA copy moves at most 256 entries an axis


def takes(num_experts: int, k: int) -> bool:
    """Whether this kernel routes E experts, k a token (E <= 256: one copy a row tile)."""
    return 1 <= k <= num_experts <= MAX_EXPERTS


def _kernel(l_gmem, w_gmem, i_gmem, l_smem, w_smem, i_smem, bar, *, E: int, k: int,
            norm_topk_prob: bool, topk_softmax: bool = False):
    # l_gmem [Mp, Ep] f32 (columns past E: -inf; rows past M: zeros); w_gmem, i_gmem
    # [Mp, kp]: chosen j in column j.
    rows = pl.ds(lax.axis_index("m") * ROWS, ROWS)
    plgpu.copy_gmem_to_smem(l_gmem.at[rows], l_smem, bar)
    plgpu.barrier_wait(bar)
    layout = plgpu.Layout.WGMMA
    logits = plgpu.load(l_smem, layout=layout)  # [ROWS, Ep]
    shape = logits.shape

    def rows_to(v, like=shape):  # [ROWS] -> [ROWS, n], each row's value in every column
        return lax.broadcast_in_dim(v, like, [0])

    if topk_softmax:  # the top k of the logits, then their softmax
        score = logits
    else:
        top = logits.max(axis=1)  # exact in any order
        e = jnp.exp(logits - rows_to(top))  # the padding columns give exact zeros
        score = e / rows_to(e.sum(axis=1))  # p
    col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
    left = jnp.where(col < E, score, -jnp.inf)
    kp = w_smem.shape[1]
    slot = plgpu.broadcasted_iota(jnp.int32, (ROWS, kp), 1, layout=layout)
    ws, ids = [], plgpu.layout_cast(jnp.zeros((ROWS, kp), jnp.int32), layout)
    for j in range(k):
        m = left.max(axis=1)  # the score at the chosen expert: left holds it or -inf
        i = jnp.where(left == rows_to(m), col, E).min(axis=1)  # the lowest id of the max
        i = jnp.minimum(i, E - 1)  # a NaN row (flagged by the model) stays in range
        ws.append(m)
        ids = jnp.where(slot == j, rows_to(i, ids.shape), ids)
        left = jnp.where(col == rows_to(i), -jnp.inf, left)
    if topk_softmax:
        ws = topk_softmaxed(ws)
    if norm_topk_prob:
        ws = renormalised(ws)
    out = plgpu.layout_cast(jnp.zeros((ROWS, kp), jnp.float32), layout)
    for j, w in enumerate(ws):
        out = jnp.where(slot == j, rows_to(w, out.shape), out)
    w_smem[...] = out
    i_smem[...] = ids
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(w_smem, w_gmem.at[rows])
    plgpu.copy_smem_to_gmem(i_smem, i_gmem.at[rows])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("k", "norm_topk_prob", "topk_softmax",
                                             "interpret"))
def route_kernel(router_logits: jax.Array, k: int, *, norm_topk_prob: bool,
                 topk_softmax: bool = False, interpret: bool = False
                 ) -> tuple[jax.Array, jax.Array]:
    """`pallas_kernels.route.route` in one Mosaic GPU kernel: router_logits [M, E] f32 ->
    (weights [M, k] f32, ids [M, k] int32), ids in the order chosen. E <= 256
    (`takes`). `topk_softmax`: gpt-oss's mode (`route`'s). `interpret`: Pallas's GPU
    interpret mode (CPU)."""
    _check_route(router_logits, k, norm_topk_prob, topk_softmax)
    M, E = router_logits.shape
    if not takes(E, k):
        raise ValueError(f"route_kernel (Mosaic GPU) takes at most {MAX_EXPERTS} experts; "
                         f"got E={E} (route with pallas_kernels.route.route)")
    if M == 0:
        return jnp.zeros((0, k), jnp.float32), jnp.zeros((0, k), jnp.int32)
    Ep, kp, mp = round_up(E, COLS), round_up(k, 8), round_up(M, ROWS)
    x = pad_axis(pad_axis(router_logits, 1, Ep, value=-jnp.inf), 0, mp)
    w, ids = plgpu.kernel(
        functools.partial(_kernel, E=E, k=k, norm_topk_prob=norm_topk_prob,
                          topk_softmax=topk_softmax),
        out_type=(jax.ShapeDtypeStruct((mp, kp), jnp.float32),
                  jax.ShapeDtypeStruct((mp, kp), jnp.int32)),
        scratch_types=dict(l_smem=plgpu.SMEM((ROWS, Ep), jnp.float32),
                           w_smem=plgpu.SMEM((ROWS, kp), jnp.float32),
                           i_smem=plgpu.SMEM((ROWS, kp), jnp.int32),
                           bar=plgpu.Barrier(num_arrivals=1)),
        grid=(mp // ROWS,),
        grid_names=("m",),
        kernel_name="jspec_mosaic_route",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(x)
    return w[:M, :k], ids[:M, :k]
