"""How a model's forward runs: its kernel choices and, for a draft, its latency choices.

`ModelConfig` says what the checkpoint is; these say how jspec computes it.

- `KernelOptions`: the backend and the speed options of the forward pass. The fusions
  and scheduling options give the same logits, bit for bit, as the plain path with
  them off (each has its test); `attn_split` and `attn_split_rows` are numeric: every
  value keeps property P, but two values may round differently, so one model keeps
  one value.
- `DraftOptions`: latency choices for a model that only drafts. None of them is
  row-invariant and none needs to be: a draft's numerics change what is proposed,
  never what is emitted (the target's verify decides every token).

Both are frozen, hashable dataclasses that live in the static part of `Model`.
`jspec.with_options(model, KernelOptions(...), DraftOptions(...), field=value)`
applies them. The measurements behind each default are in docs/tuning.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jspec._checks import is_int

BACKENDS = ("xla", "pallas")
LOWERINGS = ("triton", "mosaic")


def _power_of_two(name: str, value: int, least: int = 1) -> None:
    if not is_int(value) or value < least or value & (value - 1):
        raise ValueError(f"{name}={value!r} must be a power of two >= {least}")


def _ints(options, names: tuple[str, ...]) -> None:
    """A numpy integer given for one of `names` is kept as the Python int it equals (the
    options are static, hashed config); bools stay as given, for the checks to refuse."""
    for name in names:
        value = getattr(options, name)
        if isinstance(value, np.integer):
            object.__setattr__(options, name, int(value))


def _bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be a bool")


def default_interpret() -> bool:
    """Pallas kernels run in interpret mode where there is no GPU."""
    import jax

    return jax.default_backend() == "cpu"


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Kernel choices of a forward pass (the static part of `Model`).

    Attributes:
      backend: "pallas" (the invariant kernels) or "xla" (plain jnp, the baseline).
      interpret: run Pallas kernels in interpret mode (the CPU has no Pallas lowering).
      fuse_add_norm: each residual add and the RMSNorm after it as one op (not with
        Gemma's sandwich norms).
      pad_rows_once: pallas: pad the residual stream's rows once per forward to a
        multiple of 16, so no pad or slice sits between the kernels.
      fuse_qk_rope: pallas: the q/k norms and RoPE of q and k in one kernel.
      fuse_glu: pallas: the gate/up projection and the GLU in one kernel.
      attn_split: pallas: split-KV attention's keys per partition (a multiple of the
        key block: 16 in interpret mode, 64 on a GPU); 0: one pass; None: the kernel's
        own (128 on a GPU, one pass in interpret mode). Numeric: each value gives its
        own bits.
      attn_split_rows: pallas: split-KV attention's row tile (a power of two >= 16);
        None: the kernel's own (16). Numeric, like attn_split.
      attn_fused_fold: pallas: split-KV attention folds its partials in the same launch
        (True), in a second kernel (False), or by the call's row tiles (None).
      attn_serial_split: pallas: split-KV attention keeps its partials in registers,
        programs of two row tiles walking every partition in order and sharing K/V
        loads (True; for prefill chunks), or writes them for a fold (False), or by the
        call's row tiles (None: the kernel's rule: on a GPU, calls with 32 or more
        row tiles a sequence and kv head, i.e. prefill chunks; never in interpret mode).
        The same partials and fold order, so the same bits (docs/tuning.md).
      attn_skip_empty: pallas: split-KV writes no partial for a partition a row tile
        cannot see (True), or writes the empty state there (False or None: the default
        until the device has shown it). The fold reads only the partitions a tile sees,
        so the same bits; a cache larger than its context costs no partial writes.
      attn_group_split: pallas: past one fold group of split-KV partitions, a program
        per (row tile, group) computes its partitions' partials in turn and folds them
        in registers, writing only the group's (True), or every partition's partial
        is written and folded (False), or by the call's group programs (None: the
        kernel's rule, `AttentionConfig.group_split_programs`). The same partials and
        fold order, so the same bits (docs/tuning.md).
      moe_layout_kernel: pallas: a mixture of experts' blocks of up to 16 routed slots
        (k per token) lay their rows out by expert in one kernel
        (`tile_layout_kernel`) instead of ~7 small XLA ops (True), or in those ops
        (False or None: the default until its source loop is proven on a GPU).
        Integer arithmetic: the same layout, so the same bits. Needs fuse_glu.
      moe_combine_kernel: pallas: a mixture of experts' combine (each token's k expert
        outputs weighted and added left to right in f32) in one kernel reading the
        outputs in their slots (`combine_kernel`: the gather back, products, sum, cast
        and padding in one launch) (True), or in XLA ops (False or None: the default;
        slower than the XLA ops for verify blocks, docs/tuning.md). Numeric: the
        kernel's products and adds are its own, so its bits may differ from the XLA
        combine's; row-invariant either way. Needs fuse_glu (its slots are the fused
        expert MLP's).
      mxfp4_kernel: pallas, Triton lowering: MXFP4-packed experts (`mxfp4_experts=True`)
        are decoded inside the grouped kernels' K loop, block by block, with the float
        weight's tiles (True or None: the default; a step reads 4.25 bits a routed
        weight, no dequantized copy), or each routed slot's expert is dequantized before
        the kernels (False; always on "mosaic", whose grouped kernels take float weights
        and whose bits, R11, are not Triton's). Exact integer decoding either way: the
        same bits (docs/tuning.md).
      mxfp4_prmt: with `mxfp4_kernel` on, bf16 activations, on a GPU: each block's codes
        are decoded by a byte-permute table in inline PTX (`mxfp4.decode_rows_prmt`: ~5
        instructions a weight where the integer decode takes ~15; 406-419 against 603-612
        SASS instructions a K step of gpt-oss-120b's kernels) (True or None: the
        default), or by the integer ops (False). Exact either way: the same values, so
        the same bits (interpret mode, which has no PTX, decodes with the integer ops).
      mxfp4_prefetch: with `mxfp4_kernel` on: d (1-8): the packed kernels' K loop loads
        each block's codes and scales d steps before their decode
        (`pallas_kernels.moe._packed_k_loop`: the loads reach the decode as loop-carried
        values, which Triton's pipeliner does not stage); None: 4 where the PTX decode
        runs (`moe.PRMT_PREFETCH`), else one step ahead in the loop's own form (the
        integer decode spills at 4). Scheduling only: the same dots in the same order,
        the same bits.
      matmul_row_group: pallas: up to this many row tiles per matmul program, each
        weight block loaded once for all of them (scheduling only).
      matmul_schedule: pallas: launches of several row tiles use the weight's tuned
        multi-tile schedule, verify blocks of more than 64 rows its tall one and prefill
        chunks of more than 1,024 rows a compute-bound tile (scheduling only on the GPU,
        the K tile included: `pallas_kernels.matmul.SCHEDULE_FIELDS`).
      kv_dus: a batch-1 call writes its new K/V with one dynamic_update_slice per
        buffer, not a vmapped one (the same cache bits).
      kv_write_kernel: pallas, Triton lowering, with fuse_qk_rope: the q/k norm + RoPE
        kernel also writes the new K and V into the caches (`qk_norm_rope_kv`: one launch
        instead of that kernel and two cache updates) (True), or XLA writes them (False
        or None: the default; why: docs/tuning.md). A copy: the same cache bits.
      lowering: pallas: how the matmul family (`matmul`, `matmul_glu`), the norms
        (`rmsnorm`, the residual add + norm), RoPE with the q/k norms and attention
        (split-KV steps, verify blocks and trees) are lowered for the GPU: "triton"
        (pallas_kernels/*.py) or "mosaic" (Mosaic GPU: wgmma and TMA,
        pallas_kernels/mosaic/; a forward then runs no Triton kernel). Attention goes
        to Mosaic GPU where it takes the model's head size, dtype and split
        (`pallas_kernels.mosaic.attention.takes`; its 64-row tiles ignore the
        attn_split_rows / fused-fold / serial-split / skip-empty / group-split
        options); a mixture of experts' grouped kernels where the weights are 16-bit
        and the expert width a multiple of 64, and routing over up to 256 experts (the
        layout and combine kernel options do not apply); the unfused GLU, `row_partials`
        > 1, tensor-parallel shards and top-p too. Numeric (rule R11): each lowering
        gives its own bits, each row-invariant.
      row_partials: S > 1 computes the row-parallel weights (wo, a dense MLP's w_down;
        S must divide their K) as S f32 partials over equal K chunks, added left to
        right: the same bits at every tensor-parallel degree dividing S (one device
        included); 1: one K loop. An expert's w_down keeps one K loop (R9).
        Numeric: each S gives its own bits.
      prefill_chunk: a prompt is prefilled in chunks of this many tokens (the last one
        shorter), with no LM head (`jspec.generate.prefill`): memory, not numerics;
        every chunk size gives the same bits (property P).
    """

    backend: str = "pallas"
    interpret: bool = False
    fuse_add_norm: bool = True
    pad_rows_once: bool = True
    fuse_qk_rope: bool = True
    fuse_glu: bool = True
    attn_split: int | None = None
    attn_split_rows: int | None = None
    attn_fused_fold: bool | None = None
    attn_serial_split: bool | None = None
    attn_skip_empty: bool | None = None
    attn_group_split: bool | None = None
    moe_layout_kernel: bool | None = None
    moe_combine_kernel: bool | None = None
    mxfp4_kernel: bool | None = None
    mxfp4_prmt: bool | None = None
    mxfp4_prefetch: int | None = None
    matmul_row_group: int = 4
    matmul_schedule: bool = True
    kv_dus: bool = True
    kv_write_kernel: bool | None = None
    row_partials: int = 1
    lowering: str = "triton"
    prefill_chunk: int = 2048

    def __post_init__(self):
        _ints(self, ("matmul_row_group", "row_partials", "prefill_chunk", "attn_split",
                     "attn_split_rows", "mxfp4_prefetch"))
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}; expected one of {BACKENDS}")
        if self.lowering not in LOWERINGS:
            raise ValueError(f"lowering={self.lowering!r}; expected one of {LOWERINGS}")
        for name in ("interpret", "matmul_schedule", "kv_dus") + FUSIONS:
            _bool(name, getattr(self, name))
        for name in ("attn_fused_fold", "attn_serial_split", "attn_skip_empty",
                     "attn_group_split",
                     "moe_layout_kernel", "moe_combine_kernel", "kv_write_kernel",
                     "mxfp4_kernel", "mxfp4_prmt"):
            if getattr(self, name) is not None:
                _bool(name, getattr(self, name))
        if self.mxfp4_prmt and self.mxfp4_kernel is False:
            raise ValueError("mxfp4_prmt=True decodes inside the grouped kernels: it needs "
                             "mxfp4_kernel on (True or None)")
        if self.mxfp4_prefetch is not None:
            depth = self.mxfp4_prefetch
            if not is_int(depth) or not 1 <= depth <= 8:
                raise ValueError(f"mxfp4_prefetch={depth!r} must be None or an int in [1, 8] "
                                 "(blocks the packed K loop loads ahead)")
            if self.mxfp4_kernel is False:
                raise ValueError("mxfp4_prefetch schedules the grouped kernels' packed loop: "
                                 "it needs mxfp4_kernel on (True or None)")
        if self.kv_write_kernel and not self.fuse_qk_rope:
            raise ValueError("kv_write_kernel=True writes the new K/V from the fused q/k "
                             "norm + RoPE kernel: it needs fuse_qk_rope=True")
        for name in ("moe_layout_kernel", "moe_combine_kernel"):
            if getattr(self, name) and not self.fuse_glu:
                raise ValueError(f"{name}=True works on the fused expert MLP's one layout "
                                 "(`grouped_mlp`): it needs fuse_glu=True")
        if not is_int(self.matmul_row_group) or self.matmul_row_group < 1:
            raise ValueError(f"matmul_row_group={self.matmul_row_group!r} must be an int >= 1")
        if self.attn_split is not None:
            self._check_attn_split()
        if self.attn_split_rows is not None:
            _power_of_two("attn_split_rows", self.attn_split_rows, 16)
        if not is_int(self.row_partials) or self.row_partials < 1:
            raise ValueError(f"row_partials={self.row_partials!r} must be an int >= 1")
        if not is_int(self.prefill_chunk) or self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={self.prefill_chunk!r} must be an int >= 1 "
                             "(tokens a prefill chunk)")

    def _check_attn_split(self) -> None:
        """attn_split: 0 or a positive multiple of the attention kernels' key block, which
        depends on `interpret` alone (`pallas_kernels.attention_tile.key_block`)."""
        split = self.attn_split
        if not is_int(split) or split < 0:
            raise ValueError(f"attn_split={split!r} must be an int >= 0 (0: one pass) or "
                             "None (the kernel's default)")
        if split:
            from pallas_kernels.attention_tile import key_block

            block = key_block(self.interpret)
            if split % block:
                raise ValueError(
                    f"attn_split={split} must be 0 (one pass) or a positive multiple of the "
                    f"attention kernels' key block: {block} with interpret={self.interpret} "
                    "(64 on a GPU, 16 in interpret mode)")

    def replace(self, **fields) -> KernelOptions:
        return dataclasses.replace(self, **fields)

    def plain(self) -> KernelOptions:
        """The same options with every fusion off (`FUSIONS`): the path each fusion is
        checked against, bit for bit."""
        return self.replace(**PLAIN)


