"""Row-invariant matmul on Mosaic GPU: y = x @ w with a fixed, sequential K reduction.

The Mosaic GPU lowering of `pallas_kernels/matmul.py` (whose docstring says why XLA's
own dot is not row-invariant) and of `pallas_kernels/matmul_glu.py`; the jnp references
are theirs. One program owns one [64, bn] output tile: 64 rows is one warpgroup MMA
(wgmma) M, and rows past M are zero rows (TMA fills the part of a tile that lies past
the array with zeros, and skips it on the store), so M changes only the grid (R1).

Inside a program, K is walked from 0 upward in bk-wide steps by `plgpu.emit_pipeline`:
TMA copies the [64, bk] block of x and the [bk, bn] block of w of step k into shared
memory (`stages` steps in flight), and one wgmma adds their product into the f32
accumulator, which stays in registers for the whole loop. wgmmas on one accumulator
run in issue order, so every output element is the same sum in the same order
(k = 0, 1, ..., nk - 1; within a step, the wgmma's own fixed k16 order) whatever M,
the row's place in its tile or the other rows are. No atomics, nothing reduced across
rows (R2). A config may split K (`splits`: a weight with few column tiles, whose decode
step would leave most of the GPU idle): K is zero-padded to a multiple of splits * bk
and cut into equal contiguous chunks, a third grid axis walks each chunk as above into
an f32 partial, and the partials are added left to right (`add_partials`, as the Triton
lowering's split-K and row-parallel partials are): whatever M is, a split config is
`add_partials(matmul_partials(...))` over the zero-padded K (over K itself where splits * bk
divides it, so its chunks are then row-parallel partials' of that degree). Otherwise the f32
sum is cast to out_dtype in the kernel's epilogue and stored through shared memory by TMA.

`mosaic_matmul_config` is a function of (K, N, dtype) only; bk of K alone, so the
order of a column's sum does not depend on its column tile. The pipeline depth
(`stages`) is scheduling: it changes no bits.

`matmul_glu` runs the gate and up halves of a fused [K, 2F] weight in one program: two
accumulators, each with `matmul`'s tiles and K order for the [K, 2F] weight (two wgmmas a
step, on the same x block), then `matmul_glu`'s GLU arithmetic on the two rounded tiles,
so it is `glu` of this `matmul`'s halves in the same arithmetic.

Only 16-bit operands (bf16, f16): an f32 wgmma multiplies in TF32, which is not the
f32 product the Triton lowering and the reference promise.

**The swapped design** (`MosaicMatmulConfig(swapped=True)`): the wgmma's 64-row M is
taken by 64 of the weight's columns and its N by 16 tokens, acc [64, 16] =
w block^T @ x block^T (both operands transposed views of the TMA-loaded blocks), so one
token fills a sixteenth of the instruction instead of a sixty-fourth and a step copies
the weight's [bk, 64] block and x's [16 t, bk] block, not a 64-row x block. Every M runs
the same [64, 16] instruction: a program takes up to `token_tiles` token tiles (each its
own accumulator, the weight block loaded once for all: scheduling), K is walked in the
same fixed order, and the output tile is stored through a transposed view of shared
memory (a 16-bit output; Mosaic GPU finds no layout for an f32 tile's transposed store,
so an f32 output, the logits, is stored column-major as the accumulators lie and
`matmul` returns its transpose: the same values). A token's column of the product is
the same sum whatever the other columns hold and whichever of the 16 it is (R1): the
claim `tuning/mosaic_matmul.py --swapped` checks on the device, as the rows were checked
for the plain design. The design is part of the configuration (R11: its own bits),
chosen per weight shape by `TUNED_FILE`. `wide` puts a program's token tiles in one
[64, 16 tiles] accumulator, one wgmma of N = 16 tiles a step (a 160-row verify block: one
instruction where ten were issued); the same sums if the hardware forms every column of
an instruction alike whatever its N, which the sweep's bit checks decide before the
table may take it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import check_out_dtype, pad_axis, round_up
from pallas_kernels.matmul import add_partials, matmul_reference
from pallas_kernels.matmul_glu import _glu_tile, check_glu_weight, matmul_glu_reference
from pallas_kernels.mosaic.prefill_matmul import (
    SMEM_MAX,
    PrefillConfig,
    prefill_matmul,
    prefill_matmul_glu,
)

__all__ = ["BM", "MosaicMatmulConfig", "matmul", "matmul_glu", "matmul_glu_reference",
           "matmul_partials", "matmul_reference", "mosaic_matmul_config"]

BM = 64  # rows per program tile: one wgmma M (fixed: the row count changes only the grid)
BT = 16  # swapped: tokens per wgmma N (fixed: every M runs the same instruction)
TOKEN_TILES = BM // BT  # swapped: token tiles a program at most by default (scheduling: a
# function of M), so x's block is the plain design's [64, bk] and `pipeline_stages` serves
# both designs; a config may take up to MAX_TOKEN_TILES (16 tiles: a TMA box's 256 rows)
MAX_TOKEN_TILES = 16
TUNED_FILE = os.path.join(os.path.dirname(__file__), "matmul_tuned.json")
BK_TILES = (128, 64, 32, 16)  # bk: the largest that divides K
PREFILL_ROWS = 320  # a launch of more rows (a prefill chunk) may take its weight's prefill
# tile (`mosaic_launch_config`); 320: a batch-64 verify block of 5 tokens a row
TALL_ROWS = 64  # a launch of more rows, up to PREFILL_ROWS (verify blocks at batch 16-64),
# may take its weight's `tall` tile (the warp-specialized design; scheduling, its bits the
# decode config's where the device sweep wrote it), past the tile's own `above` rows
BN_TILES = (128, 64, 32)  # bn: the largest that divides N and leaves MIN_COLUMN_TILES
MIN_COLUMN_TILES = 128  # column tiles wanted at decode, where they are the whole grid
SMEM_BUDGET = 192 * 1024  # bytes of pipeline buffers a program may hold
MAX_STAGES = 4
MAX_SPLITS = 16  # K chunks of a split config at most
DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class MosaicMatmulConfig:
    bn: int  # output columns per program (the wgmma N)
    bk: int  # K elements per pipeline step (one wgmma of bk / 16 k16 steps)
    stages: int  # pipeline steps in flight (scheduling only: no bits change)
    swapped: bool = False  # the weight's columns as the wgmma M (bn = 64), tokens as N
    # swapped: 16-token tiles a program at most, each its own accumulator, the weight
    # block loaded once for all (scheduling: no bits change). Past TOKEN_TILES the x block
    # grows, so the pipeline holds fewer steps (`swapped_stages`); 10 tiles take a
    # 160-row verify block in one program per column block, its weights read once.
    token_tiles: int = TOKEN_TILES
    # swapped: a program's token tiles in one accumulator [64, 16 tiles] and one wgmma of
    # N = 16 tiles a step (not one [64, 16] each). Numeric until the device shows a
    # column's bits do not depend on the instruction's N: the sweep's bit checks decide.
    wide: bool = False
    # Fixed K partitions (rule R2): K is zero-padded to a multiple of splits * bk and cut
    # into `splits` equal contiguous chunks; a third grid axis walks each chunk in order
    # into an f32 partial, and `add_partials` adds them left to right. Numeric (R11: the
    # split's own bits), chosen per weight shape; 1: one walk over K.
    splits: int = 1

    def __post_init__(self):
        for name in ("bn", "bk", "stages", "token_tiles", "splits"):  # numpy ints as ints
            v = getattr(self, name)
            if isinstance(v, np.integer) and not isinstance(v, np.bool_):
                object.__setattr__(self, name, int(v))
        for name in ("bn", "bk"):
            t = getattr(self, name)
            if not isinstance(t, int) or t < 16 or t > 256 or t & (t - 1):
                raise ValueError(f"MosaicMatmulConfig.{name}={t!r} must be a power of 2 in "
                                 "16..256")
        if not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"MosaicMatmulConfig.stages={self.stages!r} must be an int >= 2 "
                             "(one wgmma stays in flight while the next step loads)")
        if not isinstance(self.swapped, bool):
            raise TypeError(f"MosaicMatmulConfig.swapped={self.swapped!r} must be a bool")
        if (not isinstance(self.token_tiles, int) or not 1 <= self.token_tiles <= MAX_TOKEN_TILES
                or (not self.swapped and self.token_tiles != TOKEN_TILES)):
            raise ValueError(f"MosaicMatmulConfig.token_tiles={self.token_tiles!r} must be an "
                             f"int in 1..{MAX_TOKEN_TILES} (the swapped design's; the plain "
                             f"design's row tile is {BM})")
        if not isinstance(self.wide, bool) or (self.wide and not self.swapped):
            raise ValueError(f"MosaicMatmulConfig.wide={self.wide!r} is the swapped design's "
                             "(a bool)")
        if (isinstance(self.splits, bool) or not isinstance(self.splits, int)
                or not 1 <= self.splits <= MAX_SPLITS):
            raise ValueError(f"MosaicMatmulConfig.splits={self.splits!r} must be an int in "
                             f"1..{MAX_SPLITS} (K chunks, added left to right)")
        if self.swapped and (self.bn != BM or self.bk < 64):
            raise ValueError(f"MosaicMatmulConfig(swapped=True) takes bn={BM} (the wgmma M) "
                             f"and bk >= 64 (both operands' 128-byte swizzle); got bn={self.bn}, "
                             f"bk={self.bk}")


def _largest_dividing(n: int, tiles: tuple[int, ...]) -> int | None:
    return next((t for t in tiles if n % t == 0), None)


def _column_tile(N: int) -> int:
    """The largest of BN_TILES dividing N that leaves >= MIN_COLUMN_TILES column tiles
    (a decode step has one row tile, so the column tiles are its grid); else the
    smallest dividing N; else the smallest (N is padded)."""
    dividing = [t for t in BN_TILES if N % t == 0]
    for t in dividing:
        if N // t >= MIN_COLUMN_TILES:
            return t
    return dividing[-1] if dividing else BN_TILES[-1]


def pipeline_stages(bk: int, bn: int, dtype, weights: int = 1) -> int:
    """Pipeline depth that fits SMEM_BUDGET: each step holds x's [64, bk] block and
    `weights` [bk, bn] blocks (2 for the fused GLU)."""
    per_step = (BM * bk + weights * bk * bn) * jnp.dtype(dtype).itemsize
    return max(2, min(MAX_STAGES, SMEM_BUDGET // per_step))


def swapped_stages(cfg: MosaicMatmulConfig, tiles: int, dtype, out_dtype, weights: int = 1
                   ) -> int:
    """The swapped design's pipeline depth for a program of `tiles` token tiles: the
    config's, or, past TOKEN_TILES tiles, as many steps as SMEM_MAX holds beside the
    output tile (each step: x's [16 tiles, bk] block and `weights` [bk, 64] blocks)."""
    if tiles <= TOKEN_TILES:
        return cfg.stages
    size = jnp.dtype(dtype).itemsize
    per_step = (BT * tiles + weights * BM) * cfg.bk * size
    fit = (SMEM_MAX - BT * tiles * BM * jnp.dtype(out_dtype).itemsize) // per_step
    if fit < 2:
        raise ValueError(f"MosaicMatmulConfig(token_tiles={cfg.token_tiles}, bk={cfg.bk}): "
                         f"{tiles} token tiles leave shared memory for {fit} pipeline steps "
                         "(2 at least): fewer token tiles or a smaller bk")
    return min(cfg.stages, fit)


@functools.cache
def read_tuned_file(path: str = TUNED_FILE) -> dict:
    """{(K, N, dtype name): MosaicMatmulConfig} from the data file (none: {})."""
    return {key: cfg for key, (cfg, _, _) in _read_entries(path).items()}


@functools.cache
def read_prefill_tiles(path: str = TUNED_FILE) -> dict:
    """{(K, N, dtype name): MosaicMatmulConfig | PrefillConfig} of the entries' `prefill`
    tiles: the plain design with the entry's bk (bk sets bits; the column tile and stages
    do not), or the warp-specialized design (`"design": "ws"`), each written only where the
    sweep's bit checks showed the library launch's bits on the device."""
    return {key: tile for key, (_, tile, _) in _read_entries(path).items() if tile is not None}


@functools.cache
def read_tall_tiles(path: str = TUNED_FILE) -> dict:
    """{(K, N, dtype name): (above, PrefillConfig)} of the entries' `tall` tiles: the
    warp-specialized design for launches of `above` < M <= PREFILL_ROWS rows (verify
    blocks at batch 16-64; TALL_ROWS <= above), written by `tuning/mosaic_prefill.py
    --tier=tall` only where its bits equal the library launch's and decode rows' and it
    was no slower at any row count timed past `above`."""
    return {key: tall for key, (_, _, tall) in _read_entries(path).items() if tall is not None}


@functools.cache
def _read_entries(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    tuned = data.get("tuned", []) if isinstance(data, dict) else None
    if not isinstance(tuned, list):
        raise ValueError(f"{path}: not a Mosaic tile table (an object with a 'tuned' list)")
    out = {}
    for i, e in enumerate(tuned):
        try:
            key, entry = _read_entry(path, e)
        except (TypeError, KeyError, ValueError) as err:
            msg = str(err) if str(err).startswith(path) else f"{path}: entry {i}: {err!r}"
            raise ValueError(msg) from None
        if key in out:
            raise ValueError(f"{path}: two entries for K={key[0]}, N={key[1]}, {key[2]}")
        out[key] = entry
    return out


def _read_entry(path: str, e: dict) -> tuple:
    """(key, (config, prefill tile, tall tile)) of one table entry."""
    key = (e["K"], e["N"], e["dtype"])
    if (not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in key[:2])
            or key[2] not in DTYPES):
        raise ValueError(f"K={key[0]!r}, N={key[1]!r} must be positive ints and "
                         f"dtype={key[2]!r} one of {DTYPES}")
    cfg = MosaicMatmulConfig(**e["config"])
    if cfg.splits > 1:
        _check_chunks(cfg, key[0])
    if cfg.splits > 1 and ("prefill" in e or "tall" in e):
        raise ValueError(f"{path}: K={key[0]}, N={key[1]} splits K ({cfg.splits} chunks): "
                         "its prefill and tall tiles would not have its bits")
    fields = _tile_fields(path, key, e, "prefill")
    design = fields.pop("design", "plain")
    if design not in ("plain", "ws"):
        raise ValueError(f"{path}: the prefill tile of K={key[0]}, N={key[1]} names "
                         f"design={design!r} ('plain' or 'ws')")
    tall = None
    if "tall" in e:  # the ws design only: below PREFILL_ROWS the plain one is the
        tall = _tile_fields(path, key, e, "tall")  # decode config itself
        where = f"{path}: the tall tile of K={key[0]}, N={key[1]}"
        if tall.pop("design", None) != "ws":
            raise ValueError(f"{where} must name design 'ws' (the warp-specialized "
                             "design)")
        above = tall.pop("above", None)  # (the sweep writes it: never a default)
        if (not isinstance(above, int) or isinstance(above, bool)
                or not TALL_ROWS <= above < PREFILL_ROWS):
            raise ValueError(f"{where}: above={above!r} must be an int in "
                             f"{TALL_ROWS}..{PREFILL_ROWS - 1} (the rows it serves "
                             f"start past it, end at {PREFILL_ROWS})")
        tall = (above, _ws_tile(path, key, tall, "tall"))
    if design == "ws":  # written by tuning/mosaic_prefill.py only where its bits equal
        return key, (cfg, _ws_tile(path, key, fields), tall)  # the library's, decode rows'
    if not fields and e.get("prefill"):
        raise ValueError(f"{path}: the prefill tile of K={key[0]}, N={key[1]} names its "
                         "design without its tile")
    tile = MosaicMatmulConfig(**fields) if fields else None
    if tile is not None and (tile.swapped or tile.bk != cfg.bk or tile.splits != 1):
        raise ValueError(f"{path}: the prefill tile of K={key[0]}, N={key[1]} must be the "
                         f"plain design with the entry's bk={cfg.bk} and no split (bk and "
                         f"a split set bits); got {tile}")
    return key, (cfg, tile, tall)


def _tile_fields(path: str, key: tuple, entry: dict, tier: str) -> dict:
    fields = entry.get(tier, {})
    if not isinstance(fields, dict):
        raise ValueError(f"{path}: the {tier} tile of K={key[0]}, N={key[1]} must be an object "
                         f"of fields; got {fields!r}")
    return dict(fields)


WS_FIELDS = ("tile_m", "tile_n", "bk", "stages", "wg_split")  # a ws tile names them all


def _ws_tile(path: str, key: tuple, fields: dict, tier: str = "prefill") -> PrefillConfig:
    """A table entry's warp-specialized tile, checked as the kernel will need it. `glu`
    (written by the sweep for a fused gate/up weight [K, 2F]): the launch's two weight
    blocks and F are checked too."""
    where = f"{path}: the {tier} tile of K={key[0]}, N={key[1]}"
    if not fields:
        raise ValueError(f"{where} names design 'ws' without its tiles")
    missing = [f for f in WS_FIELDS if f not in fields]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)} (a sweep writes every field; "
                         "a tile nobody swept is not read)")
    glu = fields.pop("glu", False)
    if not isinstance(glu, bool):
        raise ValueError(f"{where}: glu={glu!r} must be a bool")
    try:
        tile = PrefillConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    width = key[1] // 2 if glu else key[1]
    if key[1] % (2 if glu else 1) or width % tile.cluster_cols:
        raise ValueError(f"{where}: the CTA's column tile {tile.cta_n} (x cluster_n "
                         f"{tile.cluster_n}) does not divide {'F' if glu else 'N'}")
    need = tile.smem_bytes(key[2], key[2], 2 if glu else 1)
    if need > SMEM_MAX:
        raise ValueError(f"{where}: {tile} needs {need} bytes of shared memory ({SMEM_MAX} "
                         "at most)")
    return tile


