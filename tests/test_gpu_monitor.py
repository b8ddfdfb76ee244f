"""jspec.bench.gpu_monitor: nvidia-smi samples summarised for a receipt (a stand-in
nvidia-smi on PATH plays the GPU)."""

import os
import time

import pytest

from jspec.bench.gpu_monitor import GpuMonitor

FAKE = """#!/bin/sh
case "$*" in
  *clocks_event_reasons*) ;;
  *) [ -n "$OLD_DRIVER" ] || { echo "unexpected field list" >&2; exit 2; } ;;
esac
case "$*" in
  *clocks_event_reasons*)
    [ -n "$OLD_DRIVER" ] && { echo 'Field "clocks_event_reasons.active" is not valid' >&2
                              exit 2; } ;;
esac
case "$*" in
  *loop-ms*)
    echo "1980, 3201, 402.5, 41, 0x0000000000000000"
    echo "1755, 3201, 610.0, 44, 0x0000000000000004"
    echo "1980, 3201, 598.1, 45, 0x0000000000000000"
    echo "garbage line"
    sleep 30 ;;
  *pci.bus_id*) echo "1980, 3201, 80.0, 40, 0x0000000000000000, 00000000:19:00.0" ;;
esac
"""


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    exe = tmp_path / "nvidia-smi"
    exe.write_text(FAKE)
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    return exe


def test_summary_of_the_samples(fake_smi):
    with GpuMonitor(ms=50) as mon:
        time.sleep(0.5)  # the stand-in prints its samples at once
    s = mon.summary()
    assert s["samples"] == 3 and s["index"] == "1" and s["pci_bus_id"] == "00000000:19:00.0"
    assert s["sm_mhz"] == [1755.0, 1980.0, 1980.0] and s["mem_mhz"] == 3201.0
    assert s["power_w"] == [598.1, 610.0] and s["temp_c"] == 45.0
    assert s["event_reasons"] == ["0x0000000000000000", "0x0000000000000004"]


def test_a_driver_without_the_new_field_name(fake_smi, monkeypatch):
    # Older drivers call the field clocks_throttle_reasons.active; the stand-in then
    # refuses the new name, and the monitor falls back.
    monkeypatch.setenv("OLD_DRIVER", "1")
    with GpuMonitor(ms=50) as mon:
        time.sleep(0.3)
    assert "clocks_throttle_reasons.active" in mon.fields


def test_without_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with GpuMonitor() as mon:
        pass
    assert mon.summary() == {"unavailable": "no nvidia-smi on PATH"}
    with pytest.raises(ValueError, match="ms=5"):
        GpuMonitor(ms=5)
