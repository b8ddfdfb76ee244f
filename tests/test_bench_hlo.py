"""jspec.bench.hlo: a compiled program's fusions mapped to the lines of jspec behind them."""

import jax
import jax.numpy as jnp

from jspec.bench.hlo import fusion_sources
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
