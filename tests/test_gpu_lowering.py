"""Every Pallas kernel of the GPU path lowers to Triton IR for the H200, on a CPU.

Interpret mode (the rest of the CPU suite) runs none of the Triton lowering, so an op
that the lowering does not support (a load through two stacked `.at` views, a cache
modifier jax 0.11.2 cannot map) would only surface on the device. Here
`gpu_info.get_gpu_info` answers with the H200's entry (sm_90) and jax lowers the
jitted functions for the "cuda" platform with abstract weights: nothing is
allocated, compiled to PTX or run. Covered: the Qwen3-8B- and Gemma-3-4B-shaped
forwards (2 layers; the tuned matmul table, multi-tile schedules with 64-row tiles,
masked row tiles, split-KV attention, every speed option) at decode, verify and
prefill shapes, B = 1 and 8; the fused draft forward (`DraftOptions.fused`) of Qwen3-0.6B and
Gemma-3-4B shapes; the logsumexp and top-p kernels. Shared memory limits and register
spills are checked by the Triton compiler on the device, not here.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from conftest import slow_except
from jax._src.pallas.triton import pallas_call_registration

from jspec.cache import init_cache
from jspec.model import Model, apply
from jspec.options import DraftOptions
from jspec.random_model import preset_config, random_params
from pallas_kernels.logsumexp import logsumexp
from pallas_kernels.top_p import top_p_kept

pytestmark = pytest.mark.usefixtures("h200")  # conftest: lowered for the H200


def _lower(fn, *args) -> str:
    """StableHLO text of fn(*args) lowered for CUDA (args may be abstract)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _abstract_model(preset: str, layers: int = 2) -> Model:
    cfg = preset_config(preset, num_layers=layers)
    return Model(config=cfg, params=jax.eval_shape(lambda: random_params(cfg)))


@pytest.mark.parametrize("preset,batch,tokens", slow_except(
    [("qwen3-8b", 1, 1), ("qwen3-8b", 8, 5), ("gemma3-4b", 8, 9), ("gemma3-4b", 1, 70),
     ("gpt-oss-20b", 8, 5)],
    ["qwen3-8b", "gemma3-4b", "gpt-oss-20b"], [(1, 1), (1, 5), (8, 1), (8, 5), (8, 9), (1, 70)]))
