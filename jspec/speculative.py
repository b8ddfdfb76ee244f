"""Speculative generation: draft, verify, accept, commit, in one jitted while_loop.

Invariant between rounds: the target cache holds every committed token of a row
except the last one, `cur`, at positions 0..pos-1; `cur` sits at `pos`.

One round (all rows at once, each with its own pos and acceptance):
  draft   d_1..d_g = drafter.propose(...)                    g = gamma
  verify  logits = target.forward([cur, d_1..d_g])           one call, T = g + 1
          row i is the target's view after cur, d_1..d_i
  accept  (n_acc, nxt) = policy(logits, drafts)             nxt: correction or bonus
  commit  emit d_1..d_{n_acc}, nxt; target length -> pos + n_acc + 1 (a rollback:
          the rejected entries past it are never read); cur <- nxt;
          drafter.commit(...) catches the draft up.

Under property P the verify logits of row i are bitwise the logits serial
decoding computes at that position, so `exact_greedy` reproduces serial greedy
and `gumbel_coupled` reproduces serial `Sample` output token for token.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec._checks import check_bool, check_ints, check_type, check_x32, is_int
from jspec.adaptive import Controller, snapshot
from jspec.cache import init_cache, rollback
from jspec.chunked_prefill import check_lens
from jspec.chunked_prefill import prefill as chunked_prefill
from jspec.compaction import RowBook, batch_for, check_batch_major, compact, plan
from jspec.drafters import FeatureDrafter, ModelDrafter, OracleDrafter, PromptLookupDrafter
from jspec.drafting import ProposeContext, check_drafter, grows_trees
from jspec.generate import (
    PAD,
    check_not_a_draft,
    first_non_finite,
    pad_prompts,
    plan_shapes,
    verify_what,
)
from jspec.loop import (
    DRAFT_CODE,
    POLICY_CODE,
    POLICY_INVALID_CODE,
    check_until,
    raise_non_finite,
    rows_until,
    run_chunked,
    token_bar,
)
from jspec.model import (
    COMPILER_OPTIONS,
    Forward,
    Model,
    apply,
    check_runs_here,
    check_token_ids,
    row_flags,
)
from jspec.sampling import with_lowering
from jspec.spec_config import SpecConfig, shape_spec
from jspec.tree import TreeConfig, commit_path, from_parents, well_formed


@struct.dataclass
class SpecState:
    """Loop state of speculative decoding.

    Attributes:
      step: [] int32 rounds done.
      cache: target KV cache (committed tokens except `cur`).
      draft: the drafter's state pytree.
      cur: [B] int32 last committed token.
      out: [B, N] int32 generated tokens, PAD after a stop.
      num: [B] int32 tokens generated per row.
      done: [B] bool.
      proposed, accepted: [B] int32 draft tokens proposed / accepted per row.
      accepted_at: [B, depth] int32 accepted proposals per row by draft position / tree
        depth (depth: the deepest round shape's).
      rounds_live: [B] int32 verify rounds in which the row was still live.
      audit_bad: [] bool, a runtime audit found a difference (the loop stops).
      audit_at: [3] int32 (round, row, block row) of the first difference.
      audit_logits: [2, V] f32 verify and serial logits of that position.
      audits: [] int32 blocks audited.
      bad: [] bool, a live row's verify logits hold NaN or inf, or the forward flagged its
        activations (`Forward.bad`; the prompt's included): the loop stops.
      bad_at: [3] int32 (row, position, code) of the first such block (position of cur
        and code -1 when only the logits are broken; `jspec.loop.raise_non_finite`).
      rows: [B] int32 each row's id in the run's batch (its noise key and its row of
        `out`; `SpecConfig.compact` keeps the live rows only; a padding row holds the
        batch size, an id past `out`, and is done).
    """

    step: jax.Array
    cache: object
    draft: object
    cur: jax.Array
    out: jax.Array
    num: jax.Array
    done: jax.Array
    proposed: jax.Array
    accepted: jax.Array
    accepted_at: jax.Array
    rounds_live: jax.Array
    audit_bad: jax.Array
    audit_at: jax.Array
    audit_logits: jax.Array
    audits: jax.Array
    bad: jax.Array
    bad_at: jax.Array
    rows: jax.Array


class ParityError(RuntimeError):
    """A runtime audit found verify logits that differ from serial decoding."""


def feature_layers(drafter) -> tuple[int, ...]:
    """The target layers whose hidden states the drafter reads (() for most drafters)."""
    return tuple(drafter.feature_layers)


def _prefill(target: Model, drafter, tokens, lens, seed, *, spec: SpecConfig, max_len: int):
    B = tokens.shape[0]
    cache = init_cache(target, B, max_len)
    # Chunked, no LM head; the cache stops at lens - 1: cur = the last prompt token, which
    # the first verify block computes (the logits it samples from).
    pre = chunked_prefill(target, tokens, lens, cache, features=feature_layers(drafter))
    cache, feats, flags = pre.cache, pre.features, pre.flags  # flags [B, 2]
    bad = flags[:, 0] >= 0
    row = jnp.argmax(bad).astype(jnp.int32)
    cur = jnp.take_along_axis(tokens, (lens - 1)[:, None], axis=1)[:, 0]
    extra = {} if feats is None else {"features": feats}  # only feature drafters take them
    draft = drafter.init(tokens, lens, max_len, spec.depth, **extra)
    g, N = spec.depth, spec.max_new_tokens
    z = jnp.zeros((B,), jnp.int32)
    return SpecState(step=jnp.int32(0), cache=cache, draft=draft, cur=cur,
                     out=jnp.full((B, N), PAD, jnp.int32), num=z, done=jnp.zeros((B,), bool),
                     proposed=z, accepted=z, accepted_at=jnp.zeros((B, g), jnp.int32),
                     rounds_live=z, audit_bad=jnp.zeros((), bool),
                     audit_at=jnp.full((3,), -1, jnp.int32),
                     audit_logits=jnp.zeros((2, target.config.vocab_size), jnp.float32),
                     audits=jnp.int32(0), bad=jnp.any(bad),
                     bad_at=jnp.where(jnp.any(bad), jnp.stack([row, flags[row, 1], flags[row, 0]]),
                                      -1),
                     rows=jnp.arange(B, dtype=jnp.int32))


def context(target: Model, state: SpecState, seed, *, spec: SpecConfig) -> ProposeContext:
    """The round's `ProposeContext` (cur, positions, row ids, the drafter's seed, gamma,
    the vocabulary, the draft sampler) from a state, for a loop of your own around the
    phases: `draft_step(drafter, state.draft, context(...))`, then `commit_step`."""
    check_type("state", state, SpecState, "a jspec.speculative.SpecState (prefill)")
    _check_phase_spec(spec, "context")
    _check_seed_arg(seed, "context")
    return _context(target, state, seed, spec)


def _concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _check_seed_arg(seed, name: str) -> None:
    """A phase's seed: an integer scalar (traced: its dtype and shape; concrete: also its
    value in [0, 2**31)), not a float or a negative int wrapped silently."""
    shape, dtype = np.shape(seed), getattr(seed, "dtype", None)
    if dtype is None:
        dtype = np.asarray(seed).dtype
    if shape != () or not np.issubdtype(dtype, np.integer) or dtype == np.bool_:
        raise ValueError(f"{name}: seed must be an integer scalar (e.g. jnp.int32(0)); got "
                         f"shape {shape}, dtype {dtype}")
    if _concrete(seed) and not 0 <= int(seed) < 2**31:
        raise ValueError(f"{name}: seed={int(seed)} must lie in [0, 2**31)")


def _context(target: Model, state: SpecState, seed, spec: SpecConfig) -> ProposeContext:
    draft_seed = seed + spec.policy.draft_seed_salt if spec.policy.draft_seed_salt else seed
    return ProposeContext(cur=state.cur, pos=state.cache.lengths,
                          rows=state.rows, seed=draft_seed,
                          gamma=spec.depth, vocab=target.config.vocab_size,
                          draft_sampler=spec.draft_sampler())


def _check_proposals(drafter, what: str, x, shape: tuple, kind: str) -> None:
    """A drafter's output against the `jspec.Drafter` protocol, at trace time (shapes and
    dtypes are static): a clear error naming the drafter, never a silent cast or a block
    past the cache the engine planned."""
    got_shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    ok_dtype = dtype is not None and (
        jnp.issubdtype(dtype, jnp.integer) if kind == "int" else
        jnp.issubdtype(dtype, jnp.floating))
    if got_shape is None or tuple(got_shape) != shape or not ok_dtype:
        want = "integer token ids" if kind == "int" else "floating-point logits"
        got = (f"{dtype}{list(got_shape)}" if got_shape is not None
               else type(x).__name__)
        raise ValueError(f"{type(drafter).__name__}: {what} must be {want} of shape "
                         f"{list(shape)} (the jspec.Drafter protocol); got {got}")


def _unpack(drafter, method: str, out, names: tuple[str, ...]):
    """A drafter method's answer as the tuple of `names` the `jspec.Drafter` protocol
    returns, else a ValueError naming the drafter and method (not Python's bare "not
    enough values to unpack")."""
    if not isinstance(out, tuple | list) or len(out) != len(names):
        got = (f"{len(out)} values" if isinstance(out, tuple | list)
               else f"one {type(out).__name__}")
        raise ValueError(f"{type(drafter).__name__}.{method} must return the "
                         f"{len(names)}-tuple ({', '.join(names)}) (the jspec.Drafter "
                         f"protocol); got {got}")
    return tuple(out)


def _leaf_kind(x) -> str:
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    return f"{dtype}{list(shape)}" if shape is not None else type(x).__name__


def _check_state(drafter, method: str, new, carry) -> None:
    """The drafter state `method` returned against the state the loop carries (the one
    `init`, then the previous round's commit, returned), at trace time: the same pytree
    structure, leaf shapes and dtypes (the `jspec.Drafter` protocol), else a ValueError
    naming the drafter, the method and the first leaf that differs (not the while_loop's
    "carry input and carry output must have equal types")."""
    name = f"{type(drafter).__name__}.{method}"
    want, got = jax.tree_util.tree_structure(carry), jax.tree_util.tree_structure(new)
    if want != got:
        raise ValueError(f"{name} must return the drafter state in the form init returned "
                         f"it (the loop carries it from round to round; the jspec.Drafter "
                         f"protocol): expected a pytree {want}, got {got}")
    paths = jax.tree_util.tree_flatten_with_path(carry)[0]
    for (path, a), b in zip(paths, jax.tree_util.tree_leaves(new), strict=True):
        weak = getattr(a, "weak_type", False)  # the loop promotes a weak-typed carry
        if (getattr(a, "shape", None) != getattr(b, "shape", None)
                or (not weak and getattr(a, "dtype", None) != getattr(b, "dtype", None))):
            raise ValueError(f"{name} must return the drafter state in the form init "
                             f"returned it (the loop carries it from round to round; the "
                             f"jspec.Drafter protocol): state{jax.tree_util.keystr(path)} "
                             f"should be {_leaf_kind(a)}, got {_leaf_kind(b)}")


def _draft(drafter, dstate, ctx: ProposeContext, *, draft_logits_read: bool = False):
    """Phase 1: gamma proposals [B, g] (+ the logits they came from [B, g, V], checked
    where the policy reads them)."""
    drafts, draft_logits, dstate = _unpack(drafter, "propose", drafter.propose(dstate, ctx),
                                           ("drafts", "draft_logits", "state"))
    B, g = ctx.cur.shape[0], ctx.gamma
    _check_proposals(drafter, "propose's drafts", drafts, (B, g), "int")
    if draft_logits_read:
        _check_proposals(drafter, "propose's draft_logits", draft_logits, (B, g, ctx.vocab),
                         "float")
    return drafts.astype(jnp.int32), draft_logits, dstate


def _in_vocab(drafts, vocab: int):
    """Proposals that are token ids [B, g] bool. The others (a broken drafter's) are
    rejected by every policy and fed to the target as 0, so they never reach its cache."""
    return (drafts >= 0) & (drafts < vocab)


def _verify(target: Model, cache, cur, drafts, layers: tuple[int, ...] = ()) -> Forward:
    """Phase 2: one target forward over [cur, d_1..d_g]: logits [B, g+1, V], the cache (and
    with `layers`, the hidden states entering them [B, g+1, n D] for a feature drafter)."""
    drafts = jnp.where(_in_vocab(drafts, target.config.vocab_size), drafts, 0)
    tokens = jnp.concatenate([cur[:, None], drafts], axis=1)  # [B, g+1]
    return apply(target, tokens, cache, features=layers)


def _accept(logits, drafts, draft_logits, seed, pos, *, spec: SpecConfig, rows=None):
    """Phase 3: the policy's (n_acc [B], next token [B]); pos [B] is the position of cur;
    rows [B] the rows' ids (noise keys; default 0..B-1). A proposal outside the vocabulary
    is never accepted."""
    B, G, V = logits.shape
    rows = jnp.arange(B, dtype=jnp.int32) if rows is None else rows
    positions = pos[:, None] + 1 + jnp.arange(G, dtype=jnp.int32)[None, :]
    valid = _in_vocab(drafts, V)
    out = spec.policy.accept(logits, jnp.where(valid, drafts, 0), draft_logits, seed, rows,
                             positions, valid)
    return _check_answer(spec.policy, "accept", out, ("n_acc", "next"), B)


def _check_answer(policy, method: str, out, names: tuple[str, ...], B: int):
    """A policy's answer against the `jspec.Policy` protocol, at trace time: a tuple of
    integer arrays of shape [B] each, else a ValueError naming the policy (not a
    broadcast scalar or a float count deep inside the loop's carry). -> int32 arrays."""
    def kind(x):  # int32[2], or the type of a non-array
        shape = getattr(x, "shape", None)
        return f"{x.dtype}{list(shape)}" if shape is not None else type(x).__name__

    want = ", ".join(f"{n} [{B}]" for n in names)
    if not isinstance(out, tuple | list) or len(out) != len(names):
        got = (f"{len(out)} values" if isinstance(out, tuple | list) else f"one {kind(out)}")
        raise ValueError(f"{type(policy).__name__}.{method} must return ({want}) (the "
                         f"jspec.Policy protocol); got {got}")
    for n, x in zip(names, out, strict=True):
        shape = getattr(x, "shape", None)
        if shape is None or tuple(shape) != (B,) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{type(policy).__name__}.{method}: {n} must be integers of "
                             f"shape [{B}] (the jspec.Policy protocol); got {kind(x)}")
    return tuple(x.astype(jnp.int32) for x in out)


