"""Fingerprints of every Triton kernel the H200 would run, computed on a CPU.

  python experiments/lowered_ir.py --out=/tmp/before.json                 # before a change
  python experiments/lowered_ir.py --compare=/tmp/before.json             # after it

A refactor of kernel code, or a change meant to be scheduling only, is proven by
the parity matrix on the device. This is the cheaper first check: jax lowers the
Qwen3-8B and Gemma-3-4B forwards (2 layers, abstract weights) for the "cuda"
platform with the H200's device description, as `tests/test_gpu_lowering.py` does,
and each Pallas call's Triton IR (with its grid, warps and stages) is hashed, and
so is the rest of the program (the XLA ops between the kernels, whose rounding the
parity promise covers as well).
Source locations are left out of the IR (`JAX_TRACEBACK_IN_LOCATIONS_LIMIT=0`, set
before jax loads), so moving code or renaming a helper leaves the hashes alone, and
equal hashes mean the device compiles the same program: same bits, no device time.
A changed hash says which kernel to prove on the device. Nothing is compiled to PTX.
"""

from __future__ import annotations

import os

os.environ["JAX_TRACEBACK_IN_LOCATIONS_LIMIT"] = "0"  # before jax is imported

import difflib  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from jax._src.pallas.triton import gpu_info, pallas_call_registration  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from jspec.cache import init_cache  # noqa: E402
from jspec.config import options  # noqa: E402
from jspec.model import Model, _forward  # noqa: E402
from jspec.random_model import preset_config, random_params  # noqa: E402

_SHAPES = flags.DEFINE_list(
    "shapes", ["qwen3-8b:1x1", "qwen3-8b:1x5", "qwen3-8b:8x1", "qwen3-8b:8x5",
               "qwen3-8b:8x9", "qwen3-8b:1x70", "gemma3-4b:1x1", "gemma3-4b:8x5"],
    "preset:BxT forwards to lower (2 layers, a 256-token cache)")
_OPTIONS = flags.DEFINE_list("options", [], "speed options (jspec.config.options)")
_OUT = flags.DEFINE_string("out", "", "write the fingerprints here (JSON)")
_COMPARE = flags.DEFINE_string("compare", "", "compare with fingerprints written earlier")

_CONFIG = "mhlo.backend_config = {"


def _triton_configs(text: str) -> list[dict[str, str]]:
    """The backend_config fields of every Triton custom call in lowered StableHLO text
    (values as written: strings keep their quotes and escapes)."""
    out = []
    for line in text.splitlines():
        if "@__gpu$xla.gpu.triton" not in line or _CONFIG not in line:
            continue
        i, fields = line.index(_CONFIG) + len(_CONFIG), {}
        while True:
            while line[i] in " ,":
                i += 1
            if line[i] == "}":
                break
            key = re.match(r"\w+", line[i:]).group(0)
            i += len(key) + 3  # "key = "
            if line[i] == '"':  # a string: up to the next unescaped quote
                j = i + 1
                while line[j] != '"':
                    j += 2 if line[j] == "\\" else 1
                fields[key], i = line[i:j + 1], j + 1
            else:
                j = i
                while line[j] not in ",}":
                    j += 1
                fields[key], i = line[i:j].strip(), j
        out.append(fields)
    return out


def fingerprints(shape: str) -> list[str]:
    """'name grid warps stages sha' of each Triton call of one lowered forward, in order."""
    preset, _, bt = shape.partition(":")
    batch, tokens = (int(v) for v in bt.split("x"))
    cfg = preset_config(preset, num_layers=2, interpret=False).replace(
        **options(*_OPTIONS.value))
    model = Model(config=cfg, params=jax.eval_shape(lambda: random_params(cfg)))
    cache = jax.eval_shape(lambda: init_cache(model, batch, 256))
    toks = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
    text = jax.jit(_forward).trace(model, toks, cache).lower(
        lowering_platforms=("cuda",)).as_text()
    out = []
    for field in _triton_configs(text):
        num = {k: v.split(":")[0].strip() for k, v in field.items() if k != "ir"}
        ir = hashlib.sha256(field["ir"].encode()).hexdigest()[:16]
        grid = "x".join(num.get(f"grid_{a}", "?") for a in "xyz")
        out.append(f"{num['name'].strip(chr(34))} grid {grid} warps {num.get('num_warps')} "
                   f"stages {num.get('num_stages')} {ir}")
    # Everything else of the program (the XLA ops between the kernels), kernels' IR blanked.
    glue = re.sub(r'ir = "(?:[^"\\]|\\.)*"', 'ir = ""', text)
    return out + [f"(the program around them) {hashlib.sha256(glue.encode()).hexdigest()[:16]}"]


def main(argv):
    del argv
    info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    pallas_call_registration.gpu_info_lib.get_gpu_info = lambda *a, **k: info
    got = {shape: fingerprints(shape) for shape in _SHAPES.value}
    for shape, calls in got.items():
        print(f"{shape}: {len(calls)} Triton calls")
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump({"options": _OPTIONS.value, "jax": jax.__version__, "kernels": got}, f,
                      indent=1)
        print(f"written: {_OUT.value}")
    if _COMPARE.value:
        with open(_COMPARE.value) as f:
            old = json.load(f)["kernels"]
        changed = 0
        for shape in got:
            if shape not in old:
                print(f"{shape}: not in {_COMPARE.value}")
                continue
            diff = [d for d in difflib.unified_diff(old[shape], got[shape], "was", "now",
                                                    lineterm="", n=0)
                    if d[:1] in "+-" and d[:3] not in ("---", "+++")]
            if diff:
                changed += 1
                print(f"{shape}:\n  " + "\n  ".join(diff))
        print("the same kernels" if not changed else f"{changed} shapes differ")
        sys.exit(1 if changed else 0)


if __name__ == "__main__":
    app.run(main)
