"""Extension points: a research drafter and a research policy are one class each.

The two examples of docs/usage.md ("Extending jspec", its `# example:` blocks) are
executed here as written:
- BigramDrafter, which implements only `jspec.Drafter`, gives speculative output equal
  to serial greedy output token for token, on chains and on a tree;
- TopKAllowance, a `jspec.Policy` that is not lossless, runs through the engine: with
  k = 2 every emitted token is among the target's top 2 after the tokens before it
  (slow: with k = 1 it is exact greedy);
and the boundary: a non-drafter is a TypeError naming what it lacks; a policy and
sampling arguments that disagree are a ValueError naming both.
"""

import dataclasses
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import expected, load
from flax import struct

import jspec
from jspec.policies import resolve_policy
from jspec.tree import TreeConfig

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                   "usage.md")
N = 10


def _examples() -> dict:
    """The names each `# example:` block of docs/usage.md defines."""
    text = open(DOC, encoding="utf-8").read()
    ns: dict = {}
    blocks = re.findall(r"```python\n(# example: .*?)```", text, flags=re.S)
    assert len(blocks) == 2, "docs/usage.md lost an example"
    for code in blocks:
        exec(compile(code, DOC, "exec"), ns)  # noqa: S102 - the documented examples
    return ns


EX = _examples()


def _prompts():
    p = expected("qwen3")["prompt"]
    return [p, p[:5]]


def _bigram_table(target, serial):
    """[V, V]: small random scores plus +10 on the bigrams of the serial output, so the
    drafter is often right (and sometimes wrong)."""
    V = target.config.vocab_size
    table = np.random.default_rng(0).normal(size=(V, V)).astype(np.float32)
    for b, p in enumerate(_prompts()):
        seq = list(p) + serial.row(b)
        for a, c in zip(seq[:-1], seq[1:], strict=True):
            if (a + c) % 3:  # leave some out: rejections too
                table[a, c] += 10.0
    return jnp.asarray(table)


@pytest.fixture(scope="module")
def setup():
    target = load("qwen3", "pallas")
    serial = jspec.generate(target, _prompts(), max_new_tokens=N)
    return target, serial, EX["BigramDrafter"](_bigram_table(target, serial))


# The research drafter's tree in the slow run (trees: test_tree_speculative.py's drafters)
@pytest.mark.parametrize("tree", [None, pytest.param(TreeConfig(branching=(2, 2, 1)),
                                                     marks=pytest.mark.slow)])
def test_a_research_drafter_gives_serial_output(setup, tree):
    target, serial, drafter = setup
    assert isinstance(drafter, jspec.Drafter)
    spec = jspec.SpecConfig(gamma=None if tree else 3, max_new_tokens=N, tree=tree)
    out = jspec.speculative_generate(target, drafter, _prompts(), spec)
    for b in range(2):
        assert out.row(b) == serial.row(b)
    assert 0 < out.stats["accepted"] < out.stats["proposed"]


@pytest.mark.slow
def test_a_research_drafter_grows_dynamic_trees(setup):
    target, serial, drafter = setup
    spec = jspec.SpecConfig(max_new_tokens=N, tree=TreeConfig(dynamic=(2, 6, 3)))
    out = jspec.speculative_generate(target, drafter, _prompts(), spec)
    for b in range(2):
        assert out.row(b) == serial.row(b)


@pytest.mark.slow
def test_a_top1_allowance_is_exact_greedy(setup):
    target, serial, drafter = setup
    spec = jspec.SpecConfig(gamma=3, max_new_tokens=N, policy=EX["TopKAllowance"](k=1))
    out = jspec.speculative_generate(target, drafter, _prompts(), spec)
    for b in range(2):
        assert out.row(b) == serial.row(b)


@pytest.mark.slow  # a further case of a property the default run proves
def test_a_research_policy_runs_through_the_engine(setup):
    target, _, drafter = setup
    top_k = EX["TopKAllowance"]
    two = jspec.speculative_generate(target, drafter, _prompts(),
                                     jspec.SpecConfig(gamma=3, max_new_tokens=N,
                                                      policy=top_k(k=2)))
    for b, p in enumerate(_prompts()):  # every token in the top 2 after its prefix
        seq = list(p) + two.row(b)
        cache = jspec.init_cache(target, 1, 64)
        logits, _ = jspec.forward(target, jnp.asarray([seq]), cache)
        top2 = np.argsort(-np.asarray(logits[0]), axis=-1, kind="stable")[:, :2]
        for j in range(len(p), len(seq)):
            assert seq[j] in top2[j - 1], (b, j)
    with pytest.raises(ValueError, match="verifies chains only"):
        jspec.SpecConfig(policy=top_k(), tree=TreeConfig(branching=(2,)))