def _commit(drafter, state: SpecState, ctx: ProposeContext, cache, dstate, drafts, n_acc, nxt,
            *, spec: SpecConfig, features=None, tree: bool = False) -> SpecState:
    """Phase 4: emit d_1..d_{n_acc}, nxt (cut at max_new_tokens and stop tokens), roll the
    target back to pos + n_acc + 1, catch the drafter up, update statistics."""
    g, N = drafts.shape[1], spec.max_new_tokens
    B = state.cur.shape[0]
    rows, pos = ctx.rows, ctx.pos
    live = ~state.done
    n_acc = jnp.where(live, n_acc, 0)
    slot = jnp.arange(g + 1)[None, :]
    emit = jnp.where(slot < n_acc[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), nxt[:, None])
    count = jnp.minimum(n_acc + 1, N - state.num)
    if spec.stop_tokens:
        is_stop = jnp.isin(emit, jnp.asarray(spec.stop_tokens, jnp.int32)) & (slot < count[:, None])
        hit = jnp.any(is_stop, axis=1)
        count = jnp.where(hit, jnp.argmax(is_stop, axis=1) + 1, count)
    else:
        hit = jnp.zeros((B,), bool)
    count = jnp.where(live, count, 0)
    dest = jnp.where(slot < count[:, None], state.num[:, None] + slot, N)  # N: dropped
    out = state.out.at[rows[:, None], dest].set(emit, mode="drop")
    num = state.num + count
    done = state.done | (live & (hit | (num >= N)))
    cache = rollback(cache, jnp.where(live, pos + n_acc + 1, pos))
    extra = {} if features is None else {"features": features}
    if tree:  # drafts: the accepted root path's tokens [B, depth]
        dstate = drafter.commit_tree(dstate, ctx, n_acc, nxt, drafts, **extra)
    else:
        dstate = drafter.commit(dstate, ctx, n_acc, nxt, drafts, **extra)
    _check_state(drafter, "commit_tree" if tree else "commit", dstate, state.draft)
    depth = state.accepted_at.shape[1]  # the deepest shape's (an adaptive run's state)
    acc_at = state.accepted_at + (
        (jnp.arange(depth)[None, :] < n_acc[:, None]) & live[:, None]).astype(jnp.int32)
    return state.replace(step=state.step + 1, cache=cache, draft=dstate,
                         cur=jnp.where(live, nxt, state.cur), out=out, num=num, done=done,
                         proposed=state.proposed + jnp.where(live, spec.proposals, 0),
                         accepted=state.accepted + n_acc, accepted_at=acc_at,
                         rounds_live=state.rounds_live + live.astype(jnp.int32))


