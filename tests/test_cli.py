"""The command-line entry points run end to end (tiny model made on the fly)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *flags):
    cmd = [sys.executable, os.path.join(ROOT, "experiments", script), *flags]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_generate_cli_runs():
    r = _run("generate.py", f"--config={ROOT}/configs/generate.py:runlocal")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tokens/s" in r.stdout and "def rgb_to_hls" in r.stdout


# gumbel_coupled's parity is also tests/test_speculative.py's (slow here: a second CLI run)
@pytest.mark.parametrize("policy", ["exact_greedy",
                                    pytest.param("gumbel_coupled", marks=pytest.mark.slow)])
def test_speculative_cli_checks_parity(policy):
    r = _run("speculative_decode.py", f"--config={ROOT}/configs/speculative.py:runlocal",
             f"--config.policy={policy}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "PARITY: OK" in r.stdout and "acceptance" in r.stdout
    assert "embedded code pair" in r.stdout


@pytest.mark.slow  # the pruned head's exactness is tests/test_pruned_head.py's
def test_speculative_cli_with_a_pruned_draft_head(tmp_path):
    # The head keeps the 300 most frequent tokens of a text (here a piece of Python);
    # the output must still equal serial decoding.
    corpus = tmp_path / "corpus.py"
    corpus.write_text(open(f"{ROOT}/jspec/drafters.py").read())
    r = _run("speculative_decode.py", f"--config={ROOT}/configs/speculative.py:runlocal",
             f"--config.draft_head={corpus}", "--config.draft_head_size=300")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "PARITY: OK" in r.stdout and "[draft head: 300 of" in r.stdout
    bad = _run("speculative_decode.py", f"--config={ROOT}/configs/speculative.py:runlocal",
               f"--config.draft_head={tmp_path}/missing.npy")
    assert bad.returncode != 0 and "no such file" in bad.stderr


def test_bench_e2e_smoke(tmp_path):
    r = _run("bench_e2e.py", "--target=tiny-qwen3", "--draft=tiny-qwen3:1", "--batches=1",
             "--prompt_len=16", "--max_new_tokens=8", "--gammas=2", "--accept=0.8", "--iters=1",
             "--nopeers", "--draft_backend=xla", "--oracle_seeds=2", "--draft_head=256",
             f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    with open(tmp_path / "bench_e2e.json") as f:
        rep = json.load(f)
    assert rep["complete"] and rep["copy_TBps"] > 0 and rep["peers"]["skipped"] == "--nopeers"
    assert rep["oracle_waits_for_draft"] is True and rep["draft_head"] == 256
    assert rep["draft_backend"] == "xla"
    assert {(s["backend"], s["batch"]) for s in rep["serial"]} == {("pallas", 1), ("xla", 1)}
    assert all(s["roofline_tokens_per_s"] > 0 for s in rep["serial"])
    assert {(s["drafter"], s["gamma"]) for s in rep["speculative"]} == {("oracle", 2),
                                                                        ("lookup", 2)}
    assert all(s["parity"] for s in rep["speculative"])
    # Each timed row says what the GPU ran at; a CPU run says there was nothing to read.
    assert all("gpu" in s for s in rep["serial"] + rep["speculative"])
    oracle = next(s for s in rep["speculative"] if s["drafter"] == "oracle")
    assert [r["seed"] for r in oracle["seeds"]] == [0, 1] and rep["oracle_seeds"] == 2
    assert all(r["parity"] for r in oracle["seeds"])
    for name in ("speedup_vs_gamma", "tokens_per_s_vs_acceptance"):
        assert (tmp_path / f"bench_e2e_{name}.png").exists()
    # Receipts (runs cut short too) re-drawn without running anything.
    r = _run("bench_e2e.py", f"--replot={tmp_path / 'bench_e2e.json'}", f"--out={tmp_path}",
             "--tag=again")
    assert r.returncode == 0 and "serial greedy" in r.stdout, r.stderr[-2000:]
    assert (tmp_path / "bench_e2e_again_speedup_vs_gamma.png").exists()
    bad = _run("bench_e2e.py", "--target=tiny-qwen3", "--draft=tiny-qwen3:1", "--nopeers",
               "--draft_head=100000", f"--out={tmp_path}")
    assert bad.returncode != 0 and "exceeds the draft's vocabulary (512)" in bad.stderr


@pytest.mark.slow  # an experiment script's run; its engine calls are the default run's
def test_eval_pair_smoke(tmp_path):
    r = _run("eval_pair.py", "--num_prompts=2", "--batch=2", "--max_new_tokens=8",
             "--gammas=2", "--policies=exact_greedy", "--iters=1", "--nopeers",
             f"--out={tmp_path}", "--tag=smoke")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "eval_pair_cpu_smoke.json"))
    assert rep["runs"][0]["parity"] and rep["runs"][0]["gamma"] == 2
    assert 0.0 <= rep["runs"][0]["acceptance"] <= 1.0
    assert (tmp_path / "eval_pair_cpu_smoke.png").exists()


def test_profile_step_summarizes_a_device_timeline():
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import trace_tools

    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7"}},
            {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    ev = [{"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": 10, "name": "jspec_matmul",
           "args": {"tf_op": "jit(decode_loop)/while/body/pallas_call"}},
          {"ph": "X", "pid": 1, "tid": 7, "ts": 15, "dur": 5, "name": "loop_add_fusion"},
          {"ph": "X", "pid": 1, "tid": 8, "ts": 15, "dur": 5, "name": "add.1"},  # derived line
          {"ph": "X", "pid": 1, "tid": 7, "ts": 18, "dur": 4, "name": "MemcpyDtoH"}]
    s = trace_tools.summarize(trace_tools.device_events({"traceEvents": meta + ev}), 2, 5)
    assert s["device_events"] == 3 and s["events_per_step"] == 1.5
    assert (s["kernel_us_per_step"], s["busy_us_per_step"], s["span_us_per_step"]) == (9.5, 8.5,
                                                                                       11.0)
    assert s["us_per_step_by_kind"] == {"pallas": 5.0, "xla": 2.5, "copy": 2.0}
    assert s["top"][0]["op"] == "jit(decode_loop)/while/body/pallas_call"
    assert trace_tools.summarize([], 1, 5)["device_events"] == 0


@pytest.mark.slow  # a profiling script's run (its summary is checked above)
def test_profile_step_runs(tmp_path):
    r = _run("profile_step.py", "--target=tiny-qwen3", "--draft=tiny-qwen3:1", "--prompt_len=8",
             "--steps=3", "--iters=1", "--backends=xla", "--workloads=serial,spec",
             f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    with open(tmp_path / "profile_step.json") as f:
        rep = json.load(f)
    assert rep["complete"] and [x["workload"] for x in rep["runs"]] == ["serial", "spec"]
    assert rep["runs"][0]["steps"] == 3 and rep["runs"][0]["ms_per_step"] > 0
    assert all("gpu" in x for x in rep["runs"])  # the GPU's clocks (a CPU: unavailable)


def test_hlo_kernels_matches_kernels_to_their_hlo():
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import hlo_kernels

    text = """HloModule m

