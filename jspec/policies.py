"""Verify policies: how many draft tokens to accept and which token comes next.

One verify block gives the target's logits at gamma + 1 positions: row i
conditions on the last committed token `cur` and proposals d_1..d_i, so it
predicts the token at position pos(cur) + 1 + i. Every policy returns
(n_acc [B], next [B]): the first n_acc proposals are accepted and `next` is the
target's own token after them (the correction, or the bonus when all pass).

- exact_greedy: t_i = argmax(logits_i); accept while d_{i+1} == t_i. With
  property P the logits are those of serial decoding, so the output is the
  serial greedy output.
- gumbel_coupled: t_i = argmax(logits_i / T + G(seed, row, position)) with the
  same position-keyed noise as the serial `Sample` sampler: sampled
  speculative output == sampled serial output, bit for bit.
- rejection_sampling: accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
  at the first rejection draw from norm(max(0, p - q)); if all pass draw from
  p_{gamma+1} (Leviathan et al. 2023, Chen et al. 2023). Distribution-exact,
  not token-exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.sampling import Greedy, Sample, gumbel_noise, uniform_noise

POLICIES = ("exact_greedy", "rejection_sampling", "gumbel_coupled")
_SALT_UNIFORM = 0x5EED1
_SALT_RESIDUAL = 0x5EED2


def target_sampler(policy: str, temperature: float, top_k: int, top_p: float):
    """The serial sampler whose output a policy reproduces (token- or distribution-wise)."""
    if policy == "exact_greedy":
        return Greedy()
    if policy in ("gumbel_coupled", "rejection_sampling"):
        return Sample(temperature=temperature, top_k=top_k, top_p=top_p)
    raise ValueError(f"unknown verify policy {policy!r}; choose from {POLICIES}")


def _flat(x):  # [B, G, ...] -> [B*G, ...]
    return x.reshape((-1,) + x.shape[2:])


def target_tokens(sampler, logits, seed, rows, positions):
    """Per-row target tokens of a verify block: logits [B, G, V] -> [B, G].

    Each row is sampled exactly as serial decoding samples it (same sampler,
    same (seed, row, position) key), one row at a time in effect.
    """
    B, G, _ = logits.shape
    rows_g = jnp.broadcast_to(rows[:, None], (B, G))
    toks = sampler(_flat(logits), seed, _flat(rows_g), _flat(positions))
    return toks.reshape(B, G)


def accept_matching(drafts, targets, valid=None):
    """drafts [B, g], targets [B, g+1] -> (n_acc [B], next [B]): accept while equal
    (and, where `valid` [B, g] is given, while the proposal is a token id)."""
    match = drafts == targets[:, :-1]
    if valid is not None:
        match = match & valid
    match = match.astype(jnp.int32)
    n_acc = jnp.sum(jnp.cumprod(match, axis=1), axis=1)
    nxt = jnp.take_along_axis(targets, n_acc[:, None], axis=1)[:, 0]
    return n_acc, nxt


def _log_probs(sampler: Sample, logits):
    x = sampler.filtered_logits(logits)  # [N, V], -inf outside top-k/top-p
    return jax.nn.log_softmax(x, axis=-1)


def rejection_sample(sampler: Sample, logits, draft_logits, drafts, seed, rows, positions,
                     valid=None):
    """logits [B, g+1, V], draft_logits [B, g, V] (the q the drafts were drawn from),
    drafts [B, g], positions [B, g+1] -> (n_acc [B], next [B]).

    valid [B, g]: False marks a proposal that was not a token id (`drafts` holds 0 there).
    Its q is a point mass off the vocabulary: p(d) = 0, so it is rejected, and the
    residual max(0, p - q) is p itself."""
    B, G, V = logits.shape
    g = G - 1
    logp = _log_probs(sampler, _flat(logits)).reshape(B, G, V)
    logq = _log_probs(sampler, _flat(draft_logits)).reshape(B, g, V)
    p, q = jnp.exp(logp), jnp.exp(logq)
    p_d = jnp.take_along_axis(p[:, :g], drafts[:, :, None], axis=2)[..., 0]  # [B, g]
    q_d = jnp.take_along_axis(q, drafts[:, :, None], axis=2)[..., 0]
    rows_g = jnp.broadcast_to(rows[:, None], (B, g))
    u = uniform_noise(seed + _SALT_UNIFORM, _flat(rows_g), _flat(positions[:, :g])).reshape(B, g)
    ok = u * q_d < p_d  # u < p/q without dividing by q = 0
    if valid is not None:
        ok = ok & valid
    ok = ok.astype(jnp.int32)
    n_acc = jnp.sum(jnp.cumprod(ok, axis=1), axis=1)  # [B]
    q_pad = jnp.concatenate([q, jnp.zeros((B, 1, V), q.dtype)], axis=1)  # q := 0 at the bonus
    p_j = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]  # [B, V]
    q_j = jnp.take_along_axis(q_pad, n_acc[:, None, None], axis=1)[:, 0]
    if valid is not None:  # an off-vocabulary proposal's q has no mass on the vocabulary
        hit = jnp.take_along_axis(jnp.pad(valid, ((0, 0), (0, 1)), constant_values=True),
                                  n_acc[:, None], axis=1)
        q_j = jnp.where(hit, q_j, 0.0)
    resid = jnp.maximum(p_j - q_j, 0.0)
    resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, p_j)  # p == q: draw from p
    pos_j = jnp.take_along_axis(positions, n_acc[:, None], axis=1)[:, 0]
    noise = gumbel_noise(seed + _SALT_RESIDUAL, rows, pos_j, V)
    logr = jnp.where(resid > 0, jnp.log(resid), -jnp.inf)
    nxt = jnp.argmax(logr + noise, axis=-1).astype(jnp.int32)
    return n_acc, nxt


def verify(policy: str, sampler, logits, drafts, draft_logits, seed, rows, positions,
           valid=None):
    """Dispatches a policy. logits [B, g+1, V]; drafts [B, g]; positions [B, g+1];
    valid [B, g] (optional): proposals that are token ids; the others are rejected."""
    if policy in ("exact_greedy", "gumbel_coupled"):
        targets = target_tokens(sampler, logits, seed, rows, positions)
        return accept_matching(drafts, targets, valid)
    if policy == "rejection_sampling":
        return rejection_sample(sampler, logits, draft_logits, drafts, seed, rows, positions,
                                valid)
    raise ValueError(f"unknown verify policy {policy!r}; choose from {POLICIES}")


# ------------------------------------------------------------------------------ trees
_SALT_TREE_UNIFORM = 0x5EED3


def tree_children(parents, k: int):
    """parents [B, N + 1] (-1 for the root; parents before children) -> children
    [B, N + 1, k]: each node's children in index order (their draft rank order), -1 past
    the last."""
    B, n = parents.shape
    same = (parents[:, :, None] == parents[:, None, :]) & (
        jnp.arange(n)[None, None, :] < jnp.arange(n)[None, :, None])  # [B, i, j]: j < i sibling
    order = jnp.sum(same, axis=-1)  # [B, N + 1]: i's place among its siblings
    ok = (parents >= 0) & (order < k)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, n))
    children = jnp.full((B, n + 1, k), -1, jnp.int32)  # one spare row for the root's -1
    children = children.at[rows, jnp.where(ok, parents, n), jnp.where(ok, order, 0)].set(
        jnp.where(ok, jnp.arange(n, dtype=jnp.int32)[None], -1))
    return children[:, :n]


def accept_tree_matching(tokens, parents, depth, targets, valid, max_depth: int):
    """The deepest node whose every token equals the target's token at its parent:
    tokens, parents, depth, targets [B, N + 1], valid [B, N + 1] -> (node [B], n [B] its
    depth, next token [B] the target's after it). Ties: the lowest index."""
    B, n = tokens.shape
    parent = jnp.maximum(parents, 0)
    match = valid & (tokens == jnp.take_along_axis(targets, parent, 1))
    acc = jnp.zeros((B, n), bool).at[:, 0].set(True)
    for d in range(1, max_depth + 1):  # parents are accepted before their children
        acc = acc | ((depth == d) & match & jnp.take_along_axis(acc, parent, 1))
    key = jnp.where(acc, depth * n + (n - 1 - jnp.arange(n)[None]), -1)
    node = jnp.argmax(key, axis=1).astype(jnp.int32)
    pick = lambda x: jnp.take_along_axis(x, node[:, None], 1)[:, 0]  # noqa: E731
    return node, pick(depth), pick(targets)


def rejection_sample_tree(sampler: Sample, logits, q_logits, tokens, parents, depth, valid,
                          seed, rows, positions, *, max_depth: int, max_children: int,
                          update_q: bool = True):
    """Recursive rejection sampling over a tree whose children were drawn from the draft
    distribution q without replacement, in index order (SpecInfer's multi-draft scheme in
    its without-replacement form): at the current node, child i is accepted with
    probability min(1, p(c_i) / q(c_i)); on a rejection p <- norm(max(p - q, 0)) and c_i
    leaves q (renormalised); an accepted child becomes the current node; when no child is
    accepted the next token is drawn from p. The output is distributed as the target's p
    at every step. logits, q_logits [B, N + 1, V]; positions [B, N + 1] the position of
    the token after each node. update_q=False is a known-broken variant (the rejected
    child stays in q) that tests use to show their check can fail.
    -> (node [B], n [B], next token [B])."""
    B, n, V = logits.shape
    p_all = jnp.exp(_log_probs(sampler, _flat(logits)).reshape(B, n, V))
    q_all = jnp.exp(_log_probs(sampler, _flat(q_logits)).reshape(B, n, V))
    children = tree_children(parents, max_children)
    rb = jnp.arange(B)
    u_node = jnp.zeros((B,), jnp.int32)
    p, q = p_all[:, 0], q_all[:, 0]
    stopped = jnp.zeros((B,), bool)
    for _ in range(max_depth):
        moved = jnp.zeros((B,), bool)
        pos = positions[rb, u_node]
        for i in range(max_children):
            c = children[rb, u_node, i]
            has = (c >= 0) & ~stopped & ~moved
            cc = jnp.maximum(c, 0)
            has = has & valid[rb, cc]
            tok = tokens[rb, cc]
            pc, qc = p[rb, tok], q[rb, tok]
            u = uniform_noise(seed + _SALT_TREE_UNIFORM, rows * max_children + i, pos)
            live = has & (qc > 0)
            accept = live & (u * qc < pc)
            reject = live & ~accept
            # A rejection: p <- norm(max(p - q, 0)) (p itself if that is empty) and the
            # rejected token leaves q.
            resid = jnp.maximum(p - q, 0.0)
            z = jnp.sum(resid, -1, keepdims=True)
            p_rej = jnp.where(z > 0, resid / jnp.where(z > 0, z, 1.0), p)
            q_rm = q.at[rb, tok].set(0.0) if update_q else q
            zq = jnp.sum(q_rm, -1, keepdims=True)
            q_rej = jnp.where(zq > 0, q_rm / jnp.where(zq > 0, zq, 1.0), 0.0)
            p = jnp.where(reject[:, None], p_rej, p)
            q = jnp.where(reject[:, None], q_rej, q)
            # An acceptance moves down: the child's own p and q.
            u_node = jnp.where(accept, cc, u_node)
            p = jnp.where(accept[:, None], p_all[rb, cc], p)
            q = jnp.where(accept[:, None], q_all[rb, cc], q)
            moved = moved | accept
        stopped = stopped | ~moved
    pos = positions[rb, u_node]
    noise = gumbel_noise(seed + _SALT_RESIDUAL, rows, pos, V)
    logr = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), -jnp.inf)
    nxt = jnp.argmax(logr + noise, axis=-1).astype(jnp.int32)
    return u_node, depth[rb, u_node], nxt


def verify_tree(policy: str, sampler, logits, tokens, parents, depth, q_logits, valid, seed,
                rows, positions, *, max_depth: int, max_children: int):
    """Dispatches a policy over a tree verify: logits [B, N + 1, V] of the root and the
    nodes; positions [B, N + 1] of the token after each. -> (node, n, next token) [B]."""
    if policy in ("exact_greedy", "gumbel_coupled"):
        targets = target_tokens(sampler, logits, seed, rows, positions)
        return accept_tree_matching(tokens, parents, depth, targets, valid, max_depth)
    if policy == "rejection_sampling":
        return rejection_sample_tree(sampler, logits, q_logits, tokens, parents, depth, valid,
                                     seed, rows, positions, max_depth=max_depth,
                                     max_children=max_children)
    raise ValueError(f"unknown verify policy {policy!r}; choose from {POLICIES}")
