"""JSON receipts: a benchmark run's report, written where the run says.

A run writes its receipt (and its plots) under one stem, rewriting it as it goes so a run
cut short keeps what it measured. A receipt an earlier run left under the same name is
never replaced: the new run takes the next free `_run<N>` stem and says so.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from jspec._checks import existing_ancestor

_STEMS: dict[str, str] = {}  # this process's stems, by the stem asked for
MAX_TAG_BYTES = 120


def check_tag(tag: str, flag: str = "--tag") -> str:
    """A receipt name suffix: a file name part, so no path separator, no '..' and no NUL
    (the directory is --out's); else a ValueError naming `flag`. Scripts call it with
    their other flag checks, before any work; `receipt_stem` checks again."""
    if not isinstance(tag, str):
        raise ValueError(f"{flag}={tag!r} must be a string")
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if any(c in tag for c in seps) or ".." in tag or "\0" in tag:
        raise ValueError(f"{flag}={tag!r}: a receipt name suffix takes no path separators "
                         "or '..' (it names a file in --out; set --out for another folder)")
    if len(tag.encode()) > MAX_TAG_BYTES:  # the file name, with a name and _run<N>.json
        raise ValueError(f"{flag}: {len(tag.encode())} bytes; a receipt name suffix takes at "
                         f"most {MAX_TAG_BYTES} (file names stop at 255)")
    return tag


def check_out_dir(path: str, flag: str = "--out") -> str:
    """An output folder the run can write, checked before any work (a receipt, plot or
    head written only at the end would otherwise be lost with the run): `path` is a
    directory or absent, and the nearest folder that exists at or above it takes a new
    file (tried with a temporary file, removed again: no permission bits assumed, and
    nothing made). Else a ValueError naming `flag`."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{flag}={path!r} must be a directory path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag}={path!r} is a file, not a directory")
    probe = existing_ancestor(os.path.abspath(path))
    if not os.path.isdir(probe):
        raise ValueError(f"{flag}={path!r}: {probe!r} is a file, so the directory cannot be "
                         "made")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        where = "" if probe == os.path.abspath(path) else f" (in {probe!r}, to make it)"
        raise ValueError(f"{flag}={path!r} is not writable{where}: "
                         f"{e.strerror or e}") from None
    return path


def receipt_stem(out_dir: str, name: str, tag: str = "") -> str:
    """<out_dir>/<name>[_<tag>] for this run (the folder made if missing): the same stem
    for every write of the run; where an earlier run's <stem>.json exists, the first
    free <stem>_run<N> (N = 2, 3, ...), printed on stderr. A tag `check_tag` refuses is a
    ValueError."""
    check_tag(tag)
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, name + (f"_{tag}" if tag else ""))
    if base not in _STEMS:
        stem, n = base, 1
        while os.path.exists(stem + ".json"):
            n += 1
            stem = f"{base}_run{n}"
        if stem != base:
            print(f"{base}.json is an earlier run's receipt, kept: this run writes "
                  f"{stem}.json", file=sys.stderr, flush=True)
        _STEMS[base] = stem
    return _STEMS[base]


def _plain(value):
    """A flag's value as JSON holds it (a config or other object: its text)."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


def run_record() -> dict:
    """What ran: the command line and, in an absl entry point, the value of every flag
    its main module defines (defaults included)."""
    record = {"command": " ".join(sys.argv)}
    try:
        from absl import flags

        by_module = flags.FLAGS.flags_by_module_dict()  # a script's flags: by its argv[0]
        defined = by_module.get(sys.argv[0]) or by_module.get(
            getattr(sys.modules["__main__"], "__file__", ""), [])
        if flags.FLAGS.is_parsed() and defined:
            record["flags"] = {f.name: _plain(f.value) for f in defined}
    except Exception:  # noqa: BLE001 - no absl, or no flags: the command line alone
        pass
    return record


def write_receipt(out_dir: str, name: str, tag: str, report: dict) -> str:
    """Writes report to `receipt_stem(out_dir, name, tag)`.json, whole (a temporary file
    replaced), and returns the path. A report without them gets `run_record()`'s command
    and flags."""
    for key, value in run_record().items():
        report.setdefault(key, value)
    path = receipt_stem(out_dir, name, tag) + ".json"
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)
    return path