def _serial_replay(target: Model, cache, tokens):
    """tokens [B, G] fed one at a time from `cache` -> logits [B, G, V] (serial decoding)."""

    def step(c, tok):  # tok [B]
        logits, c = apply(target, tok[:, None], c)
        return c, logits[:, 0]

    _, logits = jax.lax.scan(step, cache, tokens.T)
    return jnp.moveaxis(logits, 0, 1)


def _audit(target: Model, state: SpecState, cache, cur, drafts, logits, *, spec: SpecConfig,
           upto=None):
    """Every `audit_every`-th block: compare the verify logits with serial replay, bitwise
    (`upto` [B]: only the first upto + 1 positions of each row, a tree's accepted path)."""
    G = drafts.shape[1] + 1

    def check(_):
        safe = jnp.where(_in_vocab(drafts, target.config.vocab_size), drafts, 0)
        tokens = jnp.concatenate([cur[:, None], safe], axis=1)  # [B, G]
        serial = _serial_replay(target, rollback(cache, state.cache.lengths), tokens)
        diff = jnp.any(jax.lax.bitcast_convert_type(serial, jnp.uint32)
                       != jax.lax.bitcast_convert_type(logits, jnp.uint32), axis=-1)  # [B, G]
        diff = diff & ~state.done[:, None]
        if upto is not None:
            diff = diff & (jnp.arange(G)[None, :] <= upto[:, None])
        flat = jnp.argmax(diff.reshape(-1))
        b, i = flat // G, flat % G
        bad = jnp.any(diff)
        return (bad, jnp.stack([state.step, state.rows[b], i]).astype(jnp.int32),
                jnp.stack([logits[b, i], serial[b, i]]))

    def skip(_):
        return jnp.zeros((), bool), state.audit_at, state.audit_logits

    due = (state.step % spec.audit_every == 0) & ~state.audit_bad
    bad, at, lg = jax.lax.cond(due, check, skip, None)
    return state.replace(audit_bad=state.audit_bad | bad,
                         audit_at=jnp.where(bad, at, state.audit_at),
                         audit_logits=jnp.where(bad, lg, state.audit_logits),
                         audits=state.audits + due.astype(jnp.int32))


def _check_finite(state: SpecState, out: Forward, pos, positions) -> SpecState:
    """Flags a verify (logits [B, G, V], pos [B] of cur, positions [B, G] of its slots) whose
    logits hold NaN or inf in a live row, or whose forward flagged its activations
    (`Forward.bad`): the loop stops after the round and the host raises NonFiniteError."""
    bad, row, flag = first_non_finite(out.logits, ~state.done, row_flags(out.bad, positions))
    at = jnp.where(flag[0] >= 0, jnp.stack([state.rows[row], flag[1], flag[0]]),
                   jnp.stack([state.rows[row], pos[row], jnp.int32(-1)]))
    return state.replace(bad=state.bad | bad, bad_at=jnp.where(bad & ~state.bad, at,
                                                                state.bad_at))


def _check_policy_range(state: SpecState, pos, outside, code: int = POLICY_CODE) -> SpecState:
    """Flags the first live row whose policy answer lies outside `jspec.Policy`'s ranges
    (outside [B] bool; values, so seen only as the loop runs): the loop stops after the
    round and the host raises a ValueError (`raise_non_finite`, code POLICY_CODE), not an
    output with holes in it. code POLICY_INVALID_CODE: the answer accepted a proposal its
    `valid` marked as no token id (the protocol says it must be rejected), so an id
    outside the vocabulary is never emitted."""
    off = outside & ~state.done
    row = jnp.argmax(off).astype(jnp.int32)
    bad = jnp.any(off)
    at = jnp.stack([state.rows[row], pos[row], jnp.int32(code)])
    return state.replace(bad=state.bad | bad, bad_at=jnp.where(bad & ~state.bad, at,
                                                                state.bad_at))


def _check_draft_logits(state: SpecState, pos, q, valid) -> SpecState:
    """Flags the first live row whose draft logits q [B, n, V] (a policy with
    `uses_draft_logits` reads them as the draft's distribution) hold NaN or +inf, or are
    -inf at every token, at a valid proposal (valid [B, n]): the loop stops after the
    round and the host raises NonFiniteError (code DRAFT_CODE), where a policy would
    otherwise sample its corrections from a NaN residual."""
    broken = (jnp.any(jnp.isnan(q) | (q == jnp.inf), axis=-1)
              | jnp.all(q == -jnp.inf, axis=-1))  # [B, n]
    return _check_policy_range(state, pos, jnp.any(broken & valid, axis=1), DRAFT_CODE)


def _tree_round(target: Model, drafter, state: SpecState, seed, *,
                spec: SpecConfig) -> SpecState:
    """A tree round: the drafter grows a tree under cur (`propose_tree`); one target
    forward verifies all of it (tree attention: every node's logits are serial decoding's
    after its root path); the policy walks it to the deepest accepted node; the accepted
    path's K/V move onto contiguous positions (`commit_path`) and the drafter catches up
    on the path (`commit_tree`)."""
    tree = spec.tree
    D, K = tree.depth, tree.max_children
    ctx = _context(target, state, seed, spec)
    tokens, parents, q, dstate = _unpack(  # [B, N + 1]
        drafter, "propose_tree", drafter.propose_tree(state.draft, ctx, tree),
        ("tokens", "parents", "q", "state"))
    V = target.config.vocab_size
    n1 = (ctx.cur.shape[0], tree.num_nodes + 1)
    _check_proposals(drafter, "propose_tree's tokens", tokens, n1, "int")
    _check_proposals(drafter, "propose_tree's parents", parents, n1, "int")
    if spec.policy.uses_draft_logits:
        _check_proposals(drafter, "propose_tree's q", q, n1 + (V,), "float")
    # A node outside a well-formed tree of depth <= D (a broken drafter's) is never
    # accepted and becomes a lone root, so the layout reads no broken parent chain.
    formed = well_formed(parents, D).at[:, 0].set(True)
    parents = jnp.where(formed, parents, -1).at[:, 0].set(-1).astype(jnp.int32)
    valid = (_in_vocab(tokens, V) & formed).at[:, 0].set(True)
    # Node 0 is cur, whatever the drafter put there (a wrong root was verified as given).
    tokens = jnp.where(valid, tokens.astype(jnp.int32), 0).at[:, 0].set(ctx.cur)
    t_in = from_parents(parents, state.cache.lengths, D)
    layers = feature_layers(drafter)
    out = apply(target, tokens, state.cache, tree=t_in, features=layers)
    logits, cache = out.logits, out.cache
    state = _check_finite(state, out, ctx.pos, ctx.pos[:, None] + t_in.depth)
    if spec.policy.uses_draft_logits:  # node 0's q is the root's: no proposal reads it
        state = _check_draft_logits(state, ctx.pos, q[:, 1:], valid[:, 1:])
    positions = ctx.pos[:, None] + 1 + t_in.depth  # of the token after each node
    node, n, nxt = _check_answer(spec.policy, "accept_tree", spec.policy.accept_tree(
        logits, tokens, parents, t_in.depth, q, valid, seed, ctx.rows, positions, max_depth=D,
        max_children=K), ("node", "n", "next"), ctx.cur.shape[0])
    state = _check_policy_range(state, ctx.pos, (node < 0) | (node >= n1[1]) | (n < 0) | (n > D)
                                | (nxt < 0) | (nxt >= V))
    path = jnp.take_along_axis(t_in.path, node[:, None, None], axis=1)[:, 0]  # [B, D + 1]
    idx = jnp.maximum(path - ctx.pos[:, None], 0)  # the path's call indices
    path_tokens = jnp.take_along_axis(tokens, idx[:, 1:], axis=1)  # [B, D]
    # An accepted node the engine marked invalid (not a token id, or off a well-formed
    # tree) breaks the protocol: flagged, never committed as if it were a draft.
    on_path = (jnp.take_along_axis(valid, idx[:, 1:], axis=1)
               | (jnp.arange(D)[None, :] >= n[:, None]))
    at_node = jnp.take_along_axis(valid, jnp.clip(node, 0, n1[1] - 1)[:, None], axis=1)[:, 0]
    state = _check_policy_range(state, ctx.pos, ~jnp.all(on_path, axis=1) | ~at_node,
                                POLICY_INVALID_CODE)
    if spec.audit_every:
        path_logits = jnp.take_along_axis(logits, idx[:, :, None], axis=1)  # [B, D + 1, V]
        state = _audit(target, state, cache, state.cur, path_tokens, path_logits, spec=spec,
                       upto=n)
    cache = commit_path(cache, ctx.pos, path, n)
    feats = None
    if layers:  # the root's and the path's features, as a chain commit reads them
        feats = jnp.take_along_axis(out.features, idx[:, :, None], axis=1)  # [B, D + 1, n Dt]
    return _commit(drafter, state, ctx, cache, dstate, path_tokens, n, nxt, spec=spec,
                   features=feats, tree=True)


