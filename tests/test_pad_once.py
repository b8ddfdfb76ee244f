"""`ModelConfig.pad_rows_once`: the residual stream padded once per forward.

(a) the traced pallas forward has fewer pad ops (the norm and GLU kernels get aligned
    rows; the matmul pads no rows either way: its last row tile masks the rows past M);
(b) its logits are bitwise equal to the default path's, at prefill, one-token
    steps, verify blocks and in a ragged batch, alone and with fuse_add_norm, so the
    option is a pure speed change; P then follows from the default path's tests;
(c) the xla backend ignores it (that baseline stays a plain JAX model).
CPU, Pallas in interpret mode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bits, eqn_counts, model_and_tokens

from jspec import parity, with_options
from jspec.cache import init_cache
from jspec.model import apply

MAX_LEN = 40
N = 21  # tokens per sequence: not a multiple of the 16-row tile


@pytest.fixture(scope="module", params=("gemma3", "tiny-qwen3"))
def case(request):
    """A bf16 pallas model and a sequence of N tokens (gemma3: sandwich norms,
    (1 + w), embedding scale, sliding windows)."""
    return model_and_tokens(request.param, N, seed=5)


def _ops(model, T=1):
    """(pads, slices, pallas calls) of a forward of T tokens, traced for the GPU."""
    model = model.with_backend(model.options.backend, interpret=False)
    cache = init_cache(model, 1, MAX_LEN)
    c = eqn_counts(jax.make_jaxpr(apply)(model, jnp.zeros((1, T), jnp.int32), cache).jaxpr)
    return c["pad"], c["slice"], c["pallas_call"]


def test_pad_once_removes_pad_and_slice_ops(case):
    model, _ = case
    L = model.config.num_layers
    for T in (1, 5):
        padded = with_options(model, pad_rows_once=True)
        (p0, s0, k0), (p1, s1, k1) = _ops(model, T), _ops(padded, T)
        # The same kernels; per layer at least 2 pads and 2 slices fewer (5 of each
        # while the matmul still padded its rows).
        # (The padded forward slices its Forward.bad rows once, at the end: s1 - 1.)
        assert k1 == k0 and p0 - p1 >= 2 * L and s0 - (s1 - 1) >= 2 * L, (
            (p0, s0, k0), (p1, s1, k1))
    assert _ops(model, 16)[:2] == _ops(with_options(model, pad_rows_once=True), 16)[:2]  # aligned
    xla = model.with_backend("xla")
    assert _ops(with_options(xla, pad_rows_once=True)) == _ops(xla)  # (c): ignored on xla


# fuse_add_norm is ignored with Gemma 3's sandwich norms: Gemma 3 with it on repeats the
# case without it, and runs in the slow run only. Gemma 3 with pad_rows_once is in the
# default run through test_qk_rope.py::test_all_speed_options_together_equal_default.
@pytest.mark.parametrize("case,fuse", [
    pytest.param("gemma3", False, marks=pytest.mark.slow),
    pytest.param("gemma3", True, marks=pytest.mark.slow),
    pytest.param("tiny-qwen3", False, marks=pytest.mark.slow),
    pytest.param("tiny-qwen3", True, marks=pytest.mark.slow)],  # default: the ragged test
    indirect=["case"])
def test_pad_once_logits_equal_default_logits(case, fuse):
    model, seq = case
    base = with_options(model, fuse_add_norm=fuse)  # ignored with (Gemma's) sandwich norms
    padded = with_options(base, pad_rows_once=True)
    schedules = [("prefill", parity.prefill_schedule(N)), ("serial", parity.serial_schedule(N)),
                 ("verify k=4", parity.verify_schedule(N, 4, prefix=1, seed=4))]
    for label, steps in schedules:
        want = parity.schedule_logits(base, [seq], steps, MAX_LEN, seed=1)[0]
        got = parity.schedule_logits(padded, [seq], steps, MAX_LEN, seed=1)[0]
        assert np.array_equal(bits(got), bits(want)), label
        assert np.isfinite(got).all(), label


@pytest.mark.parametrize("case", [pytest.param("gemma3", marks=pytest.mark.slow), "tiny-qwen3"],
                         indirect=True)  # Gemma 3's pad-once logits are the test above's
def test_pad_once_ragged_batch_equals_default(case):
    model, seq = case
    padded = with_options(model, pad_rows_once=True)
    rng = np.random.default_rng(6)
    V = model.config.vocab_size
    seqs = [seq, rng.integers(0, V, N).astype(np.int32), rng.integers(0, V, N).astype(np.int32)]
    steps = parity.batch_schedule([N] * 3, 4, seed=7)
    want = parity.schedule_logits(model, seqs, steps, MAX_LEN)
    got = parity.schedule_logits(padded, seqs, steps, MAX_LEN)
    for b in range(3):
        assert np.array_equal(bits(got[b]), bits(want[b])), b