def mosaic_launch_config(K: int, N: int, dtype, m: int, schedule: bool = True
                         ) -> MosaicMatmulConfig | PrefillConfig:
    """The tiles a launch of m rows runs: `mosaic_matmul_config`'s, or with schedule, past
    PREFILL_ROWS rows (prefill chunks), the weight's `prefill` tile where the table has
    one (the plain design with the same bk, or a `PrefillConfig`: the warp-specialized
    design), and past its `tall` tile's `above` rows (tall verify blocks) that tile (a
    `PrefillConfig`), each written only where the device showed the library launch's
    bits. The tiers are scheduling: every tier's row has the decode config's bits."""
    key = (K, N, jnp.dtype(dtype).name)
    if schedule and m > PREFILL_ROWS:
        tile = read_prefill_tiles().get(key)
        if tile is not None:
            return tile
    elif schedule and m > TALL_ROWS:
        above, tile = read_tall_tiles().get(key, (PREFILL_ROWS, None))
        if m > above:
            return tile
    return mosaic_matmul_config(K, N, dtype)


def mosaic_matmul_config(K: int, N: int, dtype, tuned: bool = True) -> MosaicMatmulConfig:
    """Tiles for a [K, N] weight; deliberately takes no M: `TUNED_FILE`'s entry for the
    shape (unless tuned=False), else the rule (the plain design, bk of K alone)."""
    entry = read_tuned_file().get((K, N, jnp.dtype(dtype).name)) if tuned else None
    if entry is not None:
        return entry
    bk = _largest_dividing(K, BK_TILES) or BK_TILES[-1]
    bn = _column_tile(N)
    return MosaicMatmulConfig(bn=bn, bk=bk, stages=pipeline_stages(bk, bn, dtype))


