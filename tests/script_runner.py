"""Runs the experiment scripts as `python script.py flags...` does, without paying the
imports each time.

The command-line tests start scripts by the dozen, and each new Python spends ~5 s
importing jax, flax and jspec before it reads a flag. `run_script` hands the command to
one helper process per test worker (this file run as a script), which has imported them
once and forks a child per command: the child sets argv, the working directory, stdin
(/dev/null), stdout and stderr, runs the script as `__main__` and exits with the
script's exit status, as a new interpreter would. Nothing but the imports is shared: the
helper never starts a JAX backend, so each child starts its own.

A command that is not `sys.executable path/to/script.py ...`, or that asks for its own
environment or input, runs as a plain subprocess.
"""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile

_HELPER = None  # this worker's helper process


def _helper() -> subprocess.Popen:
    global _HELPER
    if _HELPER is None or _HELPER.poll() is not None:
        _HELPER = subprocess.Popen([sys.executable, os.path.abspath(__file__)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, text=True, bufsize=1)
        atexit.register(_HELPER.kill)
    return _HELPER


def _line(helper: subprocess.Popen, timeout: float | None) -> dict | None:
    ready, _, _ = select.select([helper.stdout], [], [], timeout)
    if not ready:
        return None
    line = helper.stdout.readline()
    if not line:
        raise RuntimeError("the script runner's helper process died")
    return json.loads(line)


def run_script(cmd, *, cwd=None, timeout=None, env=None, capture_output=True, text=True,
               check=False, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, cwd=..., capture_output=True, text=True, timeout=...)` for a
    Python script, in a child forked from a process that has done the imports."""
    cmd = [str(c) for c in cmd]
    plain = (kwargs or not capture_output or len(cmd) < 2 or cmd[0] != sys.executable
             or not cmd[1].endswith(".py") or (env is not None and env != dict(os.environ)))
    if plain:
        r = subprocess.run(cmd, cwd=cwd, timeout=timeout, env=env,
                           capture_output=capture_output, text=text, **kwargs)
    else:
        with tempfile.TemporaryDirectory(prefix="jspec-script-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            helper = _helper()
            helper.stdin.write(json.dumps({"argv": cmd[1:], "cwd": os.path.abspath(cwd or "."),
                                           "out": out, "err": err}) + "\n")
            pid = _line(helper, 120)["pid"]
            done = _line(helper, timeout)
            if done is None:
                os.kill(pid, signal.SIGKILL)
                _line(helper, 60)
                raise subprocess.TimeoutExpired(cmd, timeout)
            mode = "r" if text else "rb"
            with open(out, mode) as f_out, open(err, mode) as f_err:
                r = subprocess.CompletedProcess(cmd, done["rc"], f_out.read(), f_err.read())
    if check:
        r.check_returncode()
    return r


def _child(req: dict) -> None:
    """In the forked child: become `python argv...` and never return."""
    import runpy

    code = 1
    try:
        os.chdir(req["cwd"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            new = os.open(path, flags, 0o644)
            os.dup2(new, fd)
            os.close(new)
        script = req["argv"][0]
        sys.argv = list(req["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:  # what the interpreter does with it
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException as e:  # the interpreter's report: the script's frames on
            tb = e.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename != script:
                tb = tb.tb_next
            e = e.with_traceback(tb or e.__traceback__)
            sys.excepthook(type(e), e, e.__traceback__)
            code = 1
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF if code >= 0 else 1)


def _serve() -> None:
    # What every script imports first; no JAX backend is started here.
    import absl.app  # noqa: F401
    import absl.flags  # noqa: F401
    import jax  # noqa: F401
    import jax.numpy  # noqa: F401
    import numpy  # noqa: F401

    import jspec  # noqa: F401

    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    _serve()
