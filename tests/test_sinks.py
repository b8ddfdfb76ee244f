"""Attention sinks (gpt-oss's learned per-head sink logits) in whole forwards, CPU
interpret mode. The kernel paths are checked in tests/test_kernel_attention.py,
tests/test_tree.py and tests/test_mosaic_attention.py; here a tiny random model with
`attn_sinks=True` keeps property P (prefill == one-token steps == verify blocks == a
row in a ragged batch, split-KV too, trees == serial), its speculative output is its
serial output, and the xla backend and the fused draft path run the same function.
"""

import numpy as np
import pytest
from conftest import rel, steps, xla_f32
from test_tree import _rows, check_tree

import jspec
from jspec import parity, with_options
from jspec.random_model import preset_config, random_params

N = 24  # tokens a sequence


@pytest.fixture(scope="module")
def model():
    cfg = preset_config("tiny-qwen3").replace(attn_sinks=True)
    return jspec.Model(config=cfg, params=random_params(cfg, seed=1),
                       options=jspec.KernelOptions(interpret=True))


def _seq(model, n=N, seed=0):
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, n).astype(np.int32)


def test_sinks_change_the_logits_and_the_xla_backend_agrees(model):
    assert model.params["layers"][0]["sinks"].shape == (model.config.num_heads,)
    seq = _seq(model)
    prefill = parity.prefill_schedule(N)
    xla = xla_f32(model)  # f32 weights: the CPU's XLA runs no bf16 dots
    got = parity.schedule_logits(xla.with_backend("pallas"), [seq], prefill, 64)[0]
    assert rel(got, parity.schedule_logits(xla, [seq], prefill, 64)[0]) < 1e-5
    without = xla.replace(config=xla.config.replace(attn_sinks=False))
    assert rel(parity.schedule_logits(without, [seq], prefill, 64)[0], got) > 1e-3


@pytest.mark.parametrize("split", [None, pytest.param(32, marks=pytest.mark.slow)],
                         ids=("one-pass", "split-kv"))  # split-KV: the gpt_oss fixture's run
def test_property_p_holds_with_sinks(model, split):
    model = with_options(model, attn_split=split)
    seqs = [_seq(model), _seq(model, 17, seed=1)]
    ref = [parity.schedule_logits(model, [s], parity.prefill_schedule(len(s)), 64)[0]
           for s in seqs]
    for sched in (parity.serial_schedule(N), parity.verify_schedule(N, 3, prefix=5)):
        got = parity.schedule_logits(model, [seqs[0]], sched, 64, seed=3)[0]
        assert parity.count_mismatches(got, ref[0]) == (0, None)
    got = parity.schedule_logits(model, seqs, parity.batch_schedule([N, 17], 4, seed=2), 64)
    for g, r in zip(got, ref, strict=True):
        assert parity.count_mismatches(g, r) == (0, None)


def test_tree_nodes_equal_serial_with_sinks(model):
    rows = _rows(model, np.random.default_rng(4), 7, [13, 9])
    assert check_tree(model, rows, "blocks", seed=5) == 0


@pytest.mark.slow  # a further case: test_moe.py's gpt_oss fixture proves it by default
def test_speculative_equals_serial_with_sinks(model):
    prompts = [_seq(model, 9), _seq(model, 5, seed=2)]
    n = 12
    serial = jspec.generate(model, prompts, max_new_tokens=n)
    seqs = np.zeros((2, 9 + n), np.int32)
    for b, p in enumerate(prompts):
        seqs[b, :len(p) + n] = np.concatenate([p, serial.tokens[b]])
    drafter = jspec.OracleDrafter(seqs, corrupt_prob=0.4)
    out = jspec.speculative_generate(model, drafter, prompts,
                                     jspec.SpecConfig(gamma=3, max_new_tokens=n))
    for b in range(2):
        assert out.row(b) == serial.row(b), (b, out.stats)
    assert 0 < out.stats["acceptance_rate"] < 1


@pytest.mark.slow  # a draft's numerics never reach the output (its speed path)
def test_fused_draft_path_takes_the_sinks(model):
    # The draft's latency path (DraftOptions.fused) runs the rows' split-KV attention
    # with the sinks (its one-kernel q/k + attention has none and is not taken).
    base = xla_f32(model)
    seq = _seq(model, 30, seed=6)[None]
    want, _ = steps(base, seq, 20, (1, 2, 1))
    got, _ = steps(with_options(base, fused=True), seq, 20, (1, 2, 1))
    for g, w in zip(got[1:], want[1:], strict=True):
        assert rel(g, w) < 1e-5
