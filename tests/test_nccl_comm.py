"""NcclComm's call sequence, against a recording stand-in for ``cupy.cuda.nccl``
and ``cupy.cuda``.

The stand-ins record what NcclComm calls and in what order; they move no bytes
and know nothing of NCCL's semantics. These tests check our calls and their
ordering (group brackets, send/recv order, stream waits, abort on timeout or
error), not NCCL. The GPU tests run the real thing.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
from cupy_standins import CUDA_ERROR_NOT_READY, UID13, FakeDeviceArray, NcclError, RecordingCuda, RecordingNccl

from jreshard.engine.comm import RecvOp, SendOp
from jreshard.errors import PeerError, TransferError, TransferTimeoutError
from jreshard.mpi.rendezvous import MpiRendezvous
from jreshard.nccl import cupy_nccl
from jreshard.nccl.cupy_nccl import NcclComm, device_pointer, uid_from_bytes, uid_to_bytes
from jreshard.nccl.rendezvous import KeyValueRendezvous


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


def make(local, devices=None, store=None, namespace="t", major=14):
    cuda = RecordingCuda()
    nccl = RecordingNccl(cuda, major)
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
    assert [e[0] for e in log[:start] if e[0] != "eventQuery"] == ["record", "wait_event", "record", "wait_event"]
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
    assert [e[0] for e in log[end + 1 :]] == ["record", "record", "eventQuery", "eventQuery"]
    assert not calls(nccl.log, "abort")


def test_rows_post_the_same_calls_as_ops_at_base_pointer_plus_offset():
    def inside(exchange):
        comm, nccl, _ = make({0: 0, 1: 1}, namespace=f"rows{len(seen)}")
        nccl.log.clear()
        exchange(comm)
        log = [e for e in nccl.log if e[0] != "stream"]
        seen.append([e[:5] for e in log[log.index(("groupStart",)) + 1 : log.index(("groupEnd",))]])

    seen: list[list[tuple]] = []
    bases = [Buf(0x1000, 256), Buf(0x2000, 64)]
    inside(
        lambda c: c.exchange(
            [SendOp(1, 3, 5, Buf(0x1010, 64)), SendOp(0, 2, 9, Buf(0x2000, 32))],
            [RecvOp(3, 0, 2, Buf(0x2020, 8))],
            timeout_s=5.0,
        )
    )
    inside(lambda c: c.exchange_rows([(1, 3, 5, 0, 0x10, 64), (0, 2, 9, 1, 0, 32)], [(3, 0, 2, 1, 0x20, 8)], bases,
                                     timeout_s=5.0))  # fmt: skip
    assert seen[0] == seen[1] == [("send", 0, 2, 0x2000, 32), ("send", 1, 3, 0x1010, 64), ("recv", 0, 3, 0x2020, 8)]


def test_a_row_past_its_buffer_is_refused_before_any_nccl_call():
    comm, nccl, _ = make({0: 0})
    n = len(nccl.log)
    with pytest.raises(ValueError, match=r"bytes 60\.\.68 of a buffer of 64"):
        comm.exchange_rows([(0, 1, 0, 0, 60, 8)], [], [Buf(0x100, 64)], timeout_s=1.0)
    assert len(nccl.log) == n


def test_exchange_of_nothing_calls_nothing():
    comm, nccl, _ = make({0: 0})
    n = len(nccl.log)
    comm.exchange([], [], timeout_s=1.0)
    assert len(nccl.log) == n


def test_timeout_aborts_every_communicator_and_names_the_peers():
    comm, nccl, cuda = make({0: 0, 1: 1})
    cuda.event_status = CUDA_ERROR_NOT_READY
    with pytest.raises(TransferTimeoutError, match=r"sends to ranks \[3\] and receives from ranks \[2\]") as info:
        comm.exchange([SendOp(0, 3, 0, Buf(1, 8))], [RecvOp(2, 1, 0, Buf(2, 8))], timeout_s=0.02)
    assert info.value.destination_intact is False
    assert sorted(calls(nccl.log, "abort")) == [("abort", 0), ("abort", 1)]
    assert calls(nccl.log, "check")  # polled NCCL's async error while waiting
    assert not cupy_nccl._CACHE  # aborted communicators are not reused


def test_async_error_aborts_and_raises_peer_error():
    comm, nccl, cuda = make({0: 0})
    cuda.event_status = CUDA_ERROR_NOT_READY
    nccl.async_error = NcclError(6)  # ncclRemoteError
    with pytest.raises(PeerError, match="NCCL error 6"):
        comm.exchange([SendOp(0, 1, 0, Buf(1, 8))], [], timeout_s=5.0)
    assert calls(nccl.log, "abort") == [("abort", 0)]


def test_error_while_posting_still_closes_the_group_then_aborts():
    comm, nccl, _ = make({0: 0})
    nccl.fail_send = True
    nccl.log.clear()
    with pytest.raises(PeerError, match="NCCL error 2"):
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
    raw = uid_to_bytes(UID13)
    assert len(raw) == 128
    assert uid_from_bytes(raw, signed=True) == UID13
    assert uid_from_bytes(raw, signed=False) == tuple(v & 0xFF for v in UID13)


@pytest.mark.parametrize("major", [13, 14])
def test_communicator_gets_the_id_type_its_cupy_declares(major):
    """CuPy 14 takes bytes and refuses a tuple (TypeError); CuPy 13 takes a tuple. Both the
    process that made the id and one that only received it pass the right type."""
    store = Store()
    _, nccl, _ = make({0: 0}, store=store, major=major)
    assert calls(nccl.log, "init") == [("init", 4, 0, 0, True)]
    cupy_nccl._GENERATION.clear()
    _, nccl2, _ = make({1: 0}, store=store, major=major)  # reads the id, never calls get_unique_id
    assert calls(nccl2.log, "get_unique_id", "init") == [("init", 4, 1, 0, True)]


def test_a_cuda_error_is_raised_as_itself_not_waited_on():
    comm, nccl, cuda = make({0: 0})
    cuda.event_status = 700  # cudaErrorIllegalAddress: sticky, the event will never complete
    with pytest.raises(TransferError, match="cudaError 700") as info:
        comm.exchange([SendOp(0, 1, 0, Buf(1, 8))], [], timeout_s=60.0)
    assert type(info.value) is TransferError and info.value.destination_intact is False
    assert calls(nccl.log, "abort") == [("abort", 0)] and not calls(nccl.log, "check")


def test_a_group_end_that_never_returns_is_aborted_at_the_deadline():
    comm, nccl, _ = make({0: 0})
    nccl.block_group_end = threading.Event()  # a peer that never connects
    with pytest.raises(TransferTimeoutError, match=r"did not finish within timeout_s=0.05"):
        comm.exchange([SendOp(0, 1, 0, Buf(1, 8))], [], timeout_s=0.05)
    assert calls(nccl.log, "abort") == [("abort", 0)]  # once, though watchdog and error path both abort


def test_communicator_creation_is_bounded_by_timeout_s(monkeypatch):
    release = threading.Event()
    cuda = RecordingCuda()
    nccl = RecordingNccl(cuda)
    real = nccl.NcclCommunicator

    def hangs(*args, **kwargs):
        release.wait(30)  # ncclCommInitRank waiting for a rank that never comes
        return real(*args, **kwargs)

    nccl.NcclCommunicator = hangs
    try:
        with pytest.raises(TransferTimeoutError, match="ncclCommInitRank for NCCL ranks \\[0\\]"):
            NcclComm(
                devices={0: 10, 1: 11},
                local_devices={0: 0},
                rendezvous=KeyValueRendezvous(Store()),
                nccl=nccl,
                cuda=cuda,
                timeout_s=0.05,
            )
    finally:
        release.set()
    assert not cupy_nccl._CACHE


def test_mpi_rendezvous_in_one_process():
    from mpi4py import MPI

    assert MpiRendezvous(MPI.COMM_SELF).share("k", b"id", timeout_s=1) == b"id"
    with pytest.raises(PeerError, match=r"MPI processes \[\] supplied"):
        MpiRendezvous(MPI.COMM_SELF).share("k", None, timeout_s=1)


@pytest.mark.parametrize("case", ["one", "none", "two", "late"])
def test_mpi_rendezvous_among_three_processes(tmp_path, case):
    """Every process gets the one value made; none or two made is PeerError everywhere; a process that never
    calls it is TransferTimeoutError on the others within timeout_s (MPI's allgather waited for good)."""
    from mpi_launch import launch, need_mpi, program, results

    need_mpi()
    launch([program(3, "rendezvous_body.py", case)], tmp_path, devices=1, timeout_s=90)
    got = results(tmp_path, f"rendezvous-{case}")
    assert sorted(got) == [0, 1, 2], got
    for rank, r in got.items():
        assert "error" not in r, r
        if case == "one":
            assert r["got"] == "id", r
        elif case == "none":
            assert r["raised"].startswith("PeerError") and "MPI processes [] supplied" in r["raised"], r
        elif case == "two":
            assert r["raised"].startswith("PeerError") and "[0, 1]" in r["raised"], r
        elif rank != 2:
            assert "not every one of the communicator's 3 processes joined within 4 s" in r["raised"], r
            assert r["raised"].startswith("TransferTimeoutError: rendezvous 'k': "), r
            assert 4.0 <= r["after_s"] < 9.0, r


def test_key_value_rendezvous_from_jax_needs_a_cluster():
    from jreshard.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match=r"jax\.distributed\.initialize"):
        KeyValueRendezvous.from_jax()


