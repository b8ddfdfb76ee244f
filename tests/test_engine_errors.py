"""The engine's guards: what used to fail silently or deep now fails clearly, CPU.

Each test fails without its fix: broken logits stop a run (NonFiniteError, never tokens);
a drafter's out-of-range ids are rejected and never reach the target's cache; gamma and
counts are bounded and typed; rollback rejects bad lengths; the xla backend runs bf16
batches on the CPU; length buckets share compiled programs without changing a token; the
loop runs in chunks; a draft may score a prefix of the target's vocabulary.
"""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import expected, load
from flax import struct

import jspec
from jspec import loop
from jspec.drafters import one_hot_logits


def _prompts(name="qwen3"):
    p = expected(name)["prompt"]
    return [p, p[:5]]


def _poisoned(model, value=np.nan):
    """The model with one weight of its last layer's down projection set to `value`."""
    params = jax.tree.map(lambda x: x, model.params)
    lp = dict(params["layers"][-1])
    lp["w_down"] = lp["w_down"].at[0, 0].set(value)
    params["layers"] = params["layers"][:-1] + [lp]
    return model.replace(params=params)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_logits_stop_serial_and_speculative_runs(value):
    model = _poisoned(load("qwen3", "xla"), value)
    with pytest.raises(jspec.NonFiniteError, match="row 0, position"):
        jspec.generate(model, _prompts(), max_new_tokens=4)
    with pytest.raises(jspec.NonFiniteError, match="verify"):
        jspec.speculative_generate(model, jspec.PromptLookupDrafter(), _prompts(),
                                   jspec.SpecConfig(gamma=2, max_new_tokens=4))
    with pytest.raises(jspec.NonFiniteError):
        list(jspec.generate_stream(model, _prompts(), max_new_tokens=4))


@struct.dataclass
class _BrokenQDrafter(jspec.ModelDrafter):
    """The draft model's proposals, with one slot's draft logits (a tree's q) replaced:
    `value` at every token (NaN, +inf: a draft that overflowed; -inf: nothing allowed)."""

    value: float = struct.field(pytree_node=False, default=np.nan)

    def propose(self, state, ctx):
        drafts, logits, state = super().propose(state, ctx)
        return drafts, logits.at[:, 1].set(self.value), state

    def propose_tree(self, state, ctx, tree):
        tokens, parents, q, state = super().propose_tree(state, ctx, tree)
        return tokens, parents, q.at[:, 2].set(self.value), state


@pytest.mark.parametrize("tree,value", [
    (None, np.nan) if (t, v) == (None, np.nan) else pytest.param(t, v, marks=pytest.mark.slow)
    for t in (None, jspec.TreeConfig(branching=(2, 1))) for v in (np.nan, np.inf, -np.inf)],
    ids=[f"{t}-{v}" for t in ("chain", "tree") for v in ("nan", "inf", "-inf")])
def test_broken_draft_logits_stop_a_policy_that_reads_them(value, tree):
    """Rejection sampling read NaN draft logits as the draft's distribution: every draft
    was rejected and each correction drawn from a NaN residual, silently. The run now
    stops, naming the drafter; a policy that never reads them runs as before."""
    model = load("qwen3", "xla")
    drafter = _BrokenQDrafter(model, value=value)
    spec = jspec.SpecConfig(gamma=None if tree else 2, max_new_tokens=6,
                            policy="rejection_sampling",
                            temperature=1.0, tree=tree)
    with pytest.raises(jspec.NonFiniteError, match=r"the drafter's draft logits hold NaN or "
                       r"\+inf, or are -inf at every token, where the policy "
                       "RejectionSampling reads them"):
        jspec.speculative_generate(model, drafter, _prompts(), spec)
    greedy = dataclasses.replace(spec, policy="exact_greedy", temperature=None)
    out = jspec.speculative_generate(model, drafter, _prompts(), greedy)
    serial = jspec.generate(model, _prompts(), max_new_tokens=6)
    rows = range(len(_prompts()))
    assert [out.row(b) for b in rows] == [serial.row(b) for b in rows]


def test_a_non_finite_input_is_named_where_it_entered():
    # Token 5's embedding is NaN. Attention's p @ v carries it back to position 0 (0 x NaN)
    # a layer later; the error names position 1 and the residual stream entering layer 0,
    # where it came in (before: position 0, layer 1, "the weights are finite").
    model = load("qwen3", "xla")
    params = dict(model.params)
    params["embed"] = params["embed"].at[5].set(np.nan)
    model = model.replace(params=params)
    with pytest.raises(jspec.NonFiniteError, match="row 0, position 1: the residual stream "
                       "entering layer 0"):
        jspec.generate(model, [np.asarray([1, 5, 2], np.int32)], max_new_tokens=2)


