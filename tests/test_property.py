"""Property-based parity (hypothesis): random prefixes, block sizes, cache histories
and batch mixes on tiny models. The pallas backend is always bitwise equal; on
the xla backend the same comparison finds and reports mismatches."""

import numpy as np
import pytest
from conftest import FAMILIES, load
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jspec import parity

SIZES = (1, 2, 3, 5, 9)  # call sizes T (few, so compiled shapes are reused)
LENGTHS = (16, 24, 40)
MAX_LEN = 64
# Each example compiles its own shapes: 2 by default (test_parity.py's fixed schedules and
# batch mixes prove P there too), 8 in the slow run (a twin of each).
SETTINGS = settings(max_examples=2, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
MORE = settings(SETTINGS, max_examples=8)


def _with_slow_twin(test):
    """The property `test` (given data) at SETTINGS, and a slow twin at MORE examples."""
    fast = SETTINGS(given(data=st.data())(test))
    slow = pytest.mark.slow(MORE(given(data=st.data())(test)))
    return fast, slow


@st.composite
def schedules(draw, n):
    """A cache history: calls of T slots accepting 1..T (later slots hold garbage)."""
    steps, pos = [], 0
    while pos < n:
        T = draw(st.sampled_from(SIZES))
        a = draw(st.integers(1, min(T, n - pos)))
        steps.append((T, a))
        pos += a
    return steps


def _case(data, backend):
    name = data.draw(st.sampled_from(FAMILIES), label="family")
    model = load(name, backend, "float32")
    n = data.draw(st.sampled_from(LENGTHS), label="n")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    seq = np.random.default_rng(seed).integers(0, model.config.vocab_size, n).astype(np.int32)
    ref = parity.schedule_logits(model, [seq], parity.prefill_schedule(n), MAX_LEN)[0]
    return model, seq, ref


def _any_history_equals_prefill(data):
    model, seq, ref = _case(data, "pallas")
    steps = data.draw(schedules(len(seq)), label="schedule")
    got = parity.schedule_logits(model, [seq], parity.single_row(steps), MAX_LEN, seed=7)[0]
    assert parity.count_mismatches(got, ref) == (0, None), steps


test_pallas_any_history_equals_prefill, test_pallas_any_history_equals_prefill_more = (
    _with_slow_twin(_any_history_equals_prefill))


def _any_batch_mix_equals_row_alone(data):
    model, seq, ref = _case(data, "pallas")
    B = data.draw(st.integers(2, 4), label="B")
    rng = np.random.default_rng(B)
    others = [rng.integers(0, model.config.vocab_size, data.draw(st.sampled_from(LENGTHS)))
              .astype(np.int32) for _ in range(B - 1)]
    slot = data.draw(st.integers(0, B - 1), label="slot")
    seqs = others[:slot] + [seq] + others[slot:]
    T = data.draw(st.sampled_from(SIZES), label="T")
    steps = parity.batch_schedule([len(s) for s in seqs], T, seed=T)
    got = parity.schedule_logits(model, seqs, steps, MAX_LEN)[slot]
    assert parity.count_mismatches(got, ref) == (0, None)


test_pallas_any_batch_mix_equals_row_alone, test_pallas_any_batch_mix_equals_row_alone_more = (
    _with_slow_twin(_any_batch_mix_equals_row_alone))


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_xla_mismatches_are_found_and_reported(data):
    model, seq, ref = _case(data, "xla")
    n = len(seq)
    steps = data.draw(schedules(n - 2), label="schedule") + [(1, 1), (1, 1)]
    got = parity.schedule_logits(model, [seq], parity.single_row(steps), MAX_LEN)[0]
    count, first = parity.count_mismatches(got, ref)
    assert count > 0 and first is not None
    assert not np.array_equal(got[first], ref[first])
    assert np.array_equal(got[:first].view(np.uint32), ref[:first].view(np.uint32))
