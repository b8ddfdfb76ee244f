"""The prefill and tall-verify matmul on Mosaic GPU: warp-specialized, persistent, the same
sums (the table's `prefill` and `tall` tiers: `mosaic/matmul.py`'s `mosaic_launch_config`).

`pallas_kernels/mosaic/matmul.py`'s plain design gives one program one [64, bn] tile and
walks K in a pipeline the program's one warpgroup both feeds and consumes. That suits a
decode step (a few rows, the weight's column tiles the whole grid) and wastes a prefill
chunk's: a 2,048-row launch is compute-bound, and a warpgroup that waits on its own
copies leaves the tensor cores idle. This kernel is the Hopper matmul design of JAX's
`pallas.ops.gpu.hopper_matmul_mgpu` written for jspec's rules:

- one CTA per SM (persistent), walking its output tiles [cta_m, cta_n] in a fixed
  order (`plgpu.nd_loop`, `planar_snake`: scheduling); with `cluster_n` 2, CTAs in
  pairs (a cluster) take neighbouring column tiles of the same rows, and x's block is
  copied once for both (TMA multicast): half the reads of x, which a tall verify block's
  narrow grid re-reads per column tile;
- three warpgroups: a memory warpgroup issues the TMA copies of x's [cta_m, bk] block and
  the weight's [bk, cta_n] block(s), `stages` steps ahead
  (`plgpu.emit_pipeline_warp_specialized`); two compute warpgroups each own half of the
  tile (split along M or N) and issue its wgmmas into an f32 accumulator in registers.

**The sums are the plain design's** (rules R1, R2): every output element is one
accumulator fed K from 0 upward in bk-wide steps, each step the wgmma's own fixed k16
order, nothing else added, no split-K, no atomics, nothing reduced across rows. The tile
sizes, the warpgroup split, the pipeline depth and the tile order decide where and when
a sum is computed, not its terms or their order. So a row's result does not depend on M
or on the other rows, and equals the plain design's with the same bk, bitwise: the claim
`experiments/tuning/mosaic_prefill.py` checks on the device (rows alone against decode
rows, prefixes, against the library launch) before the table may name this design for a
weight; a `mosaic` parity matrix with the table then proves it. The CTA count (the
device's SMs) only decides which CTA computes a tile, never its sum. The
epilogue casts the f32 sum as `matmul` does; the GLU variant runs `matmul_glu`'s
arithmetic on the two rounded tiles (gate and up accumulators a warpgroup, the weight's
two column blocks copied side by side).

Rows past M are TMA's zero fill and are not stored; K is padded with zeros (extra exact
zero terms at the end of the sum, as in the plain design).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import pad_axis, round_up
from pallas_kernels.matmul_glu import _glu_tile, check_glu_weight

__all__ = ["PrefillConfig", "prefill_matmul", "prefill_matmul_glu"]

SMEM_MAX = 227 * 1024  # bytes of shared memory a Hopper CTA may hold
DTYPES = ("bfloat16", "float16")
MEMORY_REGISTERS = 40  # registers a thread of the memory warpgroup keeps


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """A warp-specialized launch's tiles; every field is scheduling except bk (R11)."""
    tile_m: int = 128  # rows a compute warpgroup owns (64, 128, 192 or 256: wgmma Ms)
    tile_n: int = 128  # columns a compute warpgroup owns (the wgmma N; >= 64)
    bk: int = 64  # K elements a pipeline step (the device sweep checks its bits)
    stages: int = 3  # pipeline steps in flight (the defaults fit an f32 output's epilogue)
    wg_split: str = "m"  # the two compute warpgroups split the CTA tile along "m" or "n"
    minor: str = "n"  # the tile order's fast dimension
    band: int = 8  # the tile order's band width (tiles of the slow dimension a band)
    epi_m: int = 64  # the epilogue's store tile
    epi_n: int = 64
    cluster_n: int = 1  # CTAs a cluster along N sharing x's block (1 or 2: TMA multicast)

    def __post_init__(self):
        for name in ("tile_n", "bk", "epi_m", "epi_n"):
            t = getattr(self, name)
            if (not isinstance(t, int) or isinstance(t, bool) or t < 16 or t > 256
                    or t & (t - 1)):
                raise ValueError(f"PrefillConfig.{name}={t!r} must be a power of 2 in 16..256")
        t = self.tile_m  # (192: a 160-row verify block in one row tile)
        if not isinstance(t, int) or isinstance(t, bool) or t not in (64, 128, 192, 256):
            raise ValueError(f"PrefillConfig.tile_m={t!r} must be a multiple of 64 (the "
                             "wgmma M) in 64..256 (a TMA box)")
        # Narrower tiles run interpreted but find no layout on the GPU (a warpgroup's
        # column slice must hold a 128-byte swizzle, an epilogue tile the wgmma's 64 rows).
        if self.tile_n < 64 or self.epi_m < 64:
            raise ValueError(f"PrefillConfig: tile_n={self.tile_n} and epi_m={self.epi_m} "
                             "must be >= 64 (no GPU layout for narrower tiles)")
        if self.tile_m % self.epi_m or self.tile_n % self.epi_n:
            raise ValueError(f"PrefillConfig: the epilogue tile {self.epi_m}x{self.epi_n} "
                             f"must divide the warpgroup's {self.tile_m}x{self.tile_n}")
        if not isinstance(self.stages, int) or isinstance(self.stages, bool) or self.stages < 2:
            raise ValueError(f"PrefillConfig.stages={self.stages!r} must be an int >= 2")
        for name in ("wg_split", "minor"):
            if getattr(self, name) not in ("m", "n"):
                raise ValueError(f"PrefillConfig.{name}={getattr(self, name)!r} must be "
                                 "'m' or 'n'")
        if not isinstance(self.band, int) or isinstance(self.band, bool) or self.band < 1:
            raise ValueError(f"PrefillConfig.band={self.band!r} must be an int >= 1")
        if (not isinstance(self.cluster_n, int) or isinstance(self.cluster_n, bool)
                or self.cluster_n not in (1, 2)):
            raise ValueError(f"PrefillConfig.cluster_n={self.cluster_n!r} must be 1 or 2 (CTAs "
                             "a cluster sharing x's block)")

    @property
    def cta_m(self) -> int:
        return self.tile_m * (2 if self.wg_split == "m" else 1)

    @property
    def cta_n(self) -> int:
        return self.tile_n * (2 if self.wg_split == "n" else 1)

    @property
    def cluster_cols(self) -> int:
        """Columns a cluster covers: N (a GLU's F) must be a multiple."""
        return self.cta_n * self.cluster_n

    def smem_bytes(self, dtype, out_dtype, weights: int = 1) -> int:
        size = jnp.dtype(dtype).itemsize
        step = (self.cta_m * self.bk + weights * self.bk * self.cta_n) * size
        slots = min(2, (self.tile_m * self.tile_n) // (self.epi_m * self.epi_n))
        return (self.stages * step
                + 2 * slots * self.epi_m * self.epi_n * jnp.dtype(out_dtype).itemsize)


def _transforms(width: int, dtype) -> tuple:
    swizzle = plgpu.find_swizzle(width * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)


def _num_sms() -> int:
    """The default device's SMs; 132 where it has none (a CPU lowering for CUDA):
    scheduling only."""
    return getattr(jax.devices()[0], "core_count", None) or 132


def _kernel(x_gmem, w_gmem, o_gmem, *, cfg: PrefillConfig, nk: int, m_tiles: int,
            n_tiles: int, column_offset: int | None, epilogue):
    # x_gmem [Mr, Kp], w_gmem [Kp, Np], o_gmem [Mr, N']. column_offset: the GLU's up half
    # starts this many CTA column tiles after the gate's (None: one accumulator).
    dtype, out_dtype = x_gmem.dtype, o_gmem.dtype
    tm, tn, bk = cfg.tile_m, cfg.tile_n, cfg.bk
    weights = 1 if column_offset is None else 2
    transforms = _transforms(bk, dtype)
    w_transforms = _transforms(min(bk, cfg.cta_n), dtype)
    slots = min(2, (tm * tn) // (cfg.epi_m * cfg.epi_n))
    out_transforms = _transforms(cfg.epi_n, out_dtype)

    shared = ("cluster",) if cfg.cluster_n > 1 else ()  # x's block multicast to the pair

    def pipeline(body, context):
        specs = [plgpu.BlockSpec((cfg.cta_m, bk), lambda k: (0, k), transforms=transforms,
                                 memory_space=plgpu.SMEM, collective_axes=shared)]
        specs += [plgpu.BlockSpec((bk, cfg.cta_n), lambda k: (k, 0), transforms=w_transforms,
                                  memory_space=plgpu.SMEM) for _ in range(weights)]
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(nk,), memory_registers=MEMORY_REGISTERS, in_specs=specs,
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=min(cfg.stages, max(nk, 2)),
            compute_context=context)

    ignore = lambda *_, **__: None  # noqa: E731 - the allocations only need the specs
    allocs = pipeline(ignore, ignore).get_allocations(x_gmem, *([w_gmem] * weights))

    @functools.partial(pl.run_scoped, allocs=allocs,
                       out_smem=plgpu.SMEM((2, slots, cfg.epi_m, cfg.epi_n), out_dtype,
                                           transforms=out_transforms),
                       collective_axes="wg")
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")
        pairs = n_tiles // cfg.cluster_n  # the column tiles a cluster walks

        @plgpu.nd_loop((m_tiles * pairs,), collective_axes="sm")
        def _tiles(info):
            (lin,) = info.index
            mi, ni = plgpu.planar_snake(lin, (m_tiles, pairs),
                                        0 if cfg.minor == "m" else 1, cfg.band)
            if cfg.cluster_n > 1:
                ni = ni * cfg.cluster_n + lax.axis_index("cluster")
            cta_rows = pl.ds(mi * cfg.cta_m, cfg.cta_m)
            if cfg.wg_split == "m":
                wg_rows, wg_cols = pl.ds(wg * tm, tm), slice(None)
            else:
                wg_rows, wg_cols = slice(None), pl.ds(wg * tn, tn)

            def context(run):
                @functools.partial(pl.run_scoped,
                                   accs=[plgpu.ACC((tm, tn), jnp.float32)] * weights)
                def _acc(accs):
                    run(tuple(accs))
                    out = epilogue(*(acc[...] for acc in accs))  # [tm, tn] out_dtype
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for a in range(tm // cfg.epi_m):
                        for b in range(tn // cfg.epi_n):
                            em = slice(a * cfg.epi_m, (a + 1) * cfg.epi_m)
                            en = slice(b * cfg.epi_n, (b + 1) * cfg.epi_n)
                            slot = (a * (tn // cfg.epi_n) + b) % 2
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                            out_smem[wg, slot] = out[em, en]
                            plgpu.commit_smem()
                            # Rows past the array's end are not stored (TMA skips them).
                            plgpu.copy_smem_to_gmem(
                                out_smem.at[wg, slot],
                                o_gmem.at[cta_rows, pl.ds(ni * cfg.cta_n, cfg.cta_n)]
                                .at[wg_rows, wg_cols].at[em, en])

            def body(_, x_smem, *rest):
                *w_smem, accs = rest
                for acc, w in zip(accs, w_smem, strict=True):
                    plgpu.wgmma(acc, x_smem.at[wg_rows], w.at[:, wg_cols])  # in issue order
                plgpu.wgmma_wait(0)
                return accs

            gate = w_gmem.at[:, pl.ds(ni * cfg.cta_n, cfg.cta_n)]
            ws = [gate] if column_offset is None else [
                gate, w_gmem.at[:, pl.ds((ni + column_offset) * cfg.cta_n, cfg.cta_n)]]
            pipeline(body, context)(x_gmem.at[cta_rows, :], *ws, allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _check_sms(num_sms, name: str) -> None:
    if num_sms is not None and (not isinstance(num_sms, int) or isinstance(num_sms, bool)
                                or num_sms < 1):
        raise ValueError(f"{name}: num_sms={num_sms!r} must be an int >= 1 (the persistent "
                         "grid's CTAs) or None (the device's SMs)")


def _check(x, w, cfg, name: str) -> None:
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"{name} wants x [M, K] and w [K, N]; got {x.shape=} {w.shape=}")
    if x.dtype != w.dtype or x.dtype.name not in DTYPES:
        raise TypeError(f"{name} (Mosaic GPU) wants x and w of one dtype in {DTYPES}; got "
                        f"{x.dtype=} {w.dtype=}")
    if not isinstance(cfg, PrefillConfig):
        raise TypeError(f"{name} takes a PrefillConfig; got {type(cfg).__name__}")


def _launch(x, w, cfg: PrefillConfig, n_out: int, out_dtype, column_offset, epilogue,
            interpret: bool, name: str, num_sms: int | None):
    m, k = x.shape
    kp = round_up(k, cfg.bk)  # extra K terms add exact zeros at the end of the sum
    xp = pad_axis(pad_axis(x, 1, kp), 0, round_up(m, 8))  # TMA's 8-row tiles
    wp = pad_axis(w, 0, kp)
    weights = 1 if column_offset is None else 2
    need = cfg.smem_bytes(x.dtype, out_dtype, weights)
    if need > SMEM_MAX:
        raise ValueError(f"{name}: {cfg} needs {need} bytes of shared memory ({SMEM_MAX} "
                         "at most): fewer stages or smaller tiles")
    m_tiles, n_tiles = -(-xp.shape[0] // cfg.cta_m), n_out // cfg.cta_n
    sms = max(1, (num_sms or _num_sms()) // cfg.cluster_n)  # clusters
    cluster = dict(cluster=(cfg.cluster_n,), cluster_names=("cluster",)) \
        if cfg.cluster_n > 1 else {}
    kernel = functools.partial(_kernel, cfg=cfg, nk=kp // cfg.bk, m_tiles=m_tiles,
                               n_tiles=n_tiles, column_offset=column_offset,
                               epilogue=epilogue)
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((xp.shape[0], n_out), out_dtype),
        grid=(min(sms, m_tiles * n_tiles // cfg.cluster_n),), grid_names=("sm",), **cluster,
        num_threads=3, thread_name="wg", kernel_name=name,
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(xp, wp)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret", "num_sms"))
def prefill_matmul(x: jax.Array, w: jax.Array, *, config: PrefillConfig, out_dtype=None,
                   interpret: bool = False, num_sms: int | None = None) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in out_dtype (default float32): the plain design's
    sums with `config.bk`, warp-specialized. N must be a multiple of `config.cta_n`.
    `num_sms`: the persistent grid's CTAs (default: the device's SMs)."""
    _check(x, w, config, "prefill_matmul")
    _check_sms(num_sms, "prefill_matmul")
    out_dtype = jnp.dtype(jnp.float32 if out_dtype is None else out_dtype)
    if out_dtype.name not in ("float32", *DTYPES):
        raise TypeError(f"prefill_matmul: out_dtype={out_dtype.name} must be float32, "
                        "bfloat16 or float16")
    m, n = x.shape[0], w.shape[1]
    if n % config.cluster_cols:
        raise ValueError(f"prefill_matmul: N={n} must be a multiple of the CTA's column tile "
                         f"{config.cta_n} x cluster_n {config.cluster_n}")
    if m == 0:  # no rows: no launch (a grid of no tiles)
        return jnp.zeros((0, n), out_dtype)
    out = _launch(x, w, config, n, out_dtype, None, lambda acc: acc.astype(out_dtype),
                  interpret, "jspec_mosaic_prefill_matmul", num_sms)
    return out[:m]


@functools.partial(jax.jit, static_argnames=("activation", "config", "interpret", "num_sms"))
def prefill_matmul_glu(x: jax.Array, w: jax.Array, *, activation: str, config: PrefillConfig,
                       interpret: bool = False, num_sms: int | None = None) -> jax.Array:
    """act(x @ w[:, :F]) * (x @ w[:, F:]) for x [M, K], w [K, 2F] -> x.dtype: `matmul_glu`'s
    arithmetic on the rounded halves. F must be a multiple of `config.cta_n`."""
    _check(x, w, config, "prefill_matmul_glu")
    _check_sms(num_sms, "prefill_matmul_glu")
    check_glu_weight(w, activation)
    m, f = x.shape[0], w.shape[1] // 2
    if f % config.cluster_cols:
        raise ValueError(f"prefill_matmul_glu: F={f} must be a multiple of the CTA's column "
                         f"tile {config.cta_n} x cluster_n {config.cluster_n}")
    dtype = x.dtype

    def epilogue(gate, up):
        return _glu_tile(gate.astype(dtype), up.astype(dtype), activation)

    if m == 0:
        return jnp.zeros((0, f), dtype)
    out = _launch(x, w, config, f, dtype, f // config.cta_n, epilogue, interpret,
                  "jspec_mosaic_prefill_matmul_glu", num_sms)
    return out[:m]
