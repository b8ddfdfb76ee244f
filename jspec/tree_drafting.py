"""Draft trees: the shared growth every tree drafter drives with its own forward.

A drafter's `propose_tree` (`jspec.Drafter`: shapes and the engine's guarantees there)
calls `expand_static` or `expand_dynamic` with a `step` that runs its model, head or
lookup on one depth's nodes; these helpers take everything they need as arguments and
know no drafter. The drafters' own tree methods live on the drafters (`jspec.drafters`).

Children are the drafter's choices by rank at their parent (`jspec.sampling.top_choices`:
greedy top-k, or draws without replacement with the position-keyed noise). Static trees
(`TreeConfig.branching` / `paths`) grow depth by depth: one draft forward over each
depth's nodes (the frontier batched, tree attention in the draft), none for the last.
Dynamic trees (`TreeConfig.dynamic`, EAGLE-2) expand the top_k frontier nodes by
cumulative draft log-probability and keep the best `nodes` candidates.
Whatever a drafter proposes, the target's tree verify decides every token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafting import one_hot_logits
from jspec.sampling import Greedy, gumbel_noise, top_choices
from jspec.tree import TreeInput


def static_layout(tree):
    """numpy (parents, ranks, depth, anc [N + 1, D + 1], levels [(start, end) per depth])."""
    parents, ranks, depth = tree.topology()
    D = int(depth.max())
    anc = np.full((len(parents), D + 1), -1, np.int32)  # ancestors by depth (numpy: static)
    for i in range(len(parents)):
        j = i
        while j >= 0:
            anc[i, depth[j]] = j
            j = parents[j]
    levels = [(int(np.argmax(depth == d)), int(np.argmax(depth == d)) + int(np.sum(depth == d)))
              for d in range(D + 1)]
    return parents, ranks, depth, anc, levels


def _choose(sampler, q_parents, ranks_needed: int, ctx, position):
    """q_parents [B, P, V] -> the `ranks_needed` best choices of each parent [B, P, k]."""
    B, P, V = q_parents.shape
    rows = jnp.repeat(ctx.rows, P)
    pos = jnp.broadcast_to(position[:, None], (B, P)).reshape(-1)
    return top_choices(sampler, q_parents.reshape(B * P, V), ranks_needed, ctx.seed, rows,
                       pos).reshape(B, P, ranks_needed)


def expand_static(tree, ctx, first, step, carry):
    """Grows a static tree: first [B, V] the draft logits at the root; step(d, tokens
    [B, n], lo, hi, carry) -> (logits [B, n, V], carry) runs the drafter on the nodes of
    depth d (indices lo..hi-1). -> (tokens [B, N + 1], parents [B, N + 1], q, carry)."""
    parents, ranks, depth, anc, levels = static_layout(tree)
    B, V = first.shape
    n_all = len(parents)
    tokens = jnp.zeros((B, n_all), jnp.int32).at[:, 0].set(ctx.cur)
    q = jnp.zeros((B, n_all, V), jnp.float32).at[:, 0].set(first)
    D = len(levels) - 1
    for d in range(1, D + 1):
        lo, hi = levels[d]
        plo, phi = levels[d - 1]
        k = int(ranks[lo:hi].max()) + 1
        choices = _choose(ctx.draft_sampler, q[:, plo:phi], k, ctx, ctx.pos + d)  # [B, P, k]
        pidx = jnp.asarray(parents[lo:hi] - plo)
        toks = choices[:, pidx, jnp.asarray(ranks[lo:hi])]  # [B, hi - lo]
        tokens = tokens.at[:, lo:hi].set(toks)
        if d < D:
            logits, carry = step(d, toks, lo, hi, carry)
            q = q.at[:, lo:hi].set(logits)
    return tokens, jnp.broadcast_to(jnp.asarray(parents), (B, n_all)), q, carry


def static_tree_input(tree, lo: int, hi: int, root, slot0, depth_offset: int = 0):
    """The `TreeInput` of the nodes lo..hi-1 of a static tree whose node i was written at
    slot slot0 + i (slot0 [B]); depths shifted down by depth_offset (a head has no entry
    for the root)."""
    _, _, depth, anc, _ = static_layout(tree)
    D = anc.shape[1] - 1
    a = jnp.asarray(anc[lo:hi, depth_offset:])  # [n, D + 1 - offset]
    path = jnp.where(a >= 0, slot0[:, None, None] + a[None], -1)
    B = root.shape[0]
    d = jnp.broadcast_to(jnp.asarray(depth[lo:hi] - depth_offset), (B, hi - lo))
    del D
    return TreeInput(root=root, depth=d.astype(jnp.int32), path=path.astype(jnp.int32))


def child_scores(ctx, logits, d: int):
    """Log-probabilities [B, n, V] of children at position pos + d from draft logits
    [B, n, V]; with a sampling draft, plus the position-keyed Gumbel noise, so a node's
    best child is the draft's own sample (gumbel_coupled couples it with the target's)."""
    B, n, V = logits.shape
    sampler = ctx.draft_sampler
    if isinstance(sampler, Greedy):
        return jax.nn.log_softmax(logits, axis=-1)
    x = jax.nn.log_softmax(sampler.filtered_logits(logits.reshape(B * n, V)), axis=-1)
    g = gumbel_noise(ctx.seed, jnp.repeat(ctx.rows, n), jnp.repeat(ctx.pos + d, n), V)
    return (x + g).reshape(B, n, V)


def expand_dynamic(tree, ctx, first, step, carry):
    """EAGLE-2's dynamic tree: top_k children of the root; at each further depth the
    top_k frontier nodes (by cumulative log-probability) expand their top_k children;
    the `nodes` best candidates are verified, ancestors before descendants. step(d,
    tokens [B, k], ids [B, k], parent_ids [B, k], carry) -> (logits [B, k, V], carry)
    runs the drafter on a frontier of depth d: its candidate ids (0.. in the order the
    candidates were made) and their parents' (-1: the root). Scores: `child_scores`.
    -> (tokens, parents, q, carry)."""
    k, N, D = tree.dynamic
    B, V = first.shape
    cand_tok, cand_par, cand_score, cand_depth = [], [], [], []
    lp = child_scores(ctx, first[:, None], 1)[:, 0]  # [B, V]
    s, t = jax.lax.top_k(lp, k)  # depth 1: the root's top_k
    cand_tok.append(t)
    cand_par.append(jnp.full((B, k), -1, jnp.int32))
    cand_score.append(s)
    cand_depth.append(jnp.ones((B, k), jnp.int32))
    frontier = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (B, k))  # candidate ids
    f_par = jnp.full((B, k), -1, jnp.int32)
    f_tok, f_score = t.astype(jnp.int32), s
    n_cand = k
    for d in range(2, D + 1):
        logits, carry = step(d - 1, f_tok, frontier, f_par, carry)  # [B, k, V]
        lp = child_scores(ctx, logits, d)
        cs, ct = jax.lax.top_k(lp, k)  # [B, k, k]
        cs = f_score[:, :, None] + cs
        cand_tok.append(ct.reshape(B, k * k))
        cand_par.append(jnp.repeat(frontier, k, axis=1))
        cand_score.append(cs.reshape(B, k * k))
        cand_depth.append(jnp.full((B, k * k), d, jnp.int32))
        best_s, best = jax.lax.top_k(cs.reshape(B, k * k), k)
        f_par = jnp.take_along_axis(cand_par[-1], best, axis=1)
        frontier = n_cand + best.astype(jnp.int32)
        f_tok = jnp.take_along_axis(ct.reshape(B, k * k), best, axis=1).astype(jnp.int32)
        f_score = best_s
        n_cand += k * k
    tok = jnp.concatenate(cand_tok, 1).astype(jnp.int32)  # [B, C]
    par = jnp.concatenate(cand_par, 1)
    score = jnp.concatenate(cand_score, 1)
    dep = jnp.concatenate(cand_depth, 1)
    # Only expanded parents have children: a candidate is usable if its parent was on the
    # frontier (by construction) and kept; keep the N best, then drop any whose ancestor
    # fell out (possible only on exact score ties) and order ancestors first.
    _, keep = jax.lax.top_k(score, N)  # [B, N]
    kept = jnp.zeros(score.shape, bool).at[jnp.arange(B)[:, None], keep].set(True)
    for _ in range(D):
        ok_parent = jnp.where(par >= 0, jnp.take_along_axis(kept, jnp.maximum(par, 0), 1), True)
        kept = kept & ok_parent
    order_key = jnp.where(kept, dep * score.shape[1] + jnp.arange(score.shape[1]), 1 << 30)
    order = jnp.argsort(order_key, axis=1)[:, :N]  # kept candidates, by depth
    valid = jnp.take_along_axis(kept, order, 1)
    new_index = jnp.full(score.shape, -1, jnp.int32).at[
        jnp.arange(B)[:, None], order].set(jnp.arange(1, N + 1, dtype=jnp.int32))
    o_par = jnp.take_along_axis(par, order, 1)
    parents = jnp.where(o_par >= 0, jnp.take_along_axis(new_index, jnp.maximum(o_par, 0), 1), 0)
    parents = jnp.where(valid, parents, 0)
    tokens = jnp.where(valid, jnp.take_along_axis(tok, order, 1), -1)  # -1: never accepted
    tokens = jnp.concatenate([ctx.cur[:, None], tokens], 1)
    parents = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), parents], 1)
    q = jnp.zeros((B, N + 1, V), jnp.float32).at[:, 0].set(first)
    return tokens, parents, q, carry


# ------------------------------------------------------- pieces the drafters share


def emitted(path_tokens, n, nxt):
    """[B, D + 1]: the accepted path's n tokens, then nxt (repeated after it)."""
    slot = jnp.arange(path_tokens.shape[1] + 1)[None, :]
    return jnp.where(slot < n[:, None], jnp.pad(path_tokens, ((0, 0), (0, 1))), nxt[:, None])


def root_paths(pos, count: int, D: int):
    """[B, count, D + 1]: paths holding only a root at slot pos."""
    B = pos.shape[0]
    return jnp.full((B, count, D + 1), -1, jnp.int32).at[:, :, 0].set(pos[:, None])


def first_child_logits(tokens, parents, ranks, vocab: int):
    """A deterministic drafter's q [B, N + 1, V]: at each node the point mass on its rank-0
    child (rejection sampling then examines that child alone: exact)."""
    B, n = tokens.shape
    first = np.zeros(n, np.int32)  # the rank-0 child of each node (0: none)
    for i in range(1, n):
        if ranks[i] == 0:
            first[parents[i]] = i
    return one_hot_logits(jnp.where(jnp.asarray(first)[None] > 0, tokens[:, first], 0), vocab)
