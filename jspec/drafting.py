"""The drafter interface: `Drafter`, the protocol every drafter implements, and
`ProposeContext`, what the engine hands it each round.

A research drafter subclasses `Drafter` (or matches it structurally) and is a pytree
(`flax.struct.dataclass`): its arrays travel into the compiled loop as leaves, its
settings as static fields. The shipped ones live in `jspec.drafters`; the shared pieces
of tree growth in `jspec.tree_drafting`. Whatever a drafter proposes, the target's verify
decides every token, so a drafter changes speed, never the output (a broken one is
rejected, never emitted).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import struct

from jspec.sampling import Greedy, greedy_over_ids


@struct.dataclass
class ProposeContext:
    """Per-round inputs of a drafter (arrays are traced).

    Attributes:
      cur: [B] last committed token (its position is `pos`).
      pos: [B] int32 position of `cur`; proposal i sits at pos + 1 + i.
      rows: [B] int32 the rows' ids in the run's batch (noise keys; a compacted batch keeps
        them, and its padding rows hold the batch size).
      seed: [] int32 draft seed (`Policy.draft_seed_salt` added to the run's seed).
      gamma: proposals per round (a tree's depth for trees).
      vocab: the target's vocabulary size.
      draft_sampler: how proposals are drawn from draft logits (`Policy.draft_sampler()`):
        called as draft_sampler(logits [B, V], seed, rows [B], positions [B]) -> [B]; a
        drafter whose head scores its own columns draws through `head_draw`.
    """

    cur: jax.Array
    pos: jax.Array
    rows: jax.Array
    seed: jax.Array
    gamma: int = struct.field(pytree_node=False)
    vocab: int = struct.field(pytree_node=False)
    draft_sampler: object = struct.field(pytree_node=False)


@runtime_checkable
class Drafter(Protocol):
    """What the speculative engine calls on a drafter; every method is traced inside the
    compiled loop (static shapes, no host sync). `state` is the drafter's own pytree.

    Chains (`SpecConfig(gamma=g)`), one round:
      init(tokens [B, P], lens [B], max_len, gamma, features=None) -> state
        after the prompts (row b's prompt is tokens[b, :lens[b]]; past it, padding).
        The cache capacity is max_len; gamma is the round's depth.
      propose(state, ctx) -> (drafts [B, g] int32, draft_logits [B, g, V] f32, state)
        proposal i for position ctx.pos + 1 + i, the token ctx.draft_sampler draws from
        draft_logits[:, i] (the target's vocabulary: `to_target_vocab`; `head_draw` draws
        it from a smaller head's own columns when the sampler is `Greedy`); a
        deterministic drafter returns `one_hot_logits(drafts, ctx.vocab)`. Only policies
        with `uses_draft_logits` (rejection sampling) read them: under the others XLA
        never builds them; under those, a proposal's logits holding NaN or +inf, or -inf
        at every token, stop the run (NonFiniteError). A proposal outside [0, V) is
        rejected by every policy and never reaches the target's cache.
      commit(state, ctx, n_acc [B], nxt [B], drafts [B, g], features=None) -> state
        the verify accepted drafts[:, :n_acc] and the target's next token nxt
        (correction or bonus): the committed sequence is now ..., cur, d_1..d_n_acc, nxt
        with nxt at position ctx.pos + n_acc + 1 (the next round's cur). Rows that are
        done get n_acc = 0 and their output is ignored.
      forwards_per_round(gamma) -> int: draft forwards a round, for statistics.

    Trees (`SpecConfig(tree=TreeConfig(...))`), one round:
      propose_tree(state, ctx, tree) -> (tokens [B, N + 1], parents [B, N + 1],
        q [B, N + 1, V], state): node 0 is the root (ctx.cur, parent -1; the engine
        verifies cur there whatever the drafter returns), the others
        the draft nodes, parents before children; q[:, i] the draft logits node i's
        children were drawn from (rejection sampling reads them). Node ids outside
        [0, V) are never accepted. `jspec.tree_drafting` has the shared growth
        (`expand_static`, `expand_dynamic`) a drafter drives with its own forward.
      commit_tree(state, ctx, n [B], nxt [B], path [B, D], features=None) -> state
        the accepted root path's first n tokens path[:, :n], then nxt: the same as
        `commit` over a chain (the default).

    feature_layers: the target layers whose hidden states (the residual stream entering
      each) the drafter reads; () for most drafters. With a non-empty tuple, the engine
      passes `features=` to init ([B, P, n D]: the prompt's positions), commit
      ([B, g + 1, n D]: cur and the proposals) and commit_tree ([B, D + 1, n D]: the
      root and the accepted path), at no extra target cost.

    select_rows(state, idx [B'] int32) -> state (optional): the state of rows idx, for a
      run that goes on with its live rows in a smaller batch (`SpecConfig.compact`).
      Without it the engine takes axis 0 of every array leaf
      (`jspec.compaction.select_rows`: a batch-major state, as the shipped drafters').
      Arrays of the drafter itself that hold a row each are read by `ctx.rows`, the
      rows' ids in the run's batch (as `OracleDrafter.reference` is).

    The engine checks what a drafter returns as it traces the run: propose's 3-tuple and
    propose_tree's 4-tuple, drafts and tree tokens and parents of exactly these shapes and
    integer dtypes, draft logits (where the policy reads them) of these shapes in floating
    point, a commit's state of the structure, shapes and dtypes init's had, and before it
    runs, forwards_per_round an integer >= 0; else a ValueError naming the drafter;
    a tree node outside a well-formed tree of the config's depth (`jspec.tree.well_formed`)
    is never accepted.

    The engine guarantees: the cache capacity max_len holds every live row's round (its
    proposals and the verify block); rows advance independently, each at its own pos;
    a round's state is the one the previous call returned; arguments have the shapes
    above, fixed for a compiled run (a compacted run compiles its smaller batch once).
    """

    feature_layers: tuple[int, ...] = ()

    def init(self, tokens, lens, max_len: int, gamma: int, features=None):
        ...

    def propose(self, state, ctx: ProposeContext):
        ...

    def commit(self, state, ctx: ProposeContext, n_acc, nxt, drafts, features=None):
        ...

    def forwards_per_round(self, gamma: int) -> int:
        ...

    def propose_tree(self, state, ctx: ProposeContext, tree):
        raise NotImplementedError(f"{type(self).__name__} grows no draft trees (it "
                                  "implements no propose_tree); use chains (gamma)")

    def commit_tree(self, state, ctx: ProposeContext, n, nxt, path, features=None):
        extra = {} if features is None else {"features": features}
        return self.commit(state, ctx, n, nxt, path, **extra)


DRAFTER_MEMBERS = ("init", "propose", "commit", "forwards_per_round", "propose_tree",
                   "commit_tree", "feature_layers")


def grows_trees(drafter) -> bool:
    """Whether the drafter implements `propose_tree` (the protocol's default raises)."""
    return getattr(type(drafter), "propose_tree", None) is not Drafter.propose_tree


def check_drafter(drafter, name: str = "drafter") -> None:
    """TypeError unless `drafter` implements `Drafter`, naming what is missing; a bare
    model or feature head is named with the wrapper it needs."""
    if isinstance(drafter, type):  # the protocol's members are on the class too
        raise TypeError(f"{name} must be a drafter object, not the class "
                        f"{drafter.__name__}: instantiate it, e.g. {drafter.__name__}(...)")
    if isinstance(drafter, Drafter):
        leaves = jax.tree_util.tree_leaves(drafter)
        if len(leaves) == 1 and leaves[0] is drafter:  # not a registered pytree
            raise TypeError(f"{name} {type(drafter).__name__} is not a pytree: the engine "
                            "passes a drafter into its compiled loop, so decorate its class "
                            "with @flax.struct.dataclass (arrays as fields, settings as "
                            "struct.field(pytree_node=False))")
        return
    missing = [m for m in DRAFTER_MEMBERS if not hasattr(drafter, m)]
    kind = type(drafter).__name__
    hint = ""
    if kind == "Model" and hasattr(drafter, "params"):
        hint = ": wrap it: ModelDrafter(model)"
    elif kind == "FeatureHead":
        hint = ": wrap it: FeatureDrafter(head)"
    raise TypeError(f"{name} must be a jspec drafter implementing jspec.Drafter "
                    f"(ModelDrafter(model), FeatureDrafter(head), PromptLookupDrafter(), "
                    f"OracleDrafter(...), or a subclass of jspec.Drafter); got {kind}{hint}"
                    f" (it lacks {', '.join(missing) or 'nothing but the base class'})")


def one_hot_logits(tokens, vocab: int):
    """[B, g] -> [B, g, V] f32 logits of the point mass at each token (0 there, -inf else)."""
    return jnp.where(jax.nn.one_hot(tokens, vocab, dtype=bool), 0.0, -jnp.inf)


def to_target_vocab(logits, slot, vocab: int):
    """A drafter's logits [..., n] -> [..., vocab] in the target's ids: with `slot` ([V]
    int32, the column of each target id, -1 for none) the columns are gathered and ids
    off the head get -inf; ids past the result's width (a draft vocabulary that is a
    prefix of the target's) get -inf too."""
    if slot is not None:
        picked = jnp.take(logits, jnp.maximum(slot, 0), axis=-1)
        logits = jnp.where(slot >= 0, picked, -jnp.inf)
    V = logits.shape[-1]
    if V < vocab:
        pad = [(0, 0)] * (logits.ndim - 1) + [(0, vocab - V)]
        logits = jnp.pad(logits, pad, constant_values=-jnp.inf)
    return logits


def column_ids(slot, n: int):
    """The inverse of `slot` ([V] int32, the column of each id, -1 for none; entries in
    [-1, n)): the lowest id of each of the n columns [n] int32, -1 for a column no id
    maps to (a scatter-min, so a column two ids share carries the one Greedy picks)."""
    V = slot.shape[0]
    at = jnp.where(slot >= 0, slot, n)  # no column: past the end, dropped
    ids = jnp.full((n,), V, jnp.int32).at[at].min(jnp.arange(V, dtype=jnp.int32), mode="drop")
    return jnp.where(ids < V, ids, -1)


def head_draw(ctx: ProposeContext, slot, n: int):
    """How a drafter whose head scores n columns (`slot` as `to_target_vocab` takes it;
    None: the columns are ids 0..n-1) draws its proposals: returns
    draw(logits [B, n] f32, positions [B]) -> (tokens [B] int32, the logits in the
    target's ids [B, V] f32, `to_target_vocab(logits, slot, ctx.vocab)`: what `propose`
    returns as draft_logits).

    With a `Greedy` draft sampler (the class itself: a subclass may change the rule) the
    token comes from the n columns directly (`greedy_over_ids`), the token Greedy picks
    from the [B, V] logits for every input (on a GPU, rows of several NaNs aside, as
    `greedy_over_ids` says); those are then built only if the policy reads them. The
    column ids (`column_ids`: one scatter of V int32 a propose, for the [B, V] spread and
    reduction it saves at every draw) are made here from `slot` itself rather than stored
    beside it, where an edit of one would leave the other stale. Any other sampler draws
    from the [B, V] logits."""
    sampler, vocab = ctx.draft_sampler, ctx.vocab

    def spread(logits):
        return to_target_vocab(logits, slot, vocab)

    if type(sampler) is not Greedy:
        def draw(logits, positions):
            full = spread(logits)
            return sampler(full, ctx.seed, ctx.rows, positions), full
        return draw
    if slot is None:  # ids 0..n-1 in order, -inf past them: argmax of the columns is the same
        return lambda logits, positions: (sampler(logits, ctx.seed, ctx.rows, positions),
                                          spread(logits))
    ids = column_ids(slot, n)  # [n]
    return lambda logits, positions: (greedy_over_ids(logits, ids), spread(logits))
