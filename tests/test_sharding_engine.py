"""The engine with a sharded target (8 simulated CPU devices, in a process of its own:
see tests/test_sharding.py): `speculative_generate` == `generate` token for token with
the target over the mesh and the drafter replicated (a draft model; in the slow run also
prompt lookup with gumbel_coupled sampling, a feature head and a draft tree, under the
runtime audit, and a run whose finished rows are compacted out),
and `load_hf(mesh=...)` places exactly the shards `shard(load_hf(...))` does."""

import pytest
from sharding_checks import run

slow = pytest.mark.slow


@pytest.mark.parametrize("family,tp,full", [
    ("qwen3", 2, False), pytest.param("gemma3", 4, True, marks=slow),
    pytest.param("llama3", 4, True, marks=slow)])
@pytest.mark.slow  # a further case of a property the default run proves
def test_speculative_equals_serial_with_a_sharded_target(family, tp, full):
    found = run("spec", family, tp, *(["--full"] if full else []))
    assert len(found) == (5 if full else 1)
    if full:  # the sharded cache cut to the live row (`jspec.compaction`)
        packed = found.pop("compacted")
        assert packed["equal"] and len(packed["batch_sizes"]) > 1, packed
    for label, res in found.items():
        assert res["equal"] and res["tokens"] == 30, (label, found)
    assert found["model draft"]["acceptance"] == 1.0  # the target's own weights, on xla


def test_load_hf_with_a_mesh_places_the_shards_of_shard():
    found = run("load", "qwen3:4,llama3:2,gemma3:2")
    cache = found.pop("cache")
    for key, res in found.items():
        assert res["same params"] and res["config"], (key, res)
    # jspec.sharding.init_cache: K/V split by kv head on the devices, lengths replicated
    assert cache == {"spec": "P(None, 'tp')", "lengths": "P()",
                     "same logits": True}, cache
    # qwen3 at TP 4: one q head and its group's kv head (replicated) per shard: [q | k | v]
    assert set(map(tuple, found["qwen3:4"]["wqkv blocks"].values())) == {(64, 3 * 32)}
    assert len(found["qwen3:4"]["wqkv blocks"]) == 4


def test_checkpoints_restore_only_into_their_layout():
    # A sharded model's params are its shards' layout in arrays of the unsharded shapes:
    # restoring them into another degree would scramble them, so it is refused.
    found = run("checkpoint")
    assert found.pop("tp2 into tp2 bitwise") is True
    assert found["tp1 into tp2"].endswith(
        "saved from a model that is unsharded, and `like` is tensor-parallel over 2 devices: "
        "the "
        "layouts differ (the arrays would restore scrambled); restore into a `like` of the "
        "saved layout (jspec.sharding.shard(model, make_mesh(n))), or save the unsharded "
        "model")
    assert "model that is tensor-parallel over 2 devices, and `like` is unsharded" in \
        found["tp2 into tp1"]
    assert "and `like` is tensor-parallel over 4 devices" in found["tp2 into tp4"]


def test_the_sharded_forward_lowers_for_the_h200():
    """shard_map around the Pallas kernels lowers for CUDA (Triton IR, H200 info standing
    in, nothing compiled or run; see tests/test_gpu_lowering.py): Llama-3-70B- and
    Gemma-3-4B-shaped targets (2 layers) at TP=2 with S=2 (the 70B also S=8) at decode, verify and
    prefill shapes, and a replicated draft with the latency kernels. The only collectives
    are all-gathers, two a layer and one for the head; no all-reduce adds anything. On the
    Mosaic GPU lowering (the 70B at S=2) no kernel is Triton's."""
    found = run("lower", devices=2)
    mosaic = {k: found.pop(k) for k in list(found) if k.startswith("mosaic")}
    assert len(mosaic) == 1
    for key, res in mosaic.items():  # every kernel on Mosaic GPU: partials, unfused GLU
        assert res["triton calls"] == 0, (key, res)
        assert "jspec_mosaic_glu" in res["kernels"], (key, res)
        assert (res["all_gathers"], res["all_reduces"]) == (2 * 2 + 1, 0), (key, res)
    targets = {k: v for k, v in found.items() if not k.startswith("replicated")}
    assert len(targets) == 12
    for key, res in targets.items():
        assert "jspec_matmul_partials" in res["kernels"], (key, res)
        assert any(k.startswith("jspec_attention") for k in res["kernels"]), (key, res)
        assert (res["all_gathers"], res["all_reduces"]) == (2 * 2 + 1, 0), (key, res)
    for key in ("replicated draft T=1", "replicated draft T=2"):
        res = found[key]
        assert "jspec_draft_matvec" in res["kernels"], res
        assert (res["all_gathers"], res["all_reduces"]) == (0, 0), res
