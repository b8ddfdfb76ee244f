"""The Triton IR of every Pallas kernel in a set of forwards, lowered for the H200 on a CPU.

  python experiments/tuning/dump_triton_ir.py --out=/tmp/ir_before
  # ... change the code ...
  python experiments/tuning/dump_triton_ir.py --out=/tmp/ir_after
  diff /tmp/ir_before/hashes.txt /tmp/ir_after/hashes.txt   # nothing: same device code

A change that leaves every kernel's Triton IR byte-identical (locations stripped) leaves
what the device compiles unchanged, so the bits proven there still hold; a change that
does not must be proven on the device again (`gpu_parity`, the sweeps). Covered: the
target forward of the Qwen3-8B and Gemma-3-4B shapes at decode, verify, a 17-token block,
a 70-token and an 1,100-token prefill (B = 1, and B = 8 at decode); decode steps over
4,096 and 65,536 keys (the two-level fold, a program per fold group); the Qwen3-30B-A3B
shape at 1, 2, 5 and 70 tokens, with and without the layout and combine kernels; gpt-oss-20b
and gpt-oss-120b (experts packed, `mxfp4_kernel`: the PTX decode, 4 blocks ahead) at 1
and 5 tokens (and at 1 with the integer decode, `mxfp4_prmt=False`, and 2 blocks ahead);
the fused draft forward of the Qwen3-0.6B and Gemma-3-4B shapes; tree verifies of 17 and 65 tokens.
Nothing runs on a device: `gpu_info` answers with the H200's entry and jax lowers for
"cuda" with abstract weights (as tests/test_gpu_lowering.py does). Writes one
`<case>_<i>_<kernel>.mlir` per kernel, `hashes.txt` (the IR only) and `launch.txt` (each
kernel's warps, stages and grid, which XLA passes beside the IR); `compile_triton_ir.py`
compiles them to PTX with a standalone Triton.
"""

from __future__ import annotations

import hashlib
import os

import jax
import jax.numpy as jnp
from absl import flags
from jax._src.interpreters import mlir
from jax._src.pallas.triton import lowering, pallas_call_registration

from jspec import cli, fused_draft
from jspec.bench.h200_lowering import pretend_h200
from jspec.cache import init_cache
from jspec.model import Model, apply
from jspec.options import DraftOptions
from jspec.random_model import preset_config, random_params
from jspec.tree import from_parents

_OUT = flags.DEFINE_string("out", "/tmp/triton_ir", "folder for the IR files and hashes.txt")

_CAPTURED: list[str] = []
_LAUNCHES: list[str] = []


def _capture(lower):
    def wrapped(*args, **kwargs):
        result = lower(*args, **kwargs)
        _CAPTURED.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    return wrapped


class _LaunchRecorder:
    """`mlir` as pallas_call_registration sees it: records each Triton call's launch."""

    def __getattr__(self, name):
        return getattr(mlir, name)

    def custom_call(self, *args, backend_config=None, **kwargs):
        if isinstance(backend_config, dict) and "num_warps" in backend_config:
            value = {k: int(str(backend_config[k]).split(":")[0]) for k in
                     ("num_warps", "num_stages", "grid_x", "grid_y", "grid_z")}
            _LAUNCHES.append("warps={num_warps} stages={num_stages} "
                             "grid={grid_x},{grid_y},{grid_z}".format(**value))
        return mlir.custom_call(*args, backend_config=backend_config, **kwargs)


def _abstract(preset: str) -> Model:
    cfg = preset_config(preset, num_layers=1)
    return Model(config=cfg, params=jax.eval_shape(lambda: random_params(cfg)))


