"""NcclComm's call sequence, against a recording stand-in for ``cupy.cuda.nccl``
and ``cupy.cuda``.

The stand-ins record what NcclComm calls and in what order; they move no bytes
and know nothing of NCCL's semantics. These tests check our calls and their
ordering (group brackets, send/recv order, stream waits, abort on timeout or
error), not NCCL. The GPU tests run the real thing.
"""

from __future__ import annotations

import dataclasses

import pytest

from jreshard.errors import PeerError, TransferTimeoutError
from jreshard.nccl import cupy_nccl
from jreshard.nccl.comm import RecvOp, SendOp
from jreshard.nccl.cupy_nccl import NcclComm, device_pointer, uid_from_bytes, uid_to_bytes
from jreshard.nccl.rendezvous import KeyValueRendezvous, MpiRendezvous

UID = tuple(range(-64, 64))


class NcclError(RuntimeError):
    pass


class RecordingNccl:
    """Stand-in for ``cupy.cuda.nccl``: logs calls, moves nothing."""

    NCCL_UINT8 = 7
    NcclError = NcclError

    def __init__(self, cuda: RecordingCuda):
        self.log: list[tuple] = cuda.log
        self.cuda = cuda
        self.async_error: Exception | None = None
        self.fail_send = False
        nccl = self

        class NcclCommunicator:
            def __init__(self, ndev, uid, rank):
                self.rank = rank
                nccl.log.append(("init", ndev, rank, nccl.cuda.device, uid == UID))

            def send(self, ptr, count, dtype, peer, stream):
                nccl.log.append(("send", self.rank, peer, ptr, count, dtype, stream, nccl.cuda.device))
                if nccl.fail_send:
                    raise NcclError("NCCL_ERROR_SYSTEM_ERROR")

            def recv(self, ptr, count, dtype, peer, stream):
                nccl.log.append(("recv", self.rank, peer, ptr, count, dtype, stream, nccl.cuda.device))

            def check_async_error(self):
                nccl.log.append(("check", self.rank))
                if nccl.async_error is not None:
                    raise nccl.async_error

            def abort(self):
                nccl.log.append(("abort", self.rank))

            def destroy(self):
                nccl.log.append(("destroy", self.rank))

        self.NcclCommunicator = NcclCommunicator

    def get_unique_id(self):
        self.log.append(("get_unique_id",))
        return UID

    def groupStart(self):
        self.log.append(("groupStart",))

    def groupEnd(self):
        self.log.append(("groupEnd",))


class RecordingCuda:
    """Stand-in for ``cupy.cuda``: devices, streams and events that log."""

    def __init__(self):
        self.log: list[tuple] = []
        self.device = None
        self.events_done = True
        self._ptr = 1000
        cuda = self

        class Event:
            def __init__(self, stream):
                self.stream = stream

            @property
            def done(self):
                return cuda.events_done

        class Stream:
            def __init__(self, non_blocking=False):
                cuda._ptr += 1
                self.ptr = cuda._ptr
                self.device = cuda.device
                cuda.log.append(("stream", self.ptr, cuda.device, non_blocking))

            def record(self):
                cuda.log.append(("record", self.ptr))
                return Event(self)

            def wait_event(self, event):
                cuda.log.append(("wait_event", self.ptr, event.stream.ptr))

        class Device:
            def __init__(self, ordinal):
                self.ordinal = ordinal

            def __enter__(self):
                self.prev, cuda.device = cuda.device, self.ordinal

            def __exit__(self, *exc):
                cuda.device = self.prev

        self.Stream, self.Device = Stream, Device
        self.current = {}

    def get_current_stream(self):
        if self.device not in self.current:
            self.current[self.device] = self.Stream()
        return self.current[self.device]


class Store:
    def __init__(self):
        self.values = {}

    def key_value_set(self, key, value):
        assert key not in self.values, f"key {key} set twice"
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_in_ms):
        if key not in self.values:
            raise TimeoutError(f"DEADLINE_EXCEEDED after {timeout_in_ms} ms")
        return self.values[key]


@dataclasses.dataclass
class Buf:
    """A CUDA-array-interface stand-in: a pointer and a length."""

    ptr: int
    n: int

    @property
    def __cuda_array_interface__(self):
        return {"data": (self.ptr, False), "shape": (self.n,), "typestr": "|u1", "strides": None, "version": 3}


@pytest.fixture(autouse=True)
def empty_cache():
    cupy_nccl._CACHE.clear()
    cupy_nccl._GENERATION.clear()
    yield
    cupy_nccl._CACHE.clear()
    cupy_nccl._GENERATION.clear()


