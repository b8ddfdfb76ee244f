"""Does `grid_barrier` order memory across the programs of a persistent kernel?

  python experiments/barrier_check.py --out=experiments/results            # H200
  python experiments/barrier_check.py --interpret --programs=1 --rounds=4 \
      --out=/tmp                                                           # CPU smoke

One Pallas kernel of P programs runs R rounds. In round r every program writes its
value (r mod 7) * 1000 + pid into its row of a [2, P_pad, 32] int32 buffer (the half
r mod 2), passes barrier r, reads all P rows of that half (volatile loads) and
compares their sum with the exact expected sum; a program counts its bad rounds. A
barrier that lets a program read before another's write is visible shows as bad
rounds; a barrier that never releases would hang (the device call's time limit is the
guard). Writing half r mod 2 is safe because a program can only start round r + 2's
write after every program has arrived at barrier r + 1, i.e. finished reading round
r. Each (P, spin) pair runs --repeats launches; the receipt has the bad rounds of
every program and the kernel's device time per barrier. Writes
`barrier_check[_tag].json`.
"""

from __future__ import annotations

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

_PROGRAMS = flags.DEFINE_list("programs", ["132", "264"], "programs (all must be resident)")
_SPINS = flags.DEFINE_list("spins", list(SPINS), "barrier polling variants")
_ROUNDS = flags.DEFINE_integer("rounds", 400, "barriers per launch")
_REPEATS = flags.DEFINE_integer("repeats", 5, "launches per (programs, spin)")
_WARPS = flags.DEFINE_integer("num_warps", 8, "warps per program")
_INTERPRET = flags.DEFINE_bool("interpret", False, "CPU smoke run (--programs=1 only)")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")

WIDTH = 32


def stress(programs: int, rounds: int, spin: str, interpret: bool):
    """() -> bad rounds per program, [P_pad] int32 (zeros past P)."""
    ppad = 1 << (programs - 1).bit_length()

    def kernel(slots_in, bar_in, slots, bar, bad_ref):
        del slots_in, bar_in  # aliased to slots, bar
        pid = pl.program_id(0)
        rows = lax.broadcasted_iota(jnp.int32, (ppad, WIDTH), 0)
        base = programs * (programs - 1) // 2  # sum of pid over programs

        def body(r, bad):
            half = lax.rem(r, 2)  # (r >= 0; jnp % lowers badly to Triton here)
            val = lax.rem(r, 7) * 1000
            slots[half, pl.ds(pid, 1), :] = jnp.full((1, WIDTH), val + pid, jnp.int32)
            grid_barrier(bar, r, programs, interpret=interpret, spin=spin)
            got = plgpu.load(slots.at[half, pl.ds(0, ppad), :], mask=rows < programs,
                             other=0, volatile=True)  # [P_pad, WIDTH]
            want = WIDTH * (val * programs + base)
            return bad + (jnp.sum(got) != want).astype(jnp.int32)

        bad = lax.fori_loop(0, rounds, body, jnp.int32(0))
        bad_ref[pl.ds(pid, 1)] = jnp.full((1,), bad, jnp.int32)

    def run():
        slots = jnp.zeros((2, ppad, WIDTH), jnp.int32)
        bar = jnp.zeros((rounds,), jnp.int32)
        return pl.pallas_call(
            kernel, grid=(programs,),
            out_shape=[jax.ShapeDtypeStruct(slots.shape, jnp.int32),
                       jax.ShapeDtypeStruct(bar.shape, jnp.int32),
                       jax.ShapeDtypeStruct((ppad,), jnp.int32)],
            input_output_aliases={0: 0, 1: 1},
            compiler_params=triton_params(_WARPS.value, 1), interpret=interpret,
            name="barrier_check",
        )(slots, bar)[2]

    return jax.jit(run)


def main(_):
    interp = _INTERPRET.value
    programs = [int(p) for p in _PROGRAMS.value]
    if any(p < 1 for p in programs) or (interp and programs != [1]):
        raise app.UsageError("--programs: counts >= 1 (interpret mode: only 1, since its "
                             f"programs run one after another); got {_PROGRAMS.value}")
    for s in _SPINS.value:
        if s not in SPINS:
            raise app.UsageError(f"--spins: each of {SPINS}; got {s!r}")
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
              "rounds": _ROUNDS.value, "repeats": _REPEATS.value,
              "num_warps": _WARPS.value, "results": []}
    for p in programs:
        for spin in _SPINS.value:
            fn = stress(p, _ROUNDS.value, spin, interp)
            bad = [np.asarray(jax.block_until_ready(fn()))[:p] for _ in range(_REPEATS.value)]
            with tempfile.TemporaryDirectory() as d:
                trace, _ = traced(lambda fn=fn: jax.block_until_ready(fn()), d)
            ev = [e for e in device_events(trace) if e["name"].startswith("barrier_check")]
            us = ev[0]["dur"] if ev else float("nan")
            r = {"programs": p, "spin": spin,
                 "bad_rounds_per_launch": [int(b.sum()) for b in bad],
                 "programs_with_bad_rounds": [int((b > 0).sum()) for b in bad],
                 "us_per_launch": us, "us_per_barrier": us / _ROUNDS.value}
            report["results"].append(r)
            print(f"P={p:4d} spin={spin:8s}: bad rounds per launch {r['bad_rounds_per_launch']}"
                  f" (of {p} x {_ROUNDS.value}), {r['us_per_barrier']:.2f} us a round",
                  flush=True)
    print(f"receipt: {write_receipt(_OUT.value, 'barrier_check', _TAG.value, report)}")


if __name__ == "__main__":
    app.run(main)
