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


@pytest.mark.parametrize("policy", ["exact_greedy", "gumbel_coupled"])
def test_speculative_cli_checks_parity(policy):
    r = _run("speculative_decode.py", f"--config={ROOT}/configs/speculative.py:runlocal",
             f"--config.policy={policy}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "PARITY: OK" in r.stdout and "acceptance" in r.stdout
    assert "embedded code pair" in r.stdout


def test_bench_e2e_smoke(tmp_path):
    r = _run("bench_e2e.py", "--target=tiny-qwen3", "--draft=tiny-qwen3:1", "--batches=1",
             "--prompt_len=16", "--max_new_tokens=8", "--gammas=2", "--accept=0.8", "--iters=1",
             "--nopeers", "--draft_backend=xla", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    with open(tmp_path / "bench_e2e.json") as f:
        rep = json.load(f)
    assert rep["complete"] and rep["copy_TBps"] > 0 and rep["peers"]["skipped"] == "--nopeers"
    assert rep["draft_backend"] == "xla"
    assert {(s["backend"], s["batch"]) for s in rep["serial"]} == {("pallas", 1), ("xla", 1)}
    assert all(s["roofline_tokens_per_s"] > 0 for s in rep["serial"])
    assert {(s["drafter"], s["gamma"]) for s in rep["speculative"]} == {("oracle", 2),
                                                                        ("lookup", 2)}
    assert all(s["parity"] for s in rep["speculative"])
    for name in ("speedup_vs_gamma", "tokens_per_s_vs_acceptance"):
        assert (tmp_path / f"bench_e2e_{name}.png").exists()
    # Receipts (runs cut short too) re-drawn without running anything.
    r = _run("bench_e2e.py", f"--replot={tmp_path / 'bench_e2e.json'}", f"--out={tmp_path}",
             "--tag=again")
    assert r.returncode == 0 and "serial greedy" in r.stdout, r.stderr[-2000:]
    assert (tmp_path / "bench_e2e_again_speedup_vs_gamma.png").exists()


def test_eval_pair_smoke(tmp_path):
    r = _run("eval_pair.py", "--num_prompts=2", "--batch=2", "--max_new_tokens=8",
             "--gammas=2", "--policies=exact_greedy", "--iters=1", "--nopeers",
             f"--out={tmp_path}", "--tag=smoke")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "eval_pair_cpu_smoke.json"))
    assert rep["runs"][0]["parity"] and rep["runs"][0]["gamma"] == 2
    assert 0.0 <= rep["runs"][0]["acceptance"] <= 1.0
    assert (tmp_path / "eval_pair_cpu_smoke.png").exists()