def _check_phase_spec(spec: SpecConfig, name: str) -> None:
    check_type("spec", spec, SpecConfig, "a jspec.SpecConfig")
    if spec.seed:
        raise ValueError(f"{name}: spec.seed={spec.seed} is not read here; the phases take "
                         "the seed as their `seed` argument (pass spec.static())")


def _check_phase(state: SpecState, spec: SpecConfig, name: str) -> None:
    """A phase's state against its spec, at trace time (shapes and static fields): a
    research loop's mismatch named, never a round that runs with the wrong widths."""
    _check_phase_spec(spec, name)
    # (an adaptive run's shapes are shallower than the state's depth: theirs is the most)
    if state.out.shape[1] != spec.max_new_tokens or state.accepted_at.shape[1] < spec.depth:
        raise ValueError(f"{name}: the state was made for max_new_tokens="
                         f"{state.out.shape[1]}, depth {state.accepted_at.shape[1]}; this spec "
                         f"has max_new_tokens={spec.max_new_tokens}, depth {spec.depth} (run "
                         "a state with the spec `prefill` made it with)")


def _round(target: Model, drafter, state: SpecState, seed, *, spec: SpecConfig) -> SpecState:
    """draft -> verify -> accept -> commit."""
    if spec.tree is not None:
        return _tree_round(target, drafter, state, seed, spec=spec)
    ctx = _context(target, state, seed, spec)
    if spec.proposals:
        drafts, draft_logits, dstate = _draft(drafter, state.draft, ctx,
                                              draft_logits_read=spec.policy.uses_draft_logits)
    else:  # a plain decode step (an adaptive shape): verify [cur] alone, no proposals
        B, V = state.cur.shape[0], target.config.vocab_size
        drafts, draft_logits = jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0, V), jnp.float32)
        dstate = state.draft
    out = _verify(target, state.cache, state.cur, drafts, feature_layers(drafter))
    logits, cache, feats = out.logits, out.cache, out.features
    G = logits.shape[1]
    state = _check_finite(state, out, ctx.pos, ctx.pos[:, None] + jnp.arange(G)[None, :])
    if spec.proposals and spec.policy.uses_draft_logits:
        state = _check_draft_logits(state, ctx.pos, draft_logits,
                                    _in_vocab(drafts, target.config.vocab_size))
    if spec.audit_every:
        state = _audit(target, state, cache, state.cur, drafts, logits, spec=spec)
    n_acc, nxt = _accept(logits, drafts, draft_logits, seed, ctx.pos, spec=spec, rows=ctx.rows)
    V = target.config.vocab_size
    state = _check_policy_range(state, ctx.pos,
                                (n_acc < 0) | (n_acc >= G) | (nxt < 0) | (nxt >= V))
    # The proposals a policy may accept: the leading token ids (`valid`, which it must
    # honour). Accepting one past them would emit an id outside the vocabulary: flagged.
    lead = jnp.sum(jnp.cumprod(_in_vocab(drafts, V).astype(jnp.int32), axis=1), axis=1)
    state = _check_policy_range(state, ctx.pos, n_acc > lead, POLICY_INVALID_CODE)
    # A flagged round still commits (its tokens are never returned: the host raises).
    return _commit(drafter, state, ctx, cache, dstate, drafts, n_acc, nxt, spec=spec,
                   features=feats)


# The phases as jitted functions, for research scripts that compose them. `one_round` and
# `spec_loop` donate `state` (its buffers are reused): continue from the state they return;
# the one passed in is deleted (reading it raises "Array has been deleted"). They flag a
# broken round in the state and stop; `check_state` raises what the engine would.
_prefill_jit = jax.jit(_prefill, static_argnames=("spec", "max_len"),
                      compiler_options=COMPILER_OPTIONS)


def prefill(target: Model, drafter, tokens, lens, seed, *, spec: SpecConfig,
            max_len: int) -> SpecState:
    """The first phase from the host: a chunked prefill of tokens [B, P] (row b's prompt
    tokens[b, :lens[b]]) into a cache of max_len and the drafter's state -> SpecState.
    Concrete arguments are checked first (ids in the vocabulary, lens in [1, P], a spec
    without a seed: pass spec.static() and the seed as `seed`), each error naming the
    problem: traced, a length of 0 would read as a cache of length -1 without a word.
    `prefill.lower` lowers it (the arguments unchecked)."""
    _validate(target, drafter, spec)  # what speculative_generate checks first
    _check_phase_spec(spec, "prefill")
    _check_seed_arg(seed, "prefill")
    if _concrete(tokens, lens):
        toks = np.asarray(tokens)
        if toks.ndim != 2 or not np.issubdtype(toks.dtype, np.integer) \
                or toks.dtype == np.bool_:
            raise ValueError(f"tokens must be integer ids [B, P]; got shape {toks.shape}, "
                             f"dtype {toks.dtype}")
        check_lens(lens, *toks.shape)
        check_token_ids(toks, target.config.vocab_size)  # (a max_len too small for the
        # run is the rounds' flag: check_state names the full cache)
    return _prefill_jit(target, drafter, tokens, lens, seed, spec=spec, max_len=max_len)


prefill.lower = _prefill_jit.lower
draft_step = jax.jit(_draft, compiler_options=COMPILER_OPTIONS)
_verify_jit = jax.jit(_verify, static_argnames=("layers",), compiler_options=COMPILER_OPTIONS)
_accept_jit = jax.jit(_accept, static_argnames=("spec",), compiler_options=COMPILER_OPTIONS)


