"""The mixture-of-experts measurements: the bytes a step reads, the H200 lowering at the
Qwen3-30B-A3B shape, and the three GPU session lanes (moe_cost, moe_parity, moe_e2e)
end to end at tiny-qwen3-moe on the CPU."""

import json
import os
import re
import stat
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jspec.bench.moe_bytes import expert_bytes, step_read_bytes, uniform_union
from jspec.cache import init_cache
from jspec.model import Model, apply
from jspec.random_model import preset_config, random_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _abstract(preset: str, layers: int | None = None) -> Model:
    cfg = preset_config(preset, num_layers=layers)
    return Model(config=cfg, params=jax.eval_shape(lambda: random_params(cfg)))


def test_a_decode_step_reads_k_experts_and_a_block_their_union():
    model = _abstract("qwen3-30b-a3b")
    cfg = model.config
    one = expert_bytes(model, 0)
    assert one == 3 * cfg.hidden_size * cfg.expert_size * 2  # gate, up, down in bf16
    decode = step_read_bytes(model, 1, 1, 512)
    assert decode["experts"] == 48 * 8 * one  # uniform_union(E, k, 1) == k
    block = step_read_bytes(model, 1, 5, 512, experts_read=[30] * 48)
    assert block["experts"] == 48 * 30 * one and block["weights"] == decode["weights"]
    assert block["kv"] > decode["kv"] and block["total"] == sum(
        v for k, v in block.items() if k != "total")
    assert 35 < uniform_union(128, 8, 5) < 40 and uniform_union(128, 8, 10**4) == 128
    # A dense layer (tiny-qwen3-moe's layer 1) counts its whole MLP among the weights.
    tiny = _abstract("tiny-qwen3-moe")
    with pytest.raises(ValueError, match="2 MoE layers"):
        step_read_bytes(tiny, 1, 1, 8, experts_read=[2])
    full = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tiny.params))
    embed = tiny.params["embed"].size * tiny.params["embed"].dtype.itemsize
    assert step_read_bytes(tiny, 1, 1, 0, experts_read=[8, 8])["weights"] + 2 * 8 * \
        expert_bytes(tiny, 0) == full - embed


@pytest.mark.parametrize("batch,tokens", [(1, 1), (1, 5), *[  # the rest: other row counts
    pytest.param(b, t, marks=pytest.mark.slow) for b, t in [(8, 1), (1, 33), (1, 512)]]])
def test_qwen3_30b_a3b_forward_lowers_for_the_h200(h200, batch, tokens):
    # The lanes' shapes (decode, verify, the longest block, the prefill) lower to Triton
    # for sm_90 with the grouped expert kernels (abstract weights: nothing allocated).
    model = _abstract("qwen3-30b-a3b", 2)
    cache = jax.eval_shape(lambda: init_cache(model, batch, 1024))
    toks = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
    text = jax.jit(apply).trace(model, toks, cache).lower(lowering_platforms=("cuda",)).as_text()
    names = set(re.findall(r'name = "(jspec_[a-z_0-9]*)"', text))
    assert {"jspec_grouped_matmul", "jspec_grouped_matmul_glu"} <= names, names


@pytest.mark.slow  # three experiment scripts in interpret mode: minutes on two cores
def test_moe_session_lanes_run_at_a_tiny_preset(tmp_path):
    bin_dir = tmp_path / "bin"  # the lanes call python3: this interpreter
    bin_dir.mkdir()
    py = bin_dir / "python3"
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    env = os.environ | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": ROOT, "OUT": str(out),
        "MOE_PRESET": "tiny-qwen3-moe", "MOE_DTYPE": "float32", "MOE_INTERPRET": "1",
        "MOE_TS": "1,2", "MOE_XLA_TS": "1", "MOE_CONTEXT": "8",
        "MOE_PARITY_LAYERS": "3", "MOE_PARITY_CONTEXT": "24", "MOE_WINDOW": "4",
        "MOE_KS": "1,3", "MOE_TREES": "3", "MOE_DRAFT": "tiny-qwen3:1",
        "MOE_HEAD_VOCAB": "256", "MOE_E2E_BATCHES": "1", "MOE_TREE": "spine:2:1",
        "MOE_PROMPT": "8", "MOE_NEW": "4",
        "MOE_COST_S": "900", "MOE_PARITY_S": "900", "MOE_E2E_S": "900",
        "MOE_BACKENDS": "pallas,xla"}
    r = subprocess.run(["bash", "experiments/gpu_session.sh", "moe_cost", "moe_parity",
                        "moe_e2e"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=2400)
    assert r.returncode == 0, r.stderr[-2000:]
    log = r.stdout
    cost = json.load(open(out / "bench_moe_tiny-qwen3-moe_h200.json"))
    assert cost["complete"] and not cost["errors"], log[-3000:]
    got = {(x["backend"], x["T"]) for x in cost["rows"]}
    assert got == {("pallas", 1), ("pallas", 2), ("xla", 1)}
    for x in cost["rows"]:
        assert x["union_mean"] <= x["union_max_possible"] and x["roofline_ms"] > 0
    assert next(x for x in cost["rows"] if x["T"] == 1)["union_mean"] == 2  # k of 8
    parity = json.load(open(out / "gpu_parity_moe.json"))["results"]
    pallas = parity["tiny-qwen3-moe:3:pallas"]
    checks = {k: v for k, v in pallas.items() if isinstance(v, dict)}
    assert {"chunked prefill", "verify k=3", "row in ragged batch of 4",
            "tree of 3 nodes"} <= set(checks)
    assert all(v["mismatches"] == 0 for v in checks.values()), checks
    assert "tiny-qwen3-moe:3:xla" in parity
    e2e = json.load(open(out / "bench_e2e_h200_moe.json"))
    assert e2e["complete"], log[-3000:]
    spec = e2e["speculative"]
    assert {(s["tree"], s["oracle_accept"]) for s in spec} == {
        (t, a) for t in (None, "spine:2:1") for a in (0.8, 0.9)}
    assert all(s["parity"] and s["draft_kind"] == "feature" for s in spec)
    assert e2e["serial"][0]["step_weight_bytes"] == e2e["weight_bytes"] > 0  # B = 1
