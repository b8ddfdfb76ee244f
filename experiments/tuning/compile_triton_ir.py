"""Compiles `dump_triton_ir.py`'s kernels to PTX with a standalone Triton, on a CPU.

  python experiments/tuning/dump_triton_ir.py --out=/tmp/ir
  python -m venv /tmp/tenv && /tmp/tenv/bin/pip install triton==3.6.0
  /tmp/tenv/bin/python experiments/tuning/compile_triton_ir.py /tmp/ir

Lowering for "cuda" on a CPU stops at the Triton IR; XLA compiles that IR to PTX on the
GPU with the Triton it bundles. This script runs the rest of the pipeline with the
`triton` package: Triton's own TTIR passes first (`make_ttir`: inliner, canonicalizer,
the combine pass that folds `sum + dot(a, b, 0)` into `dot(a, b, sum)`, CSE, loop unroll;
XLA's `MakeTTIR` runs the same ones; `triton.compile` skips them for a file of TTIR), then
TTGIR -> LLVM -> PTX for sm_90, ptxas included. So a kernel whose IR
Triton's layout passes refuse (a reshape, transpose or join it cannot place, a dot operand
it cannot convert) fails here, with no device. It is a smoke test of the compiler, not of
the bits or the speed: the bundled Triton is not the package's release, and the warps and
stages are the recorded or the flags' ones. Prints one line a kernel (OK: the PTX's
size, its MMA instruction kind and shared memory; FAIL: the error) and exits 1 on a
failure. Each kernel compiles with the warps and stages it launches with where the dump
recorded them (`launch.txt`), else with the flags'. `--loops`: also each loop's SASS
instruction count and its commonest opcodes (nvdisasm from the Triton wheel), a proxy
for a K loop's work a step (the MXFP4 decode's, docs/tuning.md). Needs only `triton` (no jax).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import tempfile


def sass_loops(cubin: bytes, tmp: str) -> list[tuple[int, list[tuple[str, int]]]]:
    """(instructions, commonest opcodes) of each backward-branch loop in a kernel's SASS."""
    import triton

    path = os.path.join(tmp, "kernel.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "nvdisasm")
    lines = subprocess.run([tool, "-c", path], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"\.(L_x_\d+):", line.strip()))}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?\.(L_x_\d+)", line)
        if m and labels.get(m.group(1), i) < i - 1:
            ops = collections.Counter(
                op.group(1) for x in lines[labels[m.group(1)]:i + 1]
                if (op := re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", x)))
            loops.append((sum(ops.values()), ops.most_common(6)))
    return loops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ir_dir", help="a folder of <case>_<i>_<kernel>.mlir files")
    parser.add_argument("--match", default="", help="only files whose name contains this")
    parser.add_argument("--capability", type=int, default=90, help="sm_XX (90: Hopper)")
    parser.add_argument("--num_warps", type=int, default=4,
                        help="for kernels launch.txt does not list")
    parser.add_argument("--num_stages", type=int, default=4,
                        help="for kernels launch.txt does not list")
    parser.add_argument("--loops", action="store_true", help="each loop's SASS size")
    args = parser.parse_args()
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", args.capability, 32)
    backend = make_backend(target)
    launch = {}
    launch_file = os.path.join(args.ir_dir, "launch.txt")
    if os.path.exists(launch_file):
        with open(launch_file) as f:
            for line in f:
                key, warps, stages = line.split()[:3]
                launch[key] = (int(warps.split("=")[1]), int(stages.split("=")[1]))
    files = sorted(f for f in glob.glob(os.path.join(args.ir_dir, "*.mlir"))
                   if args.match in os.path.basename(f))
    if not files:
        print(f"no .mlir files matching {args.match!r} in {args.ir_dir}")
        return 1
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for path in files:
            name = os.path.basename(path).removesuffix(".mlir")
            warps, stages = launch.get(name, (args.num_warps, args.num_stages))
            try:
                context = ir.context()
                ir.load_dialects(context)
                backend.load_dialects(context)
                module = ir.parse_mlir_module(path, context)
                module.context = context
                backend.make_ttir(module, {}, None, args.capability)
                src = os.path.join(tmp, name + ".ttir")  # Triton's suffix
                with open(src, "w") as f:
                    f.write(str(module))
                kernel = triton.compile(src, target=target,
                                        options={"num_warps": warps, "num_stages": stages})
                ptx = kernel.asm["ptx"]
                mma = ("wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx
                       else "no mma")
                print(f"OK   {name}: {len(ptx)} B of PTX, {mma}, "
                      f"{kernel.metadata.shared} B shared, {warps} warps, {stages} stages")
                if args.loops:
                    for n, ops in sass_loops(kernel.asm["cubin"], tmp):
                        print(f"       loop: {n} SASS instructions, "
                              + " ".join(f"{op} {c}" for op, c in ops))
            except Exception as e:  # noqa: BLE001 (report every kernel, then fail)
                failed += 1
                print(f"FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    print(f"{len(files) - failed} of {len(files)} compiled (triton {triton.__version__}, "
          f"sm_{args.capability})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