def make(local, devices=None, store=None, namespace="t"):
    cuda = RecordingCuda()
    nccl = RecordingNccl(cuda)
    devices = devices or {0: 10, 1: 11, 2: 12, 3: 13}
    comm = NcclComm(
        devices=devices,
        local_devices=local,
        rendezvous=KeyValueRendezvous(store if store is not None else Store()),
        namespace=namespace,
        nccl=nccl,
        cuda=cuda,
    )
    return comm, nccl, cuda


def calls(log, *names):
    return [e for e in log if e[0] in names]


def test_creation_one_device_makes_and_shares_the_unique_id():
    store = Store()
    comm, nccl, _ = make({0: 0}, store=store)
    assert comm.local_ranks == (0,)
    assert calls(nccl.log, "get_unique_id", "init", "groupStart") == [("get_unique_id",), ("init", 4, 0, 0, True)]
    assert len(store.values) == 1
    # Another process (a fresh generation counter), without NCCL rank 0, reads the id instead of making one.
    cupy_nccl._GENERATION.clear()
    other, nccl2, _ = make({2: 0}, store=store)
    assert calls(nccl2.log, "get_unique_id", "init") == [("init", 4, 2, 0, True)]
    assert other.nccl_rank(2) == 2 and len(store.values) == 1


def test_a_process_without_rank_zero_waits_for_the_id_and_times_out_cleanly():
    with pytest.raises(TransferTimeoutError, match="was not set within timeout_s"):
        make({3: 0})


def test_several_devices_in_one_process_init_inside_one_group():
    comm, nccl, _ = make({0: 0, 1: 1, 3: 2})
    seq = calls(nccl.log, "groupStart", "groupEnd", "init")
    inits = [("init", 4, 0, 0, True), ("init", 4, 1, 1, True), ("init", 4, 3, 2, True)]
    assert seq == [("groupStart",), *inits, ("groupEnd",)]
    assert comm.nccl_rank(3) == 3


def test_ranks_sharing_a_gpu_share_one_nccl_rank():
    comm, nccl, _ = make({0: 0, 4: 0}, devices={0: 10, 4: 10, 1: 11})
    assert comm.nccl_rank(0) == comm.nccl_rank(4) == 0 and comm.nccl_rank(1) == 1
    assert len(calls(nccl.log, "init")) == 1
    with pytest.raises(ValueError, match="must share its ordinal"):
        make({0: 0, 4: 1}, devices={0: 10, 4: 10, 1: 11}, namespace="u")


def test_communicators_are_cached_and_reused():
    store = Store()
    a, nccl, cuda = make({0: 0}, store=store)
    b = NcclComm(
        devices={0: 10, 1: 11, 2: 12, 3: 13},
        local_devices={0: 0},
        rendezvous=KeyValueRendezvous(store),
        namespace="t",
        nccl=nccl,
        cuda=cuda,
    )
    assert len(calls(nccl.log, "init")) == 1 and len(store.values) == 1
    assert b.stream(0) is a.stream(0)
    assert cupy_nccl.destroy_cached_communicators() == 1
    assert calls(nccl.log, "destroy") == [("destroy", 0)]


def test_exchange_order_group_and_stream_sync():
    comm, nccl, _ = make({0: 0, 1: 1})
    nccl.log.clear()
    s0 = comm.stream(0).ptr
    sends = [SendOp(1, 3, 5, Buf(0x200, 64)), SendOp(0, 2, 9, Buf(0x100, 32)), SendOp(0, 2, 1, Buf(0x180, 16))]
    recvs = [RecvOp(3, 0, 2, Buf(0x300, 8)), RecvOp(2, 1, 0, Buf(0x400, 4))]
    comm.exchange(sends, recvs, timeout_s=5.0)
    log = [e for e in nccl.log if e[0] != "stream"]
    start = log.index(("groupStart",))
    end = log.index(("groupEnd",))
    # Before the group: each NCCL stream waits on its device's current stream.
    assert [e[0] for e in log[:start]] == ["record", "wait_event", "record", "wait_event"]
    inside = log[start + 1 : end]
    # Sends then receives, each in (src, dst, tag) order; peers as NCCL ranks; bytes as uint8.
    assert [(e[0], e[1], e[2], e[3], e[4]) for e in inside] == [
        ("send", 0, 2, 0x180, 16),
        ("send", 0, 2, 0x100, 32),
        ("send", 1, 3, 0x200, 64),
        ("recv", 1, 2, 0x400, 4),
        ("recv", 0, 3, 0x300, 8),
    ]
    assert all(e[5] == RecordingNccl.NCCL_UINT8 for e in inside)
    assert inside[0][6] == s0 and inside[0][7] == 0 and inside[2][7] == 1  # on the device's NCCL stream
    # After the group: an event per device, then done (no abort, no async-error check needed).
    assert [e[0] for e in log[end + 1 :]] == ["record", "record"]
    assert not calls(nccl.log, "abort")


