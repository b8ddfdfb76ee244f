"""Adaptive round shapes (`jspec.Adaptive`): exactness whatever the shapes, and the choice.

Every round shape is exact, so a run whose shape changes mid-run (a fixed schedule of
plain decode steps, gammas and a tree, chunk by chunk) gives serial decoding's tokens,
for every drafter and policy; the choice (`jspec.adaptive.choose`) picks plain decode
steps when nothing is accepted and the largest gamma when everything is; the statistics
add up.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import expected, load

import jspec
from jspec.adaptive import Acceptance, Controller, choose, expected_rows
from jspec.feature_head import random_head

N = 12
TREE = jspec.TreeConfig(branching=(2, 1))


def _prompts(name):
    p = expected(name)["prompt"]
    return [p, p[:4], p[3:10]]  # ragged batch of 3


def _feature(target):
    layers = tuple(sorted({1, target.config.num_layers}))
    return jspec.FeatureDrafter(random_head(target, seed=0, feature_layers=layers,
                                            dtype="float32",
                                            options=jspec.KernelOptions(backend="xla")))


def _check(target, drafter, prompts, spec, serial):
    out = jspec.speculative_generate(target, drafter, prompts, spec)
    for b in range(len(prompts)):
        assert out.row(b) == serial.row(b), (b, out.stats["adaptive"])
    ad = out.stats["adaptive"]["shapes"]
    assert sum(s["tokens"] for s in ad.values()) == out.stats["tokens"] == int(
        out.num_tokens.sum())
    assert sum(s["rounds"] for s in ad.values()) == out.stats["rounds"]
    assert sum(s["accepted"] for s in ad.values()) == out.stats["accepted"]
    _check_timeline(out.stats["timeline"], out.stats["rounds"])
    return out


def _check_timeline(tl, rounds):
    """The run's timeline: every call of the loop accounted for, inside the loop's time."""
    assert sum(c[0] for c in tl["calls"]) == rounds and all(c[0] >= 0 for c in tl["calls"])
    assert tl["calls_s"] == pytest.approx(sum(c[1] for c in tl["calls"]))
    assert 0 < tl["calls_s"] <= tl["loop_s"] and tl["prefill_s"] > 0


@pytest.mark.parametrize("kind", [pytest.param("model", marks=pytest.mark.slow), "feature",
                                  pytest.param("lookup", marks=pytest.mark.slow)])
def test_forced_shape_changes_mid_run_equal_serial_greedy(kind):
    target = load("qwen3", "pallas")
    prompts = _prompts("qwen3")
    serial = jspec.generate(target, prompts, max_new_tokens=N)
    drafter = {"model": lambda: jspec.ModelDrafter(target), "feature": lambda: _feature(target),
               "lookup": lambda: jspec.PromptLookupDrafter(max_ngram=2)}[kind]()
    tree = TREE if kind != "model" else None  # the model drafter's trees: test_tree_*
    sched = (2, 0) + ((tree,) if tree else (1,)) + (0, 2)
    ad = jspec.Adaptive(gammas=(0, 1, 2) if tree is None else (0, 2), tree=tree,
                        chunk_rounds=1, schedule=sched)
    out = _check(target, drafter, prompts, jspec.SpecConfig(max_new_tokens=N, adaptive=ad),
                 serial)
    used = {k for k, s in out.stats["adaptive"]["shapes"].items() if s["chunks"]}
    assert used == {"decode", "gamma2", "tree" if tree else "gamma1"}
    _check_timeline(serial.stats["timeline"], N)  # serial: a step a token, no stop tokens
    # (a fixed shape's timeline: test_speculative.py's test_exact_greedy_equals_serial_greedy)


@pytest.mark.slow  # a further case of a property the default run proves
def test_forced_shapes_equal_serial_sampling_and_stream():
    target = load("qwen3", "pallas")
    prompts = _prompts("qwen3")
    ad = jspec.Adaptive(gammas=(0, 2), chunk_rounds=1, schedule=(2, 0, 0, 2))
    spec = jspec.SpecConfig(policy="gumbel_coupled", temperature=0.8, max_new_tokens=N,
                            seed=3, adaptive=ad)
    serial = jspec.generate(target, prompts, max_new_tokens=N, sampler=spec.serial_sampler(),
                            seed=3)
    drafter = jspec.ModelDrafter(target)
    out = _check(target, drafter, prompts, spec, serial)
    chunks = list(jspec.speculative_stream(target, drafter, prompts, spec))
    assert [sum((c[b] for c in chunks), []) for b in range(3)] == [out.row(b) for b in range(3)]


@pytest.mark.slow  # a further case of a property the default run proves
def test_the_chooser_runs_exact_with_measured_costs():
    """No schedule: the probes, the choice and the exploration all stay exact (the
    shapes of the sampling test: its compiled loops serve)."""
    target = load("qwen3", "pallas")
    prompts = _prompts("qwen3")
    ad = jspec.Adaptive(gammas=(0, 2), chunk_rounds=2, explore_every=1)
    spec = jspec.SpecConfig(policy="gumbel_coupled", temperature=0.8, max_new_tokens=N,
                            seed=3, adaptive=ad)
    serial = jspec.generate(target, prompts, max_new_tokens=N, sampler=spec.serial_sampler(),
                            seed=3)
    out = _check(target, jspec.ModelDrafter(target), prompts, spec, serial)
    ad = out.stats["adaptive"]
    shapes = ad["shapes"]
    assert shapes["gamma2"]["chunks"] >= 1 and shapes["decode"]["chunks"] >= 1  # both probed
    # The chunk overhead timed by chunks of no rounds (they change nothing: exact above),
    # the chunks listed in order.
    assert len(ad["empty_chunks_s"]) == 2 and ad["chunk_overhead_s"] <= min(ad["empty_chunks_s"])
    assert ad["measured_s_per_round"]["chunk_overhead"] == ad["chunk_overhead_s"]
    assert len(ad["history"]) == ad["chunks"] and not ad["history"][0][3]  # first: untimed
    assert sum(h[1] for h in ad["history"]) == out.stats["rounds"]


def _acc(rate, B=4, D=8):
    return Acceptance(rates=np.full((B, D), rate), live=np.ones(B, bool),
                      remaining=np.full(B, 100))


def test_choose_picks_decode_at_no_acceptance_and_the_largest_gamma_at_full():
    shapes = (0, 1, 2, 4)
    costs = {0: 1.0, 1: 1.05, 2: 1.1, 4: 1.2}
    assert choose(_acc(0.0), costs, shapes) == 0
    assert choose(_acc(1.0), costs, shapes) == 4
    assert choose(_acc(0.6), costs, shapes) in (2, 4)
    # A verify that costs as much as the tokens it may win never pays.
    assert choose(_acc(0.5), {0: 1.0, 1: 2.0, 2: 3.0, 4: 5.0}, shapes) == 0
    # Finished rows count for nothing; a tree's measured tokens compete with the chains.
    acc = _acc(1.0)
    acc.live[:] = False
    assert choose(acc, costs, shapes) == 0
    acc = _acc(0.5)
    acc.tree_tokens = np.full(4, 3.5)
    assert choose(acc, {**costs, TREE: 1.3}, shapes + (TREE,)) == TREE


def test_expected_tokens_of_a_chain():
    rates = np.array([[0.5, 0.5, 0.5, 0.5], [1.0, 1.0, 0.0, 1.0]])
    np.testing.assert_allclose(expected_rows(rates, 2), [1.75, 3.0])  # 1 + a + a^2
    np.testing.assert_allclose(expected_rows(rates, 4), [1.9375, 3.0])
    np.testing.assert_allclose(expected_rows(rates, 4, remaining=np.array([1, 2])), [1, 2])
    np.testing.assert_allclose(expected_rows(rates, 0), [1, 1])


def test_controller_learns_per_position_acceptance_and_costs():
    ctl = Controller(jspec.Adaptive(gammas=(0, 1, 4), chunk_rounds=8), batch=2,
                     max_new_tokens=64)
    assert ctl.pick() == 4 and ctl.chunk_limit(4) == 1  # probe the largest chain first
    z = lambda: {"step": 0, "num": np.zeros(2), "accepted": np.zeros(2),  # noqa: E731
                 "rounds_live": np.zeros(2), "accepted_at": np.zeros((2, 4)),
                 "done": np.zeros(2, bool)}
    after = z() | {"step": 10, "num": np.array([50, 10]), "accepted": np.array([40, 0]),
                   "rounds_live": np.array([10, 10]),
                   "accepted_at": np.array([[10, 10, 10, 10], [0, 0, 0, 0]])}
    ctl.record(4, z(), after, seconds=5.0, compiled=False)  # a run's first chunk: untimed
    assert not ctl.measured(4) and ctl.pick() == 4 and ctl.chunk_limit(4) == 1
    ctl.record(4, z(), after, seconds=1.0, compiled=False)
    rates = ctl.acceptance().rates
    assert rates[0, 0] > 0.8 and rates[1, 0] < 0.2
    assert ctl.costs()[4] == pytest.approx(0.1) and ctl.costs()[0] < 0.1  # prior below
    assert ctl.pick() == 1  # then the other unmeasured shapes, largest first
    # A shape's first chunk in a run is not timed (on a GPU the call updates the program's
    # command buffers for this run's buffers): a second one-round probe.
    ctl.record(1, after, after | {"step": 11}, seconds=9.0, compiled=False)
    assert ctl.pick() == 1 and not ctl.measured(1) and ctl.chunk_limit(1) == 1
    ctl.record(1, after | {"step": 11}, after | {"step": 12}, seconds=0.2, compiled=False)
    assert ctl.measured(1)
    ctl.record(0, after, after | {"step": 14}, seconds=7.0, compiled=True)  # not timed
    assert ctl.pick() == 0 and not ctl.measured(0) and ctl.chunk_limit(0) == 1
    ctl.record(0, after | {"step": 14}, after | {"step": 15}, seconds=0.08, compiled=False)
    assert ctl.costs()[0] == pytest.approx(0.08)
    assert ctl.pick() == 4  # row 0 accepts everything: gamma 4 pays for the batch


def test_a_chunks_fixed_overhead_is_not_charged_to_its_rounds():
    # Every chunk costs a dispatch and a sync whatever its rounds (here 4 ms). gamma 2
    # runs chunks of 1 / 8 / 16 / 32 rounds at 2 ms a round; gamma 4's one-round probe
    # took 4 + 2.8 ms. Per round as timed, gamma 4 would look 6.8 ms; less the overhead
    # (the intercept of gamma 2's seconds against rounds), 2.8 ms, and at acceptance 0.9
    # (4.1 against 2.71 tokens a round) gamma 4 is the better shape.
    snap = lambda step: {"step": step, "num": np.zeros(1), "accepted": np.zeros(1),  # noqa: E731
                         "rounds_live": np.zeros(1), "accepted_at": np.zeros((1, 4)),
                         "done": np.zeros(1, bool)}

    def controller(**kw):  # past its first chunk (never timed)
        ctl = Controller(jspec.Adaptive(gammas=(2, 4), **kw), batch=1, max_new_tokens=10_000)
        ctl.record(4, snap(0), snap(1), seconds=1.0, compiled=False)
        return ctl

    ctl = controller()
    ctl.record(4, snap(0), snap(1), seconds=0.0068, compiled=False)
    assert ctl.overhead() == 0.0 and ctl.costs()[4] == pytest.approx(0.0068)
    step = 1
    for rounds in (1, 8, 16, 32):
        ctl.record(2, snap(step), snap(step + rounds), seconds=0.004 + 0.002 * rounds,
                   compiled=False)
        step += rounds
    assert ctl.overhead() == pytest.approx(0.004)
    assert ctl.costs() == {2: pytest.approx(0.002), 4: pytest.approx(0.0028)}
    assert ctl.stats()["chunk_overhead_s"] == pytest.approx(0.004)
    ctl.hits[:], ctl.trials[:] = 90, 100
    assert ctl.pick() == 4
    # A run from measured costs (per round, overhead excluded) reads the overhead off its
    # first timed chunk: 8 rounds of gamma 4 at 2.8 ms plus 4 ms are 2.8 ms a round, not 3.3.
    ctl = controller(costs=ctl.stats()["measured_s_per_round"])
    ctl.record(4, snap(0), snap(8), seconds=0.004 + 8 * 0.0028, compiled=False)
    assert ctl.overhead() == pytest.approx(0.004)
    assert ctl.costs() == {2: pytest.approx(0.002), 4: pytest.approx(0.0028)}
    # Never above 0.9 x the shortest chunk: a cost per round stays positive.
    ctl = controller()
    ctl.record(4, snap(0), snap(1), seconds=0.001, compiled=False)
    for rounds in (1, 8, 16):  # gamma 2's first chunk in the run: not timed
        ctl.record(2, snap(1), snap(1 + rounds), seconds=0.004 + 0.002 * rounds,
                   compiled=False)
    assert ctl.overhead() == pytest.approx(0.0009) and ctl.costs()[4] > 0


def test_a_given_cost_that_is_wrong_is_corrected_by_one_timed_chunk():
    # An earlier run measured decode far too cheap (0.4 ms a round; it costs 2.2 ms plus
    # 1.3 ms a chunk). Decode is chosen first; after its first timed chunk of 8 rounds its
    # cost is 2.2 ms with the overhead timed on chunks of no rounds, and gamma 4 (3.3 ms a
    # round, a = 0.8: 3.4 tokens) takes over. Read off the wrong given cost instead, the
    # overhead would make that chunk's rounds 0.4 ms again and decode would stay.
    snap = lambda step: {"step": step, "num": np.zeros(1), "accepted": np.zeros(1),  # noqa: E731
                         "rounds_live": np.zeros(1), "accepted_at": np.zeros((1, 4)),
                         "done": np.zeros(1, bool)}

    def controller():
        ad = jspec.Adaptive(gammas=(0, 4), costs={"decode": 0.0004, "gamma4": 0.0033})
        ctl = Controller(ad, batch=1, max_new_tokens=10_000)
        ctl.hits[:], ctl.trials[:] = 8.0, 10.0
        assert ctl.pick() == 0 and not ctl.wants_overhead()
        ctl.record(0, snap(0), snap(8), seconds=0.05, compiled=False)  # first: untimed
        return ctl

    ctl = controller()
    assert ctl.wants_overhead()
    ctl.record_overhead(0.0015)
    assert ctl.wants_overhead()
    ctl.record_overhead(0.0013)
    assert not ctl.wants_overhead() and ctl.overhead() == pytest.approx(0.0013)
    ctl.record(0, snap(8), snap(16), seconds=0.0013 + 8 * 0.0022, compiled=False)
    assert ctl.costs()[0] == pytest.approx(0.0022)
    assert ctl.pick() == 4
    assert ctl.stats()["measured_s_per_round"]["chunk_overhead"] == pytest.approx(0.0013)
    assert [h[:2] + [h[3]] for h in ctl.stats()["history"]] == [["decode", 8, False],
                                                                ["decode", 8, True]]
    old = controller()  # no chunk of no rounds timed: the fallback
    old.record(0, snap(8), snap(16), seconds=0.0013 + 8 * 0.0022, compiled=False)
    assert old.costs()[0] == pytest.approx(0.0004) and old.pick() == 0
    # A given overhead: nothing to time; 0 is a valid overhead, a negative one is not.
    ctl = Controller(jspec.Adaptive(gammas=(0, 4), costs={"chunk_overhead": 0.0}), 1, 64)
    ctl.record(4, snap(0), snap(1), seconds=0.05, compiled=False)
    assert not ctl.wants_overhead() and ctl.overhead() == 0.0
    with pytest.raises(ValueError, match=r"costs\['chunk_overhead'\]=-1.0 must be"):
        jspec.Adaptive(costs={"chunk_overhead": -1.0})


def test_a_shape_chosen_again_runs_longer_chunks():
    ctl = Controller(jspec.Adaptive(gammas=(0, 2), chunk_rounds=4, max_chunk_rounds=16),
                     batch=1, max_new_tokens=1000)
    snap = lambda step: {"step": step, "num": np.zeros(1), "accepted": np.zeros(1),  # noqa: E731
                         "rounds_live": np.zeros(1), "accepted_at": np.zeros((1, 2)),
                         "done": np.zeros(1, bool)}
    step, limits = 0, []
    # probes (1 round; a shape's first chunk in a run is not timed, so each is probed
    # twice), then chunks of a shape
    for shape in (2, 2, 0, 0, 2, 2, 2, 2, 0, 2):
        limits.append(ctl.chunk_limit(shape))
        ctl.record(shape, snap(step), snap(step + limits[-1]), seconds=0.01 * limits[-1],
                   compiled=False)
        step += limits[-1]
    assert limits == [1, 1, 1, 1, 4, 8, 16, 16, 4, 4]
    with pytest.raises(ValueError, match="max_chunk_rounds=2 must be >= chunk_rounds=4"):
        jspec.Adaptive(chunk_rounds=4, max_chunk_rounds=2)


def test_a_near_tie_keeps_the_last_shape():
    # gamma 2 and gamma 4 within the margin: the last chunk's shape stays (its chunks keep
    # doubling); a clear winner still takes over; margin 0 is the plain choice.
    def run(margin, cost4):
        ad = jspec.Adaptive(gammas=(2, 4), chunk_rounds=4, stay_margin=margin,
                            costs={"gamma2": 0.010, "gamma4": cost4})
        ctl = Controller(ad, batch=1, max_new_tokens=10_000)
        ctl.hits[:] = 8.0  # acceptance ~0.8 at every position
        ctl.trials[:] = 10.0
        snap = lambda step: {"step": step, "num": np.zeros(1), "accepted": np.zeros(1),  # noqa: E731
                             "rounds_live": np.zeros(1), "accepted_at": np.zeros((1, 4)),
                             "done": np.zeros(1, bool)}
        ctl.record(4, snap(0), snap(4), seconds=4 * cost4, compiled=True)  # untimed
        return ctl.pick(), ctl.chunk_limit(ctl.pick())

    acc = Acceptance(rates=np.full((1, 4), 0.8), live=np.ones(1, bool),
                     remaining=np.full(1, 10_000))
    e2, e4 = expected_rows(acc.rates, 2)[0], expected_rows(acc.rates, 4)[0]
    tie = 0.010 * e4 / e2  # gamma 4's cost per round at equal tokens per second
    assert run(0.05, tie * 1.03) == (4, 8)  # 3% worse: kept, its chunk doubles
    assert run(0.0, tie * 1.03) == (2, 4)  # no margin: the plain choice
    assert run(0.05, tie * 1.10) == (2, 4)  # 10% worse: gamma 2 takes over
    with pytest.raises(ValueError, match="stay_margin=1.5 must be a number in"):
        jspec.Adaptive(stay_margin=1.5)


def test_measured_costs_start_a_run_without_probes():
    # Costs an earlier run measured: no 1-round probes; the first chunk, before any
    # acceptance is seen, is the largest chain (it measures every position; a full
    # chunk), then the choice's; the costs never reach the compiled config.
    costs = {"decode": 0.010, "gamma1": 0.011, "gamma4": 0.013}
    ad = jspec.Adaptive(gammas=(0, 1, 4), chunk_rounds=8, costs=costs)
    assert ad.costs == (("decode", 0.01), ("gamma1", 0.011), ("gamma4", 0.013))
    ctl = Controller(ad, batch=2, max_new_tokens=64)
    assert ctl.costs() == {0: pytest.approx(0.010), 1: pytest.approx(0.011),
                           4: pytest.approx(0.013)}
    first = ctl.pick()
    assert first == 4 and ctl.chunk_limit(first) == 8  # not a probe
    # Even where the prior acceptance (0.5) would choose decode: the largest chain first.
    dear = Controller(jspec.Adaptive(gammas=(0, 1, 4),
                                     costs=costs | {"gamma1": 0.02, "gamma4": 0.03}), 2, 64)
    assert choose(dear.acceptance(), dear.costs(), dear.shapes) == 0 and dear.pick() == 4
    snap = lambda step: {"step": step, "num": np.zeros(2), "accepted": np.zeros(2),  # noqa: E731
                         "rounds_live": np.full(2, step), "accepted_at": np.zeros((2, 4)),
                         "done": np.zeros(2, bool)}
    dear.record(4, snap(0), snap(8), seconds=0.1, compiled=False)  # nothing accepted
    assert dear.pick() == choose(dear.acceptance(), dear.costs(), dear.shapes) == 0
    assert Controller(jspec.Adaptive(gammas=(0, 1, 4)), 2, 64).chunk_limit(4) == 1  # probes
    spec = jspec.SpecConfig(adaptive=ad)
    assert spec.static() == jspec.SpecConfig(adaptive=jspec.Adaptive(gammas=(0, 1, 4),
                                                                     chunk_rounds=8)).static()
    # Partly measured: the others are still probed; what a run measured comes back in the
    # form `costs` takes.
    ctl = Controller(jspec.Adaptive(gammas=(0, 2), costs={"gamma2": 0.02}), 1, 64)
    assert ctl.pick() == 0 and ctl.chunk_limit(0) == 1
    assert ctl.stats()["measured_s_per_round"] == {"gamma2": pytest.approx(0.02)}
    with pytest.raises(ValueError, match="names 'gamma3', which is neither one of the shapes"):
        jspec.Adaptive(gammas=(0, 2), costs={"gamma3": 0.1})
    with pytest.raises(ValueError, match=r"costs\['decode'\]=-1.0 must be seconds"):
        jspec.Adaptive(costs={"decode": -1.0})
    with pytest.raises(TypeError, match="pairs or a dict"):
        jspec.Adaptive(costs=[0.1, 0.2])


@pytest.mark.slow  # a further case of a property the default run proves
def test_a_run_from_measured_costs_is_exact():
    target = load("qwen3", "pallas")
    prompts = _prompts("qwen3")
    serial = jspec.generate(target, prompts, max_new_tokens=N)
    drafter = jspec.PromptLookupDrafter(max_ngram=2)
    first = _check(target, drafter, prompts, jspec.SpecConfig(
        max_new_tokens=N, adaptive=jspec.Adaptive(gammas=(0, 2), chunk_rounds=2)), serial)
    measured = first.stats["adaptive"]["measured_s_per_round"]
    again = _check(target, drafter, prompts, jspec.SpecConfig(
        max_new_tokens=N, adaptive=jspec.Adaptive(gammas=(0, 2), chunk_rounds=2,
                                                  costs=measured)), serial)
    assert measured and all(v > 0 for v in again.stats["adaptive"]["measured_s_per_round"]
                            .values())
    assert again.stats["adaptive"]["empty_chunks_s"] == []  # the overhead came with the costs


def test_bad_adaptive_settings_get_clear_errors():
    with pytest.raises(ValueError, match="gamma=99 exceeds MAX_GAMMA"):
        jspec.SpecConfig(adaptive=jspec.Adaptive(gammas=(0, 99)))
    with pytest.raises(ValueError, match=r"Adaptive.gammas\[0\]=-1"):
        jspec.Adaptive(gammas=(-1, 2))
    with pytest.raises(ValueError, match="schedule holds 3"):
        jspec.Adaptive(gammas=(0, 2), schedule=(2, 3))
    with pytest.raises(ValueError, match="chunk_rounds"):
        jspec.Adaptive(chunk_rounds=0)
    with pytest.raises(TypeError, match="jspec.Adaptive"):
        jspec.SpecConfig(adaptive=(0, 2))
    with pytest.raises(ValueError, match="Adaptive\\(tree=...\\)"):
        jspec.SpecConfig(tree=TREE, adaptive=jspec.Adaptive())
    with pytest.raises(ValueError, match="needs a static tree"):  # each shape's own checks
        jspec.SpecConfig(policy="rejection_sampling", temperature=1.0, adaptive=jspec.Adaptive(
            tree=jspec.TreeConfig(dynamic=(2, 4, 2))))
    spec = jspec.SpecConfig(adaptive=jspec.Adaptive(gammas=(0, 3), tree=TREE))
    assert spec.depth == 3 and spec.proposals == 4
    assert hash(spec) == hash(jspec.SpecConfig(adaptive=jspec.Adaptive(gammas=(3, 0),
                                                                       tree=TREE)))


def test_decode_shape_state_is_the_engine_state():
    """A gamma-0 round proposes nothing and keeps the state's shapes (one SpecState for
    every shape)."""
    target = load("qwen3", "pallas")
    from jspec.spec_config import shape_spec
    from jspec.speculative import one_round, prefill

    spec = jspec.SpecConfig(max_new_tokens=4, adaptive=jspec.Adaptive(gammas=(0, 2)))
    toks = jnp.asarray(expected("qwen3")["prompt"][None, :6])
    state = prefill(target, jspec.PromptLookupDrafter(), toks, jnp.array([6]), jnp.int32(0),
                    spec=spec, max_len=32)
    assert state.accepted_at.shape == (1, 2)
    s0 = one_round(target, jspec.PromptLookupDrafter(), state, jnp.int32(0),
                   spec=shape_spec(spec, 0))
    assert int(s0.num[0]) == 1 and int(s0.proposed[0]) == 0


def _catch_up_runs(ks):
    """Adaptive runs of a draft model with decode runs of 2 and 4 (catch_up 3), one per
    catch_up in ks, each checked against serial decoding."""
    target = load("qwen3", "pallas")
    prompts = _prompts("qwen3")
    serial = jspec.generate(target, prompts, max_new_tokens=16)
    sched = (2, 0, 0, 2, 0, 0, 0, 0, TREE, 0, 2)
    ad = jspec.Adaptive(gammas=(0, 2), tree=TREE, chunk_rounds=1, schedule=sched)
    spec = jspec.SpecConfig(max_new_tokens=16, adaptive=ad)
    runs = {k: _check(target, jspec.ModelDrafter(target, catch_up=k), prompts, spec, serial)
            for k in ks}
    return target, spec, runs


@pytest.mark.slow  # a second run (catch_up 1) beside the default run's (3)
def test_catch_up_changes_no_proposal():
    # The draft runs on pallas, so by property P a block gives it the bits of one token at
    # a time: the proposals, and so the acceptance, are the same whatever catch_up.
    _, _, runs = _catch_up_runs((1, 3))
    for key in ("proposed", "accepted", "acceptance_by_position"):
        assert runs[1].stats[key] == runs[3].stats[key], key
    assert runs[3].stats["draft_forwards"] < runs[1].stats["draft_forwards"]


@pytest.mark.slow  # whole runs; the default run checks the pending state and the counts
def test_a_draft_model_catching_up_gives_serial_output_and_its_counted_forwards():
    # Plain decode steps leave the draft model's tokens pending; it runs them in blocks of
    # catch_up (when full, or before its next proposal); the output is serial's. (The
    # feature head's blocks: tests/test_feature_drafter.py.)
    target, spec, runs = _catch_up_runs((3,))
    assert runs[3].stats["adaptive"]["shapes"]["decode"]["rounds"] >= 6
    from jspec.speculative import draft_forwards

    for k, out in runs.items():
        ran = [[{"decode": 0, "gamma2": 2, "tree": TREE}[h[0]], h[1]]
               for h in out.stats["adaptive"]["history"]]
        assert out.stats["draft_forwards"] == draft_forwards(
            jspec.ModelDrafter(target, catch_up=k), ran)


def test_a_draft_model_catches_up_on_decode_steps_in_blocks():
    # Draft forwards: a block of catch_up decode steps is one, and a flush before a
    # proposal another (hand-counted: init 1, then per chunk below).
    from jspec.speculative import draft_forwards

    target = load("qwen3", "pallas")
    seq = [[2, 1], [0, 2], [2, 1], [0, 4], [TREE, 1], [0, 1], [2, 1]]
    d1, d3 = (jspec.ModelDrafter(target, catch_up=k) for k in (1, 3))
    assert draft_forwards(d3, seq) == 1 + 2 + 0 + (1 + 2) + 1 + (1 + 2) + 0 + (1 + 2)
    assert draft_forwards(d1, seq) == 1 + 2 + 2 + 2 + 4 + 2 + 1 + 2
    assert draft_forwards(jspec.OracleDrafter(jnp.zeros((1, 4), jnp.int32), draft=d3),
                          seq) == draft_forwards(d3, seq)
    assert draft_forwards(jspec.PromptLookupDrafter(), seq) == 0
    sched = (2, 0, 0, 2, 0, 0, 0, 0, TREE, 0, 2)  # `_catch_up_runs`' spec
    spec = jspec.SpecConfig(max_new_tokens=16, adaptive=jspec.Adaptive(
        gammas=(0, 2), tree=TREE, chunk_rounds=1, schedule=sched))
    # Two decode rounds run no draft forward: their tokens wait, the draft cache stays put.
    from jspec.spec_config import shape_spec
    from jspec.speculative import one_round, prefill

    fast = load("qwen3", "xla")
    drafter = jspec.ModelDrafter(fast, catch_up=3)
    toks = jnp.asarray(expected("qwen3")["prompt"][None, :6])
    state = prefill(fast, drafter, toks, jnp.array([6]), jnp.int32(0), spec=spec.static(),
                    max_len=32)
    length = int(state.draft.cache.lengths[0])
    for _ in range(2):
        state = one_round(fast, drafter, state, jnp.int32(0), spec=shape_spec(spec.static(), 0))
    assert int(state.draft.n_pending) == 2 and int(state.draft.cache.lengths[0]) == length
    state = one_round(fast, drafter, state, jnp.int32(0), spec=shape_spec(spec.static(), 0))
    assert int(state.draft.n_pending) == 0 and int(state.draft.cache.lengths[0]) == length + 3
    for bad in (0, 65, 2.5, True):
        with pytest.raises(ValueError, match=r"catch_up=.* must be an integer in \[1, 64\]"):
            jspec.ModelDrafter(target, catch_up=bad)
        with pytest.raises(ValueError, match=r"catch_up=.* must be an integer in \[1, 64\]"):
            jspec.FeatureDrafter(_feature(target).head, catch_up=bad)