# The fusions: each gives the plain path's bits (tests/test_fused.py, test_pad_once.py,
# test_qk_rope.py, test_matmul_glu.py).
FUSIONS = ("fuse_add_norm", "pad_rows_once", "fuse_qk_rope", "fuse_glu")
# The fields `KernelOptions.plain` sets (the option string's `plain` too).
PLAIN = dict(kv_write_kernel=None, moe_layout_kernel=None, moe_combine_kernel=None,
             mxfp4_kernel=False, mxfp4_prmt=None, mxfp4_prefetch=None,
             **dict.fromkeys(FUSIONS, False))


@dataclasses.dataclass(frozen=True)
class DraftOptions:
    """Latency choices for a draft model. `DraftOptions()` turns every one off.

    Attributes:
      xla_two_rows: xla: carry a zero second row through a one-row forward, so every
        projection is a two-row GEMM with no pad or slice around it.
      xla_pallas_attention: xla: attention through the Pallas split-KV kernel (one
        launch at small grids) instead of plain jnp.
      fused: calls of at most `jspec.fused_draft.FUSED_ROWS` rows (batch x tokens) run
        through the latency kernels of `pallas_kernels/latency/` (six a layer); the
        layer weights are stored transposed (`with_options` does it).
      programs: fused: the grid size each projection aims at (a power of two).
      warps: fused: warps a projection program runs (a power of two).
      attn_stages: fused: the split-KV attention's pipeline stages (1..4; 0: the
        kernel's own).
      rope_attention: fused: q/k norm, RoPE, the K/V write and split-KV attention of a
        layer in one kernel where attention folds in one launch.
      fold_unroll: fused: partials loaded per step of the split-KV fold (a power of two;
        the fold's order is ascending whatever it is).
    """

    xla_two_rows: bool = False
    xla_pallas_attention: bool = False
    fused: bool = False
    programs: int = 512
    warps: int = 2
    attn_stages: int = 3
    rope_attention: bool = True
    fold_unroll: int = 4

    def __post_init__(self):
        _ints(self, ("programs", "warps", "attn_stages", "fold_unroll"))
        for name in ("xla_two_rows", "xla_pallas_attention", "fused", "rope_attention"):
            _bool(name, getattr(self, name))
        for name in ("programs", "warps", "fold_unroll"):
            _power_of_two(name, getattr(self, name))
        if not is_int(self.attn_stages) or not 0 <= self.attn_stages <= 4:
            raise ValueError(f"attn_stages={self.attn_stages!r} must be 0 (the kernel's "
                             "own) or 1..4")

    def replace(self, **fields) -> DraftOptions:
        return dataclasses.replace(self, **fields)

    @classmethod
    def latency(cls) -> DraftOptions:
        """The latency set for a small draft on a GPU: both xla options and the fused
        few-row path (docs/tuning.md: where it was measured, and where it loses)."""
        return cls(xla_two_rows=True, xla_pallas_attention=True, fused=True)


