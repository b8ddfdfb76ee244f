"""The fused residual add + RMSNorm (`ModelConfig.fuse_add_norm`).

(a) the kernel against its plain-jnp reference (tolerance);
(b) its outputs bitwise equal to the unfused ops on the same inputs: x_new to
    the dtype's `x + o`, h to the RMSNorm kernel of that sum (the add rounds to
    the dtype before the norm reads it, as in the unfused path), and a row alone
    equal to the row inside a batch;
(c) with fuse_add_norm=True, property P on tiny Llama and Qwen3 models: prefill
    == one-token steps == verify blocks of k in {1, 4, 8}, and a row alone ==
    the row in a ragged batch, full logits compared bitwise;
(d) fused logits bitwise equal to unfused logits, so the option is a pure
    speed change.
CPU, Pallas in interpret mode; JSPEC_PALLAS_INTERPRET=0 runs the kernel tests
(a), (b) compiled (Triton) on a GPU.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import model_and_tokens

from jspec import parity, with_options
from jspec.cache import init_cache
from jspec.model import apply
from pallas_kernels import add_rmsnorm, add_rmsnorm_reference, rmsnorm
from pallas_kernels.rmsnorm import rmsnorm_config

INTERPRET = os.environ.get("JSPEC_PALLAS_INTERPRET", "1") != "0"
DTYPES = (jnp.float32, jnp.bfloat16)
MAX_LEN = 40
N = 24  # tokens per parity sequence


def _rand(rng, shape, dtype, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape), dtype)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _same_bits(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    assert np.array_equal(_bits(a), _bits(b)), f"{what}: bits differ"


def _inputs(dtype, m, d, offset, seed=0):
    rng = np.random.default_rng(seed)
    x = _rand(rng, (m, d), dtype, 2.0)
    o = _rand(rng, (m, d), dtype, 0.5)
    w = _rand(rng, (d,), dtype, 0.1) + (0.0 if offset else 1.0)
    return x, o, w.astype(dtype)


# ------------------------------------------------------------------ (a), (b): the kernel

# d=96 pads the feature axis; d=8200 walks several feature blocks.
@pytest.mark.parametrize(
    "m,d,offset", ((1, 64, 0.0), (7, 96, 1.0), (33, 128, 0.0), (33, 128, 1.0), (3, 8200, 0.0),
                   (3, 8200, 1.0)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_matches_reference_and_unfused_bits(dtype, m, d, offset):
    x, o, w = _inputs(dtype, m, d, offset)
    x_new, h = add_rmsnorm(x, o, w, eps=1e-6, offset=offset, interpret=INTERPRET)
    want_x, want_h = add_rmsnorm_reference(x, o, w, eps=1e-6, offset=offset)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(want_h, np.float32), **tol)
    # The unfused path: the add rounded to the dtype, then the RMSNorm kernel.
    _same_bits(x_new, x + o, "x_new vs x + o")
    unfused = rmsnorm(x + o, w, eps=1e-6, offset=offset, interpret=INTERPRET)
    _same_bits(h, unfused, "h vs rmsnorm(x + o)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_row_invariant(dtype):
    m, d = 150, 128
    assert rmsnorm_config(d, dtype, INTERPRET).bm < m // 2  # the batch spans several row tiles
    x, o, w = _inputs(dtype, m, d, 0.0, seed=1)
    fn = jax.jit(lambda x, o: add_rmsnorm(x, o, w, eps=1e-6, interpret=INTERPRET))
    whole = fn(x, o)
    for start, n in ((0, 1), (5, 3), (60, 16), (149, 1)):
        part = fn(x[start:start + n], o[start:start + n])
        for got, want in zip(part, whole, strict=True):
            _same_bits(got, want[start:start + n], f"rows {start}:{start + n}")


def test_add_rmsnorm_bad_input():
    f32 = lambda *s: jnp.zeros(s, jnp.float32)  # noqa: E731
    with pytest.raises(ValueError, match=r"o\.shape=\(4, 7\)"):
        add_rmsnorm(f32(4, 8), f32(4, 7), f32(8), eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="one dtype"):
        add_rmsnorm(f32(4, 8), f32(4, 8).astype(jnp.bfloat16), f32(8), eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match=r"offset=0\.5"):
        add_rmsnorm(f32(4, 8), f32(4, 8), f32(8), eps=1e-6, offset=0.5, interpret=True)


# ------------------------------------------------------------------ (c), (d): the model

def _fused(model):
    return with_options(model, fuse_add_norm=True)


@pytest.fixture(scope="module", params=(pytest.param("llama3", marks=pytest.mark.slow),
                                        "tiny-qwen3"))
def pair(request):
    """(unfused, fused) bf16 pallas models and a sequence of N tokens."""
    model, seq = model_and_tokens(request.param, N, seed=2)
    return model, _fused(model), seq


def _prefill(model, seqs):
    return parity.schedule_logits(model, seqs, parity.prefill_schedule(len(seqs[0])), MAX_LEN)


def test_fused_forward_uses_the_fused_kernel(pair):
    model, fused, _ = pair
    L = model.config.num_layers

    def count(m):
        cache = init_cache(m, 1, MAX_LEN)
        text = str(jax.make_jaxpr(apply)(m, jnp.zeros((1, 3), jnp.int32), cache))
        return (len(re.findall(r"name=add_rmsnorm\b", text)),
                len(re.findall(r"name=rmsnorm\b", text)))

    plain, fused_counts = count(model), count(fused)
    # Every residual add meets the next norm (the next layer's attn_norm, the next
    # mlp_norm, or the final norm); only layer 0's attn_norm has no add before it.
    assert plain[0] == 0 and fused_counts[0] == 2 * L, (plain, fused_counts)
    assert plain[1] - fused_counts[1] == 2 * L, (plain, fused_counts)


@pytest.mark.slow  # the fusion is the default: test_parity.py's schedules run it
def test_fused_logits_schedule_invariant(pair):
    _, fused, seq = pair
    ref = _prefill(fused, [seq])[0]
    schedules = [("serial", parity.serial_schedule(N))]
    schedules += [(f"verify k={k}", parity.verify_schedule(N, k, prefix=1, seed=k))
                  for k in (1, 4, 8)]
    for label, steps in schedules:
        got = parity.schedule_logits(fused, [seq], steps, MAX_LEN, seed=len(label))[0]
        assert parity.count_mismatches(got, ref) == (0, None), label


def test_fused_row_alone_equals_row_in_ragged_batch(pair):
    _, fused, seq = pair
    rng = np.random.default_rng(3)
    V = fused.config.vocab_size
    # Rows of one length N (so one compiled prefill is the reference), ragged in
    # position: every row accepts its own random number of tokens per call.
    seqs = [rng.integers(0, V, N).astype(np.int32), seq, rng.integers(0, V, N).astype(np.int32)]
    got = parity.schedule_logits(fused, seqs, parity.batch_schedule([N] * 3, 4, seed=4), MAX_LEN)
    for b, s in enumerate(seqs):
        ref = _prefill(fused, [s])[0]
        assert parity.count_mismatches(got[b], ref) == (0, None), b


def test_fused_logits_equal_unfused_logits(pair):
    """Prefill suffices: each path is schedule invariant (above and tests/test_parity.py)."""
    model, fused, seq = pair
    _same_bits(_prefill(fused, [seq])[0], _prefill(model, [seq])[0], "fused vs unfused")


def test_speed_options_are_on_by_default_and_named():
    from jspec.cli import parse_options
    from jspec.options import FUSIONS, KernelOptions
    from jspec.random_model import random_model

    default = KernelOptions()
    assert all(getattr(default, f) for f in FUSIONS)
    assert random_model("tiny-qwen3", interpret=False).options == default
    plain = default.replace(mxfp4_kernel=False, **dict.fromkeys(FUSIONS, False))
    assert default.plain() == plain
    assert parse_options("plain")[0] == plain
    assert parse_options("plain+fuse_glu")[0] == plain.replace(fuse_glu=True)
    assert parse_options("no_pad_rows_once,fuse_qk_rope")[0] == default.replace(
        pad_rows_once=False)
    with pytest.raises(ValueError, match="unknown option 'fuse_everything'"):
        parse_options("fuse_everything")
    assert parse_options("plain,attn_split=256")[0] == plain.replace(attn_split=256)
    with pytest.raises(ValueError, match="attn_split takes an integer"):
        parse_options("attn_split=many")
    with pytest.raises(ValueError, match="unknown option 'fuse_glu=1'"):
        parse_options("fuse_glu=1")
    for text in ("attn_split=1_6", "attn_split= 16", "attn_split=0x10", "attn_split="):
        with pytest.raises(ValueError, match="attn_split takes an integer"):
            parse_options(text)
    # `plain` is `KernelOptions.plain()` on any options, the kernel choices it resets too.
    chosen = default.replace(kv_write_kernel=True, moe_layout_kernel=True, mxfp4_prmt=True,
                             mxfp4_prefetch=2, moe_combine_kernel=True)
    assert parse_options("plain", chosen)[0] == chosen.plain() == plain
    assert parse_options("moe_combine_kernel=1+plain")[0] == plain
    with pytest.raises(ValueError, match="joins options"):
        parse_options("attn_split=+16")
    # One value a setting in a string (the last no longer wins silently); the presets
    # plain and draft may be refined after.
    for text, first in (("attn_split=17+attn_split=16", "attn_split=17"),
                        ("mosaic+triton", "mosaic"), ("fuse_glu+no_fuse_glu", "fuse_glu")):
        with pytest.raises(ValueError, match=f"already set by '{first}'"):
            parse_options(text)
    assert parse_options("plain+fuse_glu")[0] == plain.replace(fuse_glu=True)


def test_an_option_string_for_either_interpret_passes_flag_parsing():
    # attn_split=16 is a key block interpreted (a GPU's is 64): `--interpret` scripts take
    # it; a value neither takes fails at flag parsing.
    from absl import flags

    from jspec.cli import require_options

    fv = flags.FlagValues()
    holder = flags.DEFINE_list("options", [], "", flag_values=fv)
    require_options(holder)
    fv(["prog", "--options=attn_split=16,attn_split=64"])
    assert fv.options == ["attn_split=16", "attn_split=64"]
    with pytest.raises(flags.IllegalFlagValueError, match=r"attn_split=17.*on a GPU: .*64 "
                       r"with interpret=False.*interpreted \(--interpret\): .*16 with"):
        fv(["prog", "--options=attn_split=17"])  # each setting's reason: the flag's unseen
    with pytest.raises(flags.IllegalFlagValueError, match=r"'nonsense': unknown option"):
        fv(["prog", "--options=nonsense"])