%fused_computation.7 (p: bf16[8,64]) -> f32[8] {
  %p = bf16[8,64]{1,0} parameter(0)
  %c = f32[8,64]{1,0} convert(%p)
  %z = f32[] constant(0)
  ROOT %r.1 = f32[8]{0} reduce(%c, %z), dimensions={1}, to_apply=%add
}

ENTRY %main.3 (a: bf16[8,64]) -> f32[8] {
  %a = bf16[8,64]{1,0} parameter(0)
  ROOT %input_reduce_fusion.106 = f32[8]{0} fusion(%a), kind=kInput, \
calls=%fused_computation.7, metadata={op_name="jit(f)/layer_3/attn/reduce_max"}
}
"""
    lines, comps = hlo_kernels.hlo_index(text)
    d = hlo_kernels.describe("input_reduce_fusion_106", lines, comps)
    assert d["op_name"] == "jit(f)/layer_3/attn/reduce_max"
    assert d["root"].startswith("ROOT %r.1 = f32[8]{0} reduce(")
    assert d["ops"] == ["constant", "convert", "parameter", "reduce"]
    assert "metadata" not in d["instruction"]
    assert hlo_kernels.describe("no_such_kernel", lines, comps) == {"instruction": "",
                                                                    "op_name": ""}


@pytest.mark.slow  # a profiling script's run (its HLO matching is checked above)
def test_hlo_kernels_runs(tmp_path):
    r = _run("hlo_kernels.py", "--preset=tiny-qwen3", "--context=16", "--iters=1",
             "--backends=xla", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "hlo_kernels_tiny-qwen3.json"))
    assert [x["backend"] for x in rep["runs"]] == ["xla"] and rep["runs"][0]["ms_host"] > 0
    assert (tmp_path / "hlo_kernels_tiny-qwen3_xla.hlo.txt.gz").exists()


@pytest.mark.slow  # a sweep script
def test_sweep_schedule_smoke(tmp_path):
    r = _run("sweep_schedule.py", "--interpret", "--preset=tiny-qwen3", "--rows=1,40",
             "--shapes=wo,w_gate_up:glu", "--max_candidates=3", "--iters=1",
             f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "sweep_schedule.json"))
    w, g = rep["weights"]
    assert w["weight"] == "wo" and w["base_us"] > 0
    phases = [v["phase"] for v in w["variants"]]  # 3 one-field variants, then crosses
    assert phases[:3] == ["wo"] * 3 and set(phases[3:]) == {"wo combos"}, phases
    assert g["kernel"] == "matmul_glu" and "not fusable" in g["skipped"]  # interpret tiles
    for v in w["variants"]:  # same bk: on CPU every variant keeps the table's bits
        assert v["config"]["bk"] == w["base"]["bk"] and v["bits_equal"] == {"1": True,
                                                                            "40": True}
    assert w["all_bits_equal"] and w["fastest_equal"] is not None


@pytest.mark.slow  # a floor study or sweep script
def test_launch_floor_smoke(tmp_path):
    # Pallas on Triton and on Mosaic GPU (with and without grid dependencies), side by side.
    r = _run("launch_floor.py", "--interpret", "--mb=0,0.25", "--chain=2", "--iters=1",
             f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "launch_floor.json"))
    assert [(s["kind"], s["mb"]) for s in rep["sizes"]] == [
        (k, mb) for mb in (0.0, 0.25) for k in ("triton", "mgpu", "mgpu_pdl")]
    assert all(s["us_per_kernel"] > 0 and s["kernels"] == 2 for s in rep["sizes"])
    bad = _run("launch_floor.py", "--interpret", "--mb=-1", f"--out={tmp_path}")
    assert bad.returncode != 0 and "sizes must be >= 0" in bad.stderr
    bad = _run("launch_floor.py", "--interpret", "--kinds=cuda", f"--out={tmp_path}")
    assert bad.returncode != 0 and "--kinds: unknown ['cuda']" in bad.stderr
    bad = _run("launch_floor.py", "--interpret", "--kinds=mgpu", "--mb=0.001",
               f"--out={tmp_path}")
    assert bad.returncode != 0 and "less than one 32 x 256 tile" in bad.stderr


@pytest.mark.slow  # a floor study or sweep script
def test_persistent_floor_smoke(tmp_path):
    # The persistent kernel (P = 1: interpret mode runs programs one after another) and
    # the chain of one kernel per phase at P = 1 and 2 compute the same bits.
    r = _run("persistent_floor.py", "--interpret", "--layers=1", "--nolm_head",
             "--programs=1,2", "--iters=1", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "persistent_floor.json"))
    kinds = [(v["kind"], v["programs"], v["prefetch"]) for v in rep["variants"]]
    assert kinds == [("chain", 1, 0), ("persistent", 1, 0), ("chain", 1, 1),
                     ("persistent", 1, 1), ("chain", 2, 0), ("chain", 2, 1)]
    assert all(v["equal_to_chain"] and v["finite"] for v in rep["variants"])
    assert all(v["max_rel_diff_to_chain"] == 0.0 for v in rep["variants"])
    assert len({v["sha1"] for v in rep["variants"]}) == 1  # P = 1 and 2, prefetch or not
    assert "grid barrier would wait forever" in r.stdout
    bad = _run("persistent_floor.py", "--interpret", "--programs=0", f"--out={tmp_path}")
    assert bad.returncode != 0 and "every count must be >= 1" in bad.stderr


@pytest.mark.slow  # a floor study or sweep script
def test_sweep_attention_smoke(tmp_path):
    # Split-KV attention variants (masked V load or select, two stage counts) against
    # the reference config: every variant bitwise equal at decode and verify shapes.
    r = _run("sweep_attention.py", "--interpret", "--preset=tiny-qwen3", "--context=40",
             "--batches=2", "--warps=4", "--stages=1,2", "--iters=1", "--tag=smoke",
             f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "sweep_attention_smoke.json"))
    assert rep["reference"]["v_masked_load"] is False
    got = {(v["config"]["v_masked_load"], v["config"]["num_stages"]) for v in rep["variants"]}
    assert len(rep["variants"]) == 4 and got == {(m, s) for m in (False, True) for s in (1, 2)}
    assert rep["all_bits_equal"] and all(
        set(v["by_shape"]) == {"B2T1", "B2T5"} for v in rep["variants"])


def test_barrier_check_smoke(tmp_path):
    # The grid-barrier stress kernel at P = 1 (interpret mode runs programs one after
    # another, so P > 1 would wait forever and is refused): no bad rounds.
    r = _run("barrier_check.py", "--interpret", "--programs=1", "--rounds=3", "--repeats=2",
             f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "barrier_check.json"))
    assert [(x["programs"], x["spin"]) for x in rep["results"]] == [(1, "atomic"),
                                                                     (1, "volatile")]
    assert all(x["bad_rounds_per_launch"] == [0, 0] for x in rep["results"])
    bad = _run("barrier_check.py", "--interpret", "--programs=2", f"--out={tmp_path}")
    assert bad.returncode != 0 and "interpret mode: only 1" in bad.stderr


@pytest.mark.slow  # an experiment script's run; test_row_group proves its option check
def test_bench_kernels_smoke(tmp_path):
    # The kernel benchmark end to end on a tiny model (CPU: host timings, f32): single
    # ops, steps at T = 1 and 2, and an option variant checked bitwise.
    r = _run("bench_kernels.py", "--interpret", "--dtype=float32", "--preset=tiny-qwen3",
             "--batches=2", "--gammas=1", "--iters=1", "--context=16",
             "--options=matmul_row_group=1", "--tag=smoke", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "bench_kernels_tiny-qwen3_smoke.json"))
    assert {m["timing"] for m in rep["matmuls"]} == {"host"}  # no device timeline on a CPU
    assert all(m["pallas_us"] > 0 and m["xla_us"] > 0 for m in rep["matmuls"])
    steps = {(s["backend"], s["T"]) for s in rep["steps"]}
    assert steps == {(b, t) for b in ("pallas", "xla", "pallas+matmul_row_group=1")
                     for t in (1, 2)}
    assert rep["options_bits_equal_pallas"] is True


@pytest.mark.slow  # a tool's run; test_gpu_lowering lowers the same kernels
def test_lowered_ir_fingerprints(tmp_path):
    # Triton kernels fingerprinted on a CPU: the same code gives the same kernels; forcing
    # split-KV into two kernels at B=1 (one launch by default) shows as that change.
    fp = tmp_path / "fp.json"
    r = _run("lowered_ir.py", "--shapes=qwen3-8b:1x1,gemma3-4b:8x5", f"--out={fp}")
    assert r.returncode == 0, r.stderr[-2000:]
    calls = json.load(open(fp))["kernels"]["qwen3-8b:1x1"]
    assert any(c.startswith("jspec_attention_fused grid 8x1x2 warps 4 stages 2 ") for c in calls)
    same = _run("lowered_ir.py", "--shapes=qwen3-8b:1x1,gemma3-4b:8x5", f"--compare={fp}")
    assert same.returncode == 0 and "the same kernels" in same.stdout, same.stdout[-2000:]
    other = _run("lowered_ir.py", "--shapes=qwen3-8b:1x1", "--options=attn_fused_fold=0",
                 f"--compare={fp}")
    assert other.returncode == 1 and "-jspec_attention_fused" in other.stdout
    assert "+jspec_attention_combine" in other.stdout


@pytest.mark.slow  # a profiling script of the draft alone
def test_bench_draft_smoke(tmp_path):
    r = _run("bench_draft.py", "--draft=tiny-qwen3:1", "--context=16", "--rounds=2",
             "--iters=1", "--variants=/xla_two_rows=1,kv_dus=1", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "bench_draft_tiny-qwen3-1.json"))
    base, fast = rep["runs"]
    assert base["options"] == [] and fast["options"] == ["xla_two_rows=1", "kv_dus=1"]
    assert base["ms_per_round_host"] > 0 and len(base["drafts"]) == 2 * rep["gamma"]
    assert fast["logits_max_rel_diff"] < 1e-2  # bf16 weights, another XLA program
    assert "per round" in r.stdout


@pytest.mark.slow  # an experiment script's run (the engine calls it makes are tested)
def test_overlap_streams_smoke(tmp_path):
    # Target verify and draft round alone and together; on a CPU the stream annotation
    # lowers (its program runs on one stream there), so all four variants run.
    r = _run("overlap_streams.py", "--target=tiny-qwen3", "--draft=tiny-qwen3:1",
             "--context=16", "--iters=1", f"--out={tmp_path}", "--tag=smoke")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "overlap_streams_smoke.json"))
    assert set(rep["rows"]) == {"verify", "draft", "together", "together_streams"}
    assert all(row["ms"] > 0 for row in rep["rows"].values())
    assert "hidden_fraction_of_draft_streams" in rep


def test_sampling_invariance_smoke(tmp_path):
    # The sampler's row-invariance probe end to end on a small vocabulary (CPU, where
    # XLA's top-p happens to be invariant too): jspec's cut never differs, the receipt
    # holds every setting and count, and the timing runs.
    r = _run("sampling_invariance.py", "--vocab=3000", "--rows=9", "--counts=1,5",
             "--settings=0.8:0:0.9,1.0:20:0.5", "--time_iters=1", f"--out={tmp_path}",
             "--tag=_t")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "sampling_invariance_t.json"))
    assert rep["jspec_rows_differing"] == 0 and len(rep["settings"]) == 2
    assert set(rep["settings"][0]["counts"]) == {"1", "5"}
    assert set(rep["timing"]["ms"]) == {"1", "5"}
    assert _run("sampling_invariance.py", "--rows=4", "--counts=5").returncode != 0
