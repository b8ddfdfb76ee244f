"""Lowering the Triton kernels for an H200 on a machine without one (the lowering tests,
`experiments/tuning/dump_triton_ir.py`): Pallas's Triton lowering asks jax for the GPU's
info, and the H200's entry answers instead. The hooks are jax's private modules, which
move between versions; this is the one place that knows where they are."""

from __future__ import annotations


def h200_gpu_info():
    """jax's GPU info of the H200 (sm_90)."""
    try:  # jax 0.12.1 moved it out of pallas
        from jax._src import gpu_info
    except ImportError:
        from jax._src.pallas.triton import gpu_info
    return gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)


def pretend_h200(set_attr=setattr) -> None:
    """Makes Pallas's Triton lowering see an H200 (`set_attr`: e.g. pytest's
    `monkeypatch.setattr`, which undoes it after the test)."""
    from jax._src.pallas.triton import pallas_call_registration

    info = h200_gpu_info()
    set_attr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda *a, **k: info)
