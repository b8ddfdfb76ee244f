"""Drafters: pure functions over pytrees that propose gamma tokens per row.

A drafter is a pytree (flax struct) with three methods, all traced inside the
speculative loop:
  init(tokens [B, P], lens [B], max_len, gamma, features=None) -> state   after the prompts
  propose(state, ctx) -> (drafts [B, g], draft_logits [B, g, V], state)
  commit(state, ctx, n_acc [B], nxt [B], drafts [B, g], features=None) -> state
A drafter with a non-empty `feature_layers` attribute (a tuple of target layers) is also
given `features=`: the target's hidden states entering those layers [B, T, n D] for the
positions the prefill or the verify computed (`jspec.model.apply(..., features=...)`).
`draft_logits` are the logits the proposals were drawn from (one-hot logits for
deterministic drafters); only `rejection_sampling` reads them.

How a drafter samples its proposals (`ProposeContext.draft_sampler`): argmax for
exact_greedy; for gumbel_coupled, the target's own sampler with the same
(seed, row, position) noise, so a good draft agrees with the target often; for
rejection_sampling, the same sampler under an independent seed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec import tree_drafting
from jspec.cache import init_cache, rollback
from jspec.model import Model, apply
from jspec.sampling import uniform_noise

_SALT_ORACLE = 0x0AC1E
_SALT_ORACLE_TOKEN = 0x0AC1F


@struct.dataclass
class ProposeContext:
    """Per-round inputs of a drafter (arrays are traced).

    Attributes:
      cur: [B] last committed token (its position is `pos`).
      pos: [B] int32 position of `cur`; proposal i sits at pos + 1 + i.
      rows: [B] int32 row ids (noise keys).
      seed: [] int32 draft seed.
      gamma: proposals per round.
      vocab: the target's vocabulary size.
      draft_sampler: how proposals are drawn from draft logits.
    """

    cur: jax.Array
    pos: jax.Array
    rows: jax.Array
    seed: jax.Array
    gamma: int = struct.field(pytree_node=False)
    vocab: int = struct.field(pytree_node=False)
    draft_sampler: object = struct.field(pytree_node=False)


def one_hot_logits(tokens, vocab: int):
    """[B, g] -> [B, g, V] f32 logits of the point mass at each token (0 there, -inf else)."""
    return jnp.where(jax.nn.one_hot(tokens, vocab, dtype=bool), 0.0, -jnp.inf)


@struct.dataclass
class ModelDraftState:
    """cache holds every committed token including `cur`; next_logits [B, n] (the draft
    head's columns) follow `cur`."""

    cache: object
    next_logits: jax.Array


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


@struct.dataclass
class ModelDrafter:
    """A small model sharing the target's tokenizer drafts autoregressively.

    Its vocabulary may be a prefix of the target's (the same tokenizer with a padded
    embedding, e.g. Gemma 3 270M/1B's 262,144 against 4B's 262,208): the ids past it get
    draft logit -inf and are never proposed.

    Per round: gamma - 1 one-token draft steps in `propose`, and one two-token
    step in `commit` (the last accepted token again, at its own position, plus
    the target's next token), so the draft catches up on a fully accepted block
    and on the bonus token with static shapes: gamma draft forwards a round.

    `ModelDrafter.pruned(model, ids)` drafts with an LM head that scores only the tokens
    `ids` (e.g. a corpus's most frequent ones, `frequent_tokens`): a Qwen3-0.6B head over
    151,936 tokens is ~311 MB, read by every draft forward. Every other token gets draft
    logit -inf, so it is never proposed and the draft distribution is the softmax over
    `ids`. The target's verify still decides every token: outputs stay exact under
    exact_greedy (and distribution-exact under rejection_sampling); acceptance may drop
    where the target's token lies outside `ids`. `head_slot` [V] int32 maps each token to
    its column of the pruned head (-1: not scored); None for the full head. The pruned
    drafter's `model` returns logits over its head's columns, not token ids: use it
    through the drafter, not with `jspec.generate` or `jspec.forward`.
    """

    model: Model
    head_slot: jax.Array | None = None

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

    def _full(self, logits, vocab: int):
        """[..., n] logits of the head's columns -> [..., vocab] in the target's ids (-inf
        off the head and past the draft's vocabulary)."""
        return to_target_vocab(logits, self.head_slot, vocab)

    def init(self, tokens, lens, max_len: int, gamma: int, features=None) -> ModelDraftState:
        from jspec.chunked_prefill import prefill

        cache = init_cache(self.model, tokens.shape[0], max_len)
        cache, _ = prefill(self.model, tokens, lens, cache)  # chunked, no LM head: at lens - 1
        last = jnp.take_along_axis(tokens, (lens - 1)[:, None], axis=1)  # [B, 1]
        logits, cache = apply(self.model, last, cache)  # the last prompt token's logits
        return ModelDraftState(cache=cache, next_logits=logits[:, 0])

    def propose(self, state: ModelDraftState, ctx: ProposeContext):
        sample = ctx.draft_sampler
        first = self._full(state.next_logits, ctx.vocab)  # [B, V]
        d1 = sample(first, ctx.seed, ctx.rows, ctx.pos + 1)

        def step(carry, i):
            cache, tok = carry
            logits, cache = apply(self.model, tok[:, None], cache)
            logits = self._full(logits[:, 0], ctx.vocab)
            nxt = sample(logits, ctx.seed, ctx.rows, ctx.pos + 2 + i)
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
        last = jnp.where(n_acc == 0, ctx.cur,
                         jnp.take_along_axis(drafts, jnp.maximum(n_acc - 1, 0)[:, None], 1)[:, 0])
        cache = rollback(state.cache, ctx.pos + n_acc)
        logits, cache = apply(self.model, jnp.stack([last, nxt], axis=1), cache)
        return ModelDraftState(cache=cache, next_logits=logits[:, 1])


    def propose_tree(self, state: ModelDraftState, ctx: ProposeContext, tree):
        """A draft tree (`jspec.tree_drafting`): one draft forward a depth."""
        return tree_drafting.model_tree(self, state, ctx, tree)

    def commit_tree(self, state: ModelDraftState, ctx: ProposeContext, n, nxt, path,
                    features=None):
        return tree_drafting.model_commit_tree(self, state, ctx, n, nxt, path)


@struct.dataclass
class LookupState:
    """hist [B, H] committed tokens including `cur`; hlen [B]."""

    hist: jax.Array
    hlen: jax.Array


@struct.dataclass
class PromptLookupDrafter:
    """n-gram prompt lookup: find the latest earlier occurrence of the last n tokens
    (n from max_ngram down to min_ngram) in the prompt and output so far and
    propose the tokens that followed it. No model; pure jnp."""

    max_ngram: int = struct.field(pytree_node=False, default=3)
    min_ngram: int = struct.field(pytree_node=False, default=1)

    def __post_init__(self):
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
        return tree_drafting.lookup_tree(self, state, ctx, tree)

    def commit_tree(self, state: LookupState, ctx: ProposeContext, n, nxt, path,
                    features=None):
        return self.commit(state, ctx, n, nxt, path)

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
        padded = jnp.concatenate([drafts, drafts[:, :1]], axis=1)
        emitted = jnp.where(slot < n_acc[:, None], padded, nxt[:, None])  # [B, g+1]
        hist = jax.vmap(lambda h, e, s: jax.lax.dynamic_update_slice(h, e, (s,)))(
            state.hist, emitted, state.hlen)
        return LookupState(hist=hist, hlen=state.hlen + n_acc + 1)


@struct.dataclass
class OracleDrafter:
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
        return getattr(self.draft, "feature_layers", ())

    def forwards_per_round(self, gamma: int) -> int:
        return self.draft.forwards_per_round(gamma) if self.draft is not None else 0

    def init(self, tokens, lens, max_len: int, gamma: int, features=None):
        if self.draft is None:
            return ()
        return self.draft.init(tokens, lens, max_len, gamma, features=features)

    def propose(self, state, ctx: ProposeContext):
        model_drafts = None
        if self.draft is not None:
            model_drafts, _, state = self.draft.propose(state, ctx)  # [B, g]
        R = self.reference.shape[1]
        pos = ctx.pos[:, None] + 1 + jnp.arange(ctx.gamma)[None, :]  # [B, g]
        truth = jnp.take_along_axis(self.reference, jnp.minimum(pos, R - 1), axis=1)
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
        return tree_drafting.oracle_tree(self, state, ctx, tree)

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
    hidden state the second step reads."""

    cache: object
    next_logits: jax.Array
    next_hidden: jax.Array


@struct.dataclass
class FeatureDrafter:
    """Drafts with a feature head (`jspec.feature_head`: EAGLE-3's one decoder layer over
    the target's hidden states), whose cost is a few percent of a target step.

    The engine asks the target's prefill and every verify for the hidden states of
    `feature_layers` (no extra target pass) and hands them to `init` and `commit`. Per
    round: gamma - 1 one-token head steps in `propose` (each reading the head's own
    hidden state), and one step of gamma + 1 positions in `commit` that rewrites the
    accepted positions with the target's true features and computes the next round's
    first proposal: gamma head forwards a round.
    """

    head: object  # FeatureHead

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
        from jspec.feature_head import head_apply, init_head_cache

        if features is None:
            raise ValueError("FeatureDrafter.init needs the target's features")
        B, P = tokens.shape
        cache = init_head_cache(self.head, B, max_len)
        D, Vd = self.head.config.layer.hidden_size, self.head.config.layer.vocab_size
        if P < 2:  # no pair yet: a uniform first guess (the target decides anyway)
            return FeatureDraftState(cache=cache, next_logits=jnp.zeros((B, Vd), jnp.float32),
                                     next_hidden=jnp.zeros((B, D), cache.k[0].dtype))
        # Pairs (t_{i+1}, f_i), i = 0 .. P - 2, at head positions 0 .. P - 2.
        logits, hidden, cache = head_apply(self.head, tokens[:, 1:], features[:, :-1],
                                           cache, fuse=True)
        last = jnp.maximum(lens - 2, 0)[:, None, None]
        single = (lens < 2)[:, None]
        nl = jnp.where(single, 0.0, jnp.take_along_axis(logits, last, axis=1)[:, 0])
        nh = jnp.where(single, 0, jnp.take_along_axis(hidden, last, axis=1)[:, 0])
        return FeatureDraftState(cache=rollback(cache, jnp.maximum(lens - 1, 0)),
                                 next_logits=nl, next_hidden=nh.astype(hidden.dtype))

    def propose(self, state: FeatureDraftState, ctx: ProposeContext):
        from jspec.feature_head import head_apply

        sample = ctx.draft_sampler
        first = self._full(state.next_logits, ctx.vocab)  # [B, V]
        d1 = sample(first, ctx.seed, ctx.rows, ctx.pos + 1)

        def step(carry, i):
            cache, tok, hid = carry
            logits, hid, cache = head_apply(self.head, tok[:, None], hid[:, None], cache,
                                            fuse=False)
            logits = self._full(logits[:, 0], ctx.vocab)
            nxt = sample(logits, ctx.seed, ctx.rows, ctx.pos + 2 + i)
            return (cache, nxt, hid[:, 0]), (nxt, logits)

        (cache, _, _), (toks, logits) = jax.lax.scan(
            step, (state.cache, d1, state.next_hidden),
            jnp.arange(ctx.gamma - 1, dtype=jnp.int32), unroll=True)
        drafts = jnp.concatenate([d1[:, None], toks.T], axis=1)  # [B, g]
        draft_logits = jnp.concatenate([first[:, None], jnp.moveaxis(logits, 0, 1)], axis=1)
        return drafts, draft_logits, state.replace(cache=cache)

    def commit(self, state: FeatureDraftState, ctx: ProposeContext, n_acc, nxt, drafts,
               features=None):
        from jspec.feature_head import head_apply

        if features is None:
            raise ValueError("FeatureDrafter.commit needs the verify's features")
        g = drafts.shape[1]
        slot = jnp.arange(g + 1)[None, :]
        # Pairs (t_{j+1}, f_j) from cur's position on: the accepted drafts, then nxt.
        emitted = jnp.where(slot < n_acc[:, None], jnp.pad(drafts, ((0, 0), (0, 1))),
                            nxt[:, None])  # [B, g + 1]
        cache = rollback(state.cache, ctx.pos)
        logits, hidden, cache = head_apply(self.head, emitted, features, cache, fuse=True)
        at = n_acc[:, None, None]
        return FeatureDraftState(cache=rollback(cache, ctx.pos + n_acc + 1),
                                 next_logits=jnp.take_along_axis(logits, at, axis=1)[:, 0],
                                 next_hidden=jnp.take_along_axis(hidden, at, axis=1)[:, 0])

    def propose_tree(self, state: FeatureDraftState, ctx: ProposeContext, tree):
        return tree_drafting.feature_tree(self, state, ctx, tree)

    def commit_tree(self, state: FeatureDraftState, ctx: ProposeContext, n, nxt, path,
                    features=None):
        """The accepted path with the verify's features at the root and along it
        [B, D + 1, n Dt]: the chain commit over them."""
        return self.commit(state, ctx, n, nxt, path, features=features)
