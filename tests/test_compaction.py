"""Compaction (`SpecConfig(compact=True)`): once at most half of the batch is live, the run
goes on with the live rows alone in a batch of the next power of two.

Property P makes a row's logits independent of the rows beside it and of their number,
so a compacted run's output is the uncompacted run's and serial decoding's, token for
token; the rows keep their ids (noise keys), so even the drafts and the acceptance
statistics are the same. CPU, pallas in interpret mode.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import expected, load
from flax import struct

import jspec
from jspec.compaction import RowBook, batch_for, plan
from jspec.tree import TreeConfig

N = 16


def _batch(name):
    p = expected(name)["prompt"]
    return [p, p[:4], p[3:10], p[1:7], p[2:12], p[5:9], p[:6], p[4:11]]


def _stops(rows, at):
    """Stop tokens that end row b after at[b] tokens (and maybe others sooner)."""
    return tuple(sorted({rows[b][k] for b, k in at}))


def _free_run(target, prompts):
    """Serial decoding without stops, and each row's prompt + tokens for an oracle."""
    free = jspec.generate(target, prompts, max_new_tokens=N)
    seqs = np.zeros((len(prompts), max(len(p) for p in prompts) + N), np.int32)
    for b, p in enumerate(prompts):
        seqs[b, : len(p) + N] = np.concatenate([p, free.tokens[b]])
    return free, seqs


def test_a_compacted_run_equals_serial_and_the_uncompacted_run():
    # Eight rows that stop at different rounds: the batch goes 8 -> 4 (three live rows
    # and a padding row) -> 1. Oracle drafts are keyed by row id and position, so the
    # compacted run proposes and accepts exactly what the uncompacted one does.
    target = load("llama3", "pallas")
    prompts = _batch("llama3")
    free, seqs = _free_run(target, prompts)
    stops = _stops([free.row(b) for b in range(8)], ((0, 2), (1, 3), (2, 5), (3, 6), (4, 8)))
    serial = jspec.generate(target, prompts, max_new_tokens=N, stop_tokens=list(stops))
    drafter = jspec.OracleDrafter(jnp.asarray(seqs), corrupt_prob=0.3)
    runs = {c: jspec.speculative_generate(
        target, drafter, prompts,
        jspec.SpecConfig(gamma=2, max_new_tokens=N, stop_tokens=stops, compact=c))
        for c in (False, True)}
    for out in runs.values():
        assert [out.row(b) for b in range(8)] == [serial.row(b) for b in range(8)]
    plain, packed = runs[False], runs[True]
    assert plain.stats["batch_sizes"] == [8] and plain.stats["compactions"] == []
    moves = packed.stats["compactions"]
    assert packed.stats["batch_sizes"] == [8] + [m["batch"] for m in moves]
    assert len(moves) >= 2 and any(m["live"] < m["batch"] for m in moves), moves
    for key in ("proposed", "accepted", "tokens", "acceptance_by_position"):
        assert packed.stats[key] == plain.stats[key], key
    np.testing.assert_array_equal(packed.num_tokens, plain.num_tokens)
    np.testing.assert_array_equal(packed.tokens, plain.tokens)
    # Every loop call in the timeline, across cuts (serial: a step a token of its longest
    # row, the loop ending when every row has stopped).
    for out, rounds in ((plain, plain.stats["rounds"]), (packed, packed.stats["rounds"]),
                        (serial, int(serial.num_tokens.max()))):
        tl = out.stats["timeline"]
        assert sum(c[0] for c in tl["calls"]) == rounds and tl["calls_s"] <= tl["loop_s"]
    assert len(packed.stats["timeline"]["calls"]) > len(moves)