@struct.dataclass
class _WildDrafter(jspec.Drafter):
    """Proposes ids outside [0, V) at every other slot (a broken drafter)."""

    def forwards_per_round(self, gamma):
        return 0

    def init(self, tokens, lens, max_len, gamma):
        return ()

    def propose(self, state, ctx):
        B, g = ctx.cur.shape[0], ctx.gamma
        slot = jnp.arange(g)[None, :]
        drafts = jnp.where(slot % 2 == 0, ctx.vocab + 7 + slot, -3 - slot)
        drafts = jnp.broadcast_to(drafts, (B, g)).astype(jnp.int32)
        return drafts, one_hot_logits(jnp.zeros((B, g), jnp.int32), ctx.vocab), state

    def commit(self, state, ctx, n_acc, nxt, drafts):
        return state


@pytest.mark.parametrize("policy", ["exact_greedy",  # the check is the engine's, not a policy's
                                    pytest.param("rejection_sampling", marks=pytest.mark.slow)])
def test_out_of_range_proposals_are_rejected_and_never_reach_the_cache(policy):
    model = load("qwen3", "pallas")
    spec = jspec.SpecConfig(gamma=3, max_new_tokens=6, policy=policy,
                            temperature=None if policy == "exact_greedy" else 0.9)
    out = jspec.speculative_generate(model, _WildDrafter(), _prompts(), spec)
    assert out.stats["accepted"] == 0  # every wild proposal rejected
    serial = jspec.generate(model, _prompts(), max_new_tokens=6, sampler=spec.serial_sampler())
    if policy == "exact_greedy":
        for b in range(2):
            assert out.row(b) == serial.row(b)
    else:  # distribution-exact: each round draws the target's own token from p
        assert all(0 <= t < model.config.vocab_size for b in range(2) for t in out.row(b))


@struct.dataclass
class _Const:
    """A hand-written sampler: every row gets `value` (of `dtype`, `shape` [B] by default)."""
    value: int = struct.field(pytree_node=False)
    dtype: object = struct.field(pytree_node=False, default=jnp.int32)
    wide: bool = struct.field(pytree_node=False, default=False)

    def __call__(self, logits, seed, rows, positions):
        return jnp.full(logits.shape[:1] + ((1,) if self.wide else ()), self.value, self.dtype)


def test_a_samplers_answer_is_checked():
    # A sampler is a protocol like a drafter's: ids outside the vocabulary (PAD, V) stop
    # the run naming the sampler, never reaching the output or the next step's
    # embedding; the wrong dtype or shape is refused as the loop traces.
    model = load("qwen3", "xla")
    V = model.config.vocab_size
    for value in (-1, V):  # PAD itself, the first id past the vocabulary
        with pytest.raises(ValueError, match="position 5 the sampler returned a token id "
                                             "outside"):
            jspec.generate(model, [[1, 2, 3, 4, 5]], max_new_tokens=3, sampler=_Const(value))
        with pytest.raises(ValueError, match="the sampler returned a token id outside"):
            list(jspec.generate_stream(model, [[1, 2, 3]], max_new_tokens=3,
                                       sampler=_Const(value)))
    for bad in (_Const(3, jnp.float32), _Const(3, wide=True)):
        with pytest.raises(TypeError, match=r"must return integer token ids of shape \[B\]"):
            jspec.generate(model, [[1, 2, 3]], max_new_tokens=3, sampler=bad)
    out = jspec.generate(model, [[1, 2, 3]], max_new_tokens=3, sampler=_Const(V - 1))
    assert out.tokens.tolist() == [[V - 1] * 3]


def test_a_traced_call_past_the_cache_is_flagged():
    # An eager call past max_len is refused; a traced one cannot be, and its K/V writes
    # clamp onto earlier slots (finite, wrong logits): every position of that row carries
    # the cache-full code in Forward.bad, and the engine would stop on it by name.
    from jspec.model import bad_code, describe_bad

    model = load("qwen3", "xla")
    L = model.config.num_layers
    cache = jspec.init_cache(model, 2, 16)
    cache = jspec.forward(model, jnp.ones((2, 14), jnp.int32), cache).cache
    cache = cache.replace(lengths=jnp.asarray([14, 9], jnp.int32))
    toks = jnp.full((2, 4), 3, jnp.int32)
    with pytest.raises(ValueError, match="exceed"):
        jspec.apply(model, toks, cache)  # eager: refused
    out = jax.jit(lambda t, c: jspec.apply(model, t, c))(toks, cache)
    assert out.bad.tolist() == [[bad_code(L, True)] * 4, [-1] * 4]
    assert "cache was full" in describe_bad(bad_code(L, True), L)