# ---- the stream path: no host wait per exchange, one bounded wait at the end ----------


def deferred(local=None, timeout_s=5.0):
    from cupy_standins import fake_cupy

    comm, nccl, cuda = make(local or {0: 0, 1: 1})
    bufs = comm.buffers(timeout_s=timeout_s, cupy=fake_cupy(cuda))
    return comm, nccl, cuda, bufs


def test_after_buffers_an_exchange_does_not_wait_and_synchronize_does_once():
    comm, nccl, _, bufs = deferred()
    assert bufs.stream(0) is comm.stream(0) and bufs.stream(1) is comm.stream(1)  # kernels and NCCL share
    nccl.log.clear()
    for tag in range(3):
        comm.exchange([SendOp(0, 2, tag, Buf(0x100, 8))], [RecvOp(3, 1, tag, Buf(0x200, 8))], timeout_s=5.0)
    assert not calls(nccl.log, "eventQuery", "synchronize", "check")  # no host wait per exchange
    assert [e[0] for e in calls(nccl.log, "groupStart", "groupEnd")] == ["groupStart", "groupEnd"] * 3
    bufs.synchronize()
    assert len(calls(nccl.log, "eventQuery")) == 2 and not calls(nccl.log, "abort")  # one event per GPU, done


def test_fence_orders_the_pack_stream_before_the_comm_stream_through_events_without_a_host_wait():
    _, nccl, cuda, bufs = deferred()
    p0, p1 = bufs.streams.pack(0).ptr, bufs.streams.pack(1).ptr  # as a pack on each GPU makes them
    nccl.log.clear()
    bufs.fence()
    s0, s1 = bufs.stream(0).ptr, bufs.stream(1).ptr
    waits = calls(nccl.log, "wait_event")
    assert [(w[1], w[2]) for w in waits] == [(s0, p0), (s1, p1)]  # each comm stream waits on its pack stream
    assert not calls(nccl.log, "synchronize", "eventQuery") and not cuda.current  # no current stream touched