def _commit_phase(drafter, state: SpecState, ctx: ProposeContext, cache, dstate, drafts,
                  n_acc, nxt, *, spec: SpecConfig, features=None,
                  forward: Forward | None = None) -> SpecState:
    """`commit_step`'s body: the checks the engine's rounds make before their commit (a
    loop of one's own skips them), then `_commit`. An answer outside n_acc in [0, g], nxt
    in [0, V) is flagged (`check_state` raises) and n_acc clipped, so a flagged state
    never holds a negative length; `forward`'s NaN / inf logits and flags are flagged."""
    g, pos = drafts.shape[1], ctx.pos
    if forward is not None:
        G = forward.logits.shape[1]
        state = _check_finite(state, forward, pos, pos[:, None] + jnp.arange(G)[None, :])
    state = _check_policy_range(state, pos, (n_acc < 0) | (n_acc > g) | (nxt < 0)
                                | (nxt >= ctx.vocab))
    return _commit(drafter, state, ctx, cache, dstate, drafts, jnp.clip(n_acc, 0, g), nxt,
                   spec=spec, features=features)


_commit_jit = jax.jit(_commit_phase, static_argnames=("spec",),
                      compiler_options=COMPILER_OPTIONS)


def _check_rows(name: str, B: int, **arrays) -> None:
    """Each named array's shape: [B] or [B, ...] as `want` says, before tracing."""
    for what, (x, want) in arrays.items():
        shape = np.shape(x)
        if len(shape) != len(want) or shape[0] != B or any(
                w is not None and s_ != w for s_, w in zip(shape[1:], want[1:], strict=True)):
            spelled = ", ".join("B" if i == 0 else ("*" if w is None else str(w))
                                for i, w in enumerate(want))
            raise ValueError(f"{name}: {what} must be [{spelled}] with B={B}; got shape "
                             f"{shape}")


def verify_step(target: Model, cache, cur, drafts, layers: tuple[int, ...] = ()) -> Forward:
    """Phase 2: one target forward over [cur, d_1..d_g] (cur [B], drafts [B, g]) -> its
    `Forward` (logits [B, g+1, V], the cache; it unpacks as (logits, cache)). Proposals
    outside the vocabulary are fed as 0 (no policy accepts them); cur is checked on the
    host when concrete (traced, a bad id reads a clamped row and is flagged)."""
    check_type("target", target, Model, "a jspec.Model (jspec.load_hf, jspec.random_model)")
    if np.ndim(cur) != 1:
        raise ValueError(f"verify_step: cur must be [B] (one token a row); got shape "
                         f"{np.shape(cur)}")
    B = np.shape(cur)[0]
    _check_rows("verify_step", B, drafts=(drafts, (B, None)))
    if _concrete(cur):
        check_token_ids(np.asarray(cur)[:, None], target.config.vocab_size)
    return _verify_jit(target, cache, cur, drafts, layers=layers)


def accept_step(logits, drafts, draft_logits, seed, pos, *, spec: SpecConfig, rows=None):
    """Phase 3: the policy's (n_acc [B], next [B]) for verify logits [B, g+1, V], drafts [B,
    g], pos [B] (cur's positions); draft_logits [B, g, V] where the policy reads them."""
    _check_phase_spec(spec, "accept_step")
    _check_seed_arg(seed, "accept_step")
    if np.ndim(logits) != 3:
        raise ValueError(f"accept_step: logits must be [B, g+1, V]; got shape "
                         f"{np.shape(logits)}")
    B, G, V = np.shape(logits)
    _check_rows("accept_step", B, drafts=(drafts, (B, G - 1)), pos=(pos, (B,)))
    if spec.policy.uses_draft_logits:
        if draft_logits is None:
            raise ValueError(f"accept_step: {type(spec.policy).__name__} reads the draft's "
                             "logits; pass draft_step's draft_logits [B, g, V]")
        _check_rows("accept_step", B, draft_logits=(draft_logits, (B, G - 1, V)))
    return _accept_jit(logits, drafts, draft_logits, seed, pos, spec=spec, rows=rows)


def commit_step(drafter, state: SpecState, ctx: ProposeContext, cache, dstate, drafts, n_acc,
                nxt, *, spec: SpecConfig, features=None,
                forward: Forward | None = None) -> SpecState:
    """Phase 4 (`_commit_phase`): n_acc [B] in [0, g] and nxt [B] in [0, V), checked on the
    host when concrete (traced: flagged in the state, `check_state` raises); pass the
    verify block's `forward` to have its NaN / inf logits flagged as the engine's rounds
    do (without it, accept_step reads NaN logits as it reads any) and its `features` (a
    feature drafter's: `verify_step(..., layers=feature_layers(drafter))`) handed on."""
    check_type("state", state, SpecState, "a jspec.speculative.SpecState (prefill)")
    _check_phase(state, spec, "commit_step")
    B = state.cur.shape[0]
    _check_rows("commit_step", B, drafts=(drafts, (B, None)), n_acc=(n_acc, (B,)),
                nxt=(nxt, (B,)))
    g = np.shape(drafts)[1]
    if _concrete(n_acc, nxt, state.done):
        live = ~np.asarray(state.done)  # (a done row's answer is never read)
        for what, v, hi in (("n_acc", np.asarray(n_acc), g + 1),
                            ("nxt", np.asarray(nxt), ctx.vocab)):
            if not np.issubdtype(v.dtype, np.integer) or np.any(((v < 0) | (v >= hi)) & live):
                raise ValueError(f"commit_step: {what}={v.tolist()} must be integers in "
                                 f"[0, {hi}) (accept_step's answer)")
    if features is None and forward is not None:
        features = forward.features
    return _commit_jit(drafter, state, ctx, cache, dstate, drafts, n_acc, nxt, spec=spec,
                       features=features, forward=forward)
def _one_round(target: Model, drafter, state: SpecState, seed, *, spec: SpecConfig
               ) -> SpecState:
    _check_phase(state, spec, "one_round")
    return _round(target, drafter, state, seed, spec=spec)


one_round = jax.jit(_one_round, static_argnames=("spec",), donate_argnames=("state",),
                    compiler_options=COMPILER_OPTIONS)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",),
                   compiler_options=COMPILER_OPTIONS)
def spec_loop(target: Model, drafter, state: SpecState, seed, stop, live_floor=None, *,
              spec: SpecConfig) -> SpecState:
    """Rounds until every row is done, or `stop` rounds (an int32 array: the host runs
    the loop in chunks), or (with `live_floor`, an int32 array) no more than live_floor
    rows are live: one lax.while_loop, no host sync inside."""

    def cond(s):
        go = (~jnp.all(s.done) & (s.step < jnp.minimum(stop, spec.max_new_tokens))
              & ~s.audit_bad & ~s.bad)
        if live_floor is not None:
            go = go & (jnp.sum(~s.done) > live_floor)
        return go

    _check_phase(state, spec, "spec_loop")
    return jax.lax.while_loop(cond, lambda s: _round(target, drafter, s, seed, spec=spec), state)


def check_state(state: SpecState, target: Model, spec: SpecConfig) -> None:
    """What `speculative_generate` checks after each call of its loop, for a loop of your
    own around `one_round` or `spec_loop`, which only flag a broken round in the state
    (`bad`, `audit_bad`) and stop: raises `jspec.NonFiniteError` (NaN or inf logits, or a
    forward's flag such as a full cache, with its layer), a ValueError (a policy's,
    drafter's or sampler's answer out of range) or `jspec.ParityError` (the runtime
    audit)."""
    check_type("state", state, SpecState, "a jspec.speculative.SpecState (prefill)")
    raise_non_finite(state.bad, state.bad_at, "speculative decoding (verify)",
                     target.config.num_layers, spec.policy)
    _raise_on_audit(state)


@dataclasses.dataclass(frozen=True)
class SpecOutput:
    """Attributes:
    tokens: [B, max_new_tokens] int32, PAD (-1) after a row's stop token.
    num_tokens: [B] int32.
    prompt_lens: [B] int32.
    stats: proposed, accepted, acceptance_rate, acceptance_by_position (the policy's
      verdicts on the drafts: an accepted draft counts even where the row's stop token
      or max_new_tokens then cut it, so they measure the drafter, not the output;
      tokens and tokens_per_target_step count the tokens returned), target_forwards,
      draft_forwards, ttft_s, tpot_s,
      tokens_per_s (timings include compilation on the first call of a shape),
      prompt_bucket, max_len (the padded prompt length and cache capacity: the shapes
      the compiled programs are keyed by), batch_sizes (the batch, then each size a
      compaction continued in: `SpecConfig.compact`) and compactions (round, live rows,
      batch of each); timeline (speculative_generate: seconds of the argument checks,
      the prefill, the loop, and after it; each call of the loop's program as [rounds,
      seconds] and their sum, calls_s: loop_s - calls_s is the host's time between
      calls).
    """

    tokens: np.ndarray
    num_tokens: np.ndarray
    prompt_lens: np.ndarray
    stats: dict

    def row(self, b: int) -> list[int]:
        return [int(t) for t in self.tokens[b, : self.num_tokens[b]]]


