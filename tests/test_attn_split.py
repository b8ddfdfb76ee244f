"""Split-KV attention in the model (`ModelConfig.attn_split`, `attn_split_rows`), CPU
interpret mode.

With a fixed partition size the logits keep property P: prefill == one-token steps ==
verify blocks, a row alone == the same row in a ragged batch, and a larger cache
(more partitions, all past the row) changes nothing. Full logits compared bitwise.
The split path is a different numerical model from the one-pass path (its partials
are folded, not accumulated), so it is compared with itself, never with one pass.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bits, eqn_counts, model_and_tokens, xla_f32
from script_runner import run_script

from jspec import DraftOptions, parity, with_options
from jspec.cache import init_cache
from jspec.model import apply

MAX_LEN = 72
N = 40
SPLIT = 32  # two interpret-mode key blocks of 16: several partitions for 40 tokens


@pytest.fixture(scope="module", params=(("tiny-qwen3", None), ("gemma3", None),
                                        pytest.param(("tiny-qwen3", 32), marks=pytest.mark.slow)),
                ids=("tiny-qwen3", "gemma3", "tiny-qwen3-rows32"))
def case(request):
    name, rows = request.param  # rows: the split row tile (None: the kernel's 16)
    model, seq = model_and_tokens(name, N, seed=11)
    return with_options(model, attn_split=SPLIT, attn_split_rows=rows), seq


# In the slow run: the default run proves the split path's P by its other schedules (serial
# steps against trees: test_tree.py's test_split_kv_trees_equal_serial), batches and cache
# (test_split_row_alone_equals_row_in_ragged_batch below) and, at the kernel, blocks and
# calls of any size (test_kernel_attention.py's test_split_rows_equal_decode_whatever_the_call).
@pytest.mark.parametrize("case", [pytest.param(("gemma3", None), marks=pytest.mark.slow),
                                  pytest.param(("tiny-qwen3", None), marks=pytest.mark.slow),
                                  pytest.param(("tiny-qwen3", 32), marks=pytest.mark.slow)],
                         indirect=True, ids=("gemma3", "tiny-qwen3", "tiny-qwen3-rows32"))
def test_split_logits_schedule_invariant(case):
    model, seq = case
    want = parity.schedule_logits(model, [seq], parity.prefill_schedule(N), MAX_LEN, seed=1)[0]
    for label, steps in [("serial", parity.serial_schedule(N)),
                         ("blocks", parity.block_schedule(N, [3, 1, 5, 2, 8])),
                         ("verify k=4", parity.verify_schedule(N, 4, prefix=2, seed=2))]:
        got = parity.schedule_logits(model, [seq], steps, MAX_LEN, seed=1)[0]
        assert np.array_equal(bits(got), bits(want)), label
    bigger = parity.schedule_logits(model, [seq], parity.serial_schedule(N), 2 * MAX_LEN,
                                    seed=1)[0]
    assert np.array_equal(bits(bigger), bits(want)), "cache capacity x2"


# One model a test for the next two (each kept by the other in the default run; both in
# the slow run).
@pytest.mark.parametrize("case", [pytest.param(("tiny-qwen3", None), marks=pytest.mark.slow),
                                  ("gemma3", None),
                                  pytest.param(("tiny-qwen3", 32), marks=pytest.mark.slow)],
                         indirect=True, ids=("tiny-qwen3", "gemma3", "tiny-qwen3-rows32"))
def test_split_row_alone_equals_row_in_ragged_batch(case):
    model, seq = case
    rng = np.random.default_rng(5)
    others = [rng.integers(0, model.config.vocab_size, n).astype(np.int32) for n in (7, 33, 20)]
    lengths = [N] + [len(o) for o in others]
    batch = parity.schedule_logits(model, [seq] + others,
                                   parity.batch_schedule(lengths, 4, seed=3), MAX_LEN, seed=1)
    alone = parity.schedule_logits(model, [seq], parity.prefill_schedule(N), MAX_LEN, seed=1)
    assert np.array_equal(bits(batch[0]), bits(alone[0]))


def _split_row_tile(jaxpr) -> int | None:
    """Rows of the q block of the first split-KV phase-1 kernel in a jaxpr."""
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call" and e.params.get("name") == "jspec_attention_split":
            return e.params["grid_mapping"].block_mappings[0].block_shape[2].block_size
        for v in e.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and (rows := _split_row_tile(inner)):
                    return rows
    return None


def test_serial_and_group_split_options_pick_their_kernels():
    # The two register-folding split paths' options: each forward runs its kernel a layer
    # (the kernels' rows: tests/test_kernel_attention.py; P at model level: slow below).
    for name, option, kernel, T in (("gemma3", "attn_serial_split", "serial_split", 9),
                                    ("tiny-qwen3", "attn_group_split", "group_split", 1)):
        model, _ = model_and_tokens(name, N, seed=11)
        model = with_options(model, attn_split=SPLIT if T > 1 else 16, **{option: True})
        counts = eqn_counts(jax.make_jaxpr(apply)(model, jnp.zeros((1, T), jnp.int32),
                                                     init_cache(model, 1, MAX_LEN)).jaxpr)
        assert counts[f"pallas_call:jspec_attention_{kernel}"] == model.config.num_layers
        with pytest.raises(ValueError, match=f"{option}=1 must be a bool"):
            with_options(model, **{option: 1})


@pytest.mark.slow  # model-level P on a path whose kernel rows the default run proves
def test_serial_split_logits_schedule_invariant():
    # attn_serial_split: every split-KV call keeps its partials in registers (programs of
    # two row tiles over every partition): P within that path, prefill == steps == blocks
    # == verify blocks == a doubled cache (bits against the two kernels: the device's).
    model, seq = model_and_tokens("gemma3", N, seed=11)
    model = with_options(model, attn_split=SPLIT, attn_serial_split=True)
    counts = eqn_counts(jax.make_jaxpr(apply)(model, jnp.zeros((1, 9), jnp.int32),
                                                 init_cache(model, 1, MAX_LEN)).jaxpr)
    assert counts["pallas_call:jspec_attention_serial_split"] == model.config.num_layers
    want = parity.schedule_logits(model, [seq], parity.prefill_schedule(N), MAX_LEN, seed=1)[0]
    for label, steps in [("serial", parity.serial_schedule(N)),
                         ("verify k=4", parity.verify_schedule(N, 4, prefix=2, seed=2))]:
        got = parity.schedule_logits(model, [seq], steps, MAX_LEN, seed=1)[0]
        assert np.array_equal(bits(got), bits(want)), label
    with pytest.raises(ValueError, match="attn_serial_split=1 must be a bool"):
        with_options(model, attn_serial_split=1)


@pytest.mark.slow  # model-level P on a path whose kernel rows the default run proves
def test_group_split_logits_schedule_invariant():
    # attn_group_split: past one fold group, a program per (row tile, group) folds its
    # partitions' partials in registers: P within that path, prefill == steps == verify
    # blocks == a row in a ragged batch == a doubled cache (more groups) (bits against
    # the two kernels: the device's).
    model, seq = model_and_tokens("tiny-qwen3", N, seed=11)
    model = with_options(model, attn_split=16, attn_group_split=True)  # 5 groups of 2
    counts = eqn_counts(jax.make_jaxpr(apply)(model, jnp.zeros((1, 1), jnp.int32),
                                                 init_cache(model, 1, MAX_LEN)).jaxpr)
    assert counts["pallas_call:jspec_attention_group_split"] == model.config.num_layers
    assert counts["pallas_call:jspec_attention_split"] == 0
    want = parity.schedule_logits(model, [seq], parity.prefill_schedule(N), MAX_LEN, seed=1)[0]
    for label, steps in [("serial", parity.serial_schedule(N)),
                         ("verify k=4", parity.verify_schedule(N, 4, prefix=2, seed=2))]:
        got = parity.schedule_logits(model, [seq], steps, MAX_LEN, seed=1)[0]
        assert np.array_equal(bits(got), bits(want)), label
    rng = np.random.default_rng(5)
    others = [rng.integers(0, model.config.vocab_size, n).astype(np.int32) for n in (7, 33)]
    batch = parity.schedule_logits(model, [seq] + others,
                                   parity.batch_schedule([N, 7, 33], 4, seed=3),
                                   2 * MAX_LEN, seed=1)
    assert np.array_equal(bits(batch[0]), bits(want)), "ragged batch, cache x2"
    with pytest.raises(ValueError, match="attn_group_split=1 must be a bool"):
        with_options(model, attn_group_split=1)


def test_split_kernels_run_and_size_is_checked(case):
    model, _ = case
    model = with_options(model, attn_fused_fold=False)  # two kernels (default: by row tiles)
    j = jax.make_jaxpr(apply)(model, jnp.zeros((1, 1), jnp.int32),
                                 init_cache(model, 1, MAX_LEN))
    assert _split_row_tile(j.jaxpr) == (model.options.attn_split_rows or 16)
    counts = eqn_counts(j.jaxpr)
    L = model.config.num_layers
    assert counts["pallas_call:jspec_attention_split"] == L, counts
    assert counts["pallas_call:jspec_attention_combine"] == L
    assert counts["pallas_call:jspec_attention"] == 0
    with pytest.raises(ValueError, match="attn_split=-1"):
        with_options(model, attn_split=-1)
    for rows in (8, 24):
        with pytest.raises(ValueError, match=f"attn_split_rows={rows} must be a power of two"):
            with_options(model, attn_split_rows=rows)


@pytest.mark.parametrize("case", [("tiny-qwen3", None),
                                  pytest.param(("gemma3", None), marks=pytest.mark.slow),
                                  pytest.param(("tiny-qwen3", 32), marks=pytest.mark.slow)],
                         indirect=True, ids=("tiny-qwen3", "gemma3", "tiny-qwen3-rows32"))
def test_fused_fold_gives_the_two_kernels_bits(case):
    # attn_fused_fold: one launch whose last-arriving partition program per row tile folds
    # the partials; the same partials and fold order, so the same logits bit for bit
    # (interpret mode runs the programs in grid order, so the last partition folds).
    model, seq = case
    fused = with_options(model, attn_fused_fold=True)
    model = with_options(model, attn_fused_fold=False)
    counts = eqn_counts(jax.make_jaxpr(apply)(fused, jnp.zeros((1, 1), jnp.int32),
                                                 init_cache(fused, 1, MAX_LEN)).jaxpr)
    L = model.config.num_layers
    assert counts["pallas_call:jspec_attention_fused"] == L, counts
    assert counts["pallas_call:jspec_attention_split"] == 0
    assert counts["pallas_call:jspec_attention_combine"] == 0
    # A ragged batch: calls of 1-4 tokens a row at different positions, so one launch
    # folds row tiles of several rows and of partial partitions. (With the default,
    # by row tiles, the schedule tests above mix both paths in one model already.)
    rng = np.random.default_rng(6)
    seqs = [seq, rng.integers(0, model.config.vocab_size, 21).astype(np.int32)]
    steps = parity.batch_schedule([N, 21], 4, seed=7)
    got = parity.schedule_logits(fused, seqs, steps, MAX_LEN, seed=1)
    want = parity.schedule_logits(model, seqs, steps, MAX_LEN, seed=1)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(bits(g), bits(w))
    with pytest.raises(ValueError, match="attn_fused_fold=2 must be a bool"):
        with_options(model, attn_fused_fold=2)


# Slow: the kernel's bits with and without skip_empty are the default run's
# (tests/test_kernel_attention.py::test_skip_empty_writes_no_partial_and_keeps_the_bits);
# these are the same property through a whole model.
@pytest.mark.parametrize("case", [pytest.param(("tiny-qwen3", None), marks=pytest.mark.slow),
                                  pytest.param(("gemma3", None), marks=pytest.mark.slow)],
                         indirect=True, ids=("tiny-qwen3", "gemma3"))
def test_skip_empty_gives_the_default_bits(case):
    # attn_skip_empty: no partial written for a partition a row tile cannot see (the
    # fold never reads one): the same logits, one launch and two kernels, in a ragged
    # batch and in a cache twice as large (more empty partitions).
    model, seq = case
    rng = np.random.default_rng(8)
    seqs = [seq, rng.integers(0, model.config.vocab_size, 21).astype(np.int32)]
    steps = parity.batch_schedule([N, 21], 4, seed=9)
    for fused in (True, False):
        base = with_options(model, attn_fused_fold=fused)
        skip = with_options(base, attn_skip_empty=True)
        for cap in (MAX_LEN, 2 * MAX_LEN):
            want = parity.schedule_logits(base, seqs, steps, cap, seed=1)
            got = parity.schedule_logits(skip, seqs, steps, cap, seed=1)
            for g, w in zip(got, want, strict=True):
                assert np.array_equal(bits(g), bits(w)), (fused, cap)
    with pytest.raises(ValueError, match="attn_skip_empty=1 must be a bool"):
        with_options(model, attn_skip_empty=1)


def test_fused_fold_by_default_for_small_grids(case):
    # attn_fused_fold None: one launch when the call has at most 8 split row tiles
    # (AttentionConfig.fused_fold_tiles), two kernels above.
    model, _ = case
    rows = model.options.attn_split_rows or 16
    G = model.config.num_heads // model.config.num_kv_heads
    for batch, tokens in ((1, 1), (2, 3), (9, 1), (1, 40)):
        j = jax.make_jaxpr(apply)(model, jnp.zeros((batch, tokens), jnp.int32),
                                     init_cache(model, batch, MAX_LEN))
        counts = eqn_counts(j.jaxpr)
        fused = batch * -(-tokens * G // rows) <= 8
        assert counts["pallas_call:jspec_attention_fused"] == fused * model.config.num_layers
        assert counts["pallas_call:jspec_attention_split"] == (not fused) * \
            model.config.num_layers, (batch, tokens, counts)


def test_xla_backend_can_run_the_pallas_attention():
    # xla_pallas_attention: a draft model on the xla backend with the Pallas split-KV
    # kernel (fused fold) for its attention. Not a parity claim (the xla backend has
    # none): the kernel replaces attention_xla, and its logits agree with it to f32
    # rounding (f32 weights: the CPU's XLA runs no bf16 x bf16 -> f32 dots).
    model, seq = model_and_tokens("tiny-qwen3", 12, seed=4)
    model = xla_f32(model)
    fast = with_options(model, xla_pallas_attention=True, attn_split=SPLIT, attn_fused_fold=True)
    toks = jnp.asarray(seq[None])
    counts = eqn_counts(jax.make_jaxpr(apply)(fast, toks, init_cache(fast, 1, MAX_LEN)).jaxpr)
    assert counts["pallas_call:jspec_attention_fused"] == model.config.num_layers, counts
    want = np.asarray(apply(model, toks, init_cache(model, 1, MAX_LEN)).logits)
    got = np.asarray(apply(fast, toks, init_cache(fast, 1, MAX_LEN)).logits)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    with pytest.raises(ValueError, match="xla_pallas_attention=3 must be a bool"):
        with_options(model, xla_pallas_attention=3)


@pytest.mark.slow  # a CLI run of gpu_parity.py; the split kernels are proven above
def test_gpu_parity_matrix_runs_with_split_options(tmp_path):
    # The H200 parity harness with split-KV on (`gpu_parity.py --options=attn_split=N`),
    # smoke-run in interpret mode: every check finds 0 mismatches.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = run_script([sys.executable, os.path.join(root, "experiments", "gpu_parity.py"),
                    "--interpret", "--models=tiny-qwen3:1", "--context=64", "--window=6",
                    "--ks=1,4", "--backends=pallas", f"--options=attn_split={SPLIT}",
                    "--tag=split", f"--out={tmp_path}"],
                   cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    with open(tmp_path / "gpu_parity_split.json") as f:
        rep = json.load(f)
    assert rep["speed_options"]["attn_split"] == SPLIT
    [res] = rep["results"].values()
    checks = {k: v for k, v in res.items() if isinstance(v, dict)}
    assert checks and all(v["mismatches"] == 0 and v["positions"] > 0 for v in checks.values())


def _zero_counter_arrays(jaxpr, shape) -> int:
    """int32 arrays of `shape` made by broadcasting a constant (jnp.zeros), at every call
    site of every sub-jaxpr."""
    n = 0
    for e in jaxpr.eqns:
        if e.primitive.name == "broadcast_in_dim":
            aval = e.outvars[0].aval
            n += aval.dtype == jnp.int32 and tuple(aval.shape) == shape
        for v in e.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _zero_counter_arrays(inner, shape)
    return n


def test_fused_fold_counters_come_back_zeroed_and_chain():
    # attention_counted: the folding program puts its row tile's counter back to zero, so
    # a call returns the counters as it took them and the next call may take them as is
    # (a forward zeroes them once, not once a layer: on the GPU each zeros constant a
    # kernel writes into is a device copy). Chained calls give fresh calls' bits; a
    # counter that is not zero leaves the tile unfolded, which the bits show.
    from pallas_kernels.attention import attention, attention_counted

    rng = np.random.default_rng(3)
    B, T, H, Hkv, S, D = 2, 3, 4, 2, 64, 16
    q1, q2 = (jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(B, Hkv, S, D)), jnp.bfloat16) for _ in range(2))
    pos = jnp.asarray([[40, 41, 42], [9, 10, 11]], jnp.int32)
    kw = dict(scale=0.25, interpret=True, split=SPLIT)
    tiles = B * Hkv * 1  # T * G = 6 rows: one 16-row tile a kv head
    out1, c = attention_counted(q1, k, v, pos, jnp.int32(0), None, fused_fold=True, **kw)
    assert c.dtype == jnp.int32 and c.shape == (tiles,) and not np.any(np.asarray(c))
    assert np.array_equal(bits(out1), bits(attention(q1, k, v, pos, jnp.int32(0),
                                                     fused_fold=False, **kw)))
    want2 = attention(q2, k, v, pos, jnp.int32(0), fused_fold=False, **kw)
    out2, c2 = attention_counted(q2, k, v, pos, jnp.int32(0), c, fused_fold=True, **kw)
    assert np.array_equal(bits(out2), bits(want2)) and not np.any(np.asarray(c2))
    dirty, _ = attention_counted(q2, k, v, pos, jnp.int32(0), c + 1, fused_fold=True, **kw)
    assert not np.array_equal(bits(dirty), bits(want2))
    # The two-kernel path passes the counters through untouched.
    _, same = attention_counted(q2, k, v, pos, jnp.int32(0), c + 7, fused_fold=False, **kw)
    assert np.array_equal(np.asarray(same), np.asarray(c + 7))
    with pytest.raises(ValueError, match=r"counters must be int32\[4\]"):
        attention_counted(q2, k, v, pos, jnp.int32(0), jnp.zeros((5,), jnp.int32),
                          fused_fold=True, **kw)


@pytest.mark.parametrize("draft", (None, DraftOptions(fused=True),
                                   DraftOptions(fused=True, rope_attention=False)),
                         ids=("model", "fused", "fused-two-kernels"))
def test_a_forward_zeroes_the_counters_once(draft):
    # Every layer's one-launch attention takes the counters the layer before returned:
    # the model's, the fused draft's q/k step + attention kernel, or its two kernels.
    model, _ = model_and_tokens("tiny-qwen3", 4, seed=2)
    model = with_options(model, attn_split=SPLIT, attn_fused_fold=True)
    if draft is not None:
        model = with_options(model, draft)
    assert model.config.num_layers > 1
    j = jax.make_jaxpr(apply)(model, jnp.zeros((1, 1), jnp.int32),
                                 init_cache(model, 1, MAX_LEN))
    counts = eqn_counts(j.jaxpr)
    kernel = ("jspec_draft_qk_rope_attention" if draft == DraftOptions(fused=True)
              else "jspec_attention_fused")
    assert counts["pallas_call:" + kernel] == model.config.num_layers, counts
    tiles = model.config.num_kv_heads  # batch 1, one row tile a kv head
    # Both kernels fold in two levels here (4 partitions of the 128-slot cache, fold
    # groups of 2): a counter per tile and per group of each.
    n = tiles * (1 + 2)
    assert init_cache(model, 1, MAX_LEN).k[0].shape[2] == 4 * SPLIT
    assert _zero_counter_arrays(j.jaxpr, (n,)) == 1
