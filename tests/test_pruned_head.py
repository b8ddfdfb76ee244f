"""A draft with a pruned LM head (`ModelDrafter.pruned`, `frequent_tokens`).

The head scores only a subset of the vocabulary; every other token gets draft logit
-inf. The target's verify decides every token, so exact_greedy output stays equal to
serial output token for token whatever the subset, including subsets that miss the
target's tokens (those proposals are simply rejected).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import awkward_logits, bits, expected, load

import jspec
from jspec.cache import init_cache
from jspec.drafters import ModelDraftState, ProposeContext
from jspec.sampling import Greedy


def _ctx(cur, pos, gamma, vocab, sampler=None):
    B = cur.shape[0]
    return ProposeContext(cur=cur, pos=pos, rows=jnp.arange(B, dtype=jnp.int32),
                          seed=jnp.int32(0), gamma=gamma, vocab=vocab,
                          draft_sampler=sampler or Greedy())


def _round(drafter, prompts, gamma=3):
    """init on the prompts, then one propose: (next_logits [B, V], drafts [B, g],
    draft_logits [B, g, V])."""
    tokens = jnp.asarray(prompts, jnp.int32)
    B, P = tokens.shape
    lens = jnp.full((B,), P, jnp.int32)
    state = drafter.init(tokens, lens, P + 16, gamma)
    ctx = _ctx(tokens[:, -1], lens - 1, gamma, drafter.vocab_size)
    drafts, dlogits, _ = drafter.propose(state, ctx)
    return drafter._full(state.next_logits, drafter.vocab_size), drafts, dlogits


@pytest.mark.slow  # an opt-in head; its proposals' bits by default (the spread logits below)
def test_a_head_of_every_token_is_the_full_head_bitwise():
    draft = load("qwen3", "pallas")
    prompts = [expected("qwen3")["prompt"][:8]]
    V = draft.config.vocab_size
    full = _round(jspec.ModelDrafter(draft), prompts)
    same = _round(jspec.ModelDrafter.pruned(draft, np.arange(V)), prompts)
    for a, b in zip(full, same, strict=True):
        assert np.array_equal(bits(a), bits(b))


class _SpreadGreedy(Greedy):
    """Greedy's rule drawn the general way, from the logits spread over the target's ids
    (`jspec.drafting.head_draw` takes the head's own columns for `Greedy` itself only)."""


@pytest.mark.parametrize("head", ["full", "pruned", "shuffled"])
def test_greedy_proposals_are_the_spread_logits_greedy_bitwise(head):
    # A greedy draft draws on its head's columns; proposals and draft_logits are the
    # general path's bits from awkward first logits (ties, -inf rows, NaN, +inf, signed
    # zeros), with the columns in id order or shuffled (a hand-made head_slot).
    draft = load("qwen3", "xla")
    V, B, gamma = draft.config.vocab_size, 12, 3
    rng = np.random.default_rng(4)
    ids = np.sort(rng.choice(V, V // 3, replace=False))
    drafter = jspec.ModelDrafter(draft) if head == "full" else jspec.ModelDrafter.pruned(draft, ids)
    if head == "shuffled":
        slot = np.full(V, -1, np.int32)
        slot[rng.permutation(ids)] = np.arange(ids.size)
        drafter = drafter.replace(head_slot=jnp.asarray(slot))
    n = V if head == "full" else ids.size
    state = ModelDraftState(cache=init_cache(draft, B, 16),
                            next_logits=jnp.asarray(awkward_logits(rng, B, n)))
    z = jnp.zeros((B,), jnp.int32)
    propose = jax.jit(lambda st, ctx: drafter.propose(st, ctx)[:2])
    got = propose(state, _ctx(z, z, gamma, V))
    want = propose(state, _ctx(z, z, gamma, V, _SpreadGreedy()))
    assert np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert np.array_equal(bits(got[1]), bits(want[1]))


@pytest.mark.slow  # a further case of a property the default run proves
def test_off_head_tokens_get_minus_inf_and_are_never_proposed():
    draft = load("llama3", "pallas")
    V = draft.config.vocab_size
    prompts = [expected("llama3")["prompt"][:8], expected("llama3")["prompt"][2:10]]
    full_logits, full_drafts, _ = _round(jspec.ModelDrafter(draft), prompts)
    # The subset leaves out the full head's first choices, so the pruned draft must
    # propose something else.
    ids = np.setdiff1d(np.arange(0, V, 2), np.asarray(full_drafts).ravel())
    nxt, drafts, dlogits = _round(jspec.ModelDrafter.pruned(draft, ids), prompts)
    off = np.setdiff1d(np.arange(V), ids)
    assert np.all(np.asarray(nxt)[:, off] == -np.inf)
    assert np.all(np.asarray(dlogits)[:, :, off] == -np.inf)
    assert np.all(np.isfinite(np.asarray(nxt)[:, ids]))
    assert np.isin(np.asarray(drafts), ids).all()
    # On the head, the pruned logits are the full head's at those tokens (the pallas
    # matmul's columns do not depend on how many there are).
    assert np.array_equal(bits(np.asarray(nxt)[:, ids]), bits(np.asarray(full_logits)[:, ids]))


@pytest.mark.parametrize("name,fused", [pytest.param("qwen3", False, marks=pytest.mark.slow),
                                        pytest.param("gemma3", False, marks=pytest.mark.slow),
                                        pytest.param("qwen3", True, marks=pytest.mark.slow)])
def test_exact_greedy_with_a_pruned_draft_equals_serial(name, fused):
    # Half the vocabulary, without half of the tokens the target emits: the draft (the
    # target's own weights) cannot propose those and its other proposals there get
    # rejected; the output must still be serial's token for token. Fused: the draft also
    # runs `DraftOptions.fused`.
    target = load(name, "pallas")
    p = expected(name)["prompt"]
    prompts = [p, p[:5]]
    n = 16
    serial = jspec.generate(target, prompts, max_new_tokens=n)
    V = target.config.vocab_size
    used = np.unique(np.concatenate([serial.row(0), serial.row(1)]))
    rng = np.random.default_rng(0)
    keep = np.union1d(np.setdiff1d(rng.choice(V, V // 2, replace=False), used[::2]),
                      used[1::2])  # every other token the target emits is off the head
    draft = jspec.with_options(target, jspec.DraftOptions.latency()) if fused else target
    drafter = jspec.ModelDrafter.pruned(draft, keep)
    out = jspec.speculative_generate(target, drafter, prompts,
                                     jspec.SpecConfig(gamma=4, max_new_tokens=n))
    for b in range(len(prompts)):
        assert out.row(b) == serial.row(b)
    assert 0.0 < out.stats["acceptance_rate"] < 1.0


@pytest.mark.slow  # a further case of a property the default run proves
def test_rejection_sampling_with_a_pruned_draft_emits_valid_tokens():
    target = load("qwen3", "pallas")
    p = expected("qwen3")["prompt"]
    V = target.config.vocab_size
    drafter = jspec.ModelDrafter.pruned(target, np.arange(V // 3, V))
    spec = jspec.SpecConfig(gamma=3, policy="rejection_sampling", max_new_tokens=12,
                            temperature=1.0)
    out = jspec.speculative_generate(target, drafter, [p, p[:6]], spec)
    toks = np.concatenate([out.row(0), out.row(1)])
    assert len(toks) == 24 and toks.min() >= 0 and toks.max() < V


def test_pruned_heads_refuse_bad_ids_with_clear_errors():
    draft = load("qwen3", "pallas")
    V = draft.config.vocab_size
    for ids, msg in (([], "non-empty 1-D"), (np.zeros((2, 2), int), "non-empty 1-D"),
                     ([0.5, 1.5], "integer"), ([0, V], rf"\[0, {V}\)"), ([-1, 3], "must lie"),
                     ([3, 1, 3], "unique")):
        with pytest.raises(ValueError, match=msg):
            jspec.ModelDrafter.pruned(draft, ids)
    once = jspec.ModelDrafter.pruned(draft, [1, 2, 3])
    with pytest.raises(ValueError, match="already pruned"):
        jspec.ModelDrafter.pruned(once.model, [1, 2])


def test_frequent_tokens_counts_ties_and_errors():
    corpus = np.array([[5, 5, 2, 7], [7, 5, 9, 2]])  # 5: 3x, 2: 2x, 7: 2x, 9: 1x
    assert jspec.frequent_tokens(corpus, 1, 10).tolist() == [5]
    assert jspec.frequent_tokens(corpus, 3, 10).tolist() == [2, 5, 7]  # 2 beats 7 on a tie
    assert jspec.frequent_tokens(corpus, 5, 10).tolist() == [0, 2, 5, 7, 9]  # then unseen 0
    assert jspec.frequent_tokens([], 3, 10).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="lie in"):
        jspec.frequent_tokens([1, 10], 2, 10)
    with pytest.raises(ValueError, match="n must lie"):
        jspec.frequent_tokens(corpus, 0, 10)
    with pytest.raises(ValueError, match="integer"):
        jspec.frequent_tokens(np.array([0.5]), 1, 10)
    assert jax.numpy.asarray(jspec.frequent_tokens(corpus, 2, 10)).dtype == jnp.int32
