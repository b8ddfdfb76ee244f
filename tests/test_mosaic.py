"""The Mosaic GPU lowering of the matmul family (pallas_kernels/mosaic/) on the CPU.

Pallas's GPU interpret mode (`plgpu.InterpretGPUParams`, jax 0.11.2) runs these kernels
on the CPU: TMA copies through `emit_pipeline` (with their out-of-bounds zero fill and
skipped stores), wgmma into a register accumulator, the shared-memory epilogue. Its wgmma
is numpy's `acc + a @ b` in f32 over the [64, bk] x [bk, bn] blocks, and numpy's BLAS
gives a row bits that depend on the row's place among the 64 (seen: rows 0-7 of a
block and rows 8-63 differ in the last bit). So:

- with the interpreter as it is, a row's bits are checked across row counts at the same
  place in its tile (M = 1, 16, 17, 64, 65, 320: the first rows of each are bitwise the
  first rows of the others): the grid, the row padding and the K order do not depend on M;
- with the interpreter's product replaced by one row at a time (the same vector-matrix
  product for every row, as the hardware computes every row alike), a row alone equals
  that row among 16, 64, 65 and 320 rows, bitwise.

Whether the H200's wgmma gives a row the same bits at every place in the tile is
proven on the device (experiments/tuning/mosaic_matmul.py). The kernels also lower for
CUDA here (Mosaic GPU's lowering to its MLIR runs in Python without a GPU; PTX is
compiled on the device).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from script_runner import run_script

from jspec.ops import get_ops
from jspec.options import KernelOptions
from pallas_kernels.add_rmsnorm import add_rmsnorm_reference
from pallas_kernels.matmul import MatmulConfig, matmul_reference
from pallas_kernels.matmul_glu import _glu_tile, matmul_glu_reference
from pallas_kernels.mosaic import (
    MosaicMatmulConfig,
    add_rmsnorm,
    matmul,
    matmul_glu,
    matmul_partials,
    mosaic_matmul_config,
    qk_norm_rope,
    rmsnorm,
    rope,
)
from pallas_kernels.rmsnorm import rmsnorm_reference

K, N = 128, 64  # one K step (bk 128), two column tiles (bn 32): few interpreted steps


def _inputs(m: int, k: int = K, n: int = N, seed: int = 0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * 0.05).astype(jnp.bfloat16)
    return x, w


class _RowByRow:
    """numpy, except that matmul forms each row of a @ b on its own (the same
    vector-matrix product whatever the row's place among the others)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def matmul(a, b, dtype):
        b = np.asarray(b, dtype)
        return np.stack([np.asarray(row, dtype) @ b for row in a])


@pytest.fixture
def row_by_row_wgmma(monkeypatch):
    monkeypatch.setattr(gpu_callbacks, "np", _RowByRow())


def test_config_is_a_function_of_the_weight_shape():
    # Qwen3-8B, the rule: bk from K alone; >= 128 column tiles at decode where N allows.
    got = {kn: mosaic_matmul_config(*kn, jnp.bfloat16, tuned=False) for kn in
           [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (4096, 151936)]}
    assert {kn: (c.bk, c.bn) for kn, c in got.items()} == {
        (4096, 6144): (128, 32), (4096, 4096): (128, 32), (4096, 24576): (128, 128),
        (12288, 4096): (128, 32), (4096, 151936): (128, 128)}
    assert all(2 <= c.stages <= 4 for c in got.values())
    assert mosaic_matmul_config(96, 4096, jnp.bfloat16).bk == 32
    with pytest.raises(ValueError, match="bn"):
        MosaicMatmulConfig(bn=48, bk=64, stages=2)
    with pytest.raises(ValueError, match="stages"):
        MosaicMatmulConfig(bn=64, bk=64, stages=1)


def test_matmul_matches_reference():
    x, w = _inputs(70)
    y = matmul(x, w, interpret=True)  # [70, 64] f32
    ref = matmul_reference(x, w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)
    yb = matmul(x, w, out_dtype=jnp.bfloat16, interpret=True)
    assert yb.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(yb), np.asarray(y.astype(jnp.bfloat16)))


