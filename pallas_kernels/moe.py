"""Mixture-of-experts numerics: grouped matmul, routing and the weighted combine (rule R9).

STAND-IN. This file holds plain-jnp versions of the agreed interface so the model,
loading and tests can be written against it; the invariant Pallas grouped matmul
replaces it, with the same signatures:

- `grouped_matmul(x [R, K], w [E, K, N], expert [R] int32, *, out_dtype, interpret=False,
  config=None) -> [R, N]`: row r is x[r] @ w[expert[r]];
  `grouped_matmul_reference` (the same signature without interpret/config): the xla
  backend's path.
- `route(router_logits [M, E] f32, k, *, norm_topk_prob) -> (weights [M, k] f32,
  ids [M, k] int32)`: transformers' routing (softmax over all E in f32, the top k,
  renormalised over the k when norm_topk_prob), ties broken by the lowest expert id.
- `combine(y [M, k, D] f32, weights [M, k]) -> [M, D] f32`: sum_j weights_j * y_j, left
  to right over j.

Every function here is row-local: a row's result is a function of that row alone. The
stand-in grouped matmul gathers each row's expert weights ([R, K, N]: fine at test
sizes only) and reduces K per row; sums over E and k are unrolled left-to-right folds of
elementwise ops, never `jnp.sum`, whose vectorisation may change with the row count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check(x, w, expert) -> None:
    if x.ndim != 2 or w.ndim != 3 or expert.shape != x.shape[:1] or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_matmul: x {x.shape} [R, K], w {w.shape} [E, K, N], expert "
                         f"{expert.shape} [R]")


def grouped_matmul_reference(x, w, expert, *, out_dtype):
    """x [R, K] @ w[expert] [R, K, N] per row, in f32 -> [R, N] out_dtype."""
    _check(x, w, expert)
    wr = jnp.take(w, expert, axis=0).astype(jnp.float32)  # [R, K, N]
    y = jnp.einsum("rk,rkn->rn", x.astype(jnp.float32), wr,
                   precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype)


def grouped_matmul(x, w, expert, *, out_dtype, interpret=False, config=None):
    """The pallas backend's grouped matmul (stand-in: the reference)."""
    del interpret, config
    return grouped_matmul_reference(x, w, expert, out_dtype=out_dtype)


def _fold(cols):
    """Left-to-right sum of a list of equal-shape arrays."""
    acc = cols[0]
    for c in cols[1:]:
        acc = acc + c
    return acc


def route(router_logits, k, *, norm_topk_prob):
    """router_logits [M, E] f32 -> (weights [M, k] f32, ids [M, k] int32)."""
    logits = router_logits.astype(jnp.float32)
    M, E = logits.shape
    if not 1 <= k <= E:
        raise ValueError(f"route: k={k} is not in [1, {E}]")
    m = jnp.max(logits, axis=-1, keepdims=True)  # exact in any order
    e = jnp.exp(logits - m)  # [M, E]
    probs = e / _fold([e[:, j:j + 1] for j in range(E)])  # softmax, [M, E]
    ids, weights = [], []
    rest = probs
    col = jnp.arange(E, dtype=jnp.int32)[None, :]
    for _ in range(k):  # repeated argmax: the lowest id wins a tie
        i = jnp.argmax(rest, axis=-1).astype(jnp.int32)  # [M]
        ids.append(i)
        weights.append(jnp.take_along_axis(probs, i[:, None], axis=-1))  # [M, 1]
        rest = jnp.where(col == i[:, None], -1.0, rest)
    weights = jnp.concatenate(weights, axis=-1)  # [M, k]
    if norm_topk_prob:
        weights = weights / _fold([weights[:, j:j + 1] for j in range(k)])
    return weights, jnp.stack(ids, axis=-1)


def combine(y, weights):
    """y [M, k, D] f32, weights [M, k] -> sum_j weights[:, j] * y[:, j], j = 0..k-1, [M, D]."""
    w = weights.astype(jnp.float32)
    return _fold([y[:, j] * w[:, j:j + 1] for j in range(y.shape[1])])
