"""The shipped drafters: a draft model, a feature head, prompt lookup and an oracle.

Each implements `jspec.Drafter` (`jspec.drafting`: the protocol, what the engine calls and
guarantees, with shapes) for chains and for trees, and is a pytree (flax struct) traced
inside the speculative loop. A drafter grows its trees in its own `propose_tree`, driving
the shared growth of `jspec.tree_drafting` with its own forward.

How a drafter samples its proposals (`ProposeContext.draft_sampler`, from
`Policy.draft_sampler()`): argmax for exact_greedy; for gumbel_coupled, the target's own
sampler with the same (seed, row, position) noise, so a good draft agrees with the target
often; for rejection_sampling, the same sampler under an independent seed. A head of its
own vocabulary (a pruned draft model, a feature head) draws through
`jspec.drafting.head_draw`: the argmax on its own columns, mapped to ids, for
exact_greedy; the sampler over its logits spread to the target's vocabulary otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec._checks import check_count, check_type
from jspec.cache import init_cache, rollback
from jspec.chunked_prefill import prefill
from jspec.drafting import Drafter, ProposeContext, head_draw, one_hot_logits, to_target_vocab
from jspec.feature_head import FeatureHead, head_apply, init_head_cache
from jspec.model import Model, apply
from jspec.sampling import uniform_noise
from jspec.tree import TreeInput
from jspec.tree_drafting import (
    emitted,
    expand_dynamic,
    expand_static,
    first_child_logits,
    root_paths,
    static_layout,
    static_tree_input,
)

__all__ = ["Drafter", "FeatureDrafter", "ModelDrafter", "OracleDrafter", "PromptLookupDrafter",
           "ProposeContext", "frequent_tokens", "one_hot_logits", "to_target_vocab"]

# The largest catch-up block of plain decode steps (ModelDrafter, FeatureDrafter): one
# forward of that many positions a block; past a few dozen the saving is already ~all.
MAX_CATCH_UP = 64

_SALT_ORACLE = 0x0AC1E
_SALT_ORACLE_TOKEN = 0x0AC1F


@struct.dataclass
class ModelDraftState:
    """cache and pending hold every committed token including `cur`: the cache up to its
    lengths, then pending[:, :n_pending] (tokens of plain decode steps not yet run through
    the draft; n_pending [] int32 is the same for every row, each step adds one to each).
    next_logits [B, n] (the draft head's columns) follow `cur` when n_pending is 0.
    n_pending None (a state made by hand): every token is in the cache."""

    cache: object
    next_logits: jax.Array
    pending: jax.Array | None = None
    n_pending: jax.Array | None = None


def _caught_up(state, catch_up):
    """The state with no step pending (before a proposal): `catch_up(state)` runs the
    waiting block if any. A state with no pending block (made by hand) is returned."""
    if state.n_pending is None:
        return state
    return jax.lax.cond(state.n_pending > 0, catch_up, lambda s: s, state)


def _wait(state, block: int, catch_up, **values):
    """A plain decode step's values wait: each pending buffer (a state field, [B, K, ...])
    gets its value at slot n_pending; a full block of `block` runs through `catch_up`."""
    n = state.n_pending
    put = {k: jax.lax.dynamic_update_index_in_dim(getattr(state, k),
                                                  v.astype(getattr(state, k).dtype), n, axis=1)
           for k, v in values.items()}
    state = state.replace(n_pending=n + 1, **put)
    return jax.lax.cond(state.n_pending == block, catch_up, lambda s: s, state)


def _with_block(max_len: int, block: int, config) -> int:
    """A drafter cache's length: max_len and a catch-up block's padding past it, within
    the model's positions (at the very end a block's padding may then overwrite the
    last entries, which costs draft quality there, never exactness). A target's max_len
    is a length bucket and may pass a draft's positions where the run's tokens do not
    (`speculative._setup` refuses a run whose tokens do)."""
    return min(max_len + block, config.max_position)


def frequent_tokens(token_ids, n: int, vocab_size: int) -> np.ndarray:
    """The n most frequent ids in token_ids (any shape, a tokenized corpus), ties to the
    smaller id, returned sorted: a pruned draft head's vocabulary (`ModelDrafter.pruned`)."""
    ids = np.asarray(token_ids).reshape(-1)
    if ids.size == 0:  # no counts: ids 0..n-1
        ids = ids.astype(np.int64)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"frequent_tokens wants integer token ids; got dtype {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"frequent_tokens: ids must lie in [0, {vocab_size}); got "
                         f"[{ids.min()}, {ids.max()}]")
    if not 1 <= n <= vocab_size:
        raise ValueError(f"frequent_tokens: n must lie in [1, {vocab_size}]; got {n}")
    counts = np.bincount(ids, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))  # count desc, then id asc
    return np.sort(order[:n]).astype(np.int32)


