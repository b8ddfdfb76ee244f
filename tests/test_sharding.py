"""Tensor parallelism keeps property P (rule R8), on simulated CPU devices.

Each test runs a check of `tests/sharding_checks.py` in its own process with 8 CPU
devices (`--xla_force_host_platform_device_count` must be set before jax starts its CPU
backend; the pytest workers have started theirs with one device). The checks report
what they found; the assertions here state the invariants:

- within a degree, prefill == one-token steps == accepted blocks == verify blocks == a
  row in a ragged batch, bitwise (the order-fixed combine: partials gathered in shard
  order and added left to right);
- with row_partials=8 the logits are one device's bits at TP = 1, 2, 4, 8;
- the comparisons can fail: one device's default S = 1, Megatron's combine (a psum of
  per-shard sums) and a combine whose order follows the message size (as a collective
  library's choice of algorithm does) each give other bits.

The engine under TP: tests/test_sharding_engine.py; several processes:
tests/test_sharding_hosts.py.
"""

import pytest
from conftest import FAMILIES
from sharding_checks import run

slow = pytest.mark.slow

# Default: Qwen 3 in bf16 at TP 2 (2 partials); TP 1 and 4 (its 2 kv heads replicated,
# 4 partials), the other families and f32 in the slow run, with more schedules.
MATRIX = [("qwen3", "bfloat16", "2", False)] + [
    pytest.param(n, d, "1,2,4", True, marks=slow)
    for n in FAMILIES for d in ("bfloat16", "float32")]


@pytest.mark.parametrize("family,dtype,tps,full", MATRIX)
def test_property_p_holds_within_each_degree(family, dtype, tps, full):
    found = run("matrix", family, dtype, tps, *(["--full"] if full else []))
    assert set(found) == set(tps.split(","))
    for tp, res in found.items():
        assert len(res["found"]) >= 4
        assert all(n == 0 for n, _ in res["found"].values()), (tp, res)


@pytest.mark.slow  # a further case: the option's bits on one device are the default's
def test_kv_write_kernel_keeps_p_and_one_devices_bits_at_tp_2():
    # The q/k kernel writes each shard's K/V heads into its own cache shard.
    found = run("matrix", "qwen3", "bfloat16", "2", "--options", "kv_write_kernel=1")
    assert len(found["2"]["found"]) >= 4
    assert all(n == 0 for n, _ in found["2"]["found"].values()), found


@pytest.mark.parametrize("dtype,preset,full", [
    ("float32", "tiny-qwen3", False),
    ("float32", "tiny-qwen2", False),  # q/k/v biases split with their columns
    pytest.param("bfloat16", "tiny-qwen3", True, marks=slow),
    pytest.param("float32", "tiny-gemma3", True, marks=slow)])
@pytest.mark.slow  # a further case of a property the default run proves
def test_row_partials_8_gives_the_same_logits_at_every_degree(dtype, preset, full):
    """A model of 8 q heads, 2 kv heads (replicated at TP 4 and 8) and a vocabulary of 250
    (padded at TP 4 and 8): its prefill logits at TP 2, 4, 8 (and 1) are one device's bits
    with row_partials=8; with P within each degree, every other schedule's are too."""
    found = run("degree", dtype, "--preset", preset, *(["--full"] if full else []))
    same = [k for k in found if k.endswith("S=8")]
    assert len(same) >= 3 and all(found[k] for k in same), found
    assert found["TP=4 S=8 serial == prefill"], found
    assert found["TP=2 F=90 S=2 == one device S=2"], found
    assert found["export refuses a sharded model"], found
    if dtype == "float32":  # bf16 x bf16 products are exact in f32: orders rarely show
        assert not found["one device S=1"], found
        assert not any(v for k, v in found.items() if k.endswith("psum")), found
        assert not found["TP=4 S=8 by message size: serial == prefill"], found


@pytest.mark.slow  # a further case of the degrees' property above (sinks: test_sinks.py)
def test_attention_sinks_are_split_with_their_q_heads():
    """Shard s holds the sinks of its q heads [s H / TP, (s + 1) H / TP) (as wqkv's q
    columns), and a sharded model with sinks gives one device's logits (row_partials=8)."""
    found = run("sinks")
    for n in (2, 4, 8):
        assert found[f"TP={n}"], n
        shards = found[f"TP={n} shards"]
        per = 8 // n
        assert shards == [found["sinks"][s * per:(s + 1) * per] for s in range(n)], n