def test_final_wait_is_bounded_and_aborts():
    _, nccl, cuda, bufs = deferred(timeout_s=0.05)
    cuda.event_status = CUDA_ERROR_NOT_READY
    with pytest.raises(TransferTimeoutError, match=r"GPUs \[0, 1\] did not finish within timeout_s=0.05"):
        bufs.synchronize()
    assert sorted(calls(nccl.log, "abort")) == [("abort", 0), ("abort", 1)]
    assert calls(nccl.log, "check")  # NCCL's errors polled while waiting


def test_final_wait_reports_nccl_and_cuda_errors_as_themselves():
    _, nccl, cuda, bufs = deferred()
    cuda.event_status = CUDA_ERROR_NOT_READY
    nccl.async_error = NcclError(6)
    with pytest.raises(PeerError, match="NCCL error 6"):
        bufs.synchronize()
    _, nccl, cuda, bufs = deferred()
    cuda.event_status = 700
    with pytest.raises(TransferError, match="cudaError 700 on GPU 0") as info:
        bufs.synchronize()
    assert type(info.value) is TransferError and calls(nccl.log, "abort")


def test_the_engine_over_nccl_stand_ins_runs_in_stream_order(monkeypatch):
    """execute() with NcclComm.buffers(): every kernel and every send/receive on the GPU's one
    stream, packs before their group and unpacks after it, no host wait until the end."""
    from cupy_standins import fake_cupy
    from schedule_oracle import build_schedule

    from jreshard.cuda import kernels as CK
    from jreshard.engine.rounds import Shards, execute
    from jreshard.options import Options
    from jreshard.sharding.box import Box
    from jreshard.sharding.layout import Layout
    from jreshard.sharding.planner import plan_layouts
    from jreshard.sharding.topology import Topology

    monkeypatch.setattr(CK, "_KERNELS", {})
    cuda = RecordingCuda()
    comm = NcclComm(
        devices={0: 0, 1: 0, 2: 0},
        local_devices={0: 0, 1: 0, 2: 0},
        rendezvous=KeyValueRendezvous(Store()),
        nccl=RecordingNccl(cuda),
        cuda=cuda,
    )
    bufs = comm.buffers(timeout_s=5.0, cupy=fake_cupy(cuda))
    shape = (256, 1024)
    src = Layout.from_boxes(shape, "float32", {0: Box((0, 0), shape)})
    dst = Layout.from_boxes(shape, "float32", {1: Box((0, 0), (256, 512)), 2: Box((0, 512), shape)})
    topo = Topology.from_domains({0: 0, 1: 0, 2: 0}, devices={0: 0, 1: 1, 2: 2})
    opts = Options(backend="nccl", chunk_bytes=128 << 10, staging_bytes=1 << 20, timeout_s=5.0)
    plan = plan_layouts([(src, dst)], topo, opts)
    half = 256 * 512 * 4
    shards = Shards(
        src={(0, 0): FakeDeviceArray(2 * half, 0, 1 << 30)},
        dst={(0, 1): FakeDeviceArray(half, 0, 2 << 30), (0, 2): FakeDeviceArray(half, 0, 3 << 30)},
    )
    cuda.log.clear()
    stats = execute(build_schedule(plan, opts), comm, shards, options=opts, buffers=bufs)
    assert stats.rounds > 1
    s = comm.stream(0).ptr
    kernels = {bufs.streams.pack(0).ptr, bufs.streams.unpack(0).ptr}
    log = [e for e in cuda.log if e[0] in ("launch", "send", "recv", "groupStart", "groupEnd", "eventQuery")]
    assert {(e[2], e[3]) for e in log if e[0] == "launch"} == {(0, bufs.streams.pack(0).ptr)}  # GPU 0, packs
    assert bufs.streams.pack(0).ptr in kernels
    assert {e[6] for e in log if e[0] in ("send", "recv")} == {s}  # NCCL: its own stream
    names = [e[0] for e in log]
    assert names.count("groupStart") == stats.rounds and names[-1] == "eventQuery"
    assert "eventQuery" not in names[: len(names) - names[::-1].index("groupEnd")]  # no host wait per exchange
    assert names[0] == "launch" and names.index("launch") < names.index("groupStart")  # packed before sent
    assert not calls(cuda.log, "synchronize", "abort")


