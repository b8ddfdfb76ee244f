"""The script runner of the command-line tests gives what `subprocess.run` gives: the
exit status, the two streams, argv and the working directory, a timeout."""

import subprocess
import sys

import pytest
from script_runner import run_script

SCRIPT = '''import os, sys
print("argv", sys.argv[1:], "cwd", os.getcwd(), "main", __name__)
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "raise":
    raise ValueError("boom")
if how == "exit-text":
    sys.exit("bad input")
if how == "sleep":
    import time; time.sleep(60)
if how == "stdin":
    print("stdin", repr(sys.stdin.read()))
    how = "0"
sys.exit(int(how))
'''


@pytest.mark.parametrize("how", ["0", "2", "raise", "exit-text", "stdin"])
def test_a_script_runs_as_a_new_interpreter_runs_it(tmp_path, how):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, str(script), how]
    want = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    got = run_script(cmd, cwd=tmp_path, timeout=60)
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout,
                                                         want.stderr)


def test_a_script_past_its_timeout_is_killed(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    with pytest.raises(subprocess.TimeoutExpired):
        run_script([sys.executable, str(script), "sleep"], cwd=tmp_path, timeout=2)
    assert run_script([sys.executable, str(script), "0"], cwd=tmp_path).returncode == 0