KERNEL_FIELDS = tuple(f.name for f in dataclasses.fields(KernelOptions))
DRAFT_FIELDS = tuple(f.name for f in dataclasses.fields(DraftOptions))


# The widest draft (hidden size) at which `DraftOptions.latency()` was measured to beat
# the plain path on a GPU: a Qwen3-0.6B draft (1024). At the Qwen3-8B width (4096) the
# latency kernels lost to it (docs/tuning.md, `fused`).
LATENCY_MAX_HIDDEN = 1024


def draft_options_for(model, platform: str | None = None) -> DraftOptions:
    """The draft options measured to be fastest for this draft's shape on this platform.

    On a GPU, a draft at most `LATENCY_MAX_HIDDEN` wide gets `DraftOptions.latency()`;
    wider drafts, and every draft on a CPU (where the latency kernels would run
    interpreted), get `DraftOptions()`. The choice changes speed only: the target's verify
    decides every emitted token.
    """
    import jax

    platform = platform or jax.default_backend()
    if platform == "gpu" and model.config.hidden_size <= LATENCY_MAX_HIDDEN:
        return DraftOptions.latency()
    return DraftOptions()


@dataclasses.dataclass(frozen=True)
class Parallel:
    """Tensor parallelism of a model's forward (set by `jspec.sharding`).

    Attributes:
      axis: the mesh axis the shards lie along (inside `shard_map`).
      size: the tensor-parallel degree (shards along `axis`).
      inside: True for the per-shard model `jspec.sharding` runs inside `shard_map`
        (its config holds the shard's heads, MLP columns and vocabulary); False for the
        sharded model a user holds, whose forward enters `shard_map`.
      global_config: the whole model's `ModelConfig` (matmul tiles are chosen by the
        whole weight's shape, so a column's arithmetic is the same at every degree).
    """

    axis: str
    size: int
    inside: bool = False
    global_config: object = None

    # The hooks through which `jspec.model.apply` and `jspec.init_cache` reach a
    # parallel model's implementation (`jspec.sharding.MeshParallel`) without importing
    # it: the library's modules form no import cycle.
    def apply(self, model, tokens, cache, *, features: tuple[int, ...] = (), tree=None,
              logits: bool = True):
        """The forward of the model a user holds (inside=False): tokens [B, T] -> a
        `jspec.model.Forward` as `jspec.model.apply` returns it."""
        raise NotImplementedError(f"{type(self).__name__} has no forward: make a parallel "
                                  "model with jspec.sharding.shard")

    def init_cache(self, model, batch_size: int, max_len: int):
        """`jspec.init_cache` for the model a user holds (inside=False)."""
        raise NotImplementedError(f"{type(self).__name__} has no cache: make a parallel "
                                  "model with jspec.sharding.shard")