def _cases():
    """(name, fn, args) of every lowered call."""
    for preset in ["qwen3-8b", "gemma3-4b"]:
        model = _abstract(preset)
        for B, T in [(1, 1), (1, 5), (8, 1), (1, 17), (1, 70)]:
            cache = jax.eval_shape(lambda model=model, B=B: init_cache(model, B, 256))
            yield (f"{preset}_B{B}_T{T}", apply,
                   (model, jax.ShapeDtypeStruct((B, T), jnp.int32), cache))
        # A prefill launch of more than matmul.PREFILL_ROWS rows (the prefill tier).
        cache = jax.eval_shape(lambda model=model: init_cache(model, 1, 2048))
        yield (f"{preset}_B1_T1100", apply,
               (model, jax.ShapeDtypeStruct((1, 1100), jnp.int32), cache))
        for n in (17, 65):
            cache = jax.eval_shape(lambda model=model: init_cache(model, 1, 256))
            parents = jnp.asarray([[-1] + [(t - 1) // 2 for t in range(1, n)]], jnp.int32)

            def verify(model, toks, cache, parents):
                return apply(model, toks, cache, tree=from_parents(parents, cache.lengths, 8))

            yield (f"tree_{preset}_N{n}", verify,
                   (model, jax.ShapeDtypeStruct((1, n), jnp.int32), cache, parents))
    # Long contexts: a two-level fold (32 partitions) and a program per fold group (65,536
    # keys: 8 kv heads x 64 groups).
    model = _abstract("qwen3-8b")
    for S in (4096, 65536):
        cache = jax.eval_shape(lambda S=S: init_cache(model, 1, S))
        yield (f"qwen3-8b_B1_T1_S{S}", apply,
               (model, jax.ShapeDtypeStruct((1, 1), jnp.int32), cache))
    # Mixtures of experts: routing, the grouped kernels, the layout and combine kernels.
    model = _abstract("qwen3-30b-a3b")
    for tag, fields in [("", {}), ("_kernels", {"moe_layout_kernel": True,
                                                "moe_combine_kernel": True})]:
        m = model.replace(options=model.options.replace(**fields))
        for T in (1, 2, 5, 70):  # T = 1: `token_layout`; 2: the layout kernel's 16 slots
            cache = jax.eval_shape(lambda m=m: init_cache(m, 1, 256))
            yield (f"qwen3-30b-a3b{tag}_B1_T{T}", apply,
                   (m, jax.ShapeDtypeStruct((1, T), jnp.int32), cache))
    # gpt-oss: sinks, biases, top-k softmax; the 120b's experts MXFP4-packed, decoded in
    # the grouped kernels (`mxfp4_kernel`).
    for preset, packed in [("gpt-oss-20b", False), ("gpt-oss-120b", True)]:
        cfg = preset_config(preset, num_layers=1)
        model = Model(config=cfg, params=jax.eval_shape(
            lambda cfg=cfg, packed=packed: random_params(cfg, mxfp4_experts=packed)))
        if packed:
            model = model.replace(options=model.options.replace(mxfp4_kernel=True))
        for T in (1, 5):
            cache = jax.eval_shape(lambda m=model: init_cache(m, 1, 256))
            yield (f"{preset}_B1_T{T}", apply,
                   (model, jax.ShapeDtypeStruct((1, T), jnp.int32), cache))
        if packed:  # the integer decode (one block ahead), and the PTX one 2 blocks ahead
            for tag, fields in [("_int", {"mxfp4_prmt": False}),
                                ("_prefetch2", {"mxfp4_prefetch": 2})]:
                m = model.replace(options=model.options.replace(**fields))
                cache = jax.eval_shape(lambda m=m: init_cache(m, 1, 256))
                yield (f"{preset}{tag}_B1_T1", apply,
                       (m, jax.ShapeDtypeStruct((1, 1), jnp.int32), cache))
    for preset in ["qwen3-0.6b", "gemma3-4b"]:
        model = _abstract(preset)
        model = model.replace(options=model.options.replace(backend="xla"),
                              draft_options=DraftOptions(fused=True, rope_attention=True))
        model = model.replace(params=jax.eval_shape(lambda p: fused_draft._swap(p, True),
                                                    model.params))
        cache = jax.eval_shape(lambda model=model: init_cache(model, 1, 256))
        yield (f"draft_{preset}", apply, (model, jax.ShapeDtypeStruct((1, 1), jnp.int32), cache))


def main(_):
    pretend_h200()
    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = _capture(
        lowering.lower_jaxpr_to_triton_module)
    pallas_call_registration.mlir = _LaunchRecorder()
    os.makedirs(_OUT.value, exist_ok=True)
    lines, launches = [], []
    for name, fn, args in _cases():
        _CAPTURED.clear()
        _LAUNCHES.clear()
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        for i, (ir, launch) in enumerate(zip(_CAPTURED, _LAUNCHES, strict=True)):
            kernel = ir.split("tt.func public @")[1].split("(")[0]
            key = f"{name}_{i}_{kernel}"
            with open(os.path.join(_OUT.value, key + ".mlir"), "w") as f:
                f.write(ir)
            lines.append(f"{key} {hashlib.sha256(ir.encode()).hexdigest()[:16]}")
            launches.append(f"{key} {launch}")
    with open(os.path.join(_OUT.value, "hashes.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(_OUT.value, "launch.txt"), "w") as f:
        f.write("\n".join(launches) + "\n")
    print(f"{len(lines)} kernels -> {_OUT.value}/hashes.txt")


if __name__ == "__main__":
    cli.run(main)
