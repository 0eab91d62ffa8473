"""Every call into MPI and NCCL (stand-in), made to fail: what the caller sees (NIXL's are in
test_transport_faults.py).

NCCL: each call ``NcclComm`` makes into the stand-ins of ``cupy.cuda.nccl`` and ``cupy.cuda`` raises;
the caller sees a jreshard :class:`TransferError` (:class:`PeerError` for NCCL's calls) naming the
ranks and the phase, and every communicator is aborted (none is reused). MPI: under ``mpiexec -n 2``,
each call ``MpiComm`` makes into mpi4py raises ``MPI.Exception`` on one process; that process sees
:class:`PeerError` naming the peer and the phase, its communicator broken, and its peer is not left
hanging past ``timeout_s``. The in-process path (``LocalComm``) calls no transport library: its copies
are numpy's, its mismatches raise :class:`PeerError` (``test_engine.py``).
"""

from __future__ import annotations

import pytest
from cupy_standins import RecordingCuda, RecordingNccl
from mpi_launch import launch, need_mpi, program, results

from jreshard.engine.comm import RecvOp, SendOp
from jreshard.errors import PeerError, TransferError
from jreshard.nccl import cupy_nccl
from jreshard.nccl.cupy_nccl import NcclComm
from jreshard.nccl.rendezvous import KeyValueRendezvous

pytestmark = pytest.mark.timeout(120)


class _Store:
    def __init__(self):
        self.values = {}

    def key_value_set(self, key, value):
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_in_ms):
        return self.values[key]


class _Buf:
    def __init__(self, ptr: int, n: int):
        self.ptr, self.n = ptr, n

    @property
    def __cuda_array_interface__(self):
        return {"data": (self.ptr, False), "shape": (self.n,), "typestr": "|u1", "strides": None, "version": 3}


class Planted(RuntimeError):
    """What the stand-in raises: a library's own exception type, not jreshard's."""


def _raise(*a, **k):
    raise Planted("planted by the test")


# (what fails, how to plant it, the error type the caller sees, what its message names)
NCCL_CALLS = [
    ("groupStart", lambda n, c: setattr(n, "groupStart", _raise), PeerError, "NCCL failed while posting"),
    ("send", lambda n, c: setattr(n.NcclCommunicator, "send", _raise), PeerError, "NCCL failed while posting"),
    ("recv", lambda n, c: setattr(n.NcclCommunicator, "recv", _raise), PeerError, "NCCL failed while posting"),
    ("groupEnd", lambda n, c: setattr(n, "groupEnd", _raise), PeerError, "NCCL failed while posting"),
    ("record", lambda n, c: setattr(c.Stream, "record", _raise), TransferError, "CUDA failed"),
    ("wait_event", lambda n, c: setattr(c.Stream, "wait_event", _raise), TransferError, "CUDA failed ordering"),
    ("eventQuery", lambda n, c: setattr(c.runtime, "eventQuery", _raise), TransferError, "CUDA reported"),
    ("check_async_error", None, PeerError, "NCCL reported an error"),
]


@pytest.mark.parametrize(("call", "plant", "kind", "says"), NCCL_CALLS, ids=[c[0] for c in NCCL_CALLS])
def test_every_nccl_call_that_raises_becomes_a_jreshard_error_and_aborts(call, plant, kind, says):
    cupy_nccl._CACHE.clear()
    cupy_nccl._GENERATION.clear()
    cuda = RecordingCuda()
    nccl = RecordingNccl(cuda)
    comm = NcclComm(
        devices={0: 10, 1: 11},
        local_devices={0: 0},
        rendezvous=KeyValueRendezvous(_Store()),
        namespace="faults",
        nccl=nccl,
        cuda=cuda,
    )
    if plant is None:  # NCCL's asynchronous error, polled while the group is in flight
        cuda.event_status = 600  # cudaErrorNotReady
        nccl.async_error = Planted("planted by the test")
    else:
        plant(nccl, cuda)
    with pytest.raises(TransferError) as info:
        comm.exchange([SendOp(0, 1, 0, _Buf(1, 8))], [RecvOp(1, 0, 0, _Buf(2, 8))], timeout_s=5.0)
    err = info.value
    assert isinstance(err, kind) and says in str(err) and "Planted: planted by the test" in str(err), repr(err)
    assert err.destination_intact is False and isinstance(err.__cause__, Planted)
    assert ("abort", 0) in nccl.log and not cupy_nccl._CACHE  # aborted, never reused
    cupy_nccl._CACHE.clear()
    cupy_nccl._GENERATION.clear()


def test_every_mpi_call_that_raises_becomes_a_peer_error_naming_peer_and_phase(tmp_path):
    need_mpi()
    launch([program(2, "comm_faults.py")], tmp_path, devices=1, timeout_s=100)
    got = results(tmp_path, "comm-faults")
    assert sorted(got) == [0, 1], got
    faulty, peer = got[0], got[1]
    assert "error" not in faulty and "error" not in peer, (faulty, peer)
    for call, seen in faulty["calls"].items():
        assert seen["type"] == "PeerError", (call, seen)
        assert seen["says"] in seen["message"] and "MPI process 1" in seen["message"], (call, seen)
        assert seen["broken"] and seen["next"].startswith("PeerError: MpiComm is broken"), (call, seen)
        assert seen["seconds"] < 4.0, (call, seen)
    assert faulty["closed"] == "ok", faulty  # close() after a failure releases what it can, raises nothing
    for call, seen in peer["calls"].items():  # the healthy side: done, or a bounded timeout
        assert seen["type"] in ("ok", "TransferTimeoutError", "PeerError"), (call, seen)
        assert seen["seconds"] < 1.0 + 4.0, (call, seen)
