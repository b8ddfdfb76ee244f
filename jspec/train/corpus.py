"""The code pair's corpus: the running Python's standard library, split into the
training files and the held-out modules (`experiments/train_pair.py` trains on the
former; `experiments/eval_pair.py` prompts from the latter and counts token frequencies in
the former)."""

from __future__ import annotations

import os
import sysconfig

# Held-out modules (paths relative to the stdlib root): never seen in training,
# neither by the tokenizer nor by the models.
HELD_OUT = ("textwrap.py", "shlex.py", "fractions.py", "graphlib.py", "colorsys.py",
            "heapq.py", "statistics.py", "difflib.py", "csv.py", "bisect.py",
            "json/encoder.py", "email/quoprimime.py")
EXCLUDE_DIRS = ("test", "tests", "idlelib", "turtledemo", "site-packages", "__pycache__",
                "lib2to3", "ensurepip")


def stdlib_files() -> tuple[list[str], list[str], str]:
    """(training files, held-out files, stdlib root), relative paths, sorted.

    Every 40th training file is later split off as the validation set that
    picks the checkpoint (`split_validation` in `experiments/train_pair.py`); the
    held-out files only measure.
    """
    root = sysconfig.get_paths()["stdlib"]
    train, held = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDE_DIRS)
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, fn), root)
                (held if rel in HELD_OUT else train).append(rel)
    missing = set(HELD_OUT) - set(held)
    if missing:
        raise SystemExit(f"held-out modules missing from {root}: {sorted(missing)}")
    return sorted(train), sorted(held), root


def read(root: str, rel: str) -> str:
    with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
        return f.read()