@pytest.mark.slow  # `until` ends rows in test_text.py's stop strings by default
def test_until_ends_rows_where_the_host_says_and_the_rest_run_on():
    # A host-side check between chunks (what stop strings use): a row it ends keeps the
    # tokens it had (the free run's, as far as they go) and, compacted, leaves the batch;
    # the other rows are the free run's. The same shapes as the test above (no compile).
    target = load("llama3", "pallas")
    prompts = _batch("llama3")
    free, seqs = _free_run(target, prompts)
    at = {0: 2, 3: 5, 5: 1, 6: 9, 7: 4}  # row -> the tokens after which it may end
    asked = []

    def until(row, ids):
        asked.append((row, len(ids)))
        return len(ids) >= at.get(row, N + 1)

    drafter = jspec.OracleDrafter(jnp.asarray(seqs), corrupt_prob=0.3)
    outs = [jspec.generate(target, prompts, max_new_tokens=N, until=until),
            jspec.speculative_generate(target, drafter, prompts,
                                       jspec.SpecConfig(gamma=2, max_new_tokens=N,
                                                        compact=True), until=until)]
    for out in outs:
        for b in range(8):
            row = out.row(b)
            assert row == free.row(b)[:len(row)], b
            assert len(row) >= at[b] if b in at else len(row) == N, (b, len(row))
    assert len(outs[1].stats["batch_sizes"]) >= 2, outs[1].stats["compactions"]
    assert outs[0].num_tokens.sum() < free.num_tokens.sum()  # ended, not only cut
    assert {r for r, _ in asked} == set(range(8))
    for bad, err in ((lambda r, ids: 1, "must return a bool; it returned int 1 for row 0"),
                     ("stop", "until must be a callable")):
        with pytest.raises(TypeError, match=err):
            jspec.generate(target, prompts, max_new_tokens=N, until=bad)


# Slow: every piece is the default run's alone (compaction keeping row ids: the test above;
# sampling, adaptive shapes and trees equal to serial: test_speculative, test_adaptive).
@pytest.mark.slow
def test_compaction_keeps_row_ids_under_sampling_adaptive_shapes_and_trees():
    # gumbel_coupled keys its noise by (seed, row id, position): a row that moved to
    # another slot must still draw serial Sample's tokens. The draft model's state (a KV
    # cache and logits) is cut by the default batch-major select_rows; the shapes change
    # between chunks (decode steps, chains, a tree).
    target = load("qwen3", "pallas")
    prompts = _batch("qwen3")[:4]
    spec0 = jspec.SpecConfig(policy="gumbel_coupled", temperature=0.8, max_new_tokens=N,
                             seed=3)
    free = jspec.generate(target, prompts, max_new_tokens=N, sampler=spec0.serial_sampler(),
                          seed=3)
    stops = _stops([free.row(b) for b in range(4)], ((0, 1), (1, 3), (2, 7)))
    serial = jspec.generate(target, prompts, max_new_tokens=N, stop_tokens=list(stops),
                            sampler=spec0.serial_sampler(), seed=3)
    tree = TreeConfig(branching=(2, 1))
    ad = jspec.Adaptive(gammas=(0, 1, 2), tree=tree, chunk_rounds=1, schedule=(2, tree, 0, 1))
    spec = jspec.SpecConfig(policy="gumbel_coupled", temperature=0.8, max_new_tokens=N,
                            seed=3, stop_tokens=stops, adaptive=ad, compact=True)
    out = jspec.speculative_generate(target, jspec.ModelDrafter(target), prompts, spec)
    assert [out.row(b) for b in range(4)] == [serial.row(b) for b in range(4)]
    assert len(out.stats["batch_sizes"]) >= 2, out.stats["compactions"]


