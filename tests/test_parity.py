"""Property P on the `pallas` backend: full logits vectors, compared bitwise.

For tiny models of every dense family (Pallas in interpret mode on the CPU),
the logits at every position are the same bits whether the cache was built by
one prefill, one-token steps, accepted blocks of mixed sizes or speculative
verify blocks of k proposals (any k, any tokens in the rejected slots, after
rollbacks); whether the row is alone or in a ragged batch of 4; and whatever
the cache capacity. The same checks on the `xla` backend find mismatches, and
the tests assert that they do, so these checks can fail.
"""

import numpy as np
import pytest
from conftest import FAMILIES, expected, load

from jspec import parity

VERIFY_KS = (1, 2, 3, 4, 5, 8, 16)
MAX_LEN = 64  # n + the largest verify block fits
DTYPES = ("float32", "bfloat16")


def _seq(name):
    e = expected(name)
    return np.concatenate([e["prompt"], e["greedy"]]).astype(np.int32)  # 52 tokens


def _reference(model, seq, max_len=MAX_LEN):
    return parity.schedule_logits(model, [seq], parity.prefill_schedule(len(seq)), max_len)[0]


def _schedules(n):
    yield "serial", parity.serial_schedule(n)
    yield "blocks 3,1,5,2,8", parity.block_schedule(n, [3, 1, 5, 2, 8])
    for k in VERIFY_KS:
        yield f"verify k={k}", parity.verify_schedule(n, k, prefix=7, seed=k)


def _mismatches(model, seq):
    ref = _reference(model, seq)
    found = {}
    for label, steps in _schedules(len(seq)):
        got = parity.schedule_logits(model, [seq], steps, MAX_LEN, seed=len(label))[0]
        assert got.shape == ref.shape
        found[label] = parity.count_mismatches(got, ref)
    big = _reference(model, seq, max_len=256)
    found["max_len 256"] = parity.count_mismatches(big, ref)
    return found


# Default: bf16 for Qwen 3; the other families (Mistral: every layer windowed, Qwen2:
# q/k/v biases, Gemma 2: softcapped attention scores) and f32 in the slow run.
@pytest.mark.parametrize("name,dtype", [
    (n, d) if d == "bfloat16" and n == "qwen3" else pytest.param(n, d, marks=pytest.mark.slow)
    for n in FAMILIES + ("mistral", "ministral", "qwen2", "gemma2") for d in DTYPES])
def test_pallas_logits_are_schedule_invariant(name, dtype):
    model = load(name, "pallas", dtype)
    found = _mismatches(model, _seq(name)[:44])
    assert all(n == 0 for n, _ in found.values()), found


# Slow: the default run proves a row alone equals the row in a ragged batch with the
# hypothesis batch-mix test (tests/test_property.py, every family) and on Gemma 3 with
# split-KV (tests/test_attn_split.py); these are further cases with one-pass attention.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) for n in FAMILIES])
def test_pallas_row_alone_equals_row_in_ragged_batch(name):
    model = load(name, "pallas", "bfloat16")
    seq = _seq(name)
    rng = np.random.default_rng(0)
    others = [rng.integers(0, model.config.vocab_size, n).astype(np.int32) for n in (9, 30, 41)]
    seqs = [others[0], seq[:36], others[1], others[2]]
    lens = [len(s) for s in seqs]
    for T in (1, 4, 9):
        got = parity.schedule_logits(model, seqs, parity.batch_schedule(lens, T, seed=T), MAX_LEN)
        for b, s in enumerate(seqs):
            ref = _reference(model, s)
            assert parity.count_mismatches(got[b], ref) == (0, None), (T, b)


@pytest.mark.parametrize("name", [n if n == "qwen3" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in FAMILIES + ("gemma2",)])
def test_xla_backend_breaks_the_property(name):
    """The same comparisons on plain jnp find mismatches: the check can fail."""
    model = load(name, "xla", "float32")
    found = _mismatches(model, _seq(name)[:44])
    total = sum(n for n, _ in found.values())
    assert total > 0, f"xla backend showed no mismatch: {found}"
    assert found["serial"][0] > 0, found  # M=1 decode vs an M=44 prefill


def test_xla_batch_breaks_the_property():
    model = load("qwen3", "xla", "float32")
    seq = _seq("qwen3")[:30]
    ref = _reference(model, seq)
    other = np.arange(20, dtype=np.int32)
    got = parity.schedule_logits(model, [seq, other], parity.batch_schedule([30, 20], 4), MAX_LEN)
    assert parity.count_mismatches(got[0], ref)[0] > 0


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow),
                                   "bfloat16"])
@pytest.mark.slow  # a further case of a property the default run proves
def test_pallas_long_sequence_spanning_many_tiles(dtype):
    """160 tokens: every kernel's grid has several row tiles and the attention walks
    several key blocks past the sliding window. (This caught interpret-mode kernels
    being fused with their neighbours when their grid had a single step.)"""
    from jspec.random_model import random_model

    model = random_model("tiny-gemma3", dtype=dtype, interpret=True)
    n, max_len = 160, 192
    seq = np.random.default_rng(1).integers(0, 256, n).astype(np.int32)
    ref = _reference(model, seq, max_len)
    for label, steps in [
        ("serial tail", parity.single_row([(n - 12, n - 12)] + [(1, 1)] * 12)),
        ("verify k=4", parity.verify_schedule(n, 4, prefix=130, seed=4)),
        ("blocks", parity.block_schedule(n, [70, 1, 33, 5])),
    ]:
        got = parity.schedule_logits(model, [seq], steps, max_len)[0]
        assert parity.count_mismatches(got, ref) == (0, None), label