@struct.dataclass
class ModelDrafter(Drafter):
    """A small model sharing the target's tokenizer drafts autoregressively.

    Its vocabulary may be a prefix of the target's (the same tokenizer with a padded
    embedding, e.g. Gemma 3 270M/1B's 262,144 against 4B's 262,208): the ids past it get
    draft logit -inf and are never proposed, and reach the draft as id 0 (their embedding
    is the draft's row 0: its proposals after them are only less likely to be accepted).

    Per round: gamma - 1 one-token draft steps in `propose`, and one two-token
    step in `commit` (the last accepted token again, at its own position, plus
    the target's next token), so the draft catches up on a fully accepted block
    and on the bonus token with static shapes: gamma draft forwards a round.

    A plain decode step (an `Adaptive` shape with gamma 0) runs no draft forward: its
    token waits in the state's `pending` block, and the draft runs `catch_up` of them in
    one forward when the block is full, or the waiting ones before its next proposal. A
    run of decode steps then costs the draft one forward per `catch_up` steps, so falling
    back to plain decoding costs little more than serial decoding.

    `ModelDrafter.pruned(model, ids)` drafts with an LM head that scores only the tokens
    `ids` (e.g. a corpus's most frequent ones, `frequent_tokens`): a Qwen3-0.6B head over
    151,936 tokens is ~311 MB, read by every draft forward. Every other token gets draft
    logit -inf, so it is never proposed and the draft distribution is the softmax over
    `ids`. The target's verify still decides every token: outputs stay exact under
    exact_greedy (and distribution-exact under rejection_sampling); acceptance may drop
    where the target's token lies outside `ids`. `head_slot` [V] int32 maps each token to
    its column of the pruned head (-1: not scored); None for the full head. A greedy
    draft takes the argmax of the head's own columns (`jspec.drafting.head_draw`). The
    pruned drafter's `model` returns logits over its head's columns, not token ids: use
    it through the drafter, not with `jspec.generate` or `jspec.forward`.
    """

    model: Model
    head_slot: jax.Array | None = None
    catch_up: int = struct.field(pytree_node=False, default=8)

    def __post_init__(self):
        check_type("ModelDrafter's model", self.model, Model, "a jspec.Model")
        check_count("ModelDrafter's catch_up", self.catch_up, 1, MAX_CATCH_UP)

    @classmethod
    def pruned(cls, model: Model, ids) -> ModelDrafter:
        """A drafter whose LM head keeps the columns `ids` (int, 1-D, unique, in [0, V))."""
        V = model.config.vocab_size
        ids = np.asarray(ids)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"ModelDrafter.pruned wants a non-empty 1-D array of integer "
                             f"token ids; got shape {ids.shape}, dtype {ids.dtype}")
        if ids.min() < 0 or ids.max() >= V:
            raise ValueError(f"ModelDrafter.pruned: token ids must lie in [0, {V}); got "
                             f"[{ids.min()}, {ids.max()}]")
        ids = np.sort(ids)
        if np.any(ids[1:] == ids[:-1]):
            raise ValueError("ModelDrafter.pruned: token ids must be unique; got "
                             f"{int(np.sum(ids[1:] == ids[:-1]))} repeats")
        head = model.params["lm_head"]  # [D, V]
        if head.shape[-1] != V:
            raise ValueError(f"ModelDrafter.pruned wants the model's full LM head [D, {V}]; "
                             f"got {tuple(head.shape)} (already pruned?)")
        slot = np.full((V,), -1, np.int32)
        slot[ids] = np.arange(ids.size, dtype=np.int32)
        params = {**model.params, "lm_head": jnp.take(head, jnp.asarray(ids), axis=1)}
        return cls(model=model.replace(params=params), head_slot=jnp.asarray(slot))

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def forwards_per_round(self, gamma: int) -> int:
        return gamma

    def _own_ids(self, tokens):
        """The target's ids as the draft embeds them: an id past the draft's vocabulary (a
        prefix of the target's) as 0, which it has, for an embedding it lacks would be NaN
        (`jnp.take`'s fill) and poison its cache for the rest of the row."""
        return jnp.where(tokens < self.model.config.vocab_size, tokens, 0)

    def _apply(self, tokens, cache, **kw):
        return apply(self.model, self._own_ids(tokens), cache, **kw)

    def _full(self, logits, vocab: int):
        """[..., n] logits of the head's columns -> [..., vocab] in the target's ids (-inf
        off the head and past the draft's vocabulary)."""
        return to_target_vocab(logits, self.head_slot, vocab)

    def init(self, tokens, lens, max_len: int, gamma: int, features=None) -> ModelDraftState:
        B, K = tokens.shape[0], self.catch_up
        cache = init_cache(self.model, B, _with_block(max_len, K, self.model.config))
        # chunked, no LM head: at lens - 1
        cache = prefill(self.model, self._own_ids(tokens), lens, cache).cache
        last = jnp.take_along_axis(tokens, (lens - 1)[:, None], axis=1)  # [B, 1]
        logits, cache = self._apply(last, cache)  # the last prompt token's logits
        return ModelDraftState(cache=cache, next_logits=logits[:, 0],
                               pending=jnp.zeros((B, K), jnp.int32), n_pending=jnp.int32(0))

    def _catch_up(self, state: ModelDraftState) -> ModelDraftState:
        """The pending tokens run through the draft in one forward of `catch_up` tokens (the
        slots past n_pending are padding, written past the new lengths and never read)."""
        n = state.n_pending
        logits, cache = self._apply(state.pending, state.cache)
        cache = rollback(cache, state.cache.lengths + n)
        nl = jax.lax.dynamic_index_in_dim(logits, n - 1, axis=1, keepdims=False)
        return state.replace(cache=cache, next_logits=nl, n_pending=jnp.int32(0))

    def propose(self, state: ModelDraftState, ctx: ProposeContext):
        state = _caught_up(state, self._catch_up)
        draw = head_draw(ctx, self.head_slot, state.next_logits.shape[-1])
        d1, first = draw(state.next_logits, ctx.pos + 1)  # [B], [B, V]

        def step(carry, i):
            cache, tok = carry
            logits, cache = self._apply(tok[:, None], cache)
            nxt, logits = draw(logits[:, 0], ctx.pos + 2 + i)
            return (cache, nxt), (nxt, logits)

        # Unrolled: the steps join the round's straight-line code, which XLA captures in
        # command buffers; a rolled scan is a nested while loop launched kernel by kernel.
        (cache, _), (toks, logits) = jax.lax.scan(
            step, (state.cache, d1), jnp.arange(ctx.gamma - 1, dtype=jnp.int32), unroll=True)
        drafts = jnp.concatenate([d1[:, None], toks.T], axis=1)  # [B, g]
        draft_logits = jnp.concatenate(
            [first[:, None], jnp.moveaxis(logits, 0, 1)], axis=1)  # [B, g, V]
        return drafts, draft_logits, state.replace(cache=cache)

    def commit(self, state: ModelDraftState, ctx: ProposeContext, n_acc, nxt, drafts,
               features=None):
        if drafts.shape[1] == 0 and state.n_pending is not None:  # a plain decode step:
            return _wait(state, self.catch_up, self._catch_up, pending=nxt)  # nxt waits
        if drafts.shape[1] == 0:  # no pending block (a state made by hand)
            last = ctx.cur
        else:
            prev = jnp.take_along_axis(drafts, jnp.maximum(n_acc - 1, 0)[:, None], 1)[:, 0]
            last = jnp.where(n_acc == 0, ctx.cur, prev)
        cache = rollback(state.cache, ctx.pos + n_acc)
        logits, cache = self._apply(jnp.stack([last, nxt], axis=1), cache)
        return state.replace(cache=cache, next_logits=logits[:, 1])


    def propose_tree(self, state: ModelDraftState, ctx: ProposeContext, tree):
        """The draft model's cache holds the committed tokens with cur at slot pos; the
        nodes are written after it, depth by depth, each depth one tree forward."""
        state = _caught_up(state, self._catch_up)
        first = self._full(state.next_logits, ctx.vocab)
        root = ctx.pos
        if tree.dynamic is None:
            def step(d, toks, lo, hi, cache):  # node i at slot pos + i
                logits, cache = self._apply(toks, cache,
                                      tree=static_tree_input(tree, lo, hi, root, ctx.pos))
                return self._full(logits, ctx.vocab), cache

            tokens, parents, q, cache = expand_static(tree, ctx, first, step, state.cache)
            return tokens, parents, q, state.replace(cache=cache)
        k, N, D = tree.dynamic
        C = k + (D - 1) * k * k

        def dstep(d, toks, ids, par, carry):
            cache, paths = carry
            B = toks.shape[0]
            parent = jnp.where((par >= 0)[:, :, None],
                               jnp.take_along_axis(paths, jnp.maximum(par, 0)[:, :, None], 1),
                               root_paths(root, k, D))
            own = cache.lengths[:, None] + jnp.arange(k, dtype=jnp.int32)[None]  # [B, k] slots
            path = jnp.where(jnp.arange(D + 1)[None, None] == d, own[:, :, None], parent)
            paths = paths.at[jnp.arange(B)[:, None], ids].set(path)
            t_in = TreeInput(root=root, depth=jnp.full((B, k), d, jnp.int32), path=path)
            logits, cache = self._apply(toks, cache, tree=t_in)
            return self._full(logits, ctx.vocab), (cache, paths)

        B = ctx.cur.shape[0]
        carry = (state.cache, jnp.full((B, C, D + 1), -1, jnp.int32))
        tokens, parents, q, (cache, _) = expand_dynamic(tree, ctx, first, dstep, carry)
        return tokens, parents, q, state.replace(cache=cache)

    def commit_tree(self, state: ModelDraftState, ctx: ProposeContext, n, nxt, path,
                    features=None):
        """Rewrites the accepted path and nxt after cur (slots pos + 1 ..) in one forward;
        the logits after nxt are the next round's first."""
        cache = rollback(state.cache, ctx.pos + 1)
        logits, cache = self._apply(emitted(path, n, nxt), cache)
        nl = jnp.take_along_axis(logits, n[:, None, None], axis=1)[:, 0]
        return state.replace(cache=rollback(cache, ctx.pos + n + 2), next_logits=nl)