def _operand_transforms(cfg: MosaicMatmulConfig, dtype) -> tuple:
    """wgmma's shared-memory layout for both operands: 8-row tiles, swizzled. The lhs and
    rhs swizzle must match, so it is set by the narrower of bk (x's minor axis) and bn
    (w's)."""
    swizzle = plgpu.find_swizzle(min(cfg.bk, cfg.bn) * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)


def _check_chunks(cfg: MosaicMatmulConfig, k: int):
    """A split whose last chunk would hold only padding is refused (not silently run):
    K = k takes ceil(k / bk) steps, each chunk ceil(steps / splits) of them."""
    steps = -(-k // cfg.bk)
    per = -(-steps // cfg.splits)
    if (cfg.splits - 1) * per >= steps:
        raise ValueError(f"MosaicMatmulConfig(splits={cfg.splits}, bk={cfg.bk}) cuts K={k} "
                         f"({steps} K steps, {per} a chunk) into chunks of padding only")


def _chunk(nk: int, splits: int):
    """(this program's K chunk, its first K step): chunk s of a split config (grid axis
    "s") starts at step s * nk; without a split there is one chunk."""
    if splits == 1:
        return None, 0
    s = lax.axis_index("s")
    return s, s * nk


def _kernel(x_gmem, w_gmem, o_gmem, o_smem, *, cfg: MosaicMatmulConfig, nk: int,
            column_offsets: tuple[int, ...], epilogue):
    # x_gmem [Mr, Kp], w_gmem [Kp, Np], o_gmem [Mr, N'] in GMEM; o_smem [BM, bn].
    # column_offsets: the column tiles of w this program reads, relative to its own (0,):
    # one accumulator; (0, F / bn): the gate and the up tile of a fused GLU weight.
    # A split config: o_gmem [splits, Mr, N'], nk the steps of one chunk.
    i, j = lax.axis_index("m"), lax.axis_index("n")
    s, k0 = _chunk(nk, cfg.splits)
    transforms = _operand_transforms(cfg, x_gmem.dtype)
    # delay_release=1: a step's buffers are refilled only after the wgmma of the next
    # step has been issued, since wgmma_wait(1) leaves one wgmma reading them.
    x_spec = plgpu.BlockSpec((BM, cfg.bk), lambda k: (i, k0 + k), transforms=transforms,
                             delay_release=1)
    w_specs = [plgpu.BlockSpec((cfg.bk, cfg.bn), lambda k, c=c: (k0 + k, j + c),
                               transforms=transforms, delay_release=1)
               for c in column_offsets]

    def scope(*accs):  # accs: [BM, bn] f32 wgmma accumulators, zero at the start
        def step(_, x_smem, *w_smem):  # x_smem [BM, bk], w_smem [bk, bn] each
            for acc, w in zip(accs, w_smem, strict=True):
                plgpu.wgmma(acc, x_smem, w)  # acc += x block @ w block, in issue order
            plgpu.wgmma_wait(1)

        # Steps k = 0, 1, ..., nk - 1 in order: the K sum's order is fixed.
        plgpu.emit_pipeline(step, grid=(nk,), in_specs=[x_spec, *w_specs],
                            max_concurrent_steps=min(cfg.stages, max(nk, 2)))(
            x_gmem, *([w_gmem] * len(column_offsets)))
        o_smem[...] = epilogue(*(acc[...] for acc in accs))

    pl.run_scoped(scope, *(plgpu.ACC((BM, cfg.bn), jnp.float32) for _ in column_offsets))
    plgpu.commit_smem()
    # Rows of the tile past the array's end are not stored (TMA skips them).
    o = o_gmem if s is None else o_gmem.at[s]
    plgpu.copy_smem_to_gmem(o_smem, o.at[pl.ds(i * BM, BM), pl.ds(j * cfg.bn, cfg.bn)])
    plgpu.wait_smem_to_gmem(0)


def _kernel_swapped(x_gmem, w_gmem, o_gmem, o_smem, *, cfg: MosaicMatmulConfig, nk: int,
                    tiles: int, column_offsets: tuple[int, ...], epilogue,
                    columns_major: bool = False):
    # x_gmem [Mr, Kp], w_gmem [Kp, Np], o_gmem [Mr, N'] in GMEM; o_smem [16 tiles, 64].
    # Program (g, j): token tiles g * tiles ... of 16 tokens, the weight's columns
    # j * 64 ... (and j + c for each column offset c: the GLU's up half).
    # columns_major: o_gmem is the product's transpose [N', Mo] and o_smem [64, 16 tiles]:
    # each [64, 16] accumulator is stored as it lies (f32 outputs: `matmul` transposes).
    # A split config: o_gmem [splits, ...], nk the steps of one chunk.
    g, j = lax.axis_index("m"), lax.axis_index("n")
    s, k0 = _chunk(nk, cfg.splits)
    transforms = _operand_transforms(cfg, x_gmem.dtype)
    x_spec = plgpu.BlockSpec((BT * tiles, cfg.bk), lambda k: (g, k0 + k),
                             transforms=transforms, delay_release=1)
    w_specs = [plgpu.BlockSpec((cfg.bk, BM), lambda k, c=c: (k0 + k, j + c),
                               transforms=transforms, delay_release=1)
               for c in column_offsets]
    n_acc = len(column_offsets)
    # wide: one [64, 16 tiles] accumulator a column block (each "tile" below is then the
    # whole program's tokens); else one [64, 16] a (token tile, column block).
    acc_tiles, width = (1, BT * tiles) if cfg.wide else (tiles, BT)

    def scope(*accs):  # token tile t, column block c at t * n_acc + c
        def step(_, x_smem, *w_smem):  # x_smem [16 tiles, bk], w_smem [bk, 64] each
            for t in range(acc_tiles):
                xt = x_smem.at[pl.ds(t * width, width)].transpose((1, 0))  # [bk, width]
                for c, w in enumerate(w_smem):  # acc += w block^T @ x block^T
                    plgpu.wgmma(accs[t * n_acc + c], w.transpose((1, 0)), xt)
            plgpu.wgmma_wait(1)

        plgpu.emit_pipeline(step, grid=(nk,), in_specs=[x_spec, *w_specs],
                            max_concurrent_steps=min(cfg.stages, max(nk, 2)))(
            x_gmem, *([w_gmem] * n_acc))
        for t in range(acc_tiles):  # [64, width] -> the output's [width, 64], transposed
            out = epilogue(*(accs[t * n_acc + c][...] for c in range(n_acc)))
            if columns_major:
                o_smem[:, pl.ds(t * width, width)] = out
            else:
                o_smem.transpose((1, 0))[:, pl.ds(t * width, width)] = out

    pl.run_scoped(scope, *(plgpu.ACC((BM, width), jnp.float32)
                           for _ in range(acc_tiles * n_acc)))
    plgpu.commit_smem()
    # Tokens past the array's end are not stored (TMA skips them).
    tokens, columns = pl.ds(g * tiles * BT, tiles * BT), pl.ds(j * BM, BM)
    o = o_gmem if s is None else o_gmem.at[s]
    plgpu.copy_smem_to_gmem(o_smem, o.at[(columns, tokens) if columns_major
                                         else (tokens, columns)])
    plgpu.wait_smem_to_gmem(0)


def _check(x: jax.Array, w: jax.Array, name: str) -> None:
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"{name} wants x [M, K] and w [K, N]; got {x.shape=} {w.shape=}")
    if x.dtype != w.dtype or x.dtype.name not in DTYPES:
        raise TypeError(f"{name} (Mosaic GPU) wants x and w of one dtype in {DTYPES} (an "
                        f"f32 wgmma multiplies in TF32); got {x.dtype=} {w.dtype=}")


def _fit_table_tile(cfg: PrefillConfig, width: int, dtype, out_dtype, weights: int
                    ) -> PrefillConfig | None:
    """A table's ws tile for this launch: its pipeline made shallower where this output
    dtype's epilogue needs the room (stages are scheduling; the sweep wrote the tile for
    a 16-bit output), or None where it cannot run here (the width, or no 2 stages fit):
    the launch keeps the library config, whose bits it has."""
    if width % cfg.cluster_cols:
        return None
    for stages in range(cfg.stages, 1, -1):
        fit = dataclasses.replace(cfg, stages=stages)
        if fit.smem_bytes(dtype, out_dtype, weights) <= SMEM_MAX:
            return fit
    return None


def _config(config, K: int, N: int, dtype, name: str, m: int = 1, schedule: bool = False
            ) -> MosaicMatmulConfig:
    if config is None:
        return mosaic_launch_config(K, N, dtype, m, schedule)
    if not isinstance(config, (MosaicMatmulConfig, PrefillConfig)):
        raise TypeError(f"{name} (Mosaic GPU) takes a MosaicMatmulConfig, a PrefillConfig "
                        f"or None; got "
                        f"{type(config).__name__} (the Triton lowering's tiles, e.g. a "
                        "tensor-parallel column config, which this lowering lacks so far)")
    return config


def _launch(x, w, cfg: MosaicMatmulConfig, n_out: int, out_dtype, column_offsets, epilogue,
            interpret: bool, name: str, columns_major: bool = False):
    """Pads K (and rows to a multiple of 8, which TMA's 8-row tiles need) with zeros where
    needed and runs `_kernel` over a (row tiles, n_out / bn) grid. -> [Mr, n_out]
    (columns_major, swapped only: the transpose [n_out, Mo], Mo the programs' tokens); a
    split config: the (row tiles, n_out / bn, splits) grid's [splits, ...] partials."""
    m, k = x.shape
    # Extra K terms add exact zeros at the end of the (last chunk's) sum.
    kp = round_up(k, cfg.splits * cfg.bk)
    nk = kp // (cfg.splits * cfg.bk)  # K steps a program (of its chunk)
    xp = pad_axis(pad_axis(x, 1, kp), 0, m if m <= 8 else round_up(m, 8))  # [Mr, Kp]
    wp = pad_axis(w, 0, kp)
    if cfg.swapped:  # up to cfg.token_tiles 16-token tiles a program
        tiles = min(cfg.token_tiles, -(-xp.shape[0] // BT))
        stages = swapped_stages(cfg, tiles, x.dtype, out_dtype, len(column_offsets))
        kernel = functools.partial(_kernel_swapped, cfg=dataclasses.replace(cfg, stages=stages),
                                   nk=nk, tiles=tiles,
                                   column_offsets=column_offsets, epilogue=epilogue,
                                   columns_major=columns_major)
        o_tile, m_tile = (BT * tiles, BM), BT * tiles
    else:
        if columns_major:
            raise ValueError("columns_major is the swapped design's store")
        kernel = functools.partial(_kernel, cfg=cfg, nk=nk,
                                   column_offsets=column_offsets, epilogue=epilogue)
        o_tile, m_tile = (BM, cfg.bn), BM
    out_shape = (xp.shape[0], n_out)
    if columns_major:  # every program's token box inside the array (none clipped)
        o_tile, out_shape = o_tile[::-1], (n_out, round_up(xp.shape[0], m_tile))
    # Row tiles first: the tiles of one weight column block run side by side.
    grid, names = (-(-xp.shape[0] // m_tile), n_out // cfg.bn), ("m", "n")
    if cfg.splits > 1:  # the f32 partials [splits, ...] of the K chunks
        out_shape, grid, names = (cfg.splits, *out_shape), (*grid, cfg.splits), (*names, "s")
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        scratch_types=dict(o_smem=plgpu.SMEM(o_tile, out_dtype)),
        grid=grid,
        grid_names=names,
        kernel_name=name,
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(xp, wp)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "config", "row_group",
                                             "schedule"))
def matmul(x: jax.Array, w: jax.Array, *, out_dtype=None, interpret: bool = False,
           config: MosaicMatmulConfig | None = None, row_group: int = 1,
           schedule: bool = False) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in out_dtype (default float32), on Mosaic GPU.

    `config` overrides `mosaic_launch_config(K, N, dtype, M, schedule)` (sweeps and
    tests). Any fixed config is row-invariant; two bk give different bits. `schedule`: a
    launch past TALL_ROWS rows takes the weight's tall or prefill tile (never in interpret
    mode, where numpy's products may round by block shape). `row_group`, the Triton
    lowering's other knob, is accepted and unused: a 64-row tile already holds a batch-8
    verify block. `interpret`: run in Pallas's GPU interpret mode (CPU).
    """
    check_out_dtype("matmul", out_dtype)
    del row_group
    _check(x, w, "matmul")
    out_dtype = jnp.dtype(jnp.float32 if out_dtype is None else out_dtype)
    m, k = x.shape
    n = w.shape[1]
    cfg = _config(config, k, n, w.dtype, "matmul", m, schedule and not interpret)
    if isinstance(cfg, PrefillConfig):  # a tall launch on the warp-specialized design
        if config is None:
            cfg = _fit_table_tile(cfg, n, w.dtype, out_dtype, 1)
        if cfg is not None:  # (a given one runs as given: a bad N or size is its error)
            return prefill_matmul(x, w, config=cfg, out_dtype=out_dtype, interpret=interpret)
        cfg = mosaic_matmul_config(k, n, w.dtype)
    if m == 0:  # no rows: no launch (a grid of no row tiles)
        return jnp.zeros((0, n), out_dtype)
    # Mosaic GPU finds no layout for an f32 tile's transposed store: the swapped design
    # stores f32 outputs column-major, as its accumulators lie, and the result is their
    # transpose (the same values: a layout change, no arithmetic).
    wp = pad_axis(w, 1, round_up(n, cfg.bn))  # [K, Np]; real model widths divide bn
    if cfg.splits > 1:  # f32 partials of the K chunks, added left to right
        _check_chunks(cfg, k)
        parts = _launch(x, wp, cfg, wp.shape[1], jnp.float32, (0,), lambda acc: acc,
                        interpret, "jspec_mosaic_matmul_splitk", columns_major=cfg.swapped)
        parts = jnp.swapaxes(parts[:, :n, :m], 1, 2) if cfg.swapped else parts[:, :m, :n]
        return add_partials(parts, out_dtype)
    columns_major = cfg.swapped and out_dtype.itemsize != 2
    out = _launch(x, wp, cfg, wp.shape[1], out_dtype, (0,),
                  lambda acc: acc.astype(out_dtype), interpret, "jspec_mosaic_matmul",
                  columns_major=columns_major)
    return out[:n, :m].T if columns_major else out[:m, :n]


@functools.partial(jax.jit, static_argnames=("splits", "interpret", "config"))
def matmul_partials(x: jax.Array, w: jax.Array, *, splits: int, interpret: bool = False,
                    config: MosaicMatmulConfig | None = None) -> jax.Array:
    """x [M, K] @ w [K, N] as `splits` f32 partials [splits, M, N], NOT summed, on Mosaic
    GPU: partial c is this lowering's `matmul` of the c-th of `splits` equal K chunks
    (x[:, cK':(c+1)K'] @ w[cK':(c+1)K'], K' = K / splits) with an f32 output, so each is
    one sequential K walk with the tiles of (K', N) (`config` overrides them) and its f32
    accumulator unrounded. A caller adds the partials left to right, with others from
    other devices in between (row-parallel tensor parallelism, `row_partials`): the chunk
    boundaries and each chunk's arithmetic are the same however the chunks are spread
    over devices. With more than one chunk a launch, each chunk's slice of w is a copy
    (XLA hands a kernel whole buffers): `row_partials` above the device count is a
    setting for the bits of a tensor-parallel degree, not a fast path.
    `pallas_kernels.matmul.matmul_partials` is the Triton lowering's."""
    _check(x, w, "matmul_partials")
    k = x.shape[1]
    if (isinstance(splits, (bool, np.bool_)) or not isinstance(splits, (int, np.integer))
            or splits < 1 or k % splits):
        raise ValueError(f"matmul_partials: K={k} must split into {splits=} equal chunks")
    splits, kc = int(splits), k // int(splits)
    if config is not None:  # checked here, so the error names this function
        _config(config, kc, w.shape[1], w.dtype, "matmul_partials")
        if getattr(config, "splits", 1) > 1:
            raise ValueError(f"matmul_partials (Mosaic GPU) takes no split config (splits="
                             f"{config.splits}): each partial is one walk over its chunk")
    return jnp.stack([matmul(x[:, c * kc:(c + 1) * kc], w[c * kc:(c + 1) * kc],
                             out_dtype=jnp.float32, interpret=interpret, config=config)
                      for c in range(splits)])


@functools.partial(jax.jit, static_argnames=("activation", "interpret", "row_group", "config",
                                             "schedule"))
def matmul_glu(x: jax.Array, w: jax.Array, *, activation: str, interpret: bool = False,
               row_group: int = 1, config: MosaicMatmulConfig | None = None,
               schedule: bool = False) -> jax.Array:
    """act(x @ w[:, :F]) * (x @ w[:, F:]) for x [M, K], w [K, 2F]; returns x.dtype.

    Bitwise `glu`'s arithmetic on this lowering's `matmul(x, w, out_dtype=x.dtype)`
    halves: the tiles of the [K, 2F] weight (`config` overrides them), the same K order.
    F must be a multiple of the column tile. `schedule` as in `matmul`; `row_group`
    unused."""
    del row_group
    _check(x, w, "matmul_glu")
    check_glu_weight(w, activation)
    m, k = x.shape
    f = w.shape[1] // 2
    cfg = _config(config, k, 2 * f, w.dtype, "matmul_glu", m, schedule and not interpret)
    if isinstance(cfg, PrefillConfig):  # a tall launch on the warp-specialized design
        if config is None:
            cfg = _fit_table_tile(cfg, f, w.dtype, x.dtype, 2)
        if cfg is not None:  # (a given one runs as given: a bad F or size is its error)
            return prefill_matmul_glu(x, w, activation=activation, config=cfg,
                                      interpret=interpret)
        cfg = mosaic_matmul_config(k, 2 * f, w.dtype)
    if cfg.splits > 1:  # the GLU needs each half's rounded sum in the program
        raise ValueError(f"matmul_glu (Mosaic GPU) takes no split config (splits="
                         f"{cfg.splits}): the GLU runs on each half's whole K sum")
    if f % cfg.bn:
        raise ValueError(f"matmul_glu (Mosaic GPU): F={f} must be a multiple of the column "
                         f"tile bn={cfg.bn} of w {w.shape}")
    if m == 0:
        return jnp.zeros((0, f), x.dtype)
    # Two weight blocks a step: a shallower pipeline in the same shared memory.
    cfg = dataclasses.replace(cfg, stages=min(cfg.stages,
                                              pipeline_stages(cfg.bk, cfg.bn, w.dtype, 2)))
    dtype = x.dtype

    def epilogue(gate, up):  # [BM, bn] f32 each, rounded to the dtype as `matmul` does
        return _glu_tile(gate.astype(dtype), up.astype(dtype), activation)

    out = _launch(x, w, cfg, f, dtype, (0, f // cfg.bn), epilogue, interpret,
                  "jspec_mosaic_matmul_glu")
    return out[:m]