class _Half:
    """Chains only, no protocol: init and propose, nothing else."""

    def init(self, tokens, lens, max_len, gamma, features=None):
        return ()

    def propose(self, state, ctx):
        return None


def test_a_non_drafter_is_refused_naming_what_it_lacks(setup):
    target, _, _ = setup
    spec = jspec.SpecConfig(gamma=2, max_new_tokens=2)
    with pytest.raises(TypeError, match=r"ModelDrafter\(model\)"):
        jspec.speculative_generate(target, target, _prompts(), spec)
    with pytest.raises(TypeError, match="lacks commit, forwards_per_round, propose_tree"):
        jspec.speculative_generate(target, _Half(), _prompts(), spec)


def test_policies_and_sampling_arguments_agree():
    with pytest.raises(ValueError, match=r"'exact_greedy'.*temperature=0.8"):
        jspec.SpecConfig(policy="exact_greedy", temperature=0.8)
    with pytest.raises(ValueError, match=r"'gumbel_coupled' samples, so temperature=0"):
        jspec.SpecConfig(policy="gumbel_coupled", temperature=0)
    with pytest.raises(ValueError, match=r"temperature=0.5 but temperature=0.8"):
        jspec.SpecConfig(policy=jspec.GumbelCoupled(0.5), temperature=0.8)
    with pytest.raises(TypeError, match="jspec.Policy"):
        jspec.SpecConfig(policy=3)
    # The shorthands resolve to the objects; the objects are hashable static config.
    spec = jspec.SpecConfig(policy="gumbel_coupled", temperature=0.8, top_k=5)
    assert spec.policy == jspec.GumbelCoupled(temperature=0.8, top_k=5)
    assert spec == jspec.SpecConfig(policy=jspec.GumbelCoupled(0.8, 5))
    assert hash(spec.static()) == hash(jspec.SpecConfig(policy=jspec.GumbelCoupled(0.8, 5)))
    assert resolve_policy(None) == jspec.ExactGreedy()
    assert resolve_policy(None, 0.0, 0, 1.0) == jspec.ExactGreedy()
    assert resolve_policy(None, 0.7) == jspec.GumbelCoupled(0.7)
    assert resolve_policy("rejection_sampling") == jspec.RejectionSampling(1.0)
    assert resolve_policy(jspec.RejectionSampling(0.5), 0.5) == jspec.RejectionSampling(0.5)
    # The text API builds its policy the same way.
    pipe = jspec.TextPipeline(target=None, tokenizer=None)
    assert pipe.spec_config(temperature=0.8).policy == jspec.GumbelCoupled(0.8)
    with pytest.raises(ValueError, match="temperature=0.8"):
        pipe.spec_config(policy="exact_greedy", temperature=0.8)


def _policy(**members):
    """TopKAllowance with some members of the jspec.Policy protocol replaced."""
    ns = {k: (lambda self, v=v: v) if k.endswith("sampler") else v for k, v in members.items()}
    return dataclasses.dataclass(frozen=True)(type("Odd", (EX["TopKAllowance"],), ns))()


@pytest.mark.parametrize("members,error,words", [
    # a float salt was added to the int32 seed without a word; a larger one was jax's
    # OverflowError about an argument "y", a string a TypeError deep in the trace
    (dict(draft_seed_salt=0.5), ValueError, "Odd: draft_seed_salt=0.5 must be an integer"),
    (dict(draft_seed_salt=2**40), ValueError, "draft_seed_salt=1099511627776 must be"),
    # a draft sampler that is none failed as "'NoneType' object is not callable" inside a
    # drafter's trace, or never where the drafter draws without it
    (dict(draft_sampler=None), TypeError, "Odd: draft_sampler() returned no sampler"),
    (dict(draft_sampler="greedy"), TypeError, "draft_sampler() returned no sampler"),
    # a string flag is true: exact="no" asked the entry points for token parity
    (dict(exact="no"), TypeError, "Odd: exact='no' must be True or False"),
    (dict(uses_draft_logits=1), TypeError, "uses_draft_logits=1 must be True or False"),
])
def test_a_policys_members_are_checked_before_tracing(members, error, words):
    with pytest.raises(error, match=re.escape(words)):
        jspec.SpecConfig(gamma=2, policy=_policy(**members))


@struct.dataclass
class _Reads(jspec.Drafter):
    """BigramDrafter, claiming to read the target layers `feature_layers`."""

    inner: object
    feature_layers: object = struct.field(pytree_node=False, default=())

    def init(self, tokens, lens, max_len, gamma, features=None):
        return self.inner.init(tokens, lens, max_len, gamma)

    def forwards_per_round(self, gamma):
        return 0

    def propose(self, state, ctx):
        return self.inner.propose(state, ctx)

    def commit(self, state, ctx, n_acc, nxt, drafts, features=None):
        return state


