"""Can one persistent kernel stream a latency-bound draft forward faster than a chain?

  python experiments/persistent_floor.py --out=experiments/results         # H200
  python experiments/persistent_floor.py --interpret --layers=2 --programs=1 \
      --out=/tmp                                                           # CPU smoke

`launch_floor.py` showed that a chain of dependent kernels costs ~2 us per kernel
before its bytes, so a Qwen3-0.6B forward built kernel by kernel cannot get under
~0.6 ms. This script measures the alternative: the same forward's weight traffic as
ONE Pallas kernel of P programs (one or two per SM) that walks the layers itself and
separates dependent phases with a grid-wide barrier (an arrival counter per barrier,
atomics with acquire/release semantics, polled with the acquire RMW:
`grid_barrier.py`). Each layer has the draft's five dependent phases with its weight
bytes:

  qkv    x[1024]   @ [1024, 4096]   (8 MB; RMSNorm of the residual in the prologue)
  attn   q[768]    @ [768, 2048]    (3 MB: a stand-in with a 768-key cache's bytes)
  wo     a[2048]   @ [2048, 1024]   (4 MB)
  gu     x'[1024]  @ [1024, 6144]   (12 MB; residual + RMSNorm in the prologue)
  down   u[3072]   @ [3072, 1024]   (6 MB; SiLU(gate) * up in the prologue)

and then the 1024 x 151,936 LM head (311 MB). Every phase is split into 32 KB weight
tiles (split-K): a tile's partial sums go to a [splits, N] buffer and the next phase
reduces them in a fixed order in its prologue, so no atomics touch data and the result
is deterministic. The same phase code also runs as a chain of one kernel per phase
(`chain`), and the persistent kernel's output is compared with the chain's: a barrier
that let a phase start early would read stale partials, an O(1) error, while two
separately compiled kernels may at most round a tile's sum differently (the report
gives both the bit check and the largest relative difference). With --prefetch=d a
program keeps d weight tiles in flight ahead of the one it uses and loads its first
tile of the next phase before it waits at the barrier. --tile_scale widens the tiles,
--matvec=dot runs them on the tensor cores, --noact_volatile reads other programs'
data through the L1 (relying on the barrier's acquire alone).

Timings are device events from a profiler trace (the chain: first start to last end).
Writes `persistent_floor[_tag].json` and prints a table with the speedup each forward time
would give at a = 0.8, gamma 4 (the issue's operating point; inputs in flags).
It is a floor study of weight traffic and synchronisation, not a model: the attention
phase is a matvec with attention's bytes, and nothing here is exact arithmetic of the
draft (the draft's numerics never change jspec's output).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from grid_barrier import SPINS, grid_barrier  # noqa: E402
from receipts import write_receipt  # noqa: E402
from trace_tools import device_events, traced  # noqa: E402

from pallas_kernels._common import triton_params  # noqa: E402

_LAYERS = flags.DEFINE_integer("layers", 28, "layers (Qwen3-0.6B: 28)")
_PROGRAMS = flags.DEFINE_list("programs", ["132", "264"], "programs of the persistent "
                              "kernel (all must be resident at once: <= SMs x CTAs/SM)")
_WARPS = flags.DEFINE_integer("num_warps", 8, "warps per program")
_PREFETCH = flags.DEFINE_list("prefetch", ["0", "1"], "prefetch depths to run: weight "
                               "tiles a program loads ahead of the one it uses (0: none; "
                               ">= 1 also loads the next phase's first tile before a barrier)")
_SCALE = flags.DEFINE_list("tile_scale", ["1"], "tile widths to run: bn x this (1: 32 KB "
                           "tiles, 2: 64 KB, ...)")
_MATVEC = flags.DEFINE_list("matvec", ["reduce"], "how a tile's dot is computed: reduce "
                            "(f32 multiply + sum over the tile's rows) or dot (the tensor "
                            "cores: the activation as row 0 of a 16-row bf16 operand)")
_VOLATILE = flags.DEFINE_bool("act_volatile", True, "load other programs' partials and "
                              "residuals volatile (never from the L1); off relies on the "
                              "barrier's acquire alone (a stale read shows as a difference)")
_SPIN = flags.DEFINE_list("spin", ["atomic"], "grid barrier polling variants to run "
                         f"(persistent kernel only; {'/'.join(SPINS)}; barrier_check.py)")
_LM_HEAD = flags.DEFINE_bool("lm_head", True, "include the 1024 x 151,936 LM head")
_ITERS = flags.DEFINE_integer("iters", 5, "traced forwards per variant")
_INTERPRET = flags.DEFINE_bool("interpret", False, "CPU smoke run (timings mean nothing)")
_TOKENS = flags.DEFINE_float("tokens_per_round", 3.31, "committed tokens per round "
                             "(a = 0.8, gamma 4, 4 oracle seeds, 2026-11-30e)")
_SERIAL = flags.DEFINE_float("serial_ms", 5.27, "target decode step, ms (B=1)")
_VERIFY = flags.DEFINE_float("verify_ms", 5.43, "target verify(5) step, ms (B=1)")
_OVERHEAD = flags.DEFINE_float("overhead_ms", 0.3, "a round's bookkeeping, ms")
_GAMMA = flags.DEFINE_integer("gamma", 4, "draft forwards per round")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")

H, Q, F, KEYS, VOCAB = 1024, 2048, 3072, 768, 151936
PHASES_PER_LAYER = 5


@dataclasses.dataclass(frozen=True)
class Phase:
    """One matvec phase: act[K] @ W[K, N], in [kc, bn] weight tiles (split-K)."""
    name: str
    k: int
    n: int
    kc: int
    bn: int

    @property
    def splits(self) -> int:
        return self.k // self.kc

    @property
    def splits_pad(self) -> int:  # the partial buffer's rows: a power of 2 for Triton
        return 1 << (self.splits - 1).bit_length()

    @property
    def items(self) -> int:
        return self.splits * (self.n // self.bn)


QKV = Phase("qkv", H, Q + 2 * H, 256, 64)    # 256 tiles
ATTN = Phase("attn", KEYS, Q, 128, 64)       # 192 tiles
WO = Phase("wo", Q, H, 256, 64)              # 128 tiles
GU = Phase("gu", H, 2 * F, 256, 64)          # 384 tiles
DOWN = Phase("down", F, H, 512, 32)          # 192 tiles
LM = Phase("lm", H, VOCAB, 256, 64)          # 9496 tiles
LAYER_PHASES = (QKV, ATTN, WO, GU, DOWN)


@dataclasses.dataclass(frozen=True)
class Variant:
    """How the phases run (never what they compute, up to rounding)."""
    scale: int = 1  # tiles `scale` x wider
    vol: bool = True  # other programs' data loaded volatile
    dot: bool = False  # tensor-core dot instead of multiply + reduce
    spin: str = "atomic"  # how a grid barrier polls its counter (grid_barrier.SPINS)

    def wide(self, ph: Phase) -> Phase:
        """ph with this variant's tile width."""
        return dataclasses.replace(ph, bn=ph.bn * self.scale)