def test_the_plan_and_the_book():
    assert [batch_for(n) for n in (0, 1, 2, 3, 4, 5, 16, 17)] == [1, 1, 2, 4, 4, 8, 16, 32]
    done = np.array([True, False, True, False, False, True])
    ids = np.array([7, 3, 5, 0, 2, 9])
    idx, new = plan(done, ids, 4, pad_id=10)
    assert idx.tolist() == [1, 3, 4, 0] and new.tolist() == [3, 0, 2, 10]
    with pytest.raises(ValueError, match="do not fit"):
        plan(done, ids, 2, pad_id=10)
    book = RowBook(3, 2)
    snap = {"rows": np.array([2, 0, 3]), "num": np.array([5, 6, 7]),
            "proposed": np.array([1, 2, 3]), "accepted": np.array([1, 1, 1]),
            "accepted_at": np.ones((3, 2), int), "rounds_live": np.array([4, 4, 4])}
    book.record(snap)  # id 3 is padding: not recorded
    assert book.arrays["num"].tolist() == [6, 0, 5]
    later = dict(snap, rows=np.array([0]), num=np.array([9]), proposed=np.array([2]),
                 accepted=np.array([2]), accepted_at=np.ones((1, 2), int),
                 rounds_live=np.array([8]))
    assert book.merged(later)["num"].tolist() == [9, 0, 5]
    assert book.arrays["num"].tolist() == [6, 0, 5]  # merged() leaves the book as it was
    with pytest.raises(TypeError, match="compact must be a bool"):
        jspec.SpecConfig(compact=1)
    target = load("qwen3", "pallas")
    with pytest.raises(ValueError, match="applies to speculative_generate"):
        jspec.speculative_stream(target, jspec.PromptLookupDrafter(), [[1, 2, 3]],
                                 jspec.SpecConfig(compact=True))
    # A drafter state that is not batch-major, and no select_rows: named before any round.
    with pytest.raises(ValueError, match=r"_Odd.s state \(one array\) has shape \(7,\), not \[B=2"):
        jspec.speculative_generate(target, _Odd(), [[1, 2, 3], [4, 5]],
                                   jspec.SpecConfig(gamma=2, max_new_tokens=4, compact=True))


@struct.dataclass
class _Odd(jspec.Drafter):
    """Proposes token 0; its state is a [7] counter, not a row each."""

    def init(self, tokens, lens, max_len, gamma, features=None):
        return jnp.zeros((7,), jnp.int32)

    def forwards_per_round(self, gamma):
        return 0

    def propose(self, state, ctx):
        drafts = jnp.zeros((ctx.cur.shape[0], ctx.gamma), jnp.int32)
        return drafts, jspec.drafting.one_hot_logits(drafts, ctx.vocab), state

    def commit(self, state, ctx, n_acc, nxt, drafts, features=None):
        return state


@pytest.mark.slow  # what warm-up compiles (speed), not the output
def test_warm_up_compiles_what_a_compacted_adaptive_run_meets():
    # Which sizes and shapes a compacted adaptive run reaches depends on when its rows
    # finish and what the controller picks; jspec.warm_up compiles every one of them, so
    # the run itself compiles nothing.
    from jspec import compaction
    from jspec.speculative import _cache_size, spec_loop
    from jspec.warm import compaction_sizes

    assert [compaction_sizes(b) for b in (1, 2, 3, 5, 6, 8)] == [
        [], [1], [1], [2, 1], [4, 2, 1], [4, 2, 1]]
    target = load("llama3", "xla")
    prompts = _batch("llama3")
    free = jspec.generate(target, prompts, max_new_tokens=N)
    stops = _stops([free.row(b) for b in range(8)], ((0, 2), (1, 3), (2, 5), (3, 6), (4, 8)))
    drafter = jspec.PromptLookupDrafter()
    ad = jspec.Adaptive(gammas=(0, 2), chunk_rounds=1)
    spec = jspec.SpecConfig(max_new_tokens=N, stop_tokens=stops, adaptive=ad, compact=True)
    info = jspec.warm_up(target, drafter, prompts, spec)
    assert info["batch_sizes"] == [8, 4, 2, 1] and info["shapes"] == ["decode", "gamma2"]
    assert info["programs"] >= 8  # two loops at each of four sizes, and the cuts
    counted = (spec_loop, compaction._compact, compaction._take)
    before = [_cache_size(f) for f in counted]
    out = jspec.speculative_generate(target, drafter, prompts, spec)
    assert len(out.stats["batch_sizes"]) >= 3, out.stats["compactions"]
    assert [_cache_size(f) for f in counted] == before