def test_issue_rows_posts_one_group_on_the_given_stream_and_waits_for_nothing():
    # What a CUDA graph captures (jreshard.nccl.graph): the group's sends and receives on the stream under capture,
    # in the order both sides derive from the plan, and no event, wait or poll inside the capture.
    comm, _, cuda = make({0: 0, 1: 0})
    stream = cuda.Stream(non_blocking=True)
    buf = FakeDeviceArray(4096, 0, 1 << 20, cuda)
    stream.begin_capture()
    cuda.log.clear()
    comm.issue_rows([(1, 2, 7, 0, 1024, 512), (0, 3, 1, 0, 0, 256)], [(2, 0, 4, 0, 2048, 128)], [buf], stream)
    graph = stream.end_capture()
    graph.launch(stream=stream)
    posts = [e for e in cuda.log if e[0] in ("send", "recv")]
    assert cuda.log[0] == ("groupStart",) and cuda.log[len(posts) + 1] == ("groupEnd",)
    assert [(e[0], e[3], e[4], e[6]) for e in posts] == [
        ("send", (1 << 20) + 0, 256, stream.ptr),  # sends first, by (src, dst, tag): 0 -> 3 ...
        ("send", (1 << 20) + 1024, 512, stream.ptr),  # ... then 1 -> 2
        ("recv", (1 << 20) + 2048, 128, stream.ptr),
    ]
    assert not [e for e in cuda.log if e[0] in ("record", "eventQuery", "synchronize", "check", "wait_event")]
    with pytest.raises(ValueError, match=r"bytes 4000\.\.4100 of a buffer of 4096"):
        comm.issue_rows([(0, 2, 0, 0, 4000, 100)], [], [buf], stream)