# Drafters whose propose_tree grows static trees only (no draft scores to rank a
# dynamic tree's candidates by); `_validate` names them before anything is traced.
STATIC_TREE_DRAFTERS = (PromptLookupDrafter, OracleDrafter)


def _drafters(drafter) -> list:
    """The drafter and, for an `OracleDrafter`, the draft it wraps."""
    return [drafter] + ([drafter.draft] if isinstance(drafter, OracleDrafter)
                        and drafter.draft is not None else [])


def _validate(target: Model, drafter, spec: SpecConfig) -> None:
    check_type("target", target, Model, "a jspec.Model (jspec.load_hf, jspec.random_model)")
    check_not_a_draft(target)
    check_x32()
    check_runs_here(target, "target")
    check_drafter(drafter)
    if isinstance(drafter, OracleDrafter) and drafter.draft is not None:
        check_drafter(drafter.draft, "OracleDrafter.draft")
    if not isinstance(spec, SpecConfig):
        raise TypeError(f"spec must be a jspec.SpecConfig; got {type(spec).__name__}")
    trees = [t for t in (spec.tree, spec.adaptive.tree if spec.adaptive is not None else None)
             if t is not None]  # an adaptive run's tree is one of its round shapes
    if trees and not grows_trees(drafter):
        raise ValueError(f"{type(drafter).__name__} grows no draft trees (it implements no "
                         "propose_tree); use chains (gamma) or a tree drafter")
    if any(t.dynamic is not None for t in trees) and isinstance(drafter, STATIC_TREE_DRAFTERS):
        raise ValueError(f"{type(drafter).__name__} grows static trees (branching or paths), "
                         "not dynamic ones: TreeConfig(dynamic=...) needs a drafter with "
                         "draft scores (ModelDrafter, FeatureDrafter)")
    drafters = _drafters(drafter)
    models = [d for d in drafters if isinstance(d, ModelDrafter)]
    for d in drafters:
        if isinstance(d, FeatureDrafter):
            hc, tc = d.head.config, target.config
            if hc.vocab_size != tc.vocab_size or hc.target_hidden != tc.hidden_size:
                raise ValueError(f"the feature head was built for a target of vocabulary "
                                 f"{hc.vocab_size} and width {hc.target_hidden}; this target "
                                 f"has {tc.vocab_size} and {tc.hidden_size}")
            embed = d.head.params["embed"].shape
            if embed[-1] != hc.layer.hidden_size:
                raise ValueError(f"the feature head's embedding is {embed[-1]} wide; its layer "
                                 f"is {hc.layer.hidden_size} wide (a head narrower than the "
                                 "target brings its own embedding [V, D])")
            if max(hc.feature_layers) > tc.num_layers:
                raise ValueError(f"the feature head reads layers {hc.feature_layers}; the "
                                 f"target has {tc.num_layers}")
    for d in models:  # a draft's vocabulary may be a prefix of the target's (padded sizes)
        if d.model.config.vocab_size > target.config.vocab_size:
            raise ValueError(f"draft and target vocab mismatch: draft vocab_size="
                             f"{d.model.config.vocab_size} > target vocab_size="
                             f"{target.config.vocab_size}; a draft must score a prefix of "
                             "the target's vocabulary")
    _check_feature_layers(drafter, target)
    _check_tree_ranks(trees, target, drafters)
    for t in spec.stop_tokens:
        if not 0 <= t < target.config.vocab_size:
            raise ValueError(f"stop token {t} is out of range [0, {target.config.vocab_size})")
    _check_forwards(drafter, spec)


def _check_feature_layers(drafter, target: Model) -> None:
    """A drafter's feature_layers: target layer ids in [0, L] (the hidden state entering
    layer i; L: the final norm's input), else an error naming the drafter (it surfaced
    as the target's own `features=` argument, deep in the prefill's trace)."""
    L = target.config.num_layers
    name = f"{type(drafter).__name__}.feature_layers"
    try:
        check_ints(name, drafter.feature_layers, least=0, high=L + 1)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{e} (the target layers whose hidden states the drafter reads, ids "
                      f"0..{L} for this {L}-layer target; the jspec.Drafter protocol)") from None


def _check_forwards(drafter, spec: SpecConfig) -> None:
    """forwards_per_round at every depth the run's statistics ask it about: a count, else
    a ValueError naming the drafter (not a negative or fractional draft_forwards)."""
    depths = {1, spec.depth}
    if spec.adaptive is not None:
        depths |= {s.depth if isinstance(s, TreeConfig) else max(int(s), 1)
                   for s in spec.adaptive.shapes}
    for d in sorted(depths):
        n = drafter.forwards_per_round(d)
        if not is_int(n) or n < 0:
            raise ValueError(f"{type(drafter).__name__}.forwards_per_round({d}) must return "
                             "an integer >= 0 (the draft forwards a round of that depth "
                             f"runs, for statistics; the jspec.Drafter protocol); got {n!r}")


def _check_tree_ranks(trees, target: Model, drafters) -> None:
    """A node's children are distinct tokens ranked by the drafter (`top_choices`: the
    top-K of a row of logits): a tree's largest rank must lie below the vocabulary size,
    the target's and each drafter's that has one."""
    vocabs = [("target", target.config.vocab_size)]
    vocabs += [(f"{type(d).__name__}'s", int(d.vocab_size)) for d in drafters
               if is_int(getattr(d, "vocab_size", None))]
    for tree in trees:
        K = tree.max_children
        for who, V in vocabs:
            if K > V:
                field = next(f for f in ("branching", "paths", "dynamic")
                             if getattr(tree, f) is not None)
                raise ValueError(f"tree {field}={getattr(tree, field)!r:.100} asks for {K} "
                                 f"children of one node (ranks 0..{K - 1}); the {who} "
                                 f"vocabulary size is {V}: every rank must be < {V}")


def _check_oracle(drafter: OracleDrafter, vocab: int) -> None:
    """An oracle's reference is [B, R] token ids in [0, vocab) (or -1, generate's padding
    after a stop); its probabilities lie in [0, 1]."""
    ref = drafter.reference
    if getattr(ref, "ndim", None) != 2 or not np.issubdtype(np.dtype(ref.dtype), np.integer):
        raise ValueError(f"OracleDrafter.reference must be a [B, R] integer array (each "
                         f"row's prompt and serial output); got "
                         f"{type(ref).__name__} {getattr(ref, 'shape', '')} "
                         f"{getattr(ref, 'dtype', '')}")
    ids = np.asarray(ref)
    bad = ids[(ids < -1) | (ids >= vocab)]
    if bad.size:
        raise ValueError(f"OracleDrafter.reference holds token id {int(bad[0])}, out of range "
                         f"[0, {vocab}) (-1, generate's padding after a stop, is allowed)")
    p = np.asarray(drafter.corrupt_prob)
    numeric = np.issubdtype(p.dtype, np.floating) or np.issubdtype(p.dtype, np.integer)
    if p.ndim != 0 or not numeric or not 0 <= float(p) <= 1:
        raise ValueError(f"OracleDrafter.corrupt_prob={drafter.corrupt_prob!r} must be a "
                         "probability in [0, 1]")
    if drafter.rank_probs is not None:
        r = np.asarray(drafter.rank_probs, np.float64)
        if r.ndim != 1 or r.size == 0 or not np.all(np.isfinite(r)) or np.any(r < 0) \
                or r.sum() > 1 + 1e-6:
            raise ValueError(f"OracleDrafter.rank_probs={drafter.rank_probs!r} must be a "
                             "non-empty 1-D list of probabilities summing to at most 1")