def test_model_forward_lowers_for_the_h200(preset, batch, tokens):
    model = _abstract_model(preset)
    cache = jax.eval_shape(lambda: init_cache(model, batch, 256))
    toks = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
    text = _lower(apply, model, toks, cache)
    names = set(re.findall(r'name = "(jspec_[a-z_0-9]*)"', text))
    assert text.count("__gpu$xla.gpu.triton") >= 8
    cfg = model.config
    seq_tiles = -(-tokens * (cfg.num_heads // cfg.num_kv_heads) // 16)  # split row tiles
    tiles = batch * seq_tiles
    attention = ({"jspec_attention_serial_split"} if seq_tiles >= 32  # a prefill chunk's
                 else {"jspec_attention_fused"} if tiles <= 8  # one launch for small grids
                 else {"jspec_attention_split", "jspec_attention_combine"})
    assert attention | {"jspec_qk_norm_rope"} <= names, names
    assert names & {"jspec_matmul", "jspec_matmul_rows"}, names
    assert names & {"jspec_rmsnorm", "jspec_add_rmsnorm"}, names
    # The 64-row tiles of a multi-tile launch (wqkv and wo of Qwen3-8B) mask the rows
    # past the residual stream's 48 (B=8 x T=5 padded once to 16s): no pad to 64.
    assert "-> tensor<64x4096xbf16>" not in text


@pytest.mark.parametrize("preset,tokens,one_kernel,slots", slow_except(
    [("gemma3-4b", 2, True, 256), ("qwen3-0.6b", 1, False, 256), ("qwen3-0.6b", 1, True, 8192)],
    ["qwen3-0.6b", "gemma3-4b"], [1, 2], [True, False], [256, 8192]))
def test_fused_draft_lowers_for_the_h200(preset, tokens, one_kernel, slots):
    # DraftOptions.fused (a draft on the xla backend): five Pallas kernels a layer, the K/V cache
    # written in place by qk_rope_attention (aliased buffers), its output laid out as
    # attention rows, wo reading them in place; with rope_attention off six, the
    # cache written by qk_rope_write and q laid out for the split-KV kernel. At 8,192
    # slots the one kernel folds in two levels (4 groups of 16 partitions).
    from jspec import fused_draft

    model = _abstract_model(preset)
    model = model.replace(options=model.options.replace(backend="xla"),
                          draft_options=DraftOptions(fused=True, rope_attention=one_kernel))
    model = model.replace(params=jax.eval_shape(lambda p: fused_draft._swap(p, True),
                                                model.params))
    cache = jax.eval_shape(lambda: init_cache(model, 1, slots))
    text = _lower(apply, model, jax.ShapeDtypeStruct((1, tokens), jnp.int32), cache)
    names = set(re.findall(r'name = "(jspec_[a-z_0-9]*)"', text))
    two = {"jspec_draft_qk_rope_write", "jspec_attention_fused"}
    if slots == 8192:
        assert re.search(r"tensor<1x\d+x4x\d+x\d+xf32>", text)  # the groups' partials
    if one_kernel:
        assert {"jspec_draft_matvec", "jspec_draft_qk_rope_attention"} <= names, names
        assert not two & names, names
    else:
        assert {"jspec_draft_matvec"} | two <= names, names
    assert "jspec_matmul" not in names  # the xla backend: no invariant matmul kernels


@pytest.mark.parametrize("batch,tokens", [(1, 1), (8, 5)])
def test_kv_write_kernel_lowers_for_the_h200(batch, tokens):
    # kv_write_kernel: the q/k norm + RoPE kernel writes the new K/V into the caches
    # (scattered rows, aliased buffers): no cache update outside it.
    model = _abstract_model("qwen3-8b")
    model = model.replace(options=model.options.replace(kv_write_kernel=True))
    cache = jax.eval_shape(lambda: init_cache(model, batch, 256))
    text = _lower(apply, model, jax.ShapeDtypeStruct((batch, tokens), jnp.int32), cache)
    names = set(re.findall(r'name = "(jspec_[a-z_0-9]*)"', text))
    assert "jspec_qk_norm_rope_kv" in names and "jspec_qk_norm_rope" not in names, names
    assert "dynamic_update_slice" not in text and "stablehlo.scatter" not in text


@pytest.mark.parametrize("batch,tokens", [(1, 1), (8, 5), (8, 9)])
def test_split_row_tile_32_lowers_for_the_h200(batch, tokens):
    # attn_split_rows=32: a batch-8 verify block's 20 (gamma 4) or 36 (gamma 8) rows of a
    # kv head in one or two 32-row tiles instead of two or three 16-row ones.
    model = _abstract_model("qwen3-8b")
    model = model.replace(options=model.options.replace(attn_split_rows=32))
    cache = jax.eval_shape(lambda: init_cache(model, batch, 256))
    text = _lower(apply, model, jax.ShapeDtypeStruct((batch, tokens), jnp.int32), cache)
    assert "jspec_attention_split" in text or "jspec_attention_fused" in text
    # f32 partials [B, Hkv, partitions (256 keys / 128), rows padded to 32s, head_dim]
    rows = -(-tokens * 4 // 32) * 32  # 4 query heads per kv head
    assert f"tensor<{batch}x8x2x{rows}x128xf32>" in text


@pytest.mark.parametrize("preset,backend,batch,tokens", [
    ("qwen3-8b", "pallas", 1, 1), ("qwen3-8b", "pallas", 8, 5), ("gemma3-4b", "pallas", 1, 5),
    ("qwen3-0.6b", "xla", 1, 1), ("qwen3-0.6b", "xla", 1, 2)])
def test_fused_fold_attention_lowers_for_the_h200(preset, backend, batch, tokens):
    # attn_fused_fold: split-KV in one launch (atomic counter, volatile loads of the
    # partials); on the xla backend through xla_pallas_attention (the draft's path).
    model = _abstract_model(preset)
    model = model.replace(options=model.options.replace(backend=backend, attn_fused_fold=True),
                          draft_options=DraftOptions(xla_pallas_attention=backend == "xla"))
    cache = jax.eval_shape(lambda: init_cache(model, batch, 256))
    text = _lower(apply, model, jax.ShapeDtypeStruct((batch, tokens), jnp.int32), cache)
    assert 'name = "jspec_attention_fused"' in text
    assert "jspec_attention_split" not in text and "jspec_attention_combine" not in text


@pytest.mark.parametrize("batch,tokens,kernels", [
    (1, 1, {"jspec_attention_fused"}),
    (8, 5, {"jspec_attention_split", "jspec_attention_group_fold", "jspec_attention_combine"})])
def test_two_level_fold_lowers_for_the_h200(batch, tokens, kernels):
    # An 8,192-slot cache: 64 partitions of 128 keys, folded in 4 groups of 16 (the
    # group counters and buffers of the one launch; the group-fold kernel of the two,
    # which batch 8 x 5 tokens would leave for a program per group by default).
    from pallas_kernels.attention import attention

    q = jax.ShapeDtypeStruct((batch, tokens, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, 8, 8192, 128), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
    text = _lower(functools.partial(attention, scale=1.0, group_split=False), q, kv, kv, pos,
                  jnp.int32(0))
    assert kernels <= set(re.findall(r'name = "(jspec_[a-z_0-9]*)"', text))
    assert f"tensor<{batch}x8x4x" in text  # the groups' partials


def test_serial_split_lowers_for_the_h200():
    # A 2,048-token prefill chunk's split-KV without partials in memory (programs of two
    # 16-row tiles over 64 partitions in 4 fold groups).
    from pallas_kernels.attention import attention

    q = jax.ShapeDtypeStruct((1, 2048, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 8, 8192, 128), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((1, 2048), jnp.int32)
    text = _lower(functools.partial(attention, scale=1.0, serial_split=True), q, kv, kv, pos,
                  jnp.int32(0))
    assert 'name = "jspec_attention_serial_split"' in text
    assert "jspec_attention_split" not in text.replace("jspec_attention_serial_split", "")


@pytest.mark.parametrize("tokens", [1, 5])
def test_group_split_lowers_for_the_h200(tokens):
    # A decode step and a verify block at 131,072 keys: a program per (row tile, fold
    # group), 64 groups of 16 partitions, then the fold over groups; no partition partial.
    from pallas_kernels.attention import attention

    q = jax.ShapeDtypeStruct((1, tokens, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 8, 131072, 128), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    text = _lower(functools.partial(attention, scale=1.0, group_split=True), q, kv, kv, pos,
                  jnp.int32(0))
    names = set(re.findall(r'name = "(jspec_attention[a-z_]*)"', text))
    assert names == {"jspec_attention_group_split", "jspec_attention_combine"}, names
    assert "tensor<1x8x64x" in text  # the groups' partials
    assert "tensor<1x8x1024x" not in text  # no partition's


@pytest.mark.parametrize("batch,tokens,heads,keys,path", [
    (1, 2048, 32, 4096, "serial"),  # a prefill chunk: 8,192 rows a kv head, 512 row tiles
    (1, 128, 32, 4096, "serial"),  # 512 rows: 32 tiles, the threshold
    (1, 64, 32, 4096, "group"),  # 256 rows: 16 tiles x 8 kv heads x 2 groups = 256
    (1, 33, 64, 4096, "group"),  # a chain's verify, 8 heads a kv head: 17 tiles
    (64, 5, 32, 4096, "group"),  # batch 64 x 5 tokens: 128 tiles in all, 2 a sequence
    (1, 5, 32, 4096, "fused"),  # 2 tiles x 8 kv heads x 2 groups: too few group programs
    (1, 1, 32, 32768, "fused"),  # 8 x 16 = 128 group programs; 8 tiles: one launch
    (1, 1, 32, 131072, "group"),  # 8 x 64 = 512
    (32, 5, 32, 1024, "two"),  # one fold group (8 partitions)
])
def test_the_gpu_default_picks_the_split_path_by_shape(batch, tokens, heads, keys, path):
    # `serial_split_tiles` counts one sequence's row tiles a kv head, never the batch's:
    # prefill chunks keep no partials in memory. Past one fold group, calls of at least
    # `group_split_programs` (row tile, kv head, group) programs run a program per group;
    # others the two kernels, or the one launch for at most 8 row tiles. The same bits
    # every way (the device's proof).
    from pallas_kernels.attention import attention

    q = jax.ShapeDtypeStruct((batch, tokens, heads, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, 8, keys, 128), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
    text = _lower(functools.partial(attention, scale=1.0), q, kv, kv, pos, jnp.int32(0))
    names = set(re.findall(r'name = "(jspec_attention[a-z_]*)"', text))
    two = {"jspec_attention_split", "jspec_attention_combine"}
    want = {"serial": {"jspec_attention_serial_split"},
            "group": {"jspec_attention_group_split", "jspec_attention_combine"},
            "two": two | ({"jspec_attention_group_fold"} if keys > 2048 else set()),
            "fused": {"jspec_attention_fused"}}[path]
    assert names == want, names


@pytest.mark.parametrize("tokens,fused,kernel", [
    (1, True, "jspec_attention_fused"), (2048, False, "jspec_attention_split")])
def test_skip_empty_lowers_for_the_h200(tokens, fused, kernel):
    # split-KV writing no partial for a partition its row tile cannot see: a decode step
    # (one launch, two-level fold over 64 partitions) and a prefill chunk (two kernels).
    from pallas_kernels.attention import attention

    q = jax.ShapeDtypeStruct((1, tokens, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 8, 8192, 128), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    fn = functools.partial(attention, scale=1.0, fused_fold=fused, serial_split=False,
                           skip_empty=True, group_split=False)
    text = _lower(fn, q, kv, kv, pos, jnp.int32(0))
    assert f'name = "{kernel}"' in text


def test_top_p_lowers_for_the_h200():
    x = jax.ShapeDtypeStruct((8, 151936), jnp.float32)
    text = _lower(functools.partial(top_p_kept, top_p=0.9, interpret=False), x)
    assert 'name = "jspec_top_p"' in text or "jspec_top_p" in text


def test_logsumexp_lowers_for_the_h200():
    x = jax.ShapeDtypeStruct((8, 151936), jnp.float32)
    assert "triton" in _lower(functools.partial(logsumexp, interpret=False), x)


@pytest.mark.parametrize("preset,batch,nodes", slow_except(
    [("qwen3-8b", 1, 64), ("gemma3-4b", 8, 32)],
    ["qwen3-8b", "gemma3-4b"], [(1, 16), (1, 64), (8, 32)]))
def test_tree_verify_lowers_for_the_h200(preset, batch, nodes):
    """A tree verify (rule R7) lowers with the tree attention kernel, packed (the prefix's
    blocks plain loads, the tail's gathered token by token in a loop) and one token a
    tile (every key block one straight-line gather by cache slot: no branch between
    loads, which Triton's dominance check rejected)."""
    from jspec.tree import from_parents

    model = _abstract_model(preset)
    cache = jax.eval_shape(lambda: init_cache(model, batch, 256))
    parents = jnp.asarray([[-1] + [(t - 1) // 2 for t in range(1, nodes)]] * batch, jnp.int32)

    def verify(model, toks, cache, parents):
        tree = from_parents(parents, cache.lengths, 8)
        return apply(model, toks, cache, tree=tree)

    toks = jax.ShapeDtypeStruct((batch, nodes), jnp.int32)
    text = _lower(verify, model, toks, cache, parents)
    names = set(re.findall(r'name = "(jspec_[a-z_0-9]*)"', text))
    assert names & {"jspec_tree_attention", "jspec_tree_attention_split"}, names
    from pallas_kernels.tree_attention import tree_attention

    cfg = model.config
    q = jax.ShapeDtypeStruct((batch, nodes, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, cfg.num_kv_heads, 256, cfg.head_dim), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((batch, nodes), jnp.int32)
    path = jax.ShapeDtypeStruct((batch, nodes, 9), jnp.int32)
    root = jax.ShapeDtypeStruct((batch,), jnp.int32)
    one = functools.partial(tree_attention, scale=1.0, pack=False)
    assert "jspec_tree_attention" in _lower(one, q, kv, kv, pos, jnp.int32(0), root, path)


def _triton_modules(monkeypatch, fn, *args) -> list[str]:
    """The Triton IR (as Pallas emits it, before Triton's passes) of each kernel of fn."""
    from jax._src.pallas.triton import lowering

    out = []
    lower = lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        result = lower(*a, **k)
        out.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    monkeypatch.setattr(pallas_call_registration.lowering, "lower_jaxpr_to_triton_module",
                        capture)
    _lower(fn, *args)
    return out


@pytest.mark.parametrize("glu,rows", [(False, 1), (False, 40), (True, 1), (True, 40)])
def test_each_k_step_is_a_dot_from_zero_added_once_to_the_running_sum(monkeypatch, glu, rows):
    # Why bk is a scheduling field on the GPU (matmul.SCHEDULE_FIELDS): every dot of the
    # K loop starts from a zero accumulator and its one use is the addition to the
    # loop-carried sum, the form Triton's combine pass folds into dot(a, b, sum). A kernel
    # that used a block's dot twice, or added it elsewhere, would make bk set bits again.
    from pallas_kernels.matmul import MatmulConfig, matmul
    from pallas_kernels.matmul_glu import matmul_glu

    cfg = MatmulConfig(bm=16, bn=64, bk=128, num_warps=4, num_stages=3)
    x = jax.ShapeDtypeStruct((rows, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
    if glu:
        def fn(x, w):
            return matmul_glu(x, w, activation="silu", config=cfg, row_group=4)
    else:
        def fn(x, w):
            return matmul(x, w, out_dtype=jnp.bfloat16, config=cfg, row_group=4)
    (ir,) = _triton_modules(monkeypatch, fn, x, w)
    _check_k_loops(ir, loops=2 if glu else 1, dots=3 if rows == 40 else 1)


def test_split_k_row_groups_lower_with_the_same_k_steps(monkeypatch):
    # A split config's partials of 3 row tiles a program (40 rows, row_group 4): each
    # chunk's K loop feeds one weight block to 3 dots of the same form, then the combine.
    from pallas_kernels.matmul import MatmulConfig, matmul

    cfg = MatmulConfig(bm=16, bn=64, bk=128, num_warps=4, num_stages=3, split_k=2)
    x = jax.ShapeDtypeStruct((40, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
    partials, combine = _triton_modules(monkeypatch, functools.partial(
        matmul, out_dtype=jnp.bfloat16, config=cfg, row_group=4), x, w)
    _check_k_loops(partials, loops=1, dots=3)
    assert "tt.dot" not in combine


def test_the_grouped_expert_kernels_k_steps_have_the_same_form(monkeypatch):
    # The mixture-of-experts kernels walk K with the same loop (R9): a schedule may one day
    # set their K tile on the same grounds.
    from pallas_kernels.matmul import MatmulConfig
    from pallas_kernels.moe import grouped_matmul

    cfg = MatmulConfig(bm=16, bn=64, bk=128, num_warps=4, num_stages=3)
    x = jax.ShapeDtypeStruct((5, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, 512, 256), jnp.bfloat16)
    expert = jax.ShapeDtypeStruct((5,), jnp.int32)
    irs = _triton_modules(monkeypatch, lambda x, w, e: grouped_matmul(
        x, w, e, out_dtype=jnp.bfloat16, config=cfg), x, w, expert)
    kernels = [ir for ir in irs if "tt.dot" in ir]
    assert len(kernels) == 1
    _check_k_loops(kernels[0], loops=1, dots=1)


@pytest.mark.parametrize("glu,prmt,prefetch", [
    (False, False, None), (True, False, None), (False, True, None), (True, True, None),
    (False, True, 3), (True, False, 2)])
def test_packed_expert_dots_see_no_narrow_load_or_join(monkeypatch, glu, prmt, prefetch):
    # Triton lays a dot's operands out in registers (MMAv2's kWidth) by the narrowest load
    # it finds walking back from them through elementwise ops, views, broadcasts and
    # loads, halved if a join is on the way (AccelerateMatmul's computeOrigBitWidth). A
    # dot whose weight was decoded straight from uint8 codes took kWidth 8 where the
    # float kernel's take 2: other K values share each MMA instruction and the bits
    # differ (on an H100, 1,008 of 1,024 positions off the dequantized model). The packed
    # K loop hands the decode loop-carried codes and scales (block arguments end the
    # walk) and decodes without a join: the walk meets only the 16-bit activations. The
    # same with the decode in inline PTX (`mxfp4_prmt`): the asm op is elementwise, so the
    # walk would pass through it to a uint8 load as well. And with blocks loaded
    # `mxfp4_prefetch` steps ahead: a queue of carried blocks, one slot a step of a body
    # of that many K steps, each step's dot added to the running sum (the combine pass's
    # fold, so bk stays scheduling), the last nk % d steps after the loop (their operands
    # come from the loop's results, where the walk ends as well).
    from pallas_kernels import mxfp4
    from pallas_kernels.matmul import MatmulConfig
    from pallas_kernels.moe import PRMT_PREFETCH, grouped_matmul, grouped_matmul_glu

    cfg = MatmulConfig(bm=16, bn=64, bk=128, num_warps=4, num_stages=3)
    x = jax.ShapeDtypeStruct((5, 512), jnp.bfloat16)
    codes = jax.ShapeDtypeStruct((4, 256, 256), jnp.uint8)
    scales = jax.ShapeDtypeStruct((4, 512 // mxfp4.GROUP, 256), jnp.uint8)
    expert = jax.ShapeDtypeStruct((5,), jnp.int32)
    if glu:
        def fn(x, c, e, s):
            return grouped_matmul_glu(x, c, e, activation="silu", config=cfg, scales=s,
                                      mxfp4_prmt=prmt, mxfp4_prefetch=prefetch)
    else:
        def fn(x, c, e, s):
            return grouped_matmul(x, c, e, out_dtype=jnp.bfloat16, config=cfg, scales=s,
                                  mxfp4_prmt=prmt, mxfp4_prefetch=prefetch)
    (ir,) = [ir for ir in _triton_modules(monkeypatch, fn, x, codes, expert, scales)
             if "tt.dot" in ir]
    found = _dot_inputs(ir)
    # K = 512 in blocks of 128: 4 steps, 4 % 3 = 1 after the loop; the PTX decode loads 4
    # blocks ahead by default
    depth = prefetch or (PRMT_PREFETCH if prmt else 1)
    loops = 2 if glu else 1  # (those take the loop's results: the walk ends there too)
    assert len(found) == loops * depth
    assert ir.count("tt.dot") == loops * (depth + 4 % depth)
    _check_k_loops(ir, loops=loops, dots=depth, chained=True)
    for ops, loads in found:
        assert "tt.join" not in ops
        assert loads == {"bf16"}, loads
        # Each row's byte and scale are gathered, so the decode is elementwise (no reshape:
        # a [bk / 2, bn] -> [bk, bn] expansion moved the operands through shared memory
        # every step), and empty slots read x's zero row (the one select: the decode's;
        # none where the table decodes, in one asm op).
        assert "tt.reshape" not in ops, ops
        assert ops.count("arith.select") == (0 if prmt else 1), ops
        assert ops.count("tt.elementwise_inline_asm") == (1 if prmt else 0), ops


@pytest.mark.parametrize("preset,batch,tokens,packed", [
    ("qwen3-8b", 8, 5, False), ("qwen3-30b-a3b", 1, 5, False), ("gpt-oss-120b", 1, 5, True),
    pytest.param("gpt-oss-120b", 1, 5, "int", marks=pytest.mark.slow)])  # the kernels' case
def test_no_dot_sees_a_narrow_load_or_a_join(monkeypatch, preset, batch, tokens, packed):
    # The rule the packed kernels were fixed for, over a whole forward's kernels: each
    # dot's operands keep the layout of their own 16- or 32-bit type (a kernel that
    # loaded int8 or bool data, or joined tensors, on the way to a dot would lay its MMA
    # operands out otherwise, and its bits could differ from a kernel claimed equal).
    cfg = preset_config(preset, num_layers=1)
    model = Model(config=cfg, params=jax.eval_shape(lambda: random_params(cfg, 0,
                                                                          bool(packed))))
    if packed == "int":  # the integer decode (the default: the PTX one, 4 blocks ahead)
        model = model.replace(options=model.options.replace(mxfp4_prmt=False))
    cache = jax.eval_shape(lambda: init_cache(model, batch, 256))
    irs = _triton_modules(monkeypatch, apply, model,
                          jax.ShapeDtypeStruct((batch, tokens), jnp.int32), cache)
    found = [f for ir in irs for f in _dot_inputs(ir)]
    assert len(found) >= 4
    if packed:  # gate, up, down: a K loop each, a dot a step of a 4-step body
        from pallas_kernels.moe import PRMT_PREFETCH

        asm = sum("tt.elementwise_inline_asm" in ops for ops, _ in found)
        assert asm == (0 if packed == "int" else 3 * PRMT_PREFETCH), asm
    for ops, loads in found:
        assert "tt.join" not in ops
        assert not loads & {"i1", "i8", "ui8"}, loads


def _dot_inputs(ir: str) -> list[tuple[list[str], set[str]]]:
    """For each tt.dot in a kernel's Triton IR: the ops on the way to its operands and the
    element types those ops load, walking back through the loop body (or the kernel) it
    sits in; loop-carried values and values from outside end the walk, as they end
    Triton's (AccelerateMatmul's computeOrigBitWidth, which sets the operands' kWidth)."""
    # Value names restart in each loop's region: walk each body on its own.
    bodies = [part.split("scf.yield")[0] for part in ir.split("scf.for ")[1:]]
    bodies = [b for b in bodies if "tt.dot" in b] or [ir]
    found = []
    for body in bodies:
        defs = {}  # value -> (op, operands, line) inside the body
        for m in re.finditer(r"^\s*(%\w+)(?::\d+)? = ([\w.]+)(.*)$", body, re.M):
            defs[m.group(1)] = (m.group(2), re.findall(r"%\w+", m.group(3)), m.group(3))
        for dot in re.findall(r"= tt\.dot (%\w+), (%\w+), ", body):
            seen, todo, ops, loads = set(), list(dot), [], set()
            while todo:
                v = todo.pop()
                if v in seen or v not in defs:
                    continue
                seen.add(v)
                op, operands, rest = defs[v]
                ops.append(op)
                if op == "tt.load":
                    loads |= set(re.findall(r"!tt\.ptr<(\w+)>", rest)[-1:])
                todo += operands
            found.append((ops, loads))
    return found


def _check_k_loops(ir: str, loops: int, dots: int, chained: bool = False) -> None:
    """Each of the `loops` K loops of a kernel's IR has `dots` dots, each from a zero
    accumulator, used once, by the addition to one of the loop's carried sums (chained:
    or to the sum an earlier step of the same body left: a body of several K steps)."""
    # Value names restart in each loop's region: check each K loop's body on its own.
    bodies = [part.split("scf.yield")[0] for part in ir.split("scf.for ")[1:]]
    bodies = [b for b in bodies if "tt.dot" in b]
    assert len(bodies) == loops  # the GLU kernel: the gate's loop, the up's
    for body in bodies:
        carried = {a.split("=")[0].strip()
                   for a in re.search(r"iter_args\(([^)]*)\)", body).group(1).split(",")}
        zero = {v for v, c in re.findall(r"(%\w+) = tt\.splat %(\w+) ", body)
                if re.search(rf"%{c} = arith\.constant 0\.000000e\+00 : f32", body)}
        found = re.findall(r"(%\w+) = tt\.dot %\w+, %\w+, (%\w+) ", body)
        assert len(found) == dots  # row groups: a dot a row tile
        for res, acc in found:
            assert acc in zero, f"{res}'s dot does not start from zero"
            uses = re.findall(rf"{re.escape(res)}\b(?! =)", body)
            assert len(uses) == 1, f"{res} is used {len(uses)} times"
            (add,) = re.findall(rf"= arith\.addf (%\w+), {re.escape(res)} ", body)
            sums = carried | (set(re.findall(r"(%\w+) = arith\.addf ", body)) if chained
                              else set())
            assert add in sums, f"{res} is added to {add}, not to the loop's running sum"


@pytest.mark.parametrize("glu", [False, True])
def test_a_prefill_launch_lowers_with_the_prefill_tile(monkeypatch, glu):
    # More than PREFILL_ROWS rows on the GPU: the Qwen3-8B weights' prefill entries or
    # prefill_rule (128-row tiles, K steps of 64), where a decode step keeps the table
    # config (w_down: K steps of 512).
    from pallas_kernels.matmul import PREFILL_ROWS, matmul
    from pallas_kernels.matmul_glu import matmul_glu

    K, N = (4096, 24576) if glu else (12288, 4096)
    w = jax.ShapeDtypeStruct((K, N), jnp.bfloat16)

    def fn(x, w):
        if glu:
            return matmul_glu(x, w, activation="silu", row_group=4, schedule=True)
        return matmul(x, w, out_dtype=jnp.bfloat16, row_group=4, schedule=True)

    for m, tile in [(PREFILL_ROWS + 1, "64xbf16>"), (1, "x512xbf16>" if not glu else None)]:
        (ir,) = _triton_modules(monkeypatch, fn, jax.ShapeDtypeStruct((m, K), jnp.bfloat16),
                                w)
        dots = re.findall(r"tt\.dot %\w+, %\w+, %\w+ : (tensor<\w+>) \*", ir)
        assert dots, "no dot in the kernel"
        if tile:
            assert all(d.endswith(tile) for d in dots), (m, dots)


@pytest.mark.parametrize("lowering,batch,tokens", [
    ("triton", 1, 1), ("triton", 8, 5), pytest.param("mosaic", 1, 5, marks=pytest.mark.slow)])
def test_mxfp4_packed_experts_lower_for_the_h200(lowering, batch, tokens):
    """gpt-oss-120b with its experts MXFP4-packed (`jspec.mxfp4`): the routed experts'
    dequantization (plain XLA integer and exact float ops) and the grouped kernels lower
    for CUDA on both lowerings."""
    from jspec import mxfp4

    cfg = preset_config("gpt-oss-120b", num_layers=2)
    model = Model(config=cfg, params=jax.eval_shape(lambda: random_params(cfg, 0, True)))
    model = model.replace(options=model.options.replace(lowering=lowering))
    assert mxfp4.is_packed(model.params["layers"][0], "w_gate_up")
    cache = jax.eval_shape(lambda: init_cache(model, batch, 256))
    text = _lower(apply, model, jax.ShapeDtypeStruct((batch, tokens), jnp.int32), cache)
    if lowering == "triton":
        names = set(re.findall(r'name = "(jspec_[a-z_0-9]*)"', text))
        assert {"jspec_grouped_matmul_glu", "jspec_grouped_matmul"} <= names, names
    else:
        assert "__gpu$xla.gpu.triton" not in text and text.count("custom_call @mosaic_gpu") >= 7