@pytest.mark.slow  # a further case of a property the default run proves
def test_rows_keep_their_bits_across_row_counts():
    x, w = _inputs(320)
    full = np.asarray(matmul(x, w, interpret=True))  # 5 row tiles, the last one full
    for m in (1, 16, 17, 64, 65):
        assert np.array_equal(np.asarray(matmul(x[:m], w, interpret=True)), full[:m]), m


def test_row_alone_equals_row_among_others(row_by_row_wgmma):
    x, w = _inputs(320, seed=1)
    alone = {r: np.asarray(matmul(x[r:r + 1], w, interpret=True))[0]
             for r in (0, 9, 63, 64, 319)}
    for m in (16, 64, 65, 320):
        among = np.asarray(matmul(x[:m], w, interpret=True))
        for r, row in alone.items():
            if r < m:
                assert np.array_equal(among[r], row), (m, r)
    # Every row at another place in its tile (rolled by 9): the same bits.
    rolled = np.asarray(matmul(jnp.roll(x[:65], 9, axis=0), w, interpret=True))
    assert np.array_equal(np.roll(rolled, -9, axis=0),
                          np.asarray(matmul(x[:65], w, interpret=True)))


@pytest.mark.parametrize("activation", ["silu", pytest.param("gelu_tanh", marks=pytest.mark.slow)])
def test_matmul_glu_is_glu_of_the_matmul_halves(activation):
    x, w = _inputs(17, n=128)  # F = 64: two column tiles of 32 per half
    got = matmul_glu(x, w, activation=activation, interpret=True)  # [17, 64] bf16
    gate, up = jnp.split(matmul(x, w, out_dtype=x.dtype, interpret=True), 2, axis=-1)
    assert np.array_equal(np.asarray(got), np.asarray(_glu_tile(gate, up, activation)))
    ref = matmul_glu_reference(x, w, activation=activation)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_bad_input_is_refused():
    x, w = _inputs(4)
    with pytest.raises(TypeError, match="bfloat16"):
        matmul(x.astype(jnp.float32), w.astype(jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        matmul(x[:, :64], w, interpret=True)
    with pytest.raises(TypeError, match="MosaicMatmulConfig"):
        matmul(x, w, config=MatmulConfig(bm=16, bn=32, bk=32, num_warps=4, num_stages=2))
    with pytest.raises(ValueError, match="multiple of the column tile"):
        matmul_glu(x, w[:, :48], activation="silu", interpret=True)
    with pytest.raises(ValueError, match="lowering"):
        KernelOptions(lowering="cuda")


def test_ops_dispatch_by_lowering():
    def kernel(fn):
        return fn.func if isinstance(fn, functools.partial) else fn.__wrapped__.func

    mosaic = get_ops("pallas", False, "mosaic")
    triton = get_ops("pallas", False, "triton")
    assert kernel(mosaic.matmul) is matmul and kernel(mosaic.matmul_glu) is matmul_glu
    assert kernel(triton.matmul) is not matmul
    assert kernel(mosaic.rmsnorm) is rmsnorm and kernel(mosaic.add_norm) is add_rmsnorm
    assert kernel(triton.rmsnorm) is not rmsnorm
    from pallas_kernels import moe as triton_moe
    from pallas_kernels.mosaic import moe as mosaic_moe

    assert kernel(mosaic.grouped_mlp) is mosaic_moe.grouped_mlp  # experts by shape
    assert kernel(triton.grouped_mlp) is triton_moe.grouped_mlp
    from pallas_kernels.mosaic import route as mosaic_route

    assert kernel(mosaic.route) is mosaic_route.route_kernel  # Triton's past 256 experts
    from pallas_kernels import route as triton_route

    assert kernel(triton.route) is triton_route.route_kernel
    assert kernel(mosaic.matmul_partials) is matmul_partials  # row-parallel weights
    assert kernel(triton.matmul_partials) is not matmul_partials
    from pallas_kernels.mosaic import glu as mosaic_glu

    assert kernel(mosaic.glu) is mosaic_glu.glu and kernel(triton.glu) is not mosaic_glu.glu
    from pallas_kernels.mosaic import softcap as mosaic_softcap

    assert kernel(mosaic.softcap) is mosaic_softcap.softcap
    assert kernel(triton.softcap) is not mosaic_softcap.softcap
    # Attention by head size, dtype and split: Mosaic GPU where it takes them, else Triton.
    q, kv = jnp.zeros((1, 1, 4, 32), jnp.bfloat16), jnp.zeros((1, 2, 64, 32), jnp.bfloat16)
    pos, w = jnp.zeros((1, 1), jnp.int32), jnp.int32(0)
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        import pallas_kernels.mosaic.attention as mosaic_attention

        mp.setattr(mosaic_attention, "takes", lambda *a: calls.append(a) or False)
        get_ops.cache_clear()
        ops = get_ops("pallas", True, "mosaic")
        ops.attention(q, kv, kv, pos, w, scale=1.0, split=0)
        get_ops.cache_clear()
    assert calls == [(32, jnp.bfloat16, 0)]
    from pallas_kernels.mosaic.attention import takes

    assert takes(128, jnp.bfloat16, None) and takes(256, jnp.float16, 64)
    assert not takes(32, jnp.bfloat16, None) and not takes(128, jnp.float32, None)
    assert not takes(128, jnp.bfloat16, 0) and not takes(128, jnp.bfloat16, 96)
    assert mosaic.qk_norm_rope.__wrapped__.func is qk_norm_rope  # by head size, else Triton
    assert mosaic.rope.__wrapped__.func is rope
    assert get_ops("pallas", True, "mosaic").matmul.__wrapped__.func is matmul


_SLOW = pytest.mark.slow


# --------------------------------------------------------------------------- norms
def _norm_inputs(m: int, d: int, dtype, seed: int = 0):
    kx, ko, kw = jax.random.split(jax.random.key(seed), 3)
    x = (jax.random.normal(kx, (m, d), jnp.float32) * 3.0).astype(dtype)
    o = jax.random.normal(ko, (m, d), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (d,), jnp.float32).astype(dtype)
    return x, o, w


def _f32(a) -> np.ndarray:
    return np.asarray(a, np.float32)


@pytest.mark.parametrize("d,dtype,offset", [(256, jnp.bfloat16, 0.0), (300, jnp.float32, 1.0),
                                            pytest.param(64, jnp.bfloat16, 1.0, marks=_SLOW)])
def test_norms_match_reference(d, dtype, offset):
    x, o, w = _norm_inputs(5, d, dtype)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    h = rmsnorm(x, w, eps=1e-6, offset=offset, interpret=True)
    assert h.dtype == x.dtype and h.shape == x.shape
    np.testing.assert_allclose(_f32(h), _f32(rmsnorm_reference(x, w, eps=1e-6, offset=offset)),
                               rtol=tol, atol=tol)
    x_new, h2 = add_rmsnorm(x, o, w, eps=1e-6, offset=offset, interpret=True)
    ref_x, ref_h = add_rmsnorm_reference(x, o, w, eps=1e-6, offset=offset)
    np.testing.assert_array_equal(_f32(x_new), _f32(ref_x))  # a plain add's bits
    np.testing.assert_allclose(_f32(h2), _f32(ref_h), rtol=tol, atol=tol)
    # The fused kernel normalises the rounded sum: bitwise this lowering's rmsnorm(x + o).
    np.testing.assert_array_equal(_f32(h2), _f32(rmsnorm(x + o, w, eps=1e-6, offset=offset,
                                                         interpret=True)))


def test_norm_rows_keep_their_bits_across_row_counts():
    # One program a row: a row's bits never depend on M or on the other rows.
    x, o, w = _norm_inputs(17, 300, jnp.bfloat16, seed=3)
    full = _f32(rmsnorm(x, w, eps=1e-6, interpret=True))
    _, full_h = add_rmsnorm(x, o, w, eps=1e-6, interpret=True)
    for m in (1, 4, 17):
        np.testing.assert_array_equal(_f32(rmsnorm(x[:m], w, eps=1e-6, interpret=True)),
                                      full[:m])
    alone = add_rmsnorm(x[9:10], o[9:10], w, eps=1e-6, interpret=True)[1]
    np.testing.assert_array_equal(_f32(alone)[0], _f32(full_h)[9])


def test_norms_refuse_bad_input():
    x, o, w = _norm_inputs(2, 256, jnp.bfloat16)
    with pytest.raises(ValueError, match="offset"):
        rmsnorm(x, w, eps=1e-6, offset=0.5, interpret=True)
    with pytest.raises(ValueError, match=r"x \[M, D\] and w \[D\]"):
        rmsnorm(x, w[:128], eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="one dtype"):
        add_rmsnorm(x, o.astype(jnp.float32), w, eps=1e-6, interpret=True)


@pytest.mark.parametrize("m,d", [(1, 4096), (40, 2560), pytest.param(3, 300, marks=_SLOW)])
def test_norms_lower_for_cuda(m, d):
    x = jax.ShapeDtypeStruct((m, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((d,), jnp.bfloat16)
    text = _lower(functools.partial(rmsnorm, eps=1e-6), x, w)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
    assert ("stablehlo.pad" in text) == (d % 256 != 0)  # model widths need no padding
    text = _lower(functools.partial(add_rmsnorm, eps=1e-6, offset=1.0), x, x, w)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1


def _lower(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("m,k,n", [
    (1, 4096, 6144), (17, 12288, 4096), (320, 4096, 151936),
    pytest.param(1, 4096, 151936, marks=_SLOW), pytest.param(17, 4096, 6144, marks=_SLOW),
    pytest.param(320, 12288, 4096, marks=_SLOW)])
def test_matmul_lowers_for_cuda(m, k, n):
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    text = _lower(functools.partial(matmul, out_dtype=jnp.bfloat16), x, w)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
    # No pad copy of the weight (its shape divides the tiles); x's rows are padded to a
    # multiple of 8 (TMA's row tile) only where there are more than 8 of them.
    assert ("stablehlo.pad" in text) == (m > 8 and m % 8 != 0)


def test_matmul_partials_are_the_chunks_matmuls():
    # Row-parallel weights (row_partials, tensor parallelism): partial c is this lowering's
    # matmul of the c-th K chunk with an f32 output, bitwise; a row alone keeps its bits.
    x, w = _inputs(17, k=256)
    parts = matmul_partials(x, w, splits=2, interpret=True)
    assert parts.shape == (2, 17, N) and parts.dtype == jnp.float32
    for c in range(2):
        chunk = matmul(x[:, c * 128:(c + 1) * 128], w[c * 128:(c + 1) * 128], interpret=True)
        assert np.array_equal(np.asarray(parts[c]), np.asarray(chunk)), c
    alone = matmul_partials(x[:1], w, splits=2, interpret=True)
    assert np.array_equal(np.asarray(alone[:, 0]), np.asarray(parts[:, 0]))
    np.testing.assert_allclose(np.asarray(parts[0] + parts[1]),
                               np.asarray(matmul_reference(x, w)), rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.asarray(matmul_partials(x, w, splits=1, interpret=True)[0]),
                          np.asarray(matmul(x, w, interpret=True)))
    assert np.array_equal(np.asarray(matmul_partials(x, w, splits=np.int64(2), interpret=True)),
                          np.asarray(parts))
    for bad in (3, 0, True, 2.0):
        with pytest.raises(ValueError, match="equal chunks"):
            matmul_partials(x, w, splits=bad, interpret=True)
    with pytest.raises(TypeError, match="matmul_partials"):
        matmul_partials(x, w, splits=2, config=MatmulConfig(bm=16, bn=32, bk=32, num_warps=4,
                                                            num_stages=2))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gpt_oss"])
def test_glu_is_the_formula_and_keeps_rows(activation):
    # The unfused GLU (fuse_glu off, a tensor-parallel column shard): every element alone,
    # whatever the rows and columns beside it.
    from pallas_kernels.glu import glu_reference
    from pallas_kernels.mosaic.glu import glu

    kg, ku = jax.random.split(jax.random.key(3))
    gate = (jax.random.normal(kg, (3, 5000), jnp.float32) * 4).astype(jnp.bfloat16)
    up = (jax.random.normal(ku, (3, 5000), jnp.float32) * 4).astype(jnp.bfloat16)
    y = glu(gate, up, activation=activation, interpret=True)
    assert y.shape == gate.shape and y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32),
                               np.asarray(glu_reference(gate, up, activation=activation),
                                          np.float32), rtol=1e-2, atol=1e-2)
    alone = glu(gate[2:, 7:300], up[2:, 7:300], activation=activation, interpret=True)
    assert np.array_equal(np.asarray(alone[0]).view(np.uint16),
                          np.asarray(y[2, 7:300]).view(np.uint16))
    assert glu(gate[:0], up[:0], activation=activation, interpret=True).shape == (0, 5000)
    assert glu(gate[:, :0], up[:, :0], activation=activation, interpret=True).shape == (3, 0)
    with pytest.raises(ValueError, match="activation"):
        glu(gate, up, activation="relu", interpret=True)


def test_matmul_glu_lowers_for_cuda():
    x = jax.ShapeDtypeStruct((40, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 24576), jnp.bfloat16)
    text = _lower(functools.partial(matmul_glu, activation="silu"), x, w)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1
    assert "tensor<40x12288xbf16>" in text


@pytest.mark.parametrize("tree", [False, pytest.param(True, marks=_SLOW)])
def test_model_forward_lowers_with_mosaic_kernels_only(h200, tree):
    # A Qwen3-8B-shaped forward (2 layers) with lowering="mosaic": a decode step (or a
    # tree verify of 4 nodes) lowers for the H200 with every kernel on Mosaic GPU: the
    # projections (wqkv, wo, the fused gate/up + GLU, w_down; layers share one body), the
    # LM head, the block norm, the residual add + norm, the q/k norm + RoPE and split-KV
    # attention (or tree attention) with its fold. No Triton kernel, so no
    # `jax-pallas-triton` deprecation warning.
    import warnings

    from jspec.cache import init_cache
    from jspec.model import Model, apply
    from jspec.random_model import preset_config, random_params
    from jspec.tree import from_parents

    cfg = preset_config("qwen3-8b", num_layers=2)
    model = Model(config=cfg, params=jax.eval_shape(lambda: random_params(cfg)))
    model = model.replace(options=model.options.replace(lowering="mosaic"))
    cache = jax.eval_shape(lambda: init_cache(model, 1, 256))
    fn, tokens = apply, jax.ShapeDtypeStruct((1, 1), jnp.int32)
    if tree:
        tokens = jax.ShapeDtypeStruct((1, 4), jnp.int32)

        def fn(model, tokens, cache):
            t = from_parents(jnp.asarray([[-1, 0, 0, 1]], jnp.int32), cache.lengths, 2)
            return apply(model, tokens, cache, tree=t)

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Pallas Triton backend is deprecated")
        text = _lower(fn, model, tokens, cache)
    attention = "tree_attention" if tree else "attention"
    for name, n in (("matmul", 4), ("matmul_glu", 1), ("rmsnorm", 1), ("add_rmsnorm", 1),
                    ("qk_norm_rope", 1), (f"{attention}_split", 1), ("attention_fold", 1)):
        assert text.count(f"jspec_mosaic_{name}_mosaic_gpu") == n, name
    assert text.count("custom_call @mosaic_gpu") == 10
    assert "__gpu$xla.gpu.triton" not in text and "jspec_matmul" not in text


def test_unfused_glu_and_row_partials_lower_with_mosaic_kernels_only(h200):
    # The options that take the kernels a default forward does not: fuse_glu off (gate/up
    # as a matmul, then the GLU) and row_partials 2 (wo and w_down as two f32 partials
    # each, added left to right). Every kernel on Mosaic GPU still.
    import warnings

    from jspec.cache import init_cache
    from jspec.model import Model, apply
    from jspec.random_model import preset_config, random_params

    cfg = preset_config("qwen3-8b", num_layers=2)
    model = Model(config=cfg, params=jax.eval_shape(lambda: random_params(cfg)))
    model = model.replace(options=model.options.replace(lowering="mosaic", fuse_glu=False,
                                                        row_partials=2))
    cache = jax.eval_shape(lambda: init_cache(model, 1, 256))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Pallas Triton backend is deprecated")
        text = _lower(apply, model, jax.ShapeDtypeStruct((1, 5), jnp.int32), cache)
    # wqkv, gate/up, a chunk of wo and of w_down (both chunks of a weight are one shape,
    # lowered once), the LM head
    assert text.count("jspec_mosaic_matmul_mosaic_gpu") == 5
    assert text.count("jspec_mosaic_glu_mosaic_gpu") == 1
    assert "__gpu$xla.gpu.triton" not in text and "jspec_matmul" not in text


@_SLOW  # further cases of the test above: every family, block shape and cache size
@pytest.mark.parametrize("preset,batch,T,max_len,tree", [
    ("llama3-8b", 1, 2048, 4096, False),  # a prefill chunk
    ("llama3-8b", 1, 5, 131072, False),  # a verify block over a 128K cache
    ("gemma3-4b", 1, 17, 256, False),  # a 17-row block, sliding and global layers
    ("gemma3-4b", 1, 1, 131072, False),
    ("mixtral-8x7b", 8, 5, 256, False),  # experts, a batch's verify
    ("qwen3-30b-a3b", 1, 2048, 4096, False),
    ("qwen3-0.6b", 1, 8, 256, True),  # a tree
    ("qwen2.5-7b", 1, 5, 256, False),  # q/k/v biases (an f32 product), 28 + 4 + 4 heads
    ("mistral-7b", 1, 1, 256, False),
    ("gemma2-9b", 1, 5, 256, False),  # softcapped attention scores
    ("qwen1.5-moe-a2.7b", 1, 5, 256, False),  # a shared expert under its sigmoid gate
    ("gpt-oss-20b", 8, 5, 256, False)])  # sinks, biased experts, hidden 2880
def test_every_family_lowers_with_mosaic_kernels_only(h200, preset, batch, T, max_len, tree):
    import warnings

    from jspec.cache import init_cache
    from jspec.model import Model, apply
    from jspec.random_model import preset_config, random_params
    from jspec.tree import from_parents

    cfg = preset_config(preset, num_layers=2)
    model = Model(config=cfg, params=jax.eval_shape(lambda: random_params(cfg)))
    model = model.replace(options=model.options.replace(lowering="mosaic"))
    cache = jax.eval_shape(lambda: init_cache(model, batch, max_len))
    fn = apply
    if tree:
        def fn(model, tokens, cache):
            parents = jnp.asarray([[-1] + list(range(T - 1))] * batch, jnp.int32)
            return apply(model, tokens, cache, tree=from_parents(parents, cache.lengths, 2))

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Pallas Triton backend is deprecated")
        text = _lower(fn, model, jax.ShapeDtypeStruct((batch, T), jnp.int32), cache)
    assert text.count("custom_call @mosaic_gpu") >= 7
    assert "__gpu$xla.gpu.triton" not in text


# --------------------------------------------------------------------------- softcap


@pytest.mark.parametrize("m,n", [(1, 256), (3, 5000), (17, 4096)])
def test_softcap_is_the_formula_and_keeps_rows(m, n):
    # Gemma's final logits: every element alone, whatever the rows and columns beside it.
    from pallas_kernels.mosaic.softcap import softcap, softcap_reference

    x = jax.random.normal(jax.random.key(m), (m, n), jnp.float32) * 40.0
    y = softcap(x, 30.0, interpret=True)
    assert y.shape == (m, n) and float(jnp.max(jnp.abs(y))) <= 30.0
    np.testing.assert_allclose(np.asarray(y), np.asarray(softcap_reference(x, 30.0)),
                               rtol=1e-6, atol=1e-5)
    for r in {0, m - 1}:
        alone = softcap(x[r:r + 1, : n - 7], 30.0, interpret=True)  # another row count, N
        assert np.array_equal(np.asarray(alone[0]).view(np.uint32),
                              np.asarray(y[r, : n - 7]).view(np.uint32))
    with pytest.raises(ValueError, match="float32"):
        softcap(x.astype(jnp.bfloat16), 30.0, interpret=True)


def test_softcap_lowers_for_cuda():
    from pallas_kernels.mosaic.softcap import softcap

    text = _lower(functools.partial(softcap, cap=30.0),
                  jax.ShapeDtypeStruct((16, 256000), jnp.float32))
    assert text.count("custom_call @mosaic_gpu") == 1 and "triton" not in text


# --------------------------------------------------------------------------- q/k norm, RoPE
def _qk_inputs(m, heads, d, norm, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    qkv = jax.random.normal(ks[0], (m, heads, d), jnp.float32).astype(jnp.bfloat16)
    w = [(1 + 0.1 * jax.random.normal(k, (d,))).astype(jnp.bfloat16) if norm else None
         for k in ks[1:3]]
    return qkv, w[0], w[1], jax.random.normal(ks[3], (m, d // 2)), jax.random.normal(
        ks[4], (m, d // 2))


@pytest.mark.parametrize("nq,nk,nv,d,norm,offset", [
    (32, 8, 8, 128, True, 0.0),  # Qwen3-8B: one block of 64 heads, v heads read, not stored
    (64, 8, 8, 128, False, 0.0),  # two head blocks, the last past the input's end
    (28, 4, 4, 128, False, 0.0),  # Qwen2.5-7B: 36 heads, padded to 40 for the TMA copy
    pytest.param(8, 4, 4, 256, True, 1.0, marks=_SLOW),  # Gemma 3: head_dim 256
    pytest.param(4, 2, 2, 64, True, 1.0, marks=_SLOW)])
def test_qk_norm_rope_is_the_formula_and_keeps_rows(nq, nk, nv, d, norm, offset):
    from pallas_kernels.qk_rope import qk_norm_rope as triton_qk_norm_rope
    from pallas_kernels.qk_rope import qk_norm_rope_reference

    m = 3
    qkv, qw, kw, cos, sin = _qk_inputs(m, nq + nk + nv, d, norm)
    kw_args = dict(num_q=nq, num_k=nk, offset=offset)
    got = qk_norm_rope(qkv, qw, kw, cos, sin, interpret=True, **kw_args)
    assert got.shape == (m, nq + nk, d) and got.dtype == qkv.dtype
    want = qk_norm_rope_reference(qkv, qw, kw, cos, sin, **kw_args)
    np.testing.assert_allclose(_f32(got), _f32(want), rtol=1e-2, atol=1e-2)
    # This lowering's own arithmetic (R11: the sum of squares as two half-row sums, the
    # rotation's products and adds as its compiler contracts them): a few elements differ
    # from the Triton kernel's in the last place, the rest agree.
    tri = triton_qk_norm_rope(qkv, qw, kw, cos, sin, interpret=True, **kw_args)
    assert np.mean(_f32(got) == _f32(tri)) > 0.99
    for i in range(m):  # a row alone is that row among the others
        alone = qk_norm_rope(qkv[i:i + 1], qw, kw, cos[i:i + 1], sin[i:i + 1],
                             interpret=True, **kw_args)
        assert np.array_equal(np.asarray(alone[0]).view(np.uint16),
                              np.asarray(got[i]).view(np.uint16)), i


def test_rope_and_bad_head_sizes():
    from pallas_kernels.rope import rope_reference

    x, _, _, cos, sin = _qk_inputs(2, 8, 128, False)
    np.testing.assert_allclose(_f32(rope(x, cos, sin, interpret=True)),
                               _f32(rope_reference(x, cos, sin)), rtol=1e-2, atol=1e-2)
    ops = get_ops("pallas", True, "mosaic")
    for heads, d in ((4, 12), (12, 8)):  # halves of 6, 4: the Triton kernels take them
        odd, _, _, c, s = _qk_inputs(2, heads, d, False)
        with pytest.raises(ValueError, match="head_dim with halves of 8-256"):
            rope(odd, c, s, interpret=True)
        np.testing.assert_array_equal(_f32(ops.rope(odd, c, s)),  # the ops fall back
                                      _f32(get_ops("pallas", True, "triton").rope(odd, c, s)))


@pytest.mark.parametrize("m,nq,nk,d", [(1, 32, 8, 128), (17, 32, 4, 128), (2, 8, 4, 256),
                                        (1, 28, 4, 128)])
def test_qk_norm_rope_lowers_for_cuda(m, nq, nk, d):
    # Qwen3-8B, Qwen3-30B-A3B (36 q and k heads: the output's heads rounded up to 40),
    # Gemma-3-4B (12: to 16), Qwen2.5-7B (36 input heads padded to 40)
    qkv = jax.ShapeDtypeStruct((m, nq + 2 * nk, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((d,), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((m, d // 2), jnp.float32)
    fn = functools.partial(qk_norm_rope, num_q=nq, num_k=nk, eps=1e-6)
    text = _lower(fn, qkv, w, w, t, t)
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 1


@pytest.mark.slow  # a device script's CPU smoke run
def test_mosaic_norms_script_smoke(tmp_path):
    import json
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, os.path.join(root, "experiments/tuning/mosaic_norms.py"), "--smoke",
           "--iters=1", "--reps=1", f"--out={tmp_path}"]
    r = run_script(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "mosaic_norms.json").read_text())
    for entry in report["widths"]:
        for k in entry["kernels"].values():
            assert k["alone_mismatch_rows"] == 0 and not any(k["prefix_mismatch_rows"].values())


@pytest.mark.slow  # ~50 s each: every kernel of a forward interpreted on Mosaic GPU or Triton
@pytest.mark.parametrize("extra", [{}, {"fuse_glu": False, "row_partials": 2}])
def test_property_p_holds_with_the_mosaic_lowering(row_by_row_wgmma, extra):
    # A tiny bf16 Qwen3 (8 q/k/v heads of 32: the Mosaic q/k norm + RoPE takes them) with
    # lowering="mosaic": one-token steps and verify blocks give the prefill's logits bits;
    # also with the unfused GLU and row-parallel partials. The interpreter's wgmma forms
    # each row alone, as the hardware does (the module docstring: numpy's own product
    # rounds a row by its place in the tile, which moved position 6's logits here).
    from jspec import parity
    from jspec.random_model import random_model

    model = random_model("tiny-qwen3", interpret=True, dtype="bfloat16")
    model = model.replace(options=model.options.replace(lowering="mosaic", **extra))
    seq = np.random.default_rng(0).integers(0, model.config.vocab_size, 12).astype(np.int32)
    ref = parity.schedule_logits(model, [seq], parity.prefill_schedule(len(seq)), 24)[0]
    for steps in (parity.serial_schedule(len(seq)),
                  parity.verify_schedule(len(seq), 3, prefix=4, seed=1)):
        got = parity.schedule_logits(model, [seq], steps, 24)[0]
        assert parity.count_mismatches(got, ref) == (0, None)
