"""The Mosaic GPU lowering of the mixture-of-experts kernels (pallas_kernels/mosaic/moe.py)
on the CPU, through Pallas's GPU interpret mode (see tests/test_mosaic.py for what the
interpreter's wgmma is and why a row-by-row product stands in for the hardware's when
slots are compared alone and among others).

Rule R9 on this lowering: a slot's expert output is the same bits whatever other slots
are routed beside it (many on its expert, one per expert, experts left empty), equal to
the reference within rounding; the expert MLP is bitwise its two grouped kernels; a
mixture-of-experts forward keeps property P on this lowering and lowers for CUDA with no
Triton kernel. gpt-oss's experts (a bias on each projection, added in f32 before the
rounding; the clamped "gpt_oss" GLU) keep all of it.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_mosaic import row_by_row_wgmma  # noqa: F401  (a fixture)

from pallas_kernels.moe import grouped_matmul_glu_reference, grouped_matmul_reference
from pallas_kernels.mosaic.moe import (
    grouped_config,
    grouped_matmul,
    grouped_matmul_glu,
    grouped_mlp,
    grouped_mlp_combine,
)
from pallas_kernels.route import combine

E, K, N = 4, 128, 128  # 4 experts, one K step of 128, two 64-column blocks


def _weights(e=E, k=K, n=N, seed=0):
    return (jax.random.normal(jax.random.key(seed), (e, k, n), jnp.float32) * 0.05
            ).astype(jnp.bfloat16)


def _rows(r, k=K, seed=1):
    return jax.random.normal(jax.random.key(seed), (r, k), jnp.float32).astype(jnp.bfloat16)


def _bias(e, n, seed=2):
    return (jax.random.normal(jax.random.key(seed), (e, n), jnp.float32) * 4
            ).astype(jnp.bfloat16)


def test_config_is_a_function_of_the_weight_shape():
    assert grouped_config(128, 2048, 1536, jnp.bfloat16).bk == 128
    cfg = grouped_config(8, 192, 64, jnp.bfloat16)
    assert cfg.bk == 64 and cfg.swapped and cfg.token_tiles == 1 and cfg.bn == 64


@pytest.mark.parametrize("activation,biased", [("silu", False), ("gpt_oss", True)])
def test_matches_the_reference(activation, biased):
    x, w = _rows(11), _weights()
    b = _bias(E, N) if biased else None
    expert = jnp.array([3, 0, 3, 1, 3, 3, 0, 1, 3, 1, 3], jnp.int32)  # expert 2 empty
    y = grouped_matmul(x, w, expert, out_dtype=jnp.float32, bias=b, interpret=True)
    ref = grouped_matmul_reference(x.astype(jnp.float32), w.astype(jnp.float32), expert,
                                   out_dtype=jnp.float32, bias=b)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), atol=1e-5, rtol=1e-5)
    if biased:  # one f32 add to the unbiased product, then the one rounding
        plain = grouped_matmul(x, w, expert, out_dtype=jnp.float32, interpret=True)
        want = np.asarray(plain) + np.asarray(b, np.float32)[np.asarray(expert)]
        assert np.array_equal(np.asarray(y), want)
    g = grouped_matmul_glu(x, w, expert, activation=activation, bias=b, interpret=True)
    gate, up = jnp.split(grouped_matmul(x, w, expert, out_dtype=x.dtype, bias=b,
                                        interpret=True), 2, axis=-1)
    from pallas_kernels.matmul_glu import _glu_tile

    assert np.array_equal(np.asarray(g), np.asarray(_glu_tile(gate, up, activation)))
    np.testing.assert_allclose(
        np.asarray(g, np.float32),
        np.asarray(grouped_matmul_glu_reference(x, w, expert, activation=activation, bias=b),
                   np.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("M,ids,activation", [
    (5, [1, 3, 3, 1, 0, 3, 1, 1, 3, 0], "gelu_tanh"),
    pytest.param(1, [3, 0, 2, 1], "gelu_tanh", marks=pytest.mark.slow),
    pytest.param(1, [2, 2], "gelu_tanh", marks=pytest.mark.slow),  # gpt_oss's below
    pytest.param(5, [1, 3, 3, 1, 0, 3, 1, 1, 3, 0], "gpt_oss", marks=pytest.mark.slow),
    (1, [2, 2], "gpt_oss")])
def test_the_expert_mlp_is_its_two_kernels_and_combines(M, ids, activation):
    # One token (M = 1) takes `token_layout` (a tile per routed row), even on repeated ids.
    # "gpt_oss": gpt-oss's experts, with a bias on each projection.
    k, F = len(ids) // M, N // 2
    x = _rows(M)
    w_gu, w_dn = _weights(), _weights(E, F, K, seed=3)
    b_gu, b_dn = (_bias(E, N), _bias(E, K, seed=4)) if activation == "gpt_oss" else (None,
                                                                                     None)
    biases = dict(b_gate_up=b_gu, b_down=b_dn)
    expert = jnp.array(ids, jnp.int32)
    y = grouped_mlp(x, w_gu, w_dn, expert, activation=activation, interpret=True, **biases)
    a = grouped_matmul_glu(jnp.repeat(x, k, axis=0), w_gu, expert, activation=activation,
                           bias=b_gu, interpret=True)
    want = grouped_matmul(a, w_dn, expert, out_dtype=jnp.float32, bias=b_dn, interpret=True)
    assert y.shape == (M * k, K) and np.array_equal(np.asarray(y), np.asarray(want))
    weights = jax.nn.softmax(jax.random.normal(jax.random.key(5), (M, k)), axis=-1)
    out = grouped_mlp_combine(x, w_gu, w_dn, expert, weights, activation=activation,
                              rows_out=8, interpret=True, **biases)
    assert out.shape == (8, K) and not np.any(np.asarray(out[M:], np.float32))
    assert np.array_equal(np.asarray(out[:M]),
                          np.asarray(combine(want.reshape(M, k, K), weights).astype(x.dtype)))


@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("routing", ["one expert, two tiles", "one row each", "random"])
def test_a_slots_bits_do_not_depend_on_the_routing_beside_it(routing, biased,
                                                             row_by_row_wgmma):  # noqa: F811
    R = 20
    x, w = _rows(R), _weights()
    gmm = functools.partial(grouped_matmul, bias=_bias(E, N) if biased else None)
    expert = {"one expert, two tiles": jnp.full((R,), 2, jnp.int32),
              "one row each": jnp.arange(R, dtype=jnp.int32) % E,
              "random": jax.random.randint(jax.random.key(7), (R,), 0, E)}[routing]
    among = np.asarray(gmm(x, w, expert, out_dtype=jnp.float32, interpret=True))
    for r in (0, 7, R - 1):
        alone = gmm(x[r:r + 1], w, expert[r:r + 1], out_dtype=jnp.float32, interpret=True)
        assert np.array_equal(np.asarray(alone)[0], among[r]), (routing, r)
    perm = np.random.default_rng(0).permutation(R)
    shuffled = gmm(x[perm], w, expert[perm], out_dtype=jnp.float32, interpret=True)
    assert np.array_equal(np.asarray(shuffled), among[perm])


def test_bad_input_is_refused():
    x, w = _rows(3), _weights()
    expert = jnp.zeros((3,), jnp.int32)
    with pytest.raises(TypeError, match="16-bit"):
        grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32), expert,
                       out_dtype=None, interpret=True)
    with pytest.raises(ValueError, match="multiple of 64"):
        grouped_matmul_glu(x, w[:, :, :96], expert, activation="silu", interpret=True)
    with pytest.raises(ValueError, match="activation"):
        grouped_matmul_glu(x, w, expert, activation="relu6", interpret=True)


def _lower(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_the_expert_mlp_lowers_for_cuda(M, gpt_oss):
    # The Qwen3-30B-A3B expert shapes (128 experts, 8 a token, hidden 2048, width 768): a
    # decode step's 8 slots and a 5-token verify block's 40; two Mosaic GPU kernels.
    # gpt_oss: gpt-oss-20b's (32 experts, 4 a token, hidden and width 2880), biased.
    E_, k, D, F = (32, 4, 2880, 2880) if gpt_oss else (128, 8, 2048, 768)
    x = jax.ShapeDtypeStruct((M, D), jnp.bfloat16)
    w_gu = jax.ShapeDtypeStruct((E_, D, 2 * F), jnp.bfloat16)
    w_dn = jax.ShapeDtypeStruct((E_, F, D), jnp.bfloat16)
    expert = jax.ShapeDtypeStruct((M * k,), jnp.int32)
    biases = ((jax.ShapeDtypeStruct((E_, 2 * F), jnp.bfloat16),
               jax.ShapeDtypeStruct((E_, D), jnp.bfloat16)) if gpt_oss else (None, None))

    def fn(x, w_gu, w_dn, expert, b_gu, b_dn):
        return grouped_mlp(x, w_gu, w_dn, expert, activation="gpt_oss" if gpt_oss else "silu",
                           b_gate_up=b_gu, b_down=b_dn)

    text = _lower(fn, x, w_gu, w_dn, expert, *biases)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 2
    assert "__gpu$xla.gpu.triton" not in text and "triton_kernel_call" not in text


@pytest.mark.parametrize("schedules", ["blocks", pytest.param("steps, verify",
                                                             marks=pytest.mark.slow)])
@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.slow  # ~75 s interpreted; the default run: each Mosaic expert kernel's rows
def test_property_p_holds_for_experts_on_mosaic(schedules, gpt_oss):  # (tests above, below)
    # A tiny bf16 Qwen3-MoE (8 experts, 2 a token, a dense layer between two sparse ones)
    # with lowering="mosaic": blocks of 4, 1, 3, 1, 1 tokens (slow: one-token steps
    # throughout, verify blocks) give the prefill's logits bits (its head size of 32
    # keeps attention on Triton; the next test lowers a real one). gpt_oss: with
    # gpt-oss's expert pieces (biases, the clamped GLU, top-k softmax routing; the plain
    # target in the slow run: the same grouped kernels and routing without them).
    from test_moe import gpt_oss_experts

    from jspec import parity
    from jspec.random_model import random_model

    model = (gpt_oss_experts() if gpt_oss else
             random_model("tiny-qwen3-moe", interpret=True, dtype="bfloat16"))
    model = model.replace(options=model.options.replace(lowering="mosaic"))
    n = 10
    seq = np.random.default_rng(0).integers(0, model.config.vocab_size, n).astype(np.int32)
    ref = parity.schedule_logits(model, [seq], parity.prefill_schedule(n), 24)[0]
    runs = ([parity.block_schedule(n, [4, 1, 3, 1, 1])] if schedules == "blocks" else
            [parity.serial_schedule(n), parity.verify_schedule(n, 3, prefix=4, seed=1)])
    for steps in runs:
        got = parity.schedule_logits(model, [seq], steps, 24)[0]
        assert parity.count_mismatches(got, ref) == (0, None)


def test_an_expert_forward_lowers_with_mosaic_kernels_only(h200):
    # A Qwen3-30B-A3B-shaped forward (2 layers) with lowering="mosaic": a decode step
    # lowers for the H200 with no Triton kernel (no `jax-pallas-triton` warning): the
    # router through the matmul, the routing kernel, the grouped gate/up + GLU and down
    # kernels, and the dense kernels of tests/test_mosaic.py.
    import warnings

    from jspec.cache import init_cache
    from jspec.model import Model, apply
    from jspec.random_model import preset_config, random_params

    cfg = preset_config("qwen3-30b-a3b", num_layers=2)
    model = Model(config=cfg, params=jax.eval_shape(lambda: random_params(cfg)))
    model = model.replace(options=model.options.replace(lowering="mosaic"))
    cache = jax.eval_shape(lambda: init_cache(model, 1, 256))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Pallas Triton backend is deprecated")
        text = _lower(apply, model, jax.ShapeDtypeStruct((1, 1), jnp.int32), cache)
    for name in ("grouped_matmul_glu", "grouped_matmul", "route"):
        assert text.count(f"jspec_mosaic_{name}_mosaic_gpu") == 1, name
    assert "__gpu$xla.gpu.triton" not in text and "jspec_route" not in text


def test_the_shared_expert_gate_keeps_rows_and_lowers_for_cuda():
    # Qwen2-MoE's gate on Mosaic GPU: the Triton kernel's arithmetic (`gate_tile`), a row
    # alone as among others, one Mosaic GPU kernel.
    from pallas_kernels.mosaic.shared_gate import shared_gate
    from pallas_kernels.shared_gate import shared_gate_reference

    ks = jax.random.split(jax.random.key(4), 3)
    y, s = (jax.random.normal(k, (5, 4100)).astype(jnp.bfloat16) for k in ks[:2])
    g = (4 * jax.random.normal(ks[2], (5, 1))).astype(jnp.bfloat16)
    got = shared_gate(y, s, g, interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(shared_gate_reference(y, s, g), np.float32),
                               rtol=1e-2, atol=1e-2)
    alone = shared_gate(y[3:4], s[3:4], g[3:4], interpret=True)
    assert np.array_equal(np.asarray(alone[0]).view(np.uint16), np.asarray(got[3]).view(np.uint16))
    args = [jax.ShapeDtypeStruct(sh, jnp.bfloat16) for sh in ((16, 2048), (16, 2048), (16, 1))]
    text = _lower(shared_gate, *args)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1 and "triton" not in text


@pytest.mark.parametrize("M", [1, 5])  # 2 or 10 slots: fewer than the 8 experts, or not
def test_packed_mxfp4_experts_lower_with_the_dequantized_models_kernels(h200, M):
    # gpt-oss kept packed (bf16) with lowering="mosaic" and mxfp4_kernel=True: the grouped
    # kernels take no MXFP4 codes on Mosaic GPU, so the routed experts are dequantized and
    # run on the Mosaic GPU kernels the dequantized model runs (R11: the Triton kernels'
    # bits are their own), never on the Triton kernels that decode in the K loop.
    from jspec.cache import init_cache
    from jspec.model import apply
    from jspec.random_model import random_model

    model = random_model("tiny-gpt-oss", interpret=False, mxfp4_experts=True)
    model = model.replace(options=model.options.replace(lowering="mosaic", mxfp4_kernel=True))
    cache = jax.eval_shape(lambda: init_cache(model, 1, 64))
    text = _lower(apply, model, jax.ShapeDtypeStruct((1, M), jnp.int32), cache)
    names = set(re.findall(r'name = "(jspec_[a-z_0-9]*)"', text))
    assert not {"jspec_grouped_matmul", "jspec_grouped_matmul_glu"} & names, names
    assert "jspec_mosaic_grouped_matmul_glu_mosaic_gpu" in text
