"""JSON receipts: a benchmark run's report, written where the run says."""

from __future__ import annotations

import json
import os


def write_receipt(out_dir: str, name: str, tag: str, report: dict) -> str:
    """Writes report to <out_dir>/<name>[_<tag>].json (the folder made if missing);
    returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name + (f"_{tag}" if tag else "") + ".json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    return path