@struct.dataclass
class LookupState:
    """hist [B, H] committed tokens including `cur`; hlen [B]."""

    hist: jax.Array
    hlen: jax.Array


# The longest n-gram PromptLookupDrafter tries: each n is unrolled into the compiled round.
MAX_NGRAM = 64


@struct.dataclass
class PromptLookupDrafter(Drafter):
    """n-gram prompt lookup: find the latest earlier occurrence of the last n tokens
    (n from max_ngram down to min_ngram) in the prompt and output so far and
    propose the tokens that followed it. No model; pure jnp."""

    max_ngram: int = struct.field(pytree_node=False, default=3)
    min_ngram: int = struct.field(pytree_node=False, default=1)

    def __post_init__(self):
        check_count("max_ngram", self.max_ngram, most=MAX_NGRAM)
        check_count("min_ngram", self.min_ngram)
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram ({self.min_ngram}) <= max_ngram "
                             f"({self.max_ngram})")

    def forwards_per_round(self, gamma: int) -> int:
        return 0

    def init(self, tokens, lens, max_len: int, gamma: int, features=None) -> LookupState:
        B, P = tokens.shape
        hist = jnp.zeros((B, max_len + gamma + 1), jnp.int32).at[:, :P].set(tokens)
        return LookupState(hist=hist, hlen=lens.astype(jnp.int32))

    def _match(self, hist, hlen, n: int):
        """Latest start j with hist[j:j+n] == hist[hlen-n:hlen] and j + n < hlen; -1 if none."""
        H = hist.shape[0]
        tail = jax.lax.dynamic_slice(hist, (jnp.maximum(hlen - n, 0),), (n,))
        starts = jnp.arange(H - n + 1)
        windows = hist[starts[:, None] + jnp.arange(n)[None, :]]  # [H-n+1, n]
        ok = jnp.all(windows == tail[None, :], axis=1) & (starts + n < hlen) & (hlen >= n)
        return jnp.max(jnp.where(ok, starts, -1))

    def follows(self, hist, hlen, m: int):
        """[m] int32: where the continuations of the m latest distinct matches start
        (longest n-gram first, then latest; -1 where fewer match)."""
        H = hist.shape[0]
        cands, keys = [], []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            tail = jax.lax.dynamic_slice(hist, (jnp.maximum(hlen - n, 0),), (n,))
            starts = jnp.arange(H - n + 1)
            windows = hist[starts[:, None] + jnp.arange(n)[None, :]]
            ok = jnp.all(windows == tail[None, :], axis=1) & (starts + n < hlen) & (hlen >= n)
            cands.append(starts + n)
            keys.append(jnp.where(ok, n * (H + 1) + starts, -1))
        keys, cands = jnp.concatenate(keys), jnp.concatenate(cands)
        top, at = jax.lax.top_k(keys, m)
        return jnp.where(top >= 0, cands[at], -1).astype(jnp.int32)

    def propose_tree(self, state: LookupState, ctx: ProposeContext, tree):
        """Static trees: the branches are the latest distinct n-gram matches (longest n
        first); a node follows match number sum(its path's ranks) at its depth."""
        if tree.dynamic is not None:
            raise ValueError("PromptLookupDrafter grows static trees (branching or paths)")
        parents, ranks, depth, anc, _ = static_layout(tree)
        rank_sum = np.array([int(ranks[anc[i, 1:depth[i] + 1]].sum())
                             for i in range(len(ranks))])
        M = int(rank_sum.max()) + 1
        follow = jax.vmap(lambda h, n: self.follows(h, n, M))(state.hist, state.hlen)  # [B, M]
        H = state.hist.shape[1]
        idx = follow[:, jnp.asarray(rank_sum)] + jnp.asarray(depth - 1)[None]  # [B, N + 1]
        toks = jnp.take_along_axis(state.hist, jnp.clip(idx, 0, H - 1), axis=1)
        usable = (follow[:, jnp.asarray(rank_sum)] >= 0) & (idx < state.hlen[:, None])
        tokens = jnp.where(usable, toks, ctx.cur[:, None]).at[:, 0].set(ctx.cur)
        tokens = tokens.astype(jnp.int32)
        B = tokens.shape[0]
        return (tokens, jnp.broadcast_to(jnp.asarray(parents), (B, len(parents))),
                first_child_logits(tokens, parents, ranks, ctx.vocab), state)

    def propose(self, state: LookupState, ctx: ProposeContext):
        g = ctx.gamma

        def one(hist, hlen, cur):
            follow = jnp.int32(-1)
            for n in range(self.max_ngram, self.min_ngram - 1, -1):
                j = self._match(hist, hlen, n)
                follow = jnp.where((follow < 0) & (j >= 0), j + n, follow)
            idx = jnp.clip(follow + jnp.arange(g), 0, jnp.maximum(hlen - 1, 0))
            return jnp.where(follow >= 0, hist[idx], cur)

        drafts = jax.vmap(one)(state.hist, state.hlen, ctx.cur)
        return drafts, one_hot_logits(drafts, ctx.vocab), state

    def commit(self, state: LookupState, ctx: ProposeContext, n_acc, nxt, drafts,
               features=None):
        g = drafts.shape[1]
        slot = jnp.arange(g + 1)[None, :]
        padded = jnp.pad(drafts, ((0, 0), (0, 1)))  # [B, g + 1] (g may be 0)
        emitted = jnp.where(slot < n_acc[:, None], padded, nxt[:, None])  # [B, g+1]
        hist = jax.vmap(lambda h, e, s: jax.lax.dynamic_update_slice(h, e, (s,)))(
            state.hist, emitted, state.hlen)
        return LookupState(hist=hist, hlen=state.hlen + n_acc + 1)