def _setup(target, drafter, prompts, spec, max_len):
    """Checks a run's arguments -> (tokens, lens, max_len, spec with the policy's top-p
    lowering resolved to the target's: `jspec.sampling.with_lowering`)."""
    _validate(target, drafter, spec)
    spec = dataclasses.replace(spec, policy=with_lowering(spec.policy,
                                                          target.options.lowering))
    tokens, lens = pad_prompts(prompts, target.config.vocab_size)
    given_max_len = max_len
    # max_new_tokens + gamma + 1 positions after the prompt: the last round's verify block.
    padded, max_len = plan_shapes(tokens.shape[1], spec.max_new_tokens + spec.proposals + 1,
                                  max_len, target.config.max_position,
                                  verify_what(spec.max_new_tokens, spec.proposals))
    if padded > tokens.shape[1]:
        tokens = np.pad(tokens, ((0, 0), (0, padded - tokens.shape[1])))
    need = int(lens.max()) + spec.max_new_tokens + spec.proposals + 1
    for d in _drafters(drafter):
        limit = d.model.config.max_position if isinstance(d, ModelDrafter) else need
        if need > limit:  # its cache stops at its positions (`drafters._with_block`)
            raise ValueError(f"the draft model's max_position_embeddings ({limit}) is below "
                             f"this run's {need} positions (the longest prompt, "
                             f"{int(lens.max())} tokens, + max_new_tokens + the verify "
                             f"block); the target takes {target.config.max_position}: use a "
                             "draft of a longer context, a shorter prompt or fewer new "
                             "tokens")
    if isinstance(drafter, PromptLookupDrafter) and drafter.max_ngram > max_len:
        how = ("given" if given_max_len is not None else
               "planned from the longest prompt and max_new_tokens; a larger max_len= fits it")
        raise ValueError(f"PromptLookupDrafter(max_ngram={drafter.max_ngram}) exceeds the "
                         f"cache max_len={max_len} ({how}): no n-gram that long fits the "
                         "history; use a smaller max_ngram")
    if isinstance(drafter, OracleDrafter):
        _check_oracle(drafter, target.config.vocab_size)
        R = drafter.reference.shape
        if R[0] != tokens.shape[0] or R[1] < int(lens.max()) + spec.max_new_tokens:
            raise ValueError(f"OracleDrafter.reference has shape {R}; need [B={tokens.shape[0]}, "
                             f">= {int(lens.max()) + spec.max_new_tokens}] (prompt + output)")
    return tokens, lens, max_len, spec


def _stats(state: SpecState, spec: SpecConfig, drafter, prefill_s: float, loop_s: float,
           rows: dict) -> dict:
    """rows: the per-row counters by row id (`compaction.RowBook.merged`)."""
    num = rows["num"]
    proposed, accepted = int(np.sum(rows["proposed"])), int(np.sum(rows["accepted"]))
    rounds = int(state.step)
    live_rounds = int(np.sum(rows["rounds_live"]))
    by_pos = np.asarray(rows["accepted_at"]).sum(axis=0) / max(live_rounds, 1)
    total = int(num.sum())
    return {
        "proposed": proposed, "accepted": accepted,
        "acceptance_rate": accepted / max(proposed, 1),
        "acceptance_by_position": [float(x) for x in by_pos],
        "tokens_per_target_step": total / max(live_rounds, 1),
        "target_forwards": rounds + 1, "draft_forwards":
            rounds * drafter.forwards_per_round(spec.depth) + int(
                drafter.forwards_per_round(spec.depth) > 0),
        "rounds": rounds, "tokens": total, "audited_blocks": int(state.audits),
        "ttft_s": prefill_s, "tpot_s": loop_s / max(int(num.max()), 1),
        "tokens_per_s": total / max(prefill_s + loop_s, 1e-9),
    }


def _raise_on_audit(state: SpecState) -> None:
    if not bool(state.audit_bad):
        return
    rnd, b, i = (int(x) for x in np.asarray(state.audit_at))
    lv, ls = (np.asarray(x) for x in state.audit_logits)
    top = lambda x: [(int(j), float(x[j])) for j in np.argsort(-x, kind="stable")[:5]]  # noqa: E731
    n = int(np.sum(lv.view(np.uint32) != ls.view(np.uint32)))
    raise ParityError(
        f"runtime audit: verify block of round {rnd}, row {b}, block row {i} differs from "
        f"serial decoding in {n} of {lv.size} logits; argmax verify {int(np.argmax(lv))} vs "
        f"serial {int(np.argmax(ls))}; top-5 verify {top(lv)}; top-5 serial {top(ls)}. "
        "The backend breaks property P (the xla backend does; pallas must not).")


def _reader():
    """read(state) -> the host snapshot of state (`jspec.adaptive.snapshot`), taken once
    per state object."""
    last = {}

    def read(state):
        if last.get("state") is not state:
            last["state"], last["snap"] = state, snapshot(state)
        return last["snap"]

    return read


def _adaptive_chunk(target: Model, drafter, seed, spec: SpecConfig, ctl: Controller, read,
                    floor=lambda: None):
    """run(state, stop) for `run_chunked`: each chunk runs the shape the controller picks
    (its own compiled loop, at most ctl.chunk_limit rounds) and reports what it did;
    read: the run's `_reader`; floor() the loop's live_floor (compaction)."""
    specs = {s: shape_spec(spec, s) for s in ctl.shapes}

    def run(state, stop):
        shape = ctl.pick()
        if ctl.wants_overhead():  # a chunk of no rounds of the last (compiled) shape
            step, n0 = np.int32(read(state)["step"]), _cache_size(spec_loop)
            t0 = time.perf_counter()
            state = spec_loop(target, drafter, state, seed, step, floor(),
                              spec=specs[ctl.prev])
            jax.block_until_ready(state)
            dt = time.perf_counter() - t0
            if _cache_size(spec_loop) == n0:
                ctl.record_overhead(dt)
        before = read(state)
        stop = np.int32(min(int(stop), before["step"] + ctl.chunk_limit(shape)))
        n0 = _cache_size(spec_loop)
        t0 = time.perf_counter()
        state = spec_loop(target, drafter, state, seed, stop, floor(), spec=specs[shape])
        jax.block_until_ready(state)
        dt = time.perf_counter() - t0
        ctl.record(shape, before, read(state), dt,
                   compiled=_compiled(ctl, shape, n0, _cache_size(spec_loop)))
        return state

    return run


def _finished(snap: dict, max_new_tokens: int) -> bool:
    """The loop is over: every round run, every row done, an audit failed, or a row's
    activations went wrong."""
    return bool(snap["step"] >= max_new_tokens or np.all(snap["done"]) or snap["audit_bad"]
                or snap["bad"])


def _cache_size(fn) -> int:
    """Programs a jitted function has compiled (-1 where jax does not say)."""
    size = getattr(fn, "_cache_size", None)
    return size() if size is not None else -1


def _compiled(ctl: Controller, shape, before: int, after: int) -> bool:
    """Whether a call compiled: the jit cache grew (where jax does not say: the shape's
    first call in this run)."""
    if before < 0:
        return ctl.totals[shape]["chunks"] == 0
    return after != before


def _adaptive_stats(ctl: Controller, drafter) -> dict:
    """The adaptive statistics, and the draft forwards the run's chunks ran in order."""
    return {"adaptive": ctl.stats(),
            "draft_forwards": draft_forwards(drafter, ctl.sequence)}


def draft_forwards(drafter, sequence) -> int:
    """The draft forwards of a run whose rounds were `sequence` ([shape, rounds], in
    order; shape 0 a plain decode step), its prefill's included. A drafter with a
    `catch_up` block (the draft model, the feature head; an oracle's draft) runs no
    forward on a decode step: the step's token waits, and one forward runs the block
    when it is full or before the next proposal; other drafters count a decode step as
    a round of one proposal."""
    block = catch_up_block(drafter)
    fwd, pending = int(drafter.forwards_per_round(1) > 0), 0
    for shape, rounds in sequence:
        if not isinstance(shape, TreeConfig) and int(shape) == 0 and block is not None:
            pending += rounds
            fwd, pending = fwd + pending // block, pending % block
            continue
        if pending:  # flushed before the proposal
            fwd, pending = fwd + 1, 0
        depth = shape.depth if isinstance(shape, TreeConfig) else max(int(shape), 1)
        fwd += rounds * drafter.forwards_per_round(depth)
    return fwd


