"""What the GPU ran at while a block of work ran: SM clock, power, temperature.

Latency-bound work (a speculative round: many small kernels) scales with the SM clock,
bandwidth-bound work (a decode step) hardly does, so two GPUs of one host can agree on
serial decoding and differ on speculation. `GpuMonitor` samples `nvidia-smi`
every `ms` milliseconds while its block runs and summarises the samples for a receipt:

    with GpuMonitor() as mon:
        run()
    row["gpu"] = mon.summary()

Without nvidia-smi (a CPU run) the summary says so and nothing else. The GPU queried
is the first of CUDA_VISIBLE_DEVICES (default 0) as nvidia-smi numbers them (PCI bus
order); the summary names its index and PCI bus id.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess

# clocks_event_reasons.active is the newer name of clocks_throttle_reasons.active.
_FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")
_REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


def _gpu_index() -> str:
    return (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"


class GpuMonitor:
    def __init__(self, ms: int = 100):
        if ms < 10:
            raise ValueError(f"ms={ms}: nvidia-smi samples at most every 10 ms")
        self.ms, self.proc, self.why, self.lines = ms, None, None, []
        self.fields, self.bus_id = None, None

    def _query(self, exe: str, fields, extra=()) -> subprocess.CompletedProcess:
        return subprocess.run([exe, f"--query-gpu={','.join(fields)}",
                               "--format=csv,noheader,nounits", "-i", _gpu_index(), *extra],
                              capture_output=True, text=True, timeout=20)

    def __enter__(self) -> GpuMonitor:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            self.why = "no nvidia-smi on PATH"
            return self
        try:
            for reasons in _REASONS + (None,):
                fields = _FIELDS + ((reasons,) if reasons else ())
                probe = self._query(exe, fields + ("pci.bus_id",))
                if probe.returncode == 0:
                    self.fields = fields
                    self.bus_id = probe.stdout.strip().split(", ")[-1]
                    break
            else:
                self.why = f"nvidia-smi failed: {probe.stderr.strip() or probe.stdout.strip()}"
                return self
            self.proc = subprocess.Popen(
                [exe, f"--query-gpu={','.join(self.fields)}", "--format=csv,noheader,nounits",
                 "-i", _gpu_index(), f"--loop-ms={self.ms}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                start_new_session=True)  # its own process group, stopped whole on exit
        except (OSError, subprocess.SubprocessError) as e:
            self.why = f"nvidia-smi failed: {e}"
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, _ = self.proc.communicate()
        self.lines = [ln for ln in out.splitlines() if ln.strip()]

    def summary(self) -> dict:
        """{"samples", "index", "pci_bus_id", "sm_mhz": [min, median, max], "mem_mhz":
        median, "power_w": [median, max], "temp_c": max, "event_reasons": the distinct
        clock-event bitmasks seen} or {"unavailable": why}."""
        if self.why or self.fields is None:
            return {"unavailable": self.why or "not started"}
        cols = {f: [] for f in self.fields}
        for line in self.lines:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != len(self.fields):
                continue
            for f, p in zip(self.fields, parts, strict=True):
                cols[f].append(p)
        if not cols[self.fields[0]]:
            return {"unavailable": "no samples (the block ran shorter than one period?)",
                    "index": _gpu_index(), "pci_bus_id": self.bus_id}

        def num(f):
            vals = []
            for v in cols[f]:
                try:
                    vals.append(float(v))
                except ValueError:
                    pass
            return vals

        sm, mem = num("clocks.sm"), num("clocks.mem")
        power, temp = num("power.draw"), num("temperature.gpu")
        out = {"samples": len(cols[self.fields[0]]), "index": _gpu_index(),
               "pci_bus_id": self.bus_id, "period_ms": self.ms}
        if sm:
            out["sm_mhz"] = [min(sm), statistics.median(sm), max(sm)]
        if mem:
            out["mem_mhz"] = statistics.median(mem)
        if power:
            out["power_w"] = [statistics.median(power), max(power)]
        if temp:
            out["temp_c"] = max(temp)
        reasons = [f for f in self.fields if "reasons" in f]
        if reasons:
            out["event_reasons"] = sorted(set(cols[reasons[0]]))
        return out
