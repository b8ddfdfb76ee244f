"""The command-line entry points run end to end (tiny model made on the fly)."""

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
    assert "tokens/s" in r.stdout and "tiny random-weight" in r.stdout


@pytest.mark.parametrize("policy", ["exact_greedy", "gumbel_coupled"])
def test_speculative_cli_checks_parity(policy):
    r = _run("speculative_decode.py", f"--config={ROOT}/configs/speculative.py:runlocal",
             f"--config.policy={policy}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "PARITY: OK" in r.stdout and "acceptance" in r.stdout