def _sum_rows(ref, k0, size, volatile=True):
    """[S_pad, N] partials -> [size] f32: rows summed in order 0, 1, ... (pad rows are 0).
    Data other programs wrote is loaded volatile (from the L2, never a stale L1 line);
    jax 0.11.2's Triton lowering rejects every cache modifier ('.cg' is looked up in a
    table keyed 'cg', and 'cg' is refused before the lookup)."""
    return jnp.sum(plgpu.load(ref.at[:, pl.ds(k0, size)], volatile=volatile), axis=0)


def _rms_scale(x):  # x [H] f32 -> scalar
    return lax.rsqrt(jnp.mean(x * x) + 1e-6)


class _Bufs:
    """The kernel's refs by name (weights, partial buffers, residuals, barrier counters)."""

    def __init__(self, refs: dict):
        self.__dict__.update(refs)


def _coords(ph: Phase, i):
    """Item i (clamped to the last item) -> (split index, row offset, column offset)."""
    i = jnp.minimum(i, ph.items - 1)
    s, nt = i % ph.splits, i // ph.splits
    return s, s * ph.kc, nt * ph.bn


def _tile(ph: Phase, w_ref, layer, i):
    """The weight tile of item i (clamped to the last item) -> [kc, bn] bf16."""
    _, k0, n0 = _coords(ph, i)
    # One indexer per access: the Triton lowering does not compose `.at` views.
    if layer is None:
        view = w_ref.at[pl.ds(k0, ph.kc), pl.ds(n0, ph.bn)]
    else:
        view = w_ref.at[jnp.asarray(layer, jnp.int32), pl.ds(k0, ph.kc), pl.ds(n0, ph.bn)]
    return plgpu.load(view)