def test_exchange_of_nothing_calls_nothing():
    comm, nccl, _ = make({0: 0})
    n = len(nccl.log)
    comm.exchange([], [], timeout_s=1.0)
    assert len(nccl.log) == n


def test_timeout_aborts_every_communicator_and_names_the_peers():
    comm, nccl, cuda = make({0: 0, 1: 1})
    cuda.events_done = False
    with pytest.raises(TransferTimeoutError, match=r"sends to ranks \[3\] and receives from ranks \[2\]") as info:
        comm.exchange([SendOp(0, 3, 0, Buf(1, 8))], [RecvOp(2, 1, 0, Buf(2, 8))], timeout_s=0.02)
    assert info.value.destination_intact is False
    assert sorted(calls(nccl.log, "abort")) == [("abort", 0), ("abort", 1)]
    assert calls(nccl.log, "check")  # polled NCCL's async error while waiting
    assert not cupy_nccl._CACHE  # aborted communicators are not reused


def test_async_error_aborts_and_raises_peer_error():
    comm, nccl, cuda = make({0: 0})
    cuda.events_done = False
    nccl.async_error = NcclError("NCCL_ERROR_REMOTE_ERROR")
    with pytest.raises(PeerError, match="REMOTE_ERROR"):
        comm.exchange([SendOp(0, 1, 0, Buf(1, 8))], [], timeout_s=5.0)
    assert calls(nccl.log, "abort") == [("abort", 0)]


def test_error_while_posting_still_closes_the_group_then_aborts():
    comm, nccl, _ = make({0: 0})
    nccl.fail_send = True
    nccl.log.clear()
    with pytest.raises(PeerError, match="SYSTEM_ERROR"):
        comm.exchange([SendOp(0, 1, 0, Buf(1, 8))], [], timeout_s=5.0)
    names = [e[0] for e in nccl.log if e[0] in ("groupStart", "send", "groupEnd", "abort")]
    assert names == ["groupStart", "send", "groupEnd", "abort"]


def test_bad_ops_are_rejected_before_any_nccl_call():
    comm, nccl, _ = make({0: 0})
    n = len(nccl.log)
    with pytest.raises(ValueError, match="does not drive"):
        comm.exchange([SendOp(1, 0, 0, Buf(1, 8))], [], timeout_s=1.0)
    with pytest.raises(ValueError, match="peer rank 9"):
        comm.exchange([SendOp(0, 9, 0, Buf(1, 8))], [], timeout_s=1.0)
    with pytest.raises(ValueError, match="no __cuda_array_interface__"):
        comm.exchange([SendOp(0, 1, 0, bytearray(8))], [], timeout_s=1.0)
    assert len(nccl.log) == n
    with pytest.raises(ValueError, match="local rank 7 is not in devices"):
        make({7: 0}, namespace="v")


def test_device_pointer_checks_layout():
    assert device_pointer(Buf(0xABC, 12)) == (0xABC, 12)

    class Wide(Buf):
        @property
        def __cuda_array_interface__(self):
            return {"data": (1, False), "shape": (3,), "typestr": "<f4", "strides": None}

    with pytest.raises(ValueError, match="typestr='<f4'"):
        device_pointer(Wide(1, 3))


def test_unique_id_round_trip_both_char_signednesses():
    raw = uid_to_bytes(UID)
    assert len(raw) == 128
    assert uid_from_bytes(raw, signed=True) == UID
    assert uid_from_bytes(raw, signed=False) == tuple(v & 0xFF for v in UID)


def test_mpi_rendezvous_over_a_stand_in_communicator():
    class Comm:
        def __init__(self, values):
            self.values = values

        def allgather(self, value):
            return self.values

    assert MpiRendezvous(Comm([None, b"id", None])).share("k", None, timeout_s=1) == b"id"
    with pytest.raises(PeerError, match=r"MPI processes \[\] supplied"):
        MpiRendezvous(Comm([None, None])).share("k", None, timeout_s=1)
    with pytest.raises(PeerError, match=r"\[0, 1\]"):
        MpiRendezvous(Comm([b"a", b"b"])).share("k", b"a", timeout_s=1)


def test_key_value_rendezvous_from_jax_needs_a_cluster():
    from jreshard.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match=r"jax\.distributed\.initialize"):
        KeyValueRendezvous.from_jax()
