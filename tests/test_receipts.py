"""A run never replaces an earlier run's receipt: it rewrites its own as it goes, and
takes the next free `_run<N>` stem where an earlier receipt of its name exists. A
roofline names the card whose spec sheet it is a fraction of."""

import json
import os
import re
import sys

import pytest
from script_runner import run_script

from jspec.bench import receipts


def test_a_run_rewrites_its_own_receipt_and_keeps_earlier_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(receipts, "_STEMS", {})
    out = str(tmp_path / "out")
    first = receipts.write_receipt(out, "bench_x", "h200", {"step": 1})
    assert receipts.write_receipt(out, "bench_x", "h200", {"step": 2}) == first  # as it goes
    assert json.loads(open(first).read()) == {"step": 2, "command": " ".join(sys.argv)}
    monkeypatch.setattr(receipts, "_STEMS", {})  # a second run of the same command
    second = receipts.write_receipt(out, "bench_x", "h200", {"run": 2})
    assert second == f"{out}/bench_x_h200_run2.json"
    assert json.loads(open(first).read())["step"] == 2  # the earlier run's, kept
    assert "earlier run's receipt, kept" in capsys.readouterr().err
    monkeypatch.setattr(receipts, "_STEMS", {})
    assert receipts.receipt_stem(out, "bench_x", "h200") == f"{out}/bench_x_h200_run3"
    assert receipts.receipt_stem(out, "bench_y") == f"{out}/bench_y"  # no tag, no receipt yet


@pytest.mark.parametrize("where,words", [
    ("afile", "is a file, not a directory"),
    ("afile/sub", "is a file, so the directory cannot be made"),
    ("/proc/jspec_out", "is not writable (in '/proc', to make it)"),
    ("", "must be a directory path"),
])
def test_an_output_folder_is_checked_before_any_work(tmp_path, where, words):
    # An --out (or train_draft_head's --config.out_dir) that could not be written failed
    # at the first receipt or at the export: after the models were built, or after the
    # training. Now a ValueError naming the flag, before anything runs, and nothing made.
    (tmp_path / "afile").write_text("")
    path = where if where.startswith("/") or not where else str(tmp_path / where)
    with pytest.raises(ValueError, match=re.escape(words)) as e:
        receipts.check_out_dir(path, "--out")
    assert str(e.value).startswith("--out=")
    new = str(tmp_path / "a" / "b")  # a folder still to make, under a writable one: fine
    assert receipts.check_out_dir(new) == new and not os.path.exists(tmp_path / "a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # no probe file left


def test_a_benchmark_run_twice_keeps_both_receipts(tmp_path):
    # The same sweep command twice into one folder (a CPU smoke run): two receipts.
    cmd = [sys.executable, "experiments/tuning/sweep_matmul.py", "--interpret",
           "--presets=tiny-qwen3", "--shapes=wo", "--rows=1", "--max_candidates=1",
           "--iters=1", "--reps=1", "--noxla_probe", f"--out={tmp_path}", "--tag=t"]
    for _ in range(2):
        run_script(cmd, check=True, capture_output=True)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["sweep_matmul_t.json", "sweep_matmul_t_run2.json",
                     "sweep_matmul_t_run2_tuned.json", "sweep_matmul_t_tuned.json"], names
    rep = json.load(open(tmp_path / "sweep_matmul_t.json"))  # what ran, every flag
    assert rep["command"].startswith("experiments/tuning/sweep_matmul.py --interpret")
    assert rep["flags"]["presets"] == ["tiny-qwen3"] and rep["flags"]["iters"] == 1


def test_rooflines_name_the_card_they_are_a_fraction_of():
    from jspec.bench.timing import spec_peaks

    assert spec_peaks("NVIDIA H100 80GB HBM3") == (989e12, 3.35e12, "H100")
    assert spec_peaks("NVIDIA H200")[1:] == (4.8e12, "H200")
    assert spec_peaks("NVIDIA H100 PCIe")[1:] == (2.0e12, "H100 PCIe")
    flops, bandwidth, name = spec_peaks("cpu")  # an unlisted device: assumed, and said
    assert (flops, bandwidth) == spec_peaks("H200")[:2] and "assumed: cpu" in name