def catch_up_block(drafter) -> int | None:
    """The decode steps one catch-up forward of the drafter runs (`catch_up`), or None
    for a drafter without the block (it runs no draft, or one a step)."""
    inner = drafter.draft if isinstance(drafter, OracleDrafter) else drafter
    if isinstance(inner, ModelDrafter | FeatureDrafter):
        return inner.catch_up
    return None


def speculative_generate(target: Model, drafter, prompts, spec: SpecConfig, *,
                         max_len: int | None = None, progress: bool = False,
                         until=None) -> SpecOutput:
    """Speculative decoding of ragged prompts; see the module docstring.

    The loop runs on the device a chunk of rounds at a time, so Ctrl-C answers within
    about a second; progress=True shows a bar of generated tokens. Raises
    `jspec.NonFiniteError` if the target produces NaN or inf logits and `ParityError` if a
    runtime audit (spec.audit_every) finds a difference. until: a host-side check of
    each live row after every chunk, as `jspec.generate`'s (row: the prompt's index).
    """
    check_bool("progress", progress)
    check_until(until)
    ts = time.perf_counter()
    tokens, lens, max_len, spec = _setup(target, drafter, prompts, spec, max_len)
    compacting = spec.compact
    adaptive, seed, spec = spec.adaptive, jnp.int32(spec.seed), spec.static()
    t0 = time.perf_counter()
    state = _prefill_jit(target, drafter, jnp.asarray(tokens), jnp.asarray(lens), seed,
                    spec=spec, max_len=max_len)
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    N, B = spec.max_new_tokens, len(lens)
    if compacting:
        check_batch_major(drafter, state.draft, B)
    ctl = Controller(adaptive, B, N) if adaptive is not None else None
    read = _reader()  # one host transfer a chunk serves the loop, the bar and the controller
    book, sizes, moves = RowBook(B, spec.depth), [B], []  # compaction: rows gone, sizes

    def floor():  # the loop stops for a compaction at half the batch (None: never)
        return np.int32(sizes[-1] // 2) if compacting else None

    if ctl is None:
        run = lambda s, stop: spec_loop(target, drafter, s, seed, stop, floor(),  # noqa: E731
                                        spec=spec)
    else:
        run = _adaptive_chunk(target, drafter, seed, spec, ctl, read, floor)
    calls = []  # [rounds, seconds] of each call of the loop, as the host timed it

    def timed_run(s, stop):
        before, t = read(s)["step"], time.perf_counter()
        s = jax.block_until_ready(run(s, stop))
        dt = time.perf_counter() - t  # the snapshot after it is the host's time
        calls.append([read(s)["step"] - before, dt])
        if until is not None:
            snap = read(s)
            ended = rows_until(until, np.asarray(s.out), snap["num"], snap["rows"],
                               snap["done"])
            if ended.any():
                s = s.replace(done=s.done | jnp.asarray(ended))
        return s

    with token_bar(progress, B * N, "speculative") as update:
        while True:
            state = run_chunked(
                timed_run, state, step=lambda s: read(s)["step"],
                finished=lambda s: _finished(read(s), N) or (
                    compacting and _halved(read(s), sizes[-1])),
                progress=lambda s: update(int(np.sum(book.merged(read(s))["num"]))))
            snap = read(state)
            if _finished(snap, N):
                break
            state = _compacted(state, drafter, snap, book, sizes, ctl)
            moves.append({"round": int(snap["step"]), "live": int(np.sum(~snap["done"])),
                          "batch": sizes[-1]})
    t2 = time.perf_counter()
    check_state(state, target, spec)
    rows = book.merged(read(state))
    stats = _stats(state, spec, drafter, t1 - t0, t2 - t1, rows)
    if ctl is not None:
        stats |= _adaptive_stats(ctl, drafter)
    stats |= {"prompt_bucket": int(tokens.shape[1]), "max_len": int(max_len),
              "batch_sizes": sizes, "compactions": moves}
    out = np.asarray(state.out)
    stats["timeline"] = {"setup_s": t0 - ts, "prefill_s": t1 - t0, "loop_s": t2 - t1,
                         "calls_s": float(sum(c[1] for c in calls)), "calls": calls,
                         "finish_s": time.perf_counter() - t2}
    return SpecOutput(tokens=out, num_tokens=rows["num"].astype(np.int32),
                      prompt_lens=lens, stats=stats)


def _halved(snap: dict, batch: int) -> bool:
    """At most half of a batch of more than one row is live (a compaction is due)."""
    return batch > 1 and int(np.sum(~snap["done"])) <= batch // 2


def _compacted(state: SpecState, drafter, snap: dict, book: RowBook, sizes: list,
               ctl: Controller | None) -> SpecState:
    """The state of the live rows alone, in a batch of the next power of two; the rows
    that leave keep their counters in `book`; `sizes` gets the new batch size."""
    done = np.asarray(snap["done"])
    live = int(np.sum(~done))
    size = batch_for(live)
    book.record(snap)
    idx, ids = plan(done, np.asarray(snap["rows"]), size, book.batch)
    if ctl is not None:
        ctl.select_rows(idx, live)
    sizes.append(size)
    return compact(state, drafter, idx, ids)


def speculative_stream(target: Model, drafter, prompts, spec: SpecConfig, *,
                       max_len: int | None = None) -> Iterator[list[list[int]]]:
    """Yields, after every round, each row's newly accepted tokens (a list per row).

    The concatenation equals `speculative_generate(...)` with the same arguments. The
    arguments are checked at the call, before the first round is asked for.
    `SpecConfig.compact` is refused: a stream yields every row's tokens a round.
    """
    if isinstance(spec, SpecConfig) and spec.compact:
        raise ValueError("SpecConfig(compact=True) applies to speculative_generate; a "
                         "stream keeps its batch (it yields every row's tokens a round)")
    tokens, lens, max_len, spec = _setup(target, drafter, prompts, spec, max_len)
    return _stream(target, drafter, tokens, lens, spec, max_len)


def _adaptive_round(target: Model, drafter, state: SpecState, seed, spec: SpecConfig,
                    ctl: Controller, read) -> SpecState:
    shape = ctl.pick()
    before, n0, t0 = read(state), _cache_size(one_round), time.perf_counter()
    state = one_round(target, drafter, state, seed, spec=shape_spec(spec, shape))
    jax.block_until_ready(state)
    ctl.record(shape, before, read(state), time.perf_counter() - t0,
               compiled=_compiled(ctl, shape, n0, _cache_size(one_round)))
    return state


def _stream(target: Model, drafter, tokens, lens, spec: SpecConfig, max_len: int):
    adaptive, seed, spec = spec.adaptive, jnp.int32(spec.seed), spec.static()
    state = _prefill_jit(target, drafter, jnp.asarray(tokens), jnp.asarray(lens), seed,
                    spec=spec, max_len=max_len)
    seen = np.zeros(len(lens), np.int64)
    ctl = (Controller(adaptive, len(lens), spec.max_new_tokens)
           if adaptive is not None else None)
    read = _reader()  # one host read a round: the loop test, the controller, the tokens
    while not (np.all(read(state)["done"]) or read(state)["step"] >= spec.max_new_tokens):
        if ctl is None:
            state = one_round(target, drafter, state, seed, spec=spec)
        else:  # one round a chunk: the controller picks each round's shape
            state = _adaptive_round(target, drafter, state, seed, spec, ctl, read)
        check_state(state, target, spec)
        num, out = read(state)["num"], np.asarray(state.out)
        yield [out[b, seen[b]: num[b]].tolist() for b in range(len(lens))]
        seen = num
