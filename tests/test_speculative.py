"""The speculative engine on tiny models (pallas backend, CPU interpret mode).

exact_greedy speculative == serial greedy token for token, for gamma 1..8,
every drafter (a perfect one, a poor one, prompt lookup, the oracle), batch
mixes; gumbel_coupled == serial Sample; rejection_sampling reproduces the target
distribution (a statistical test that a broken sampler fails).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAMILIES, expected, load

import jspec
from jspec import policies
from jspec.sampling import Sample

N = 24


def _prompts(name):
    p = expected(name)["prompt"]
    return [p, p[:4], p[3:10]]  # ragged batch of 3


def _poor_draft(name):
    # Another family's tiny model with the same vocabulary: mostly rejected.
    other = {"qwen3": "llama3", "llama3": "qwen3", "gemma3": "qwen3", "mistral": "llama3",
             "qwen2": "qwen3", "gemma2": "gemma3"}[name]
    return jspec.ModelDrafter(load(other, "pallas"))


def _drafter(kind, name, target, prompts, n):
    if kind == "perfect":
        return jspec.ModelDrafter(target)
    if kind == "poor":
        return _poor_draft(name)
    if kind == "lookup":
        return jspec.PromptLookupDrafter(max_ngram=3)
    ref = jspec.generate(target, prompts, max_new_tokens=n)
    seqs = np.zeros((len(prompts), max(len(p) for p in prompts) + n), np.int32)
    for b, p in enumerate(prompts):
        seqs[b, : len(p) + n] = np.concatenate([p, ref.tokens[b]])
    return jspec.OracleDrafter(jnp.asarray(seqs), corrupt_prob=0.4,
                               draft=_poor_draft(name) if kind == "oracle+draft" else None)


_slow = pytest.mark.slow
CASES = [  # (gamma, family, drafter): every gamma 1..8, every drafter, every family; the
    # default run keeps the lookup and oracle drafters at gammas 3-4 (a perfect draft's
    # accept-all rounds: test_rejection_sampling_end_to_end_...; Llama 3 and rejected
    # drafts: test_compaction's corrupted oracle, every row against serial decoding)
    pytest.param(1, "qwen3", "perfect", marks=_slow),
    pytest.param(2, "llama3", "poor", marks=_slow),
    (3, "qwen3", "lookup"), pytest.param(3, "gemma3", "lookup", marks=_slow),
    (4, "qwen3", "oracle"), pytest.param(5, "llama3", "perfect", marks=_slow),
    pytest.param(6, "gemma3", "poor", marks=_slow), pytest.param(7, "qwen3", "lookup", marks=_slow),
    pytest.param(8, "llama3", "oracle+draft", marks=_slow),
    pytest.param(4, "gemma3", "perfect", marks=_slow),
    pytest.param(3, "mistral", "oracle+draft", marks=_slow),  # every layer windowed (16)
    pytest.param(4, "qwen2", "oracle", marks=_slow),  # q/k/v biases
    pytest.param(3, "gemma2", "lookup", marks=_slow),  # softcapped attention scores
]


@pytest.mark.parametrize("gamma,name,kind", CASES)
def test_exact_greedy_equals_serial_greedy(gamma, name, kind):
    target = load(name, "pallas")
    prompts = _prompts(name)
    serial = jspec.generate(target, prompts, max_new_tokens=N)
    drafter = _drafter(kind, name, target, prompts, N)
    out = jspec.speculative_generate(target, drafter, prompts,
                                     jspec.SpecConfig(gamma=gamma, max_new_tokens=N))
    for b in range(len(prompts)):
        assert out.row(b) == serial.row(b), (b, out.stats)
    st, tl = out.stats, out.stats["timeline"]
    assert st["tokens"] == N * len(prompts)
    # The timeline accounts for every call of the loop, inside the loop's time.
    assert sum(c[0] for c in tl["calls"]) == st["rounds"] and all(c[0] >= 0 for c in tl["calls"])
    assert tl["calls_s"] == pytest.approx(sum(c[1] for c in tl["calls"]))
    assert 0 < tl["calls_s"] <= tl["loop_s"] and tl["prefill_s"] > 0
    if kind == "perfect":
        assert st["acceptance_rate"] == 1.0
        assert st["accepted"] == st["proposed"]
    if kind == "poor":
        assert st["acceptance_rate"] < 0.5
    assert len(st["acceptance_by_position"]) == gamma


@pytest.mark.parametrize("drafters", [
    "poor", pytest.param("perfect", marks=pytest.mark.slow)])  # a poor draft meets both paths
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n != "qwen3" else n
                                  for n in FAMILIES])
def test_gumbel_coupled_equals_serial_sampling(name, drafters):
    target = load(name, "pallas")
    prompts = _prompts(name)
    spec = jspec.SpecConfig(gamma=3, policy="gumbel_coupled", max_new_tokens=N, seed=7,
                            temperature=0.8, top_k=40, top_p=0.9)
    serial = jspec.generate(target, prompts, max_new_tokens=N, sampler=spec.serial_sampler(),
                            seed=7)
    greedy = jspec.generate(target, prompts, max_new_tokens=N)
    assert serial.row(0) != greedy.row(0)  # really sampling
    drafter = jspec.ModelDrafter(target) if drafters == "perfect" else _poor_draft(name)
    out = jspec.speculative_generate(target, drafter, prompts, spec)
    for b in range(len(prompts)):
        assert out.row(b) == serial.row(b)
    if drafters == "poor":  # drafts rejected and accepted: both branches of the policy ran
        assert 0 < out.stats["accepted"] < out.stats["proposed"]


@pytest.mark.slow  # stops: test_text.py's stop strings serial, speculative and streamed
def test_stop_tokens_and_stream_match_serial():
    target = load("qwen3", "pallas")  # the free serial run: test_exact_greedy_...'s
    prompts = _prompts("qwen3")
    serial_free = jspec.generate(target, prompts, max_new_tokens=N)
    stop = serial_free.row(0)[6]
    serial = jspec.generate(target, prompts, max_new_tokens=N, stop_tokens=[stop])
    spec = jspec.SpecConfig(gamma=4, max_new_tokens=N, stop_tokens=(stop,))
    drafter = jspec.ModelDrafter(target.with_backend("xla"))  # a draft's bits never matter
    out = jspec.speculative_generate(target, drafter, prompts, spec)
    assert [out.row(b) for b in range(3)] == [serial.row(b) for b in range(3)]
    assert out.row(0)[-1] == stop and len(out.row(0)) <= 7
    chunks = list(jspec.speculative_stream(target, drafter, prompts, spec))
    streamed = [sum((c[b] for c in chunks), []) for b in range(3)]
    assert streamed == [out.row(b) for b in range(3)]


@pytest.mark.parametrize("drafters", ["perfect", pytest.param("poor", marks=pytest.mark.slow)])
def test_rejection_sampling_end_to_end_runs_with_perfect_and_poor_drafts(drafters):
    # (The distribution itself: test_rejection_sampling_reproduces_the_target_distribution.)
    target = load("qwen3", "pallas")
    prompts = _prompts("qwen3")
    spec = jspec.SpecConfig(gamma=3, policy="rejection_sampling", max_new_tokens=N,
                            temperature=1.0)
    if drafters == "perfect":
        out = jspec.speculative_generate(target, jspec.ModelDrafter(target), prompts, spec)
        assert out.stats["acceptance_rate"] > 0.9  # p == q: accepted up to float rounding
        return
    out = jspec.speculative_generate(target, _poor_draft("qwen3"), prompts, spec)
    toks = np.concatenate([out.row(b) for b in range(3)])
    assert len(toks) == 3 * N and toks.min() >= 0 and toks.max() < target.config.vocab_size


def _first_token_hist(fn, p_logits, q_logits, trials, V, gamma=2, seed=0):
    """Runs one verify round per row; returns counts of the first emitted token."""
    B = trials
    q = jax.nn.softmax(q_logits)
    key = jax.random.key(seed)
    drafts = jax.random.categorical(key, jnp.log(q), shape=(B, gamma)).astype(jnp.int32)
    logits = jnp.broadcast_to(p_logits, (B, gamma + 1, V))
    dlogits = jnp.broadcast_to(q_logits, (B, gamma, V))
    rows = jnp.arange(B, dtype=jnp.int32)
    positions = jnp.broadcast_to(10 + jnp.arange(gamma + 1), (B, gamma + 1)).astype(jnp.int32)
    n_acc, nxt = fn(Sample(1.0), logits, dlogits, drafts, jnp.int32(seed), rows, positions)
    first = jnp.where(n_acc > 0, drafts[:, 0], nxt)
    return np.bincount(np.asarray(first), minlength=V)


def _chi2(counts, p):
    expect = p * counts.sum()
    return float(np.sum((counts - expect) ** 2 / expect))


def _broken_rejection(sampler, logits, dlogits, drafts, seed, rows, positions):
    """A classic bug: on rejection, resample from p instead of norm(max(0, p - q))."""
    n_acc, _ = policies.rejection_sample(sampler, logits, dlogits, drafts, seed, rows, positions)
    redo = policies.target_tokens(sampler, logits, seed, rows, positions)
    return n_acc, jnp.take_along_axis(redo, n_acc[:, None], axis=1)[:, 0]


def test_rejection_sampling_reproduces_the_target_distribution():
    V, trials = 6, 40000
    p_logits = jnp.log(jnp.array([0.40, 0.25, 0.15, 0.10, 0.07, 0.03]))
    q_logits = jnp.log(jnp.array([0.05, 0.10, 0.40, 0.05, 0.30, 0.10]))
    p = np.asarray(jax.nn.softmax(p_logits), np.float64)
    critical = 20.52  # chi-square, 5 degrees of freedom, p = 0.001
    good = _first_token_hist(policies.rejection_sample, p_logits, q_logits, trials, V)
    assert _chi2(good, p) < critical, good
    bad = _first_token_hist(_broken_rejection, p_logits, q_logits, trials, V)
    assert _chi2(bad, p) > 10 * critical, bad


def test_bad_speculative_configs_get_clear_errors():
    target = load("qwen3", "pallas")
    p = _prompts("qwen3")
    with pytest.raises(ValueError, match="gamma=0 must be an integer >= 1"):
        jspec.SpecConfig(gamma=0)
    with pytest.raises(ValueError, match="unknown verify policy 'typical'"):
        jspec.SpecConfig(policy="typical")
    with pytest.raises(ValueError, match="temperature=0.0 must be > 0"):
        jspec.SpecConfig(policy="rejection_sampling", temperature=0.0)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        jspec.SpecConfig(max_new_tokens=0)
    wide = load("qwen3", "pallas")
    wide = wide.replace(config=wide.config.replace(vocab_size=300))
    with pytest.raises(ValueError, match="draft and target vocab mismatch"):
        jspec.speculative_generate(target, jspec.ModelDrafter(wide), p, jspec.SpecConfig())
    with pytest.raises(ValueError, match="OracleDrafter.reference has shape"):
        jspec.speculative_generate(target, jspec.OracleDrafter(jnp.zeros((3, 5), jnp.int32)),
                                   p, jspec.SpecConfig())
    ref = jnp.zeros((len(p), 200), jnp.int32)
    for bad, what in [(dict(reference=ref[0]), "reference must be a \\[B, R\\] integer"),
                      (dict(reference=ref.astype(jnp.float32)), "integer array"),
                      (dict(corrupt_prob=1.5), "corrupt_prob=1.5"),
                      (dict(corrupt_prob=float("nan")), "corrupt_prob=nan"),
                      (dict(rank_probs=[0.8, 0.3]), "summing to at most 1"),
                      (dict(reference=ref + 1000), "token id 1000, out of range \\[0, 256\\)"),
                      (dict(reference=ref - 2), "token id -2, out of range")]:
        with pytest.raises(ValueError, match=what):
            jspec.speculative_generate(target, jspec.OracleDrafter(**({"reference": ref} | bad)),
                                       p, jspec.SpecConfig())
    with pytest.raises(TypeError, match="OracleDrafter.draft must be a jspec drafter .* "
                                        "wrap it: ModelDrafter"):  # was an AttributeError
        jspec.speculative_generate(target, jspec.OracleDrafter(ref, draft=target), p,
                                   jspec.SpecConfig())
    with pytest.raises(ValueError, match="exceeds max_len"):
        jspec.speculative_generate(target, jspec.PromptLookupDrafter(), p,
                                   jspec.SpecConfig(max_new_tokens=8), max_len=16)
    with pytest.raises(ValueError, match="min_ngram"):
        jspec.PromptLookupDrafter(max_ngram=1, min_ngram=2)
    with pytest.raises(TypeError, match="SpecConfig"):
        jspec.speculative_generate(target, jspec.PromptLookupDrafter(), p, {"gamma": 4})


def test_phases_compose_in_a_research_script():
    """prefill, draft_step, verify_step, accept_step, commit_step: the same as the loop."""
    from jspec import speculative as S
    from jspec.generate import pad_prompts

    target = load("qwen3", "pallas")  # programs shared with the audit test below
    prompts = _prompts("qwen3")
    spec = jspec.SpecConfig(gamma=3, max_new_tokens=12)
    drafter = _poor_draft("qwen3")
    tokens, lens = pad_prompts(prompts, target.config.vocab_size)
    seed = jnp.int32(0)
    state = S.prefill(target, drafter, jnp.asarray(tokens), jnp.asarray(lens), seed, spec=spec,
                      max_len=tokens.shape[1] + 12 + 4)
    first = None
    while not bool(jnp.all(state.done)):
        ctx = S.context(target, state, seed, spec=spec)
        drafts, dlogits, dstate = S.draft_step(drafter, state.draft, ctx)
        fwd = S.verify_step(target, state.cache, state.cur, drafts)
        logits, cache = fwd
        assert logits.shape == (3, 4, target.config.vocab_size)
        n_acc, nxt = S.accept_step(logits, drafts, dlogits, seed, ctx.pos, spec=spec)
        if first is None:  # the answers a research loop might pass by mistake, refused
            first = state  # before they reach the state (they wrote negative lengths,
            for bad in ((n_acc - 10, nxt), (n_acc + 10, nxt), (n_acc, nxt + 10_000)):
                with pytest.raises(ValueError, match="commit_step: (n_acc|nxt)=.* must be "
                                   r"integers in \[0, "):  # made-up tokens in out)
                    S.commit_step(drafter, state, ctx, cache, dstate, drafts, *bad, spec=spec)
            with pytest.raises(ValueError, match=r"accept_step: drafts must be \[B, 3\]"):
                S.accept_step(logits, drafts[:, :2], dlogits, seed, ctx.pos, spec=spec)
            with pytest.raises(ValueError, match="verify_step: cur must be"):
                S.verify_step(target, state.cache, state.cur[:, None], drafts)
            with pytest.raises(ValueError, match="out of range"):
                S.verify_step(target, state.cache, state.cur.at[0].set(10**6), drafts)
            with pytest.raises(ValueError, match="seed must be an integer scalar"):
                S.accept_step(logits, drafts, dlogits, 0.5, ctx.pos, spec=spec)
        state = S.commit_step(drafter, state, ctx, cache, dstate, drafts, n_acc, nxt,
                              spec=spec, forward=fwd)
    serial = jspec.generate(target, prompts, max_new_tokens=12)
    assert np.array_equal(np.asarray(state.out), serial.tokens)
    # What the phases refuse before any work (each ran: a row of length 0 read as a cache
    # of length -1 and decoded garbage; spec.seed was silently unread; a state of gamma 3
    # ran under gamma 5 with its acceptance columns wrong).
    tok, ml = jnp.asarray(tokens), tokens.shape[1] + 12 + 4
    for bad_lens, match in (([0, 3, 3], r"lens\[0\]=0 must lie in \[1, P="),
                            ([3, 3], "lens must be B=3 integers")):
        with pytest.raises(ValueError, match=match):
            S.prefill(target, drafter, tok, jnp.asarray(bad_lens), seed, spec=spec, max_len=ml)
    with pytest.raises(ValueError, match=r"prefill: seed=-5 must lie in \[0, 2\*\*31\)"):
        S.prefill(target, drafter, tok, jnp.asarray(lens), jnp.int32(-5), spec=spec, max_len=ml)
    with pytest.raises(TypeError, match="wrap it"):  # what speculative_generate says
        S.prefill(target, target, tok, jnp.asarray(lens), seed, spec=spec, max_len=ml)
    with pytest.raises(ValueError, match="spec.seed=7 is not read here"):
        S.prefill(target, drafter, tok, jnp.asarray(lens), seed,
                  spec=jspec.SpecConfig(gamma=3, max_new_tokens=12, seed=7), max_len=ml)
    with pytest.raises(ValueError, match="the state was made for max_new_tokens=12, depth 3"):
        S.one_round(target, drafter, state, seed,
                    spec=jspec.SpecConfig(gamma=5, max_new_tokens=12))


def test_runtime_audit_passes_on_pallas_and_stops_xla_with_a_report():
    prompts = _prompts("qwen3")
    spec = jspec.SpecConfig(gamma=4, max_new_tokens=12, audit_every=2)
    target = load("qwen3", "pallas")
    out = jspec.speculative_generate(target, _poor_draft("qwen3"), prompts, spec)
    assert out.stats["audited_blocks"] >= 3
    serial = jspec.generate(target, prompts, max_new_tokens=12)
    assert [out.row(b) for b in range(3)] == [serial.row(b) for b in range(3)]
    xla = load("qwen3", "xla")
    with pytest.raises(jspec.ParityError, match=r"round 0, row \d, block row \d differs"):
        jspec.speculative_generate(xla, jspec.ModelDrafter(xla), prompts, spec)
    with pytest.raises(ValueError, match="audit_every=-1"):
        jspec.SpecConfig(audit_every=-1)


def _depends_on_inputs(jaxpr) -> list[bool]:
    """Per output of a closed jaxpr: whether it is computed from any of its inputs
    (an equation's outputs depend on its inputs if any input does; nested jaxprs are
    taken as a whole)."""
    dep = {id(v) for v in jaxpr.jaxpr.invars}
    for e in jaxpr.jaxpr.eqns:
        if any(id(v) in dep for v in e.invars):
            dep.update(id(v) for v in e.outvars)
    return [id(v) in dep for v in jaxpr.jaxpr.outvars]


@pytest.mark.slow  # a benchmark's timing realism, not the output (equal either way)
def test_oracle_proposals_wait_for_the_draft_model():
    # The oracle runs its draft model for the draft's cost: its proposals must depend on
    # the draft's forwards (as a real drafter's do), or the compiler may overlap those
    # forwards with the verify and hide their cost (H200, 2026-11-30h: 1.64x -> 1.47x).
    target = load("qwen3", "pallas")
    prompts = _prompts("qwen3")
    oracle = _drafter("oracle+draft", "qwen3", target, prompts, N)
    B, P = len(prompts), max(len(p) for p in prompts)
    toks = jnp.asarray(np.stack([np.resize(p, P) for p in prompts]))
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    state = oracle.init(toks, lens, P + N, 3)
    ctx = jspec.drafters.ProposeContext(
        cur=toks[:, -1], pos=lens - 1, rows=jnp.arange(B, dtype=jnp.int32),
        seed=jnp.int32(0), gamma=3, vocab=target.config.vocab_size,
        draft_sampler=jspec.SpecConfig(gamma=3).draft_sampler())

    def proposals(draft_params):
        model = oracle.draft.model.replace(params=draft_params)
        o = oracle.replace(draft=oracle.draft.replace(model=model))
        return o.propose(state, ctx)[0]

    assert _depends_on_inputs(jax.make_jaxpr(proposals)(oracle.draft.model.params)) == [True]