def _run_phase(ph: Phase, pid, programs: int, w_ref, layer, act, out_ref, pre, prefetch: int,
               var: Variant = Variant()):
    """Program pid's share of a phase: items pid, pid + P, ...; act(k0) -> [kc] f32.
    pre: this program's first tile, already loaded (or None)."""
    ph = var.wide(ph)
    rounds = -(-ph.items // programs)
    # Item i is split i % S of column tile i // S. When S divides P, every item of a
    # program has the split pid % S: its activation chunk is loaded once per phase.
    fixed = act((pid % ph.splits) * ph.kc) if programs % ph.splits == 0 else None

    def one(r, w):
        i = pid + r * programs
        s, k0, n0 = _coords(ph, i)
        a = fixed if fixed is not None else act(k0)  # [kc] f32
        if var.dot:  # [16, kc] bf16 (row 0: a) @ [kc, bn] on the tensor cores
            rows = lax.broadcasted_iota(jnp.int32, (16, ph.kc), 0)
            a16 = jnp.where(rows == 0, a[None, :], 0.0).astype(w.dtype)
            d = jnp.dot(a16, w, preferred_element_type=jnp.float32)  # [16, bn]
            # Row 0 (Triton lowers no slice): a sum with 15 exact zeros.
            pick = lax.broadcasted_iota(jnp.int32, d.shape, 0) == 0
            y = jnp.sum(jnp.where(pick, d, 0.0), axis=0)  # [bn]
        else:
            y = jnp.sum(a[:, None] * w.astype(jnp.float32), axis=0)  # [bn]

        @pl.when(i < ph.items)
        def _():
            out_ref[s, pl.ds(n0, ph.bn)] = y

    w0 = pre if pre is not None else _tile(ph, w_ref, layer, pid)
    depth = min(int(prefetch), rounds)  # tiles in flight ahead of the one in use
    if depth:  # tiles r + 1 .. r + depth load before tile r is used; the tail loads none
        def tile(r):
            return _tile(ph, w_ref, layer, pid + r * programs)

        def body(r, win):
            nxt = tile(r + depth)
            one(r, win[0])
            return (*win[1:], nxt)
        win = (w0, *(tile(r) for r in range(1, depth)))
        win = lax.fori_loop(0, rounds - depth, body, win)
        for j, w in enumerate(win):
            one(rounds - depth + j, w)
    else:
        def body(r, carry):
            one(r, _tile(ph, w_ref, layer, pid + r * programs))
            return carry
        one(0, w0)
        lax.fori_loop(1, rounds, body, 0)


def _acts(b: _Bufs, ph: Phase, layer, pid, vol: bool = True):
    """The phase's prologue: act(k0) -> [kc] f32 from the previous phase's partials.
    Program 0 also writes the residual the phase produces (read two barriers later)."""
    if ph is ATTN:
        return lambda k0: _sum_rows(b.p_qkv, k0, ph.kc, vol)
    if ph is WO:
        return lambda k0: _sum_rows(b.p_attn, k0, ph.kc, vol)
    if ph is DOWN:
        def act(k0):
            g = _sum_rows(b.p_gu, k0, ph.kc, vol)
            u = _sum_rows(b.p_gu, F + k0, ph.kc, vol)
            return g * jax.nn.sigmoid(g) * u
        return act
    # qkv, gu and the head: residual + partials, RMSNorm (1 + w) in the prologue.
    first = False
    if ph is GU:  # X[l] + wo partials -> Xmid[l]
        (base, row), parts, dst = (b.X, layer), b.p_wo, (b.Xmid, layer)
    elif ph is QKV:  # Xmid[l - 1] + down partials -> X[l]; x0 at layer 0
        first = layer == 0
        (base, row), parts, dst = (b.Xmid, jnp.maximum(layer - 1, 0)), b.p_down, (b.X, layer)
    else:  # the head: Xmid[L - 1] + down partials
        (base, row), parts, dst = (b.Xmid, jnp.int32(b.Xmid.shape[0] - 1)), b.p_down, None
    full = plgpu.load(base.at[row, :], volatile=vol) + _sum_rows(parts, 0, H, vol)  # [H]
    if ph is QKV:
        full = jnp.where(first, b.x0[...], full)
    scale = _rms_scale(full)
    if dst is not None:
        @pl.when(pid == 0)
        def _():
            dst[0][dst[1], :] = full

    def act(k0):
        piece = plgpu.load(base.at[row, pl.ds(k0, ph.kc)], volatile=vol) + _sum_rows(
            parts, k0, ph.kc, vol)
        if ph is QKV:
            piece = jnp.where(first, b.x0[pl.ds(k0, ph.kc)], piece)
        return piece * scale * (1.0 + b.norm_w[pl.ds(k0, ph.kc)])
    return act


def _weights(b: _Bufs, ph: Phase):
    return {"qkv": b.w_qkv, "attn": b.w_attn, "wo": b.w_o, "gu": b.w_gu, "down": b.w_down,
            "lm": b.w_lm}[ph.name]


def _out(b: _Bufs, ph: Phase):
    return {"qkv": b.p_qkv, "attn": b.p_attn, "wo": b.p_wo, "gu": b.p_gu, "down": b.p_down,
            "lm": b.p_lm}[ph.name]


NAMES = ("x0", "norm_w", "w_qkv", "w_attn", "w_o", "w_gu", "w_down", "w_lm", "lidx")
BUF_NAMES = ("p_qkv", "p_attn", "p_wo", "p_gu", "p_down", "p_lm", "X", "Xmid", "bar")


def _buffers(layers: int):
    f32 = jnp.float32
    return {"p_qkv": ((QKV.splits_pad, QKV.n), f32), "p_attn": ((ATTN.splits_pad, ATTN.n), f32),
            "p_wo": ((WO.splits_pad, WO.n), f32), "p_gu": ((GU.splits_pad, GU.n), f32),
            "p_down": ((DOWN.splits_pad, DOWN.n), f32), "p_lm": ((LM.splits_pad, LM.n), f32),
            "X": ((layers, H), f32), "Xmid": ((layers, H), f32),
            "bar": ((PHASES_PER_LAYER * layers + 8,), jnp.int32)}


def _call(kernel, ins, bufs, programs, interpret, name):
    shapes = _buffers(ins["w_qkv"].shape[0])
    n_in = len(NAMES)
    return pl.pallas_call(
        kernel, grid=(programs,),
        out_shape=[jax.ShapeDtypeStruct(*shapes[k]) for k in BUF_NAMES],
        input_output_aliases={n_in + j: j for j in range(len(BUF_NAMES))},
        compiler_params=triton_params(_WARPS.value, 1), interpret=interpret, name=name,
    )(*[ins[k] for k in NAMES], *[bufs[k] for k in BUF_NAMES])


def _unpack(refs) -> _Bufs:
    n_in, n_buf = len(NAMES), len(BUF_NAMES)
    d = dict(zip(NAMES, refs[:n_in], strict=True))
    d.update(zip(BUF_NAMES, refs[n_in + n_buf:], strict=True))  # outputs, aliased to inputs
    return _Bufs(d)


def persistent(ins, bufs, *, programs: int, prefetch: int, lm_head: bool, interpret: bool,
               var: Variant = Variant()):
    """The whole forward as one kernel of `programs` programs."""
    layers = ins["w_qkv"].shape[0]

    def kernel(*refs):
        b = _unpack(refs)
        pid = pl.program_id(0)

        def layer_body(layer, pre):
            for j, ph in enumerate(LAYER_PHASES):
                _run_phase(ph, pid, programs, _weights(b, ph), layer,
                           _acts(b, ph, layer, pid, var.vol), _out(b, ph), pre, prefetch, var)
                nxt = LAYER_PHASES[(j + 1) % len(LAYER_PHASES)]
                nl = layer + 1 if j == len(LAYER_PHASES) - 1 else layer
                if prefetch and nxt is not QKV:
                    pre = _tile(var.wide(nxt), _weights(b, nxt), nl, pid)
                elif prefetch:  # next layer's qkv (clamped at the last layer)
                    pre = _tile(var.wide(QKV), b.w_qkv, jnp.minimum(nl, layers - 1), pid)
                else:
                    pre = None
                grid_barrier(b.bar, layer * PHASES_PER_LAYER + j, programs,
                             interpret=interpret, spin=var.spin)
            return pre

        pre0 = _tile(var.wide(QKV), b.w_qkv, 0, pid) if prefetch else None
        if prefetch:
            lax.fori_loop(0, layers, layer_body, pre0)
        else:
            lax.fori_loop(0, layers, lambda lyr, c: (layer_body(lyr, None), c)[1], 0)
        if lm_head:
            _run_phase(LM, pid, programs, b.w_lm, None, _acts(b, LM, None, pid, var.vol),
                       b.p_lm, None, prefetch, var)

    return _call(kernel, ins, bufs, programs, interpret, "pfloor_persistent")


def chain(ins, bufs, *, programs: int, prefetch: int, lm_head: bool, interpret: bool,
          var: Variant = Variant()):
    """The same phases as one kernel each (what a kernel-per-op forward pays). The layer
    index is an input, so each phase compiles once."""
    layers = ins["w_qkv"].shape[0]

    def kernel(*refs, ph):
        b = _unpack(refs)
        pid = pl.program_id(0)
        lyr = None if ph is LM else b.lidx[0]
        _run_phase(ph, pid, programs, _weights(b, ph), lyr, _acts(b, ph, lyr, pid, var.vol),
                   _out(b, ph), None, prefetch, var)

    calls = [(ph, layer) for layer in range(layers) for ph in LAYER_PHASES]
    calls += [(LM, 0)] if lm_head else []
    for ph, layer in calls:
        args = dict(ins, lidx=jnp.full((8,), layer, jnp.int32))
        out = _call(functools.partial(kernel, ph=ph), args, bufs, programs, interpret,
                    "pfloor_chain")
        bufs = dict(zip(BUF_NAMES, out, strict=True))
    return [bufs[k] for k in BUF_NAMES]


def make_inputs(layers: int, seed: int = 0) -> dict:
    ks = jax.random.split(jax.random.key(seed), 8)

    def w(k, *shape):
        return (0.03 * jax.random.normal(k, shape, jnp.float32)).astype(jnp.bfloat16)

    return {"x0": jax.random.normal(ks[0], (H,), jnp.float32),
            "norm_w": 0.1 * jax.random.normal(ks[1], (H,), jnp.float32),
            "w_qkv": w(ks[2], layers, H, QKV.n), "w_attn": w(ks[3], layers, KEYS, Q),
            "w_o": w(ks[4], layers, Q, H), "w_gu": w(ks[5], layers, H, GU.n),
            "w_down": w(ks[6], layers, F, H), "w_lm": w(ks[7], H, VOCAB),
            "lidx": jnp.zeros((8,), jnp.int32)}


def weight_bytes(layers: int, lm_head: bool) -> int:
    per = sum(p.k * p.n for p in LAYER_PHASES) * 2
    return layers * per + (H * VOCAB * 2 if lm_head else 0)


def _run(fn, ins, layers, iters):
    """(logits [VOCAB] f32 or residual, events of this fn) over `iters` traced calls."""
    def once():
        bufs = {k: jnp.zeros(*v) for k, v in _buffers(layers).items()}
        return fn(ins, bufs)
    out = jax.block_until_ready(once())
    with tempfile.TemporaryDirectory() as d:
        trace, _ = traced(lambda: [jax.block_until_ready(once()) for _ in range(iters)], d)
    events = sorted((e for e in device_events(trace) if e["name"].startswith("pfloor_")),
                    key=lambda e: e["ts"])
    return out, events


def speedup(draft_ms: float) -> float:
    """Speculative speedup over serial decoding at the flags' operating point."""
    round_ms = _VERIFY.value + _OVERHEAD.value + _GAMMA.value * draft_ms
    return _TOKENS.value * _SERIAL.value / round_ms


def main(_):
    layers, interp, iters = _LAYERS.value, _INTERPRET.value, _ITERS.value
    if layers < 1 or iters < 1:
        raise app.UsageError(f"--layers and --iters must be >= 1; got {layers}, {iters}")
    if any(int(p) < 1 for p in _PROGRAMS.value):
        raise app.UsageError(f"--programs: every count must be >= 1; got {_PROGRAMS.value}")
    scales = [int(v) for v in _SCALE.value]
    for sc in scales:
        for p in LAYER_PHASES + (LM,):
            if sc < 1 or p.k % p.kc or p.n % (p.bn * sc):
                raise app.UsageError(f"--tile_scale={sc}: phase {p.name}'s tiles "
                                     f"{p.kc}x{p.bn * sc} do not divide {p.k}x{p.n}")
    ins = make_inputs(layers)
    nbytes = weight_bytes(layers, _LM_HEAD.value)
    n_kernels = layers * PHASES_PER_LAYER + int(_LM_HEAD.value)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
              "layers": layers, "lm_head": _LM_HEAD.value, "weight_bytes": nbytes,
              "num_warps": _WARPS.value, "act_volatile": _VOLATILE.value,
              "operating_point": {
                  "tokens_per_round": _TOKENS.value, "serial_ms": _SERIAL.value,
                  "verify_ms": _VERIFY.value, "overhead_ms": _OVERHEAD.value,
                  "gamma": _GAMMA.value}, "variants": []}
    for mv in _MATVEC.value:
        if mv not in ("reduce", "dot"):
            raise app.UsageError(f"--matvec: 'reduce' or 'dot'; got {mv!r}")
    for sp in _SPIN.value:
        if sp not in SPINS:
            raise app.UsageError(f"--spin: each of {SPINS}; got {sp!r}")
    grid = [(int(p), int(v), sc, mv, sp) for p in _PROGRAMS.value for v in _PREFETCH.value
            for sc in scales for mv in _MATVEC.value for sp in _SPIN.value]
    for programs, pf, sc, mv, sp in grid:
        ref = None  # the chain's output at this grid point: what the persistent kernel,
        # the same item code, must reproduce
        for kind, fn in (("chain", chain), ("persistent", persistent)):
            if kind == "persistent" and interp and programs > 1:
                print(f"persistent P={programs}: skipped (interpret mode runs the "
                      "programs one after another, so a grid barrier would wait "
                      "forever)")
                continue
            f = jax.jit(functools.partial(fn, programs=programs, prefetch=pf,
                                          lm_head=_LM_HEAD.value, interpret=interp,
                                          var=Variant(sc, _VOLATILE.value, mv == "dot",
                                                      sp)))
            t0 = time.perf_counter()
            out, events = _run(f, ins, layers, iters)
            wall = time.perf_counter() - t0
            logits = np.asarray(jnp.sum(out[BUF_NAMES.index("p_lm")], axis=0))
            resid = np.asarray(out[BUF_NAMES.index("Xmid")])
            if ref is None:
                ref = (logits, resid)
            equal = bool(np.array_equal(logits, ref[0]) and np.array_equal(resid, ref[1]))
            # Two separately compiled kernels may reduce a tile's sum in another
            # order, so bits can differ without a race; a barrier that let a phase
            # read stale partials would be off by O(1), not by rounding. (The chain
            # compares with itself: equal, 0.)
            diff = max(np.max(np.abs(logits - ref[0])), np.max(np.abs(resid - ref[1])))
            scale_ = max(np.max(np.abs(ref[0])), np.max(np.abs(ref[1])), 1e-30)
            rel = float(diff / scale_)
            finite = bool(np.isfinite(logits).all() and np.isfinite(resid).all())
            per = n_kernels if kind == "chain" else 1
            if events:
                spans = [events[i + per - 1]["ts"] + events[i + per - 1]["dur"]
                         - events[i]["ts"] for i in range(0, len(events) - per + 1, per)]
                us = float(np.median(spans))
            else:
                us = float("nan")
            r = {"kind": kind, "programs": programs, "prefetch": pf, "tile_scale": sc,
                 "matvec": mv, "spin": sp,
                 "us": us,
                 "tb_s": nbytes / (us * 1e-6) / 1e12 if us == us else None,
                 "us_per_layer": us / layers, "equal_to_chain": equal,
                 "max_rel_diff_to_chain": rel,
                 "sha1": hashlib.sha1(logits.tobytes() + resid.tobytes()).hexdigest(),
                 "finite": finite, "wall_s": wall,
                 "speedup_at_operating_point": speedup(us / 1e3) if us == us else None}
            report["variants"].append(r)
            print(f"{kind:10s} P={programs:3d} prefetch={int(pf)} x{sc} {mv} {sp}: {us:9.1f} us "
                  f"({us / layers:6.2f} us/layer), equal={equal} max rel diff {rel:.1e} "
                  f"finite={finite}",
                  flush=True)
    path = write_receipt(_OUT.value, "persistent_floor", _TAG.value, report)
    print(f"\n{report['device']}, jax {jax.__version__}: {layers} layers "
          f"{'+ LM head ' if _LM_HEAD.value else ''}({nbytes / 1e6:.0f} MB of weights)")
    print(f"{'kind':10s} {'P':>4s} {'pf':>3s} {'x':>2s} {'matvec':>6s} {'spin':>8s} {'us':>9s} "
          f"{'us/layer':>9s} {'TB/s':>6s} {'equal':>6s} {'rel diff':>8s} {'speedup':>8s}")
    for r in report["variants"]:
        print(f"{r['kind']:10s} {r['programs']:4d} {int(r['prefetch']):3d} {r['tile_scale']:2d} "
              f"{r['matvec']:>6s} {r['spin']:>8s} "
              f"{r['us']:9.1f} {r['us_per_layer']:9.2f} {r['tb_s'] or 0:6.2f} "
              f"{str(r['equal_to_chain']):>6s} {r['max_rel_diff_to_chain']:8.1e} "
              f"{r['speedup_at_operating_point'] or 0:8.2f}")
    print("(equal / rel diff: against the chain of the same P, prefetch, tiles x and matvec)")
    print(f"(speedup: {_TOKENS.value} tokens a round x {_SERIAL.value} ms / (verify "
          f"{_VERIFY.value} + {_OVERHEAD.value} + {_GAMMA.value} x draft))")
    print(f"receipt: {path}")


if __name__ == "__main__":
    app.run(main)