@pytest.mark.parametrize("layers,error,words", [
    # these were the target's own `features=` argument, failing in the prefill's trace
    ((99,), ValueError, "_Reads.feature_layers[0]=99 is out of range [0, 3)"),
    ((-1,), ValueError, "_Reads.feature_layers[0]=-1 is out of range [0, 3)"),
    ((1.0,), ValueError, "_Reads.feature_layers[0]=1.0 must be an integer"),
    ("12", TypeError, "_Reads.feature_layers must be a list or tuple of integers"),
])
def test_a_drafters_feature_layers_are_checked_naming_it(setup, layers, error, words):
    target, _, drafter = setup
    spec = jspec.SpecConfig(gamma=2, max_new_tokens=2)
    with pytest.raises(error, match=re.escape(words) + r".*ids 0\.\.2 for this 2-layer"):
        jspec.speculative_generate(target, _Reads(drafter, feature_layers=layers),
                                   _prompts(), spec)


@struct.dataclass
class _Bent(jspec.Drafter):
    """BigramDrafter's proposals bent out of the protocol by `bend(drafts, logits)` (chains)
    or `bend_tree(tokens, parents)` (trees)."""

    inner: object
    bend: object = struct.field(pytree_node=False, default=None)
    bend_tree: object = struct.field(pytree_node=False, default=None)

    def init(self, *a, **k):
        return self.inner.init(*a, **k)

    def forwards_per_round(self, gamma):
        return 0

    def propose(self, state, ctx):
        drafts, logits, state = self.inner.propose(state, ctx)
        return (*self.bend(drafts, logits), state)

    def commit(self, state, ctx, n_acc, nxt, drafts, features=None):
        return state

    def propose_tree(self, state, ctx, tree):
        tokens, parents, q, state = self.inner.propose_tree(state, ctx, tree)
        return (*self.bend_tree(tokens, parents), q, state)


@pytest.mark.parametrize("bend,policy,words", [
    (lambda d, q: (jnp.concatenate([d, d], 1), q), "exact_greedy",
     r"drafts must be integer token ids of shape \[2, 3\].*got int32\[2, 6\]"),
    (lambda d, q: (d[:, 0], q), "exact_greedy", r"drafts must .* got int32\[2\]"),
    (lambda d, q: (d + 0.5, q), "exact_greedy", r"drafts must .* got float32\[2, 3\]"),
    (lambda d, q: (d, None), "rejection_sampling", r"draft_logits must be floating.*NoneType"),
])
def test_proposals_outside_the_protocol_are_an_error_naming_the_drafter(setup, bend, policy,
                                                                         words):
    # Before, more proposals than gamma were verified past the planned cache (output no
    # longer serial's) and float drafts were cast to ids without a word.
    target, _, drafter = setup
    temp = {"temperature": 0.8} if policy != "exact_greedy" else {}
    spec = jspec.SpecConfig(gamma=3, max_new_tokens=N,
                            policy=resolve_policy(policy, **temp))
    with pytest.raises(ValueError, match=f"_Bent: propose's {words}"):
        jspec.speculative_generate(target, _Bent(drafter, bend=bend), _prompts(), spec)


def test_a_malformed_draft_tree_drops_its_bad_nodes_and_keeps_serial_output(setup):
    # Node 3 points at a later node and node 5 at itself; the tree's depth-3 chain
    # (1 -> 3 -> ...) is cut with its subtree. Before, a node deeper than the tree's depth
    # was verified at a cut position and could be accepted: output not serial's.
    target, serial, drafter = setup

    def bend_tree(tokens, parents):
        return tokens, parents.at[:, 3].set(6).at[:, 5].set(5)

    tree = TreeConfig(branching=(2, 2, 1))
    spec = jspec.SpecConfig(max_new_tokens=N, tree=tree)
    out = jspec.speculative_generate(target, _Bent(drafter, bend_tree=bend_tree), _prompts(),
                                     spec)
    for b in range(2):
        assert out.row(b) == serial.row(b)
    # node 5 lies four deep, node 8 names a later parent, node 9 hangs under node 5
    parents = jnp.asarray([[-1, 0, 0, 1, 3, 4, 2, 0, 9, 5]])
    assert jspec.tree.well_formed(parents, 3).tolist() == [
        [True, True, True, True, True, False, True, True, False, False]]
    with pytest.raises(ValueError, match=r"parents\[0\] is not a tree of depth <= "
                       r"max_depth=3: node 5 \(parent 4\)"):
        jspec.tree.from_parents(parents, jnp.zeros((1,), jnp.int32), 3)
