"""jspec.bench.hlo (a compiled program's fusions and copies mapped to the lines of jspec
behind them) and `jspec.bench.timing.dependent_launches`."""

import jax
import jax.numpy as jnp

from jspec.bench.hlo import copy_sources, fusion_sources
from pallas_kernels._common import pad_axis


def test_fusion_sources_name_the_repository_line():
    def f(x, y):
        return pad_axis(jnp.exp(x) * y, 0, 16).sum(axis=1)

    text = jax.jit(f).lower(jnp.ones((5, 3)), jnp.ones((5, 3))).compile().as_text()
    found = fusion_sources(text)
    assert found, text[:2000]
    kernels = [k for k, v in found.items() if "pad" in v["ops"]]
    assert kernels, found
    where = found[kernels[0]]["sources"]
    assert any(s.startswith("pallas_kernels/_common.py:") and s.endswith("(pad_axis)")
               for s in where), where
    assert all("." not in k for k in found)  # the profiler's spelling: "fusion_3"


def test_fusion_sources_of_text_without_tables():
    assert fusion_sources("") == {}
    assert fusion_sources("ENTRY %main (x: f32[]) -> f32[] {\n}\n") == {}


def test_copy_sources_list_the_copies_outside_fusions():
    text = """HloModule m

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %copy.9 = f32[4]{0} copy(%p)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %copy.1 = f32[4]{0} copy(%x)
  ROOT %f = f32[4]{0} fusion(%copy.1), kind=kLoop, calls=%fused_computation
}
"""
    assert copy_sources(text) == [{"name": "copy.1", "shape": "f32[4]{0}", "sources": []}]
    assert fusion_sources(text)["f"]["ops"] == ["copy"]


def test_dependent_launches_chain_the_calls():
    from jspec.bench.timing import dependent_launches

    calls = []

    def fn(a, b):
        calls.append(1)  # traced once: one loop body
        return (a * b, jnp.zeros(2, jnp.int32))

    a, b = jnp.asarray([[2.0, 1.0]]), jnp.asarray([[3.0, 5.0]])
    loop = dependent_launches(fn, reps=4, carry=1)
    assert float(loop(a, b)) == 4 * 6.0 and len(calls) == 1
    assert float(dependent_launches(fn, reps=3)(a, b)) == 3 * 6.0