@struct.dataclass
class OracleDrafter(Drafter):
    """Proposes the target's own serial continuation, each token replaced by another
    with probability `corrupt_prob`, for benchmarks with controlled acceptance.

    `reference` [B, R] holds each row's prompt followed by its serial output,
    aligned at position 0. With `draft` attached the draft model really runs (its
    proposals are discarded, but the oracle's wait for them), so its cost is real.
    `corrupt_prob` is a runtime value (a pytree leaf): one compiled loop serves every
    rate.
    """

    reference: jax.Array
    corrupt_prob: jax.Array | float = 0.0
    draft: object | None = None  # a ModelDrafter or FeatureDrafter that really runs
    rank_probs: jax.Array | None = None  # trees: P(the truth is the rank-r child) [K]

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return () if self.draft is None else tuple(self.draft.feature_layers)

    def forwards_per_round(self, gamma: int) -> int:
        return self.draft.forwards_per_round(gamma) if self.draft is not None else 0

    def init(self, tokens, lens, max_len: int, gamma: int, features=None):
        if self.draft is None:
            return ()
        return self.draft.init(tokens, lens, max_len, gamma, features=features)

    def _reference(self, ctx: ProposeContext):
        """The reference rows of the batch's rows, by row id (a compacted batch's too)."""
        return jnp.take(self.reference, ctx.rows, axis=0, mode="clip")

    def propose(self, state, ctx: ProposeContext):
        model_drafts = None
        if self.draft is not None:
            model_drafts, _, state = self.draft.propose(state, ctx)  # [B, g]
        R = self.reference.shape[1]
        pos = ctx.pos[:, None] + 1 + jnp.arange(ctx.gamma)[None, :]  # [B, g]
        truth = jnp.take_along_axis(self._reference(ctx), jnp.minimum(pos, R - 1), axis=1)
        B, g = pos.shape
        rows = jnp.broadcast_to(ctx.rows[:, None], (B, g)).reshape(-1)
        u = uniform_noise(ctx.seed + _SALT_ORACLE, rows, pos.reshape(-1)).reshape(B, g)
        shift = uniform_noise(ctx.seed + _SALT_ORACLE_TOKEN, rows, pos.reshape(-1)).reshape(B, g)
        V = ctx.vocab
        other = (truth + 1 + (shift * (V - 1)).astype(jnp.int32)) % V  # never == truth
        drafts = jnp.where(u < self.corrupt_prob, other, truth).astype(jnp.int32)
        if model_drafts is not None:
            # The proposals wait for the draft model's, as a real drafter's do: a select
            # that never fires (token ids are >= 0). Without it nothing the round uses
            # depends on the draft forwards, and a scheduler free to overlap independent
            # work (XLA's CONCURRENT command buffers) hides them behind the verify.
            drafts = jnp.where(model_drafts < 0, model_drafts, drafts)
        return drafts, one_hot_logits(drafts, V), state

    def commit(self, state, ctx: ProposeContext, n_acc, nxt, drafts, features=None):
        if self.draft is None:
            return state
        return self.draft.commit(state, ctx, n_acc, nxt, drafts, features=features)

    def propose_tree(self, state, ctx: ProposeContext, tree):
        """A static tree whose truth (the serial continuation) is the rank-r child of a
        node on the truth path with probability rank_probs[r] (and no child's with the
        rest); every other node a token other than the truth."""
        if tree.dynamic is not None:
            raise ValueError("OracleDrafter grows static trees (branching or paths)")
        model_toks = None
        if self.draft is not None:  # the attached drafter's tree really runs
            model_toks, _, _, state = self.draft.propose_tree(state, ctx, tree)
        parents, ranks, depth, _, levels = static_layout(tree)
        B, n = ctx.cur.shape[0], len(parents)
        R = self.reference.shape[1]
        pos = ctx.pos[:, None] + jnp.asarray(depth)[None]  # [B, N + 1] each node's position
        truth = jnp.take_along_axis(self._reference(ctx), jnp.minimum(pos, R - 1), axis=1)
        probs = (jnp.asarray([1.0 - self.corrupt_prob]) if self.rank_probs is None
                 else jnp.asarray(self.rank_probs))
        # The rank whose child carries the truth below each node (-1: none).
        rows = jnp.broadcast_to(ctx.rows[:, None], (B, n)).reshape(-1)
        u = uniform_noise(ctx.seed + _SALT_ORACLE, rows, (pos + 1).reshape(-1)).reshape(B, n)
        edges = jnp.cumsum(probs)
        truth_rank = jnp.where(u < edges[-1], jnp.searchsorted(edges, u, side="right"), -1)
        on_truth = jnp.zeros((B, n), bool).at[:, 0].set(True)
        for d in range(1, len(levels)):
            lo, hi = levels[d]
            p = jnp.asarray(parents[lo:hi])
            hit = on_truth[:, p] & (truth_rank[:, p] == jnp.asarray(ranks[lo:hi])[None])
            on_truth = on_truth.at[:, lo:hi].set(hit)
        V = ctx.vocab
        K = int(ranks.max()) + 1  # each rank's own noise: the row id carries it
        rank_rows = (jnp.broadcast_to(ctx.rows[:, None] * K, (B, n)) + jnp.asarray(ranks)[None])
        shift = uniform_noise(ctx.seed + _SALT_ORACLE_TOKEN, rank_rows.reshape(-1),
                              pos.reshape(-1)).reshape(B, n)
        other = (truth + 1 + (shift * (V - 1)).astype(jnp.int32)) % V
        tokens = jnp.where(on_truth, truth, other).at[:, 0].set(ctx.cur).astype(jnp.int32)
        if model_toks is not None:  # wait for the attached drafter, as a real one would
            tokens = jnp.where(model_toks < 0, model_toks, tokens)
        return (tokens, jnp.broadcast_to(jnp.asarray(parents), (B, n)),
                first_child_logits(tokens, parents, ranks, V), state)

    def commit_tree(self, state, ctx: ProposeContext, n, nxt, path, features=None):
        if self.draft is None:
            return state
        extra = {} if features is None else {"features": features}
        return self.draft.commit_tree(state, ctx, n, nxt, path, **extra)


