"""Tree speculation, CPU: exact against serial decoding, and distribution-exact sampling.

- exact_greedy and gumbel_coupled tree speculation equal serial decoding token for
  token, for static and dynamic trees, every drafter, ragged batches, under the audit;
- recursive rejection sampling over a tree is distribution-exact: a chi-square test of
  the emitted tokens against the target's distribution over many trials, which a
  known-broken variant (the rejected child kept in q) fails;
- the oracle's trees hold the serial continuation at the ranks asked for;
- bad trees are rejected naming the bound.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import expected, load
from flax import struct
from scipy import stats

import jspec
from jspec.feature_head import random_head
from jspec.policies import rejection_sample_tree
from jspec.sampling import Sample, top_choices
from jspec.tree import MAX_TREE_NODES, TreeConfig, parse_tree

STATIC = TreeConfig(branching=(2, 2, 1))
DYNAMIC = TreeConfig(dynamic=(2, 6, 3))


def _prompts(name="qwen3"):
    p = expected(name)["prompt"]
    return [p, p[:5]]


def _drafter(kind, target):
    if kind == "model":
        return jspec.ModelDrafter(target.with_backend("xla"))
    if kind == "feature":
        L = target.config.num_layers
        return jspec.FeatureDrafter(random_head(target, feature_layers=(0, L // 2, L),
                                                options=jspec.KernelOptions(backend="xla")))
    return jspec.PromptLookupDrafter()


_CASES = [(DYNAMIC, "feature", "exact_greedy")] + [
    pytest.param(t, k, p, marks=pytest.mark.slow)
    for t, k, p in [(STATIC, "lookup", "gumbel_coupled"), (STATIC, "model", "exact_greedy"),
                    (DYNAMIC, "model", "exact_greedy"), (STATIC, "feature", "exact_greedy"),
                    (STATIC, "model", "gumbel_coupled"), (DYNAMIC, "model", "gumbel_coupled"),
                    (STATIC, "feature", "gumbel_coupled"),
                    (DYNAMIC, "feature", "gumbel_coupled"), (STATIC, "lookup", "exact_greedy")]]


@pytest.mark.parametrize("tree,kind,policy", _CASES)
def test_tree_speculation_equals_serial(tree, kind, policy):
    target = load("qwen3", "pallas")
    spec = jspec.SpecConfig(max_new_tokens=10, policy=policy, tree=tree,
                            temperature=None if policy == "exact_greedy" else 0.8,
                            audit_every=2)
    out = jspec.speculative_generate(target, _drafter(kind, target), _prompts(), spec)
    serial = jspec.generate(target, _prompts(), max_new_tokens=10,
                            sampler=spec.serial_sampler())
    for b in range(2):
        assert out.row(b) == serial.row(b)
    assert out.stats["audited_blocks"] > 0
    assert len(out.stats["acceptance_by_position"]) == tree.depth


@pytest.mark.slow  # a further case of a property the default run proves
def test_gemma_trees_with_sliding_windows_equal_serial():
    target = load("gemma3", "pallas")
    p = expected("gemma3")["prompt"]
    spec = jspec.SpecConfig(max_new_tokens=12, tree=TreeConfig(branching=(3, 1, 1)))
    out = jspec.speculative_generate(target, _drafter("model", target), [p, p[:3]], spec)
    serial = jspec.generate(target, [p, p[:3]], max_new_tokens=12)
    assert [out.row(b) for b in range(2)] == [serial.row(b) for b in range(2)]
    assert out.stats["tokens_per_target_step"] > 1.5


@pytest.mark.slow  # the benchmarks' oracle (their acceptance, never the output)
def test_oracle_trees_hold_the_truth_at_the_asked_ranks():
    target = load("qwen3", "xla")
    p = expected("qwen3")["prompt"]
    prompts = [p[: 3 + i % 9] for i in range(24)]
    serial = jspec.generate(target, prompts, max_new_tokens=24)
    ref = np.zeros((24, 40), np.int32)
    for b, pr in enumerate(prompts):
        row = np.concatenate([pr, serial.row(b)])
        ref[b, : len(row)] = row
    tree = TreeConfig(branching=(2, 2))
    spec = jspec.SpecConfig(max_new_tokens=24, tree=tree)
    oracle = jspec.OracleDrafter(jnp.asarray(ref), rank_probs=jnp.asarray([0.6, 0.3]))
    out = jspec.speculative_generate(target, oracle, prompts, spec)
    assert [out.row(b) for b in range(24)] == [serial.row(b) for b in range(24)]
    first = out.stats["acceptance_by_position"][0]
    assert 0.8 < first < 0.98, first  # 0.9 expected: rank 0 w.p. 0.6, rank 1 w.p. 0.3


def _rrs_trial(p_logits, q_logits, K, trials, update_q=True, seed=0):
    """The first emitted token of a one-node tree (K children drawn from q without
    replacement) over `trials` rows: [trials] token ids."""
    V = p_logits.shape[-1]
    B = trials
    rows = jnp.arange(B, dtype=jnp.int32)
    sampler = Sample(temperature=1.0)
    children = top_choices(sampler, jnp.broadcast_to(q_logits, (B, V)), K, jnp.int32(seed + 7),
                           rows, jnp.ones((B,), jnp.int32))  # [B, K] draws w/o replacement
    tokens = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), children], 1)
    parents = jnp.broadcast_to(jnp.asarray([-1] + [0] * K, jnp.int32), (B, K + 1))
    depth = jnp.broadcast_to(jnp.asarray([0] + [1] * K, jnp.int32), (B, K + 1))
    logits = jnp.broadcast_to(p_logits, (B, K + 1, V))  # the children's own p: unused here
    q = jnp.broadcast_to(q_logits, (B, K + 1, V))
    node, n, nxt = rejection_sample_tree(
        sampler, logits, q, tokens, parents, depth, jnp.ones((B, K + 1), bool),
        jnp.int32(seed), rows, depth + 1, max_depth=1, max_children=K, update_q=update_q)
    first = jnp.where(n > 0, jnp.take_along_axis(tokens, node[:, None], 1)[:, 0], nxt)
    return np.asarray(first)


@pytest.mark.parametrize("K", [2, 3])
def test_tree_rejection_sampling_is_distribution_exact(K):
    rng = np.random.default_rng(K)
    V = 6
    p_logits = jnp.asarray(rng.standard_normal(V) * 1.5, jnp.float32)
    q_logits = jnp.asarray(rng.standard_normal(V) * 1.5, jnp.float32)
    p = np.asarray(jax.nn.softmax(p_logits), np.float64)
    trials = 40_000

    def chi2(update_q):
        toks = _rrs_trial(p_logits, q_logits, K, trials, update_q=update_q)
        counts = np.bincount(toks, minlength=V)
        return stats.chisquare(counts, p / p.sum() * counts.sum()).pvalue

    assert chi2(True) > 1e-3  # the emitted token follows p
    assert chi2(False) < 1e-6  # keeping rejected children in q biases it: the test can fail


def test_trees_are_bounded_and_named():
    with pytest.raises(ValueError, match=f"exceeds MAX_TREE_NODES={MAX_TREE_NODES}"):
        TreeConfig(branching=(8, 8))
    with pytest.raises(ValueError, match="exceeds MAX_TREE_DEPTH"):
        TreeConfig(branching=(1,) * 17)
    with pytest.raises(ValueError, match=r"tree path \(1, 1, 0\) has no parent \(1, 1\)"):
        TreeConfig(paths=((0,), (0, 1), (1, 1, 0)))
    with pytest.raises(ValueError, match="needs a static tree"):
        jspec.SpecConfig(policy="rejection_sampling", tree=DYNAMIC)
    with pytest.raises(ValueError, match="tree 'x,2'"):
        parse_tree("x,2")
    assert parse_tree("paths:0;1;0.0").num_nodes == 3
    assert parse_tree("dynamic:4,16,5").depth == 5
    target = load("qwen3", "xla")
    with pytest.raises(ValueError, match="static trees"):
        jspec.speculative_generate(target, jspec.PromptLookupDrafter(), _prompts(),
                                   jspec.SpecConfig(max_new_tokens=4, tree=DYNAMIC))


def test_a_tree_no_drafter_can_grow_is_named_before_any_program_runs(monkeypatch):
    # A dynamic tree with prompt lookup or the oracle (static trees only), and an adaptive
    # run's tree with a chain-only drafter, are ValueErrors at the call: before, the first
    # was raised while tracing the loop, after the prefill had run (a stream's on its
    # first item, a warm-up's mid-compile), and the adaptive tree was never checked (a
    # NotImplementedError deep in the trace of the tree's first chunk).
    from jspec import speculative, warm

    def no_program(*a, **k):
        raise AssertionError("a program ran before the arguments were checked")

    monkeypatch.setattr(speculative, "_prefill_jit", no_program)  # the engine's prefill
    monkeypatch.setattr(warm, "_prefill_jit", no_program)
    target = load("qwen3", "xla")
    ref = jnp.zeros((2, 12 + 4), jnp.int32)

    @struct.dataclass
    class Chains(jspec.Drafter):  # chains only: no propose_tree
        def init(self, tokens, lens, max_len, gamma, features=None):
            return ()

        def forwards_per_round(self, gamma):
            return 0

        def propose(self, state, ctx):
            d = jnp.broadcast_to(ctx.cur[:, None], (ctx.cur.shape[0], ctx.gamma))
            return d, jspec.drafters.one_hot_logits(d, ctx.vocab), state

        def commit(self, state, ctx, n_acc, nxt, drafts, features=None):
            return state

    adaptive_dynamic = jspec.SpecConfig(max_new_tokens=4, adaptive=jspec.Adaptive(
        gammas=(1,), tree=DYNAMIC))
    for drafter in (jspec.PromptLookupDrafter(), jspec.OracleDrafter(ref)):
        name = type(drafter).__name__
        for spec in (jspec.SpecConfig(max_new_tokens=4, tree=DYNAMIC), adaptive_dynamic):
            for run in (jspec.speculative_generate, jspec.speculative_stream, jspec.warm_up):
                with pytest.raises(ValueError, match=f"{name} grows static trees"):
                    run(target, drafter, _prompts(), spec)
    for tree in (STATIC, DYNAMIC):
        spec = jspec.SpecConfig(max_new_tokens=4, adaptive=jspec.Adaptive(gammas=(1,), tree=tree))
        for run in (jspec.speculative_generate, jspec.speculative_stream, jspec.warm_up):
            with pytest.raises(ValueError, match="Chains grows no draft trees"):
                run(target, Chains(), _prompts(), spec)