def test_gamma_and_counts_are_bounded_and_typed():
    with pytest.raises(ValueError, match="gamma=1000 exceeds MAX_GAMMA=32"):
        jspec.SpecConfig(gamma=1000)
    for bad in (2.5, 0, True):
        with pytest.raises(ValueError, match="max_new_tokens"):
            jspec.SpecConfig(max_new_tokens=bad)
    model = load("qwen3", "xla")
    with pytest.raises(ValueError, match=r"max_new_tokens=2\.5 must be an integer"):
        jspec.generate(model, _prompts(), max_new_tokens=2.5)
    with pytest.raises(ValueError, match="max_len=0"):
        jspec.generate(model, _prompts(), max_new_tokens=2, max_len=0)


def test_rollback_rejects_lengths_out_of_range():
    cache = jspec.init_cache(load("qwen3", "xla"), 2, 16).replace(
        lengths=jnp.asarray([2, 16], jnp.int32))
    with pytest.raises(ValueError, match=r"row 0: -3 \(limit 2\); row 1: -3"):
        jspec.rollback(cache, -3)
    with pytest.raises(ValueError, match=r"row 1: 17 \(limit 16\)"):
        jspec.rollback(cache, [2, 17])
    assert list(jspec.rollback(cache, [0, 16]).lengths) == [0, 16]


def test_xla_backend_runs_bf16_batches_on_the_cpu():
    # XLA's CPU runtime has no bf16 x bf16 -> f32 dot; the xla backend widens to f32 there.
    model = load("qwen3", "xla", "bfloat16")
    out = jspec.generate(model, _prompts(), max_new_tokens=4)
    assert (out.num_tokens == 4).all()
    logits, _ = jspec.forward(model, np.zeros((2, 3), np.int32), jspec.init_cache(model, 2, 8))
    assert np.isfinite(np.asarray(logits)).all()


def test_length_buckets_share_programs_and_change_no_token():
    from jspec.generate import decode_loop, prefill

    model = load("qwen3", "pallas")
    p = expected("qwen3")["prompt"]
    first = jspec.generate(model, [p[:5]], max_new_tokens=4)
    assert first.stats["prompt_bucket"] == 16 and first.stats["max_len"] == 32
    sizes = prefill._cache_size(), decode_loop._cache_size()
    outs = {n: jspec.generate(model, [p[:n]], max_new_tokens=4) for n in (7, 11)}
    assert (prefill._cache_size(), decode_loop._cache_size()) == sizes  # nothing compiled
    for n, out in outs.items():
        exact = jspec.generate(model, [p[:n]], max_new_tokens=4, max_len=n + 4)  # no padding
        assert exact.stats["prompt_bucket"] == n
        assert out.row(0) == exact.row(0)
    assert loop.bucket(1025) == 1536 and loop.bucket(5, cap=4) == 5
    assert loop.bucket(512 + 128) == 768 and loop.bucket(257) == 384
    assert loop.bucket(200) == 256 and loop.bucket(17) == 32
    assert loop.bucket(32768 + 128) == 40960 and loop.bucket(16385) == 20480
    assert all(b % 4096 == 0 for b in loop.BUCKETS if b >= 16384)  # whole fold groups


def test_buckets_stop_at_the_models_limit():
    from jspec.generate import plan_shapes

    # a prompt whose bucket is the limit itself, with new tokens after it: the prompt
    # pads less, the cache is the limit (it was rounded past it)
    assert plan_shapes(130944, 128, None, 131072) == (130944, 131072)
    assert plan_shapes(130000, 128, None, 131072) == (130944, 131072)
    assert plan_shapes(100, 28, None, 128) == (100, 128)
    assert plan_shapes(512, 128, None, 1 << 17) == (512, 768)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        plan_shapes(130945, 128, None, 131072)
    for longest in range(1, 300, 7):  # never past the limit, never below the need
        for limit in range(longest + 9, 400, 13):
            padded, max_len = plan_shapes(longest, 9, None, limit)
            assert longest <= padded and padded + 9 <= max_len <= limit