@struct.dataclass
class FeatureDraftState:
    """The head's cache holds the pairs (token i + 1, feature i) at positions i < pos;
    next_logits [B, Vd] and next_hidden [B, D] are its output at position pos - 1 (the
    pair (cur, the target's feature before cur)): the first proposal's logits and the
    hidden state the second step reads. Plain decode steps' pairs wait in pending_tokens
    [B, K], pending_features [B, K, n Dt] (their first n_pending, [] int32, the same for
    every row) until a catch-up block runs them; the outputs above are then stale until
    it has. n_pending None (a state made by hand): nothing ever waits."""

    cache: object
    next_logits: jax.Array
    next_hidden: jax.Array
    pending_tokens: jax.Array | None = None
    pending_features: jax.Array | None = None
    n_pending: jax.Array | None = None


def _head_prefill(head, toks, feats, cache, last, lens):
    """The head over the prompt's pairs toks [B, n], feats [B, n, n Dt] from position 0, in
    chunks of the head layer's `prefill_chunk` (as the target's `chunked_prefill`: one
    `lax.fori_loop` over a `dynamic_slice`, the last chunk ending at n, chunks past every
    row's pairs not run), so the head's activations and attention are [B, C, ...] whatever
    the prompt's length. Returns row b's LM-head logits [B, Vd] and hidden state [B, D]
    at pair last[b], and the cache."""
    B, n = toks.shape
    C = min(head.layer_model.options.prefill_chunk, n)
    if C == n:  # one chunk: the plain call
        logits, hidden, cache = head_apply(head, toks, feats, cache, fuse=True, at=last)
        return logits, jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0], cache

    def body(i, carry):
        cache, logits, hid = carry
        s = jnp.minimum(i * C, n - C)  # the last chunk ends at n (it may overlap)
        t = jax.lax.dynamic_slice_in_dim(toks, s, C, axis=1)
        f = jax.lax.dynamic_slice_in_dim(feats, s, C, axis=1)
        at = jnp.clip(last - s, 0, C - 1)
        lg, hidden, cache = head_apply(head, t, f, rollback(cache, jnp.full((B,), s)),
                                       fuse=True, at=at)
        here = (last >= s) & (last < s + C)  # [B]: row b's last pair is in this chunk
        h = jnp.take_along_axis(hidden, at[:, None, None], axis=1)[:, 0]
        return (cache, jnp.where(here[:, None], lg, logits),
                jnp.where(here[:, None], h.astype(hid.dtype), hid))

    like = jax.eval_shape(lambda c: head_apply(head, toks[:, :C], feats[:, :C], c, fuse=True,
                                               at=last), cache)
    init = (cache, jnp.zeros(like[0].shape, like[0].dtype),
            jnp.zeros((B, like[1].shape[-1]), like[1].dtype))
    live = (jnp.max(lens - 1).astype(jnp.int32) + C - 1) // C  # chunks holding a pair
    cache, logits, hid = jax.lax.fori_loop(0, jnp.clip(live, 1, -(-n // C)), body, init)
    return logits, hid, cache


@struct.dataclass
class FeatureDrafter(Drafter):
    """Drafts with a feature head (`jspec.feature_head`: EAGLE-3's one decoder layer over
    the target's hidden states), whose cost is a few percent of a target step.

    The engine asks the target's prefill and every verify for the hidden states of
    `feature_layers` (no extra target pass) and hands them to `init` and `commit`. Per
    round: gamma - 1 one-token head steps in `propose` (each reading the head's own
    hidden state), and one step of gamma + 1 positions in `commit` that rewrites the
    accepted positions with the target's true features and computes the next round's
    first proposal: gamma head forwards a round.

    The head scores its own Vd columns (`head_slot` in its params: the column of each
    target id). Proposals are drawn by `jspec.drafting.head_draw`: under a greedy draft
    sampler the argmax over the Vd columns with ties to the lowest target id, the token
    Greedy takes from the logits spread over the target's V ids, which are then built
    only for policies that read draft_logits; other samplers draw from the spread.

    A plain decode step (an `Adaptive` shape with gamma 0) runs no head forward: its pair
    (token, the target's feature) waits, and the head runs `catch_up` of them in one
    forward when the block is full, or the waiting ones before its next proposal.
    """

    head: object  # FeatureHead
    catch_up: int = struct.field(pytree_node=False, default=8)

    def __post_init__(self):
        check_type("FeatureDrafter's head", self.head, FeatureHead,
                   "a jspec.FeatureHead (jspec.load_eagle3, feature_head.random_head)")
        check_count("FeatureDrafter's catch_up", self.catch_up, 1, MAX_CATCH_UP)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.config.feature_layers

    @property
    def vocab_size(self) -> int:
        return self.head.config.vocab_size

    def forwards_per_round(self, gamma: int) -> int:
        return gamma

    def _full(self, logits, vocab: int):
        """[..., Vd] head logits -> [..., vocab] in the target's ids (-inf off the head)."""
        return to_target_vocab(logits, self.head.params["head_slot"], vocab)

    def init(self, tokens, lens, max_len: int, gamma: int, features=None):
        if features is None:
            raise ValueError("FeatureDrafter.init needs the target's features")
        B, P = tokens.shape
        K = self.catch_up
        cache = init_head_cache(self.head, B,
                                _with_block(max_len, K, self.head.layer_model.config))
        D, Vd = self.head.config.layer.hidden_size, self.head.config.layer.vocab_size
        pending = dict(pending_tokens=jnp.zeros((B, K), jnp.int32),
                       pending_features=jnp.zeros((B, K, features.shape[-1]), features.dtype),
                       n_pending=jnp.int32(0))
        if P < 2:  # no pair yet: a uniform first guess (the target decides anyway)
            return FeatureDraftState(cache=cache, next_logits=jnp.zeros((B, Vd), jnp.float32),
                                     next_hidden=jnp.zeros((B, D), cache.k[0].dtype), **pending)
        # Pairs (t_{i+1}, f_i), i = 0 .. P - 2, at head positions 0 .. P - 2.
        # The LM head at each row's last pair alone (no [B, P, Vd] logits, rule R10).
        last = jnp.maximum(lens - 2, 0).astype(jnp.int32)  # [B]
        logits, nh, cache = _head_prefill(self.head, tokens[:, 1:], features[:, :-1], cache,
                                          last, lens)
        single = (lens < 2)[:, None]
        nl = jnp.where(single, 0.0, logits)
        nh = jnp.where(single, 0, nh)
        return FeatureDraftState(cache=rollback(cache, jnp.maximum(lens - 1, 0)),
                                 next_logits=nl, next_hidden=nh, **pending)

    def _catch_up(self, state: FeatureDraftState) -> FeatureDraftState:
        """The pending pairs through the head in one forward of `catch_up` positions (past
        n_pending: padding, written past the new lengths and never read)."""
        n = state.n_pending
        B = state.pending_tokens.shape[0]
        at = jnp.full((B,), n - 1, jnp.int32)
        logits, hidden, cache = head_apply(self.head, state.pending_tokens,
                                           state.pending_features, state.cache, fuse=True,
                                           at=at)
        return state.replace(cache=rollback(cache, state.cache.lengths + n), next_logits=logits,
                             next_hidden=jax.lax.dynamic_index_in_dim(hidden, n - 1, axis=1,
                                                                      keepdims=False),
                             n_pending=jnp.int32(0))

    def propose(self, state: FeatureDraftState, ctx: ProposeContext):
        state = _caught_up(state, self._catch_up)
        draw = head_draw(ctx, self.head.params["head_slot"], state.next_logits.shape[-1])
        d1, first = draw(state.next_logits, ctx.pos + 1)  # [B], [B, V]

        def step(carry, i):
            cache, tok, hid = carry
            logits, hid, cache = head_apply(self.head, tok[:, None], hid[:, None], cache,
                                            fuse=False)
            nxt, logits = draw(logits[:, 0], ctx.pos + 2 + i)
            return (cache, nxt, hid[:, 0]), (nxt, logits)

        (cache, _, _), (toks, logits) = jax.lax.scan(
            step, (state.cache, d1, state.next_hidden),
            jnp.arange(ctx.gamma - 1, dtype=jnp.int32), unroll=True)
        drafts = jnp.concatenate([d1[:, None], toks.T], axis=1)  # [B, g]
        draft_logits = jnp.concatenate([first[:, None], jnp.moveaxis(logits, 0, 1)], axis=1)
        return drafts, draft_logits, state.replace(cache=cache)

    def commit(self, state: FeatureDraftState, ctx: ProposeContext, n_acc, nxt, drafts,
               features=None):
        if features is None:
            raise ValueError("FeatureDrafter.commit needs the verify's features")
        g = drafts.shape[1]
        if g == 0 and state.n_pending is not None:  # a plain decode step: (nxt, f_cur) waits
            return _wait(state, self.catch_up, self._catch_up, pending_tokens=nxt,
                         pending_features=features[:, 0])
        slot = jnp.arange(g + 1)[None, :]
        # Pairs (t_{j+1}, f_j) from cur's position on: the accepted drafts, then nxt.
        emitted = jnp.where(slot < n_acc[:, None], jnp.pad(drafts, ((0, 0), (0, 1))),
                            nxt[:, None])  # [B, g + 1]
        cache = rollback(state.cache, ctx.pos)
        at = n_acc.astype(jnp.int32)  # [B]: the LM head at the pair after the accepted ones
        logits, hidden, cache = head_apply(self.head, emitted, features, cache, fuse=True,
                                           at=at)
        return state.replace(cache=rollback(cache, ctx.pos + n_acc + 1), next_logits=logits,
                             next_hidden=jnp.take_along_axis(hidden, at[:, None, None],
                                                             axis=1)[:, 0])

    def propose_tree(self, state: FeatureDraftState, ctx: ProposeContext, tree):
        """The head's cache holds the pairs before cur's position; a node at depth d >= 1
        is the pair (its token, its parent's head hidden state) at position pos + d - 1,
        written depth by depth after them (the root has no head entry)."""
        state = _caught_up(state, self._catch_up)
        if tree.dynamic is None:
            return self._static_tree(state, ctx, tree)
        head, root = self.head, ctx.pos
        first = self._full(state.next_logits, ctx.vocab)
        Dh = state.next_hidden.shape[-1]
        k, N, D = tree.dynamic
        C = k + (D - 1) * k * k

        def dstep(d, toks, ids, par, carry):  # a frontier of tree depth d: head depth d - 1
            cache, paths, hids = carry
            B = toks.shape[0]
            idx = jnp.maximum(par, 0)
            parent = jnp.where((par >= 0)[:, :, None],
                               jnp.take_along_axis(paths, idx[:, :, None], 1),
                               jnp.full((B, k, D), -1, jnp.int32))
            hid_in = jnp.where((par >= 0)[:, :, None],
                               jnp.take_along_axis(hids, idx[:, :, None], 1),
                               state.next_hidden[:, None])
            own = cache.lengths[:, None] + jnp.arange(k, dtype=jnp.int32)[None]
            path = jnp.where(jnp.arange(D)[None, None] == d - 1, own[:, :, None], parent)
            t_in = TreeInput(root=root, depth=jnp.full((B, k), d - 1, jnp.int32), path=path)
            logits, h, cache = head_apply(head, toks, hid_in, cache, fuse=False, tree=t_in)
            rows = jnp.arange(B)[:, None]
            return self._full(logits, ctx.vocab), (cache, paths.at[rows, ids].set(path),
                                                   hids.at[rows, ids].set(h))

        B = ctx.cur.shape[0]
        carry = (state.cache, jnp.full((B, C, D), -1, jnp.int32),
                 jnp.zeros((B, C, Dh), state.next_hidden.dtype))
        tokens, parents, q, (cache, _, _) = expand_dynamic(tree, ctx, first, dstep, carry)
        return tokens, parents, q, state.replace(cache=cache)

    def _static_tree(self, state: FeatureDraftState, ctx: ProposeContext, tree):
        first = self._full(state.next_logits, ctx.vocab)
        parents = static_layout(tree)[0]
        B, Dh = ctx.cur.shape[0], state.next_hidden.shape[-1]
        hid = jnp.zeros((B, len(parents), Dh), state.next_hidden.dtype).at[:, 0].set(
            state.next_hidden)

        def step(d, toks, lo, hi, carry):  # node i at head slot pos + i - 1
            cache, hid = carry
            t_in = static_tree_input(tree, lo, hi, ctx.pos, ctx.pos - 1, depth_offset=1)
            logits, h, cache = head_apply(self.head, toks, hid[:, jnp.asarray(parents[lo:hi])],
                                          cache, fuse=False, tree=t_in)
            return self._full(logits, ctx.vocab), (cache, hid.at[:, lo:hi].set(h))

        tokens, par, q, (cache, _) = expand_static(tree, ctx, first, step, (state.cache, hid))
        return tokens, par, q, state.replace(cache=cache)

    def commit_tree(self, state: FeatureDraftState, ctx: ProposeContext, n, nxt, path,
                    features=None):
        """The accepted path with the verify's features at the root and along it
        [B, D + 1, n Dt]: the chain commit over them."""
        return self.commit(state, ctx, n, nxt, path, features=features)
