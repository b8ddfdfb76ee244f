"""Several processes: a target sharded over two processes of two CPU devices each
(`jax.distributed` on localhost, gloo collectives; `jspec.sharding.init_distributed`)
computes the bits a single process of four devices computes."""

import socket

import numpy as np
import pytest
from sharding_checks import result, start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two processes on 2 cores: the simulated-device matrix proves R8 by default
def test_two_processes_compute_the_single_process_bits(tmp_path):
    """A TP=4 forward (a prefill, then verify blocks) and a speculative generation with a
    replicated draft model, in two processes and in one; bitwise equal."""
    port = _free_port()
    multi, single = tmp_path / "multi.npz", tmp_path / "single.npz"
    procs = [start("mp-worker", rank, port, multi, devices=2) for rank in (0, 1)]
    procs.append(start("mp-reference", single, devices=4))
    found = [result(p) for p in procs]
    assert [f.get("processes") for f in found[:2]] == [2, 2]
    assert len(found[0]["devices"]) == 4
    with np.load(multi) as a, np.load(single) as b:
        assert a["logits"].shape == b["logits"].shape == (12, 256)
        assert np.array_equal(a["logits"].view(np.uint32), b["logits"].view(np.uint32))
        assert np.array_equal(a["spec"], b["spec"])
        assert (a["spec"] >= 0).all()