def test_the_loop_runs_in_chunks_with_the_same_tokens(monkeypatch):
    model = load("qwen3", "xla")
    want = jspec.generate(model, _prompts(), max_new_tokens=6)
    spec = jspec.SpecConfig(gamma=2, max_new_tokens=6)
    want_spec = jspec.speculative_generate(model, jspec.PromptLookupDrafter(), _prompts(), spec)
    calls = []
    run = loop.run_chunked

    def counting(fn, state, **kw):
        return run(lambda s, stop: (calls.append(int(stop)), fn(s, stop))[1], state, **kw)

    monkeypatch.setattr(loop, "CHUNK_SECONDS", 0.0)  # chunks of one step / round
    for name in ("jspec.generate", "jspec.speculative"):  # modules, not the functions
        monkeypatch.setattr(importlib.import_module(name), "run_chunked", counting)
    got = jspec.generate(model, _prompts(), max_new_tokens=6, progress=True)
    assert calls[:3] == [1, 2, 3] and len(calls) >= 6
    np.testing.assert_array_equal(got.tokens, want.tokens)
    got = jspec.speculative_generate(model, jspec.PromptLookupDrafter(), _prompts(), spec,
                                     progress=True)
    np.testing.assert_array_equal(got.tokens, want_spec.tokens)


@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory):
    """The official Gemma 3 layout's tiny target (vocab 576) and a gemma3_text draft whose
    vocabulary is a prefix of it (512), as 4B's 262,208 against 270M/1B's 262,144."""
    from jspec.tiny import write_tiny_gemma3_pair

    target_dir, draft_dir = write_tiny_gemma3_pair(str(tmp_path_factory.mktemp("gemma")))
    target = jspec.load_hf(target_dir, dtype="float32", interpret=True)
    draft = jspec.load_hf(draft_dir, dtype="float32", backend="xla")
    assert draft.config.vocab_size < target.config.vocab_size
    return target, draft


@pytest.mark.parametrize("policy", [
    "exact_greedy", pytest.param("gumbel_coupled", marks=pytest.mark.slow),
    pytest.param("rejection_sampling", marks=pytest.mark.slow)])
def test_a_draft_over_a_prefix_of_the_vocabulary(gemma_pair, policy):
    target, draft = gemma_pair
    prompts = [[2, 40, 41, 42, 43, 44, 45], [2, 300, 301]]
    spec = jspec.SpecConfig(gamma=3, max_new_tokens=8, policy=policy,
                            temperature=None if policy == "exact_greedy" else 0.8)
    out = jspec.speculative_generate(target, jspec.ModelDrafter(draft), prompts, spec)
    serial = jspec.generate(target, prompts, max_new_tokens=8, sampler=spec.serial_sampler(),
                            seed=spec.seed)
    if policy != "rejection_sampling":
        for b in range(2):
            assert out.row(b) == serial.row(b)
    assert out.stats["accepted"] > 0


def test_ids_past_a_draft_vocabulary_never_poison_the_draft(gemma_pair):
    # The draft embedded an id of the target's past its own vocabulary as NaN (jnp.take's
    # fill): its cache then held NaN for the rest of the row, every later draft logit was
    # NaN, and rejection sampling drew from a NaN residual. Such ids now reach it as 0.
    _, draft = gemma_pair
    V = draft.config.vocab_size
    drafter = jspec.ModelDrafter(draft)
    state = drafter.init(jnp.asarray([[2, 40, V + 3, 41]], jnp.int32), jnp.asarray([4]), 32, 2)
    assert np.isfinite(np.asarray(state.next_logits)).all()
    want = drafter.init(jnp.asarray([[2, 40, 0, 41]], jnp.int32), jnp.asarray([4]), 32, 2)
    assert np.array_equal(np.asarray(state.next_logits), np.asarray(want.next_logits))


def test_a_draft_wider_than_the_target_is_an_error(gemma_pair):
    target, draft = gemma_pair
    V = target.config.vocab_size
    p = dict(target.params)
    wide = target.replace(config=target.config.replace(vocab_size=V + 1),
                          params=p | {"embed": jnp.pad(p["embed"], ((0, 1), (0, 0)))})
    with pytest.raises(ValueError, match=f"draft vocab_size={V + 1} > target vocab_size={V}"):
        jspec.speculative_generate(target, jspec.ModelDrafter(wide), [[2, 3]],
                                   jspec.SpecConfig(gamma=2, max_new_tokens=2))
