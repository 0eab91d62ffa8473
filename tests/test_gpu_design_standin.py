"""The GPU path's design, against the numpy stand-ins of CuPy and NCCL that move real bytes
(``tests/cupy_numpy.py``) on CPU. None of it has run on a GPU: these check what jreshard issues,
on which stream and in what order, and that the bytes land.

- a transfer starts no thread per round (one watchdog thread per process);
- the launch tables of a schedule are built and uploaded once;
- pack, send and unpack run on three streams; the pack of round r + 1 does not wait for the
  sends of round r (read off the events in the stand-in's log), while a pack into an arena
  does wait for the sends and unpacks that last used it;
- nothing is issued on the legacy default stream;
- final waits poll no slower than every 100 µs;
- ``transfer_into`` on GPUs writes into the donated ``into`` memory; ``transfer``'s results
  come from XLA allocations, small leaves sharing one block per device;
- a few contiguous runs are plain copies, not a kernel;
- and, in every test, each memory access is ordered (by streams, events and host waits) after
  the earlier accesses it conflicts with: the stand-in's ``StreamOrder`` finds the races a GPU
  would have.
"""

from __future__ import annotations

import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cupy_numpy import install, make_cupy, uninstall

from jreshard.cuda import buffers as gpu_buffers
from jreshard.engine.rounds import Shards, execute
from jreshard.nccl import cupy_nccl
from jreshard.nccl.cupy_nccl import NcclComm, destroy_cached_communicators
from jreshard.nccl.nccl_support import DEADLINES
from jreshard.nccl.rendezvous import KeyValueRendezvous
from jreshard.options import Backend, Options
from jreshard.schedule import kernels as K
from jreshard.sharding.box import Box
from jreshard.sharding.layout import Layout
from jreshard.sharding.planner import plan_layouts
from jreshard.sharding.topology import Topology

SHAPE = (64, 256)  # float32, 64 KiB; 4 KiB chunks in 16 KiB of staging: many rounds
SRC_BOXES = {0: Box((0, 0), (64, 64)), 3: Box((0, 64), (64, 192)), 6: Box((0, 192), (64, 256))}  # column stripes
DST_BOXES = {1: Box((0, 0), (32, 128)), 2: Box((0, 128), (32, 256)), 4: Box((32, 0), (64, 128)),
             5: Box((32, 128), (64, 256))}  # 2 x 2 tiles: most pieces strided on both sides  # fmt: skip
RANKS = sorted([*SRC_BOXES, *DST_BOXES])


@pytest.fixture
def cp():
    cp = make_cupy()
    yield cp
    destroy_cached_communicators()
    assert cp.cuda.standin.order.races == []  # every access ordered after those it conflicts with


@pytest.fixture
def installed():
    cp = install(ndev=8)
    yield cp
    destroy_cached_communicators()
    uninstall()
    assert cp.cuda.standin.order.races == []


def run_split(cp, namespace: str, *, repeat: int = 1):
    """Column stripes on ranks 0, 3, 6 to 2 x 2 tiles on ranks 1, 2, 4, 5, all on one GPU (seven device
    keys: NCCL rank 0 sends to itself), scheduled as the GPU routes do: for two arenas in the bound."""
    from schedule_oracle import build_schedule

    opts = Options(backend="nccl", chunk_bytes=1 << 10, staging_bytes=4 << 10, timeout_s=10.0)
    src = Layout.from_boxes(SHAPE, "float32", SRC_BOXES)
    dst = Layout.from_boxes(SHAPE, "float32", DST_BOXES)
    topo = Topology.from_domains(dict.fromkeys(RANKS, 0), devices={r: r for r in RANKS})
    plan = plan_layouts([(src, dst)], topo, opts)
    half = Options(backend="nccl", chunk_bytes=1 << 10, staging_bytes=2 << 10, timeout_s=10.0)
    comm = NcclComm(
        devices={r: 0 for r in RANKS},
        local_devices={r: 0 for r in RANKS},
        rendezvous=KeyValueRendezvous.in_process(),
        namespace=namespace,
        nccl=cp.cuda.nccl,
        cuda=cp.cuda,
    )
    bufs = comm.buffers(timeout_s=10.0, cupy=cp)
    host = np.arange(64 * 256, dtype=np.float32).reshape(SHAPE)

    def part(box):
        return host[tuple(slice(a, b) for a, b in zip(box.lo, box.hi, strict=True))]

    srcs = {(0, r): cp.asarray(np.ascontiguousarray(part(b)).reshape(-1).view(np.uint8)) for r, b in SRC_BOXES.items()}
    dsts = {(0, r): cp.zeros(part(b).nbytes, cp.uint8) for r, b in DST_BOXES.items()}
    sched = build_schedule(plan, half)
    cp.cuda.Device(0).synchronize()  # the set-up above ran on the legacy default stream
    cp.cuda.standin.log.clear()
    stats = [execute(sched, comm, Shards(src=srcs, dst=dsts), options=opts, buffers=bufs) for _ in range(repeat)]
    ops = [e for e in cp.cuda.standin.log if e[0] not in ("stream", "groupStart", "groupEnd", "nccl_init")]
    assert len(ops) > 50 and [e for e in ops if e[1] == 0] == []  # nothing on the legacy default stream
    for (_, r), d in dsts.items():  # (the test's own copies to the host are on the legacy stream)
        np.testing.assert_array_equal(cp.asnumpy(d).view(np.float32).reshape(part(DST_BOXES[r]).shape),
                                      part(DST_BOXES[r]))  # fmt: skip
    peak = stats[0].peak_staging_bytes
    assert all(v == 2 * sched.staging.get(r, 0) <= opts.staging_bytes for r, v in peak.items())  # two arenas
    return stats, bufs


def test_a_transfer_starts_no_thread_per_round(cp, monkeypatch):
    run_split(cp, "design-threads-warm")  # the process's one watchdog thread, if it was not running yet
    started = []
    real = threading.Thread.start

    def start(self):
        started.append(self.name)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    before = DEADLINES.threads_started
    stats, _ = run_split(cp, "design-threads", repeat=3)
    assert stats[0].rounds >= 8
    assert started == [name for name in started if name.startswith("jreshard: ncclCommInitRank")]  # init only
    assert len(started) <= 1 and DEADLINES.threads_started == before


def test_launch_tables_are_built_and_uploaded_once_per_schedule(cp):
    (stats,), bufs = run_split(cp, "design-uploads")
    uploads = [e for e in cp.cuda.standin.log if e[0] == "upload" and e[1] == bufs.streams.pack(0).ptr]
    assert stats.rounds >= 8 and bufs.uploads == 1  # one copy for every round's tables, on the one GPU
    assert len(uploads) == 1
    launches = [e for e in cp.cuda.standin.log if e[0] == "launch" and e[2] == "jreshard_copy"]
    assert len(launches) >= 2 * stats.rounds - 2  # a pack and an unpack in (nearly) every round


def clocks(log):
    """Per log entry, what it is ordered after: ``{stream: index of the last entry there}`` (CUDA's
    stream order and event waits, as a vector clock)."""
    stream_clock: dict[int, dict[int, int]] = {}
    events: dict[int, dict[int, int]] = {}
    deps = []
    for i, e in enumerate(log):
        if e[0] in ("stream", "groupStart", "groupEnd", "nccl_init", "nccl_destroy") or len(e) < 2:
            deps.append({})
            continue
        s = e[1]
        c = stream_clock.setdefault(s, {})
        if e[0] == "wait_event":
            for k, v in events.get(e[3], {}).items():
                c[k] = max(c.get(k, -1), v)
        deps.append(dict(c))
        c[s] = i
        if e[0] == "record":
            events[e[2]] = dict(c)
    return deps


def test_pack_of_round_r_plus_1_does_not_wait_for_the_sends_of_round_r(cp):
    (stats,), bufs = run_split(cp, "design-overlap")
    log = cp.cuda.standin.log
    deps = clocks(log)
    pack, comm, unpack = bufs.streams.pack(0).ptr, bufs.stream(0).ptr, bufs.streams.unpack(0).ptr
    assert len({pack, comm, unpack}) == 3
    starts = [i for i, e in enumerate(log) if e[0] == "groupStart"]
    assert len(starts) == stats.rounds >= 8
    checked = 0
    for r in range(len(starts) - 2):
        sends = [i for i in range(starts[r], starts[r + 1]) if log[i][0] == "send"]
        packs_next = [i for i in range(starts[r] + 1, starts[r + 1]) if log[i][0] == "launch" and log[i][1] == pack]
        packs_after = [i for i in range(starts[r + 1], starts[r + 2]) if log[i][0] == "launch" and log[i][1] == pack]
        if not (sends and packs_next and packs_after):
            continue
        last_send = max(sends)
        # round r + 1's pack was issued while round r's sends were in flight, and does not wait for them
        assert all(deps[p].get(comm, -1) < last_send for p in packs_next), r
        # round r + 2's pack reuses round r's arena: it waits for those sends
        assert all(deps[p].get(comm, -1) >= last_send for p in packs_after), r
        checked += 1
    assert checked >= 4
    # every unpack waits for the receives of its round
    for r, st in enumerate(starts):
        end = starts[r + 1] if r + 1 < len(starts) else len(log)
        recvs = [i for i in range(st, end) if log[i][0] == "recv"]
        for u in (i for i in range(st, end) if log[i][0] == "launch" and log[i][1] == unpack):
            assert deps[u].get(comm, -1) >= max(recvs)


def test_nothing_is_issued_on_the_legacy_default_stream(installed):
    from jax.sharding import SingleDeviceSharding

    from jreshard.call.routes import transfer_multiprocess
    from jreshard.cuda.buffers import CupyBuffers
    from jreshard.local.gpu import CupyLocalComm

    cp = installed
    devs = jax.devices()[:3]
    x = {f"w{i}": jax.device_put(jnp.arange(64 * 256.0).reshape(SHAPE) + i, devs[0]) for i in range(3)}
    target = {k: SingleDeviceSharding(devs[1 + i % 2]) for i, k in enumerate(x)}
    bufs = CupyBuffers(cupy=cp, timeout_s=10.0)
    log = cp.cuda.standin.log
    log.clear()
    opts = Options(chunk_bytes=4 << 10, staging_bytes=16 << 10)
    comm = CupyLocalComm([d.id for d in devs], bufs)
    out, stats, _ = transfer_multiprocess(x, target, options=opts, transport=comm, buffers=bufs, details=True)
    peak = {r: v for r, v in stats.peak_staging_bytes.items() if v}
    assert peak and all(v <= opts.staging_bytes for v in peak.values())  # two arenas a rank, within the bound
    sizes = [e[2] for e in log if e[0] == "empty"]
    assert all(sizes.count(v // 2) >= 2 for v in peak.values())
    for k in x:
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(x[k]))
    ops = [e for e in log if e[0] in ("launch", "memcpy", "send", "recv", "record", "wait_event", "fill", "upload",
                                      "set", "get", "empty")]  # fmt: skip
    assert len(ops) > 20 and [e for e in ops if e[1] == 0] == []


def test_final_waits_poll_no_slower_than_every_100_us(monkeypatch):
    from cupy_standins import CUDA_ERROR_NOT_READY, RecordingCuda, RecordingNccl, fake_cupy

    pauses = []
    for mod in (gpu_buffers, cupy_nccl):
        monkeypatch.setattr(mod.time, "sleep", pauses.append)
    cuda = RecordingCuda()
    comm = NcclComm(devices={0: 0, 1: 1}, local_devices={0: 0}, rendezvous=KeyValueRendezvous.in_process(),
                    namespace="design-poll", nccl=RecordingNccl(cuda), cuda=cuda, timeout_s=5.0)  # fmt: skip
    polls = []

    def query(event):
        polls.append(event)
        return CUDA_ERROR_NOT_READY if len(polls) < 40 else 0

    cuda.runtime.eventQuery = query
    bufs = gpu_buffers.CupyBuffers(cupy=fake_cupy(cuda), timeout_s=5.0)
    bufs.stream(0)
    bufs.synchronize()
    assert len(pauses) >= 30 and max(pauses) <= 100e-6
    pauses.clear()
    polls.clear()
    from test_nccl_comm import Buf

    from jreshard.engine.comm import RecvOp, SendOp

    comm.exchange([SendOp(0, 1, 0, Buf(0x100, 8))], [RecvOp(1, 0, 0, Buf(0x200, 8))], timeout_s=5.0)
    assert len(pauses) >= 30 and max(pauses) <= 100e-6


def test_transfer_into_on_gpus_returns_arrays_over_the_into_buffers(installed):
    from jax.sharding import NamedSharding, PartitionSpec

    from jreshard.call.routes import transfer_multiprocess
    from jreshard.cuda.buffers import CupyBuffers
    from jreshard.local.gpu import CupyLocalComm

    cp = installed
    devs = jax.devices()[:4]
    mesh_a, mesh_b = jax.sharding.Mesh(np.array(devs[:2]), ("x",)), jax.sharding.Mesh(np.array(devs[2:]), ("y",))
    x = jax.device_put(jnp.arange(64 * 256.0).reshape(SHAPE), NamedSharding(mesh_a, PartitionSpec("x")))
    into = jax.device_put(jnp.zeros(SHAPE), NamedSharding(mesh_b, PartitionSpec(None, "y")))
    before = [sh.data.unsafe_buffer_pointer() for sh in into.addressable_shards]
    bufs = CupyBuffers(cupy=cp, timeout_s=10.0)
    cp.cuda.standin.log.clear()
    opts = Options(chunk_bytes=4 << 10, staging_bytes=16 << 10)
    comm = CupyLocalComm([d.id for d in devs], bufs)
    out = transfer_multiprocess(x, into, options=opts, transport=comm, buffers=bufs, into=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    assert [sh.data.unsafe_buffer_pointer() for sh in out.addressable_shards] == before  # into's memory
    assert into.is_deleted() and out.sharding == into.sharding
    assert not [e for e in cp.cuda.standin.log if e[0] == "empty" and e[2] >= 64 * 128 * 4]  # no second copy
    bufs.release()  # as the GPU route does after each call: no DLPack view keeps ``out`` from being donated
    again = transfer_multiprocess(x, out, transport=CupyLocalComm([d.id for d in devs], bufs), buffers=bufs,
                                  into=True)  # fmt: skip
    assert [sh.data.unsafe_buffer_pointer() for sh in again.addressable_shards] == before and out.is_deleted()


def test_an_into_leaf_that_is_also_a_source_is_not_donated(installed):
    from jreshard.call.routes import transfer_multiprocess
    from jreshard.cuda.buffers import CupyBuffers
    from jreshard.local.gpu import CupyLocalComm

    cp = installed
    dev = jax.devices()[0]
    x = jax.device_put(jnp.arange(8.0), dev)
    bufs = CupyBuffers(cupy=cp, timeout_s=10.0)
    out = transfer_multiprocess({"a": x, "b": x}, {"a": x, "b": None}, transport=CupyLocalComm([dev.id], bufs),
                                buffers=bufs, into=True)  # fmt: skip
    assert not x.is_deleted() and np.array_equal(np.asarray(out["a"]), np.arange(8.0))


def test_transfer_into_on_gpus_counts_every_byte_not_written_in_place(installed):
    """The engine's transfer_into in one process reports the into leaves it gave fresh buffers, and why, as
    the CPU path does: a leaf that is also a source, and the same into array twice."""
    from jreshard.call.routes import transfer_multiprocess
    from jreshard.cuda.buffers import CupyBuffers
    from jreshard.local.gpu import CupyLocalComm
    from jreshard.report import NotInPlace, ReportBuilder

    cp = installed
    devs = jax.devices()[:2]
    x = jax.device_put(jnp.arange(8.0), devs[0])
    y = jax.device_put(jnp.arange(8.0) + 1, devs[0])
    z = jax.device_put(jnp.zeros(8), devs[1])
    bufs = CupyBuffers(cupy=cp, timeout_s=10.0)
    builder = ReportBuilder(Backend.LOCAL)
    out = transfer_multiprocess({"a": x, "b": y, "c": y}, {"a": x, "b": z, "c": z},
                                transport=CupyLocalComm([d.id for d in devs], bufs), buffers=bufs, into=True,
                                report=builder)  # fmt: skip
    bufs.release()
    rep = builder.build()
    for k, want in (("a", x), ("b", y), ("c", y)):
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(want))
    assert rep.not_in_place == ((0, NotInPlace.SHARES_A_SOURCE), (2, NotInPlace.SHARES_ANOTHER_INTO))
    assert rep.not_in_place_bytes == 2 * 8 * 4 and not x.is_deleted() and z.is_deleted()
    owned = jax.device_put(jnp.zeros(8), devs[1])
    builder = ReportBuilder(Backend.LOCAL)
    transfer_multiprocess(y, owned, transport=CupyLocalComm([d.id for d in devs], bufs), buffers=bufs, into=True,
                          report=builder)  # fmt: skip
    assert builder.build().not_in_place_bytes == 0 and owned.is_deleted()


def test_results_are_allocated_through_xla_small_ones_in_one_block_per_device(installed):
    cp = installed
    dev = jax.devices()[1]
    bufs = gpu_buffers.CupyBuffers(cupy=cp)
    cp.cuda.standin.log.clear()
    sizes = [100, 4096, 3 << 20, 16, 2 << 20]
    out = bufs.allocate(sizes, dev)
    assert [b.size for b in out] == sizes and all(b.data.ptr % gpu_buffers.GPU_ALIGN == 0 for b in out)
    assert not [e for e in cp.cuda.standin.log if e[0] == "empty"]  # nothing from CuPy's pool
    owners = [b._owner for b in out]
    small = {id(owners[i]) for i in (0, 1, 3)}
    assert len(small) == 1 and len({id(owners[2]), id(owners[4])} | small) == 3  # one block, then one each
    assert out[1].data.ptr - out[0].data.ptr == gpu_buffers.GPU_ALIGN  # carved from the one block
    out[1].set(np.arange(4096, dtype=np.uint8) % 251)
    gc.collect()  # the jax arrays XLA allocated are held by the views' DLPack capsules, not by names
    y = bufs.import_shard(out[1], (1024,), np.dtype(np.float32), dev)
    assert y.unsafe_buffer_pointer() == out[1].data.ptr and y.devices() == {dev}
    np.testing.assert_array_equal(np.asarray(y).view(np.uint8), np.arange(4096, dtype=np.uint8) % 251)


def test_a_few_contiguous_runs_are_plain_copies(cp):
    bufs = gpu_buffers.CupyBuffers(cupy=cp)
    host = np.arange(4 * 64, dtype=np.uint8)
    src = cp.asarray(host)
    stage = cp.zeros(64, cp.uint8)
    cp.cuda.Device(0).synchronize()
    table = K.build_table([(0, (4, 64), Box((1, 0), (1 + 1, 32))), (0, (4, 64), Box((3, 0), (4, 32)))])
    cp.cuda.standin.log.clear()
    bufs.pack(table, [src], stage)
    bufs.synchronize()
    names = [e[0] for e in cp.cuda.standin.log]
    assert "launch" not in names and names.count("memcpy") == 2
    np.testing.assert_array_equal(cp.asnumpy(stage), np.concatenate([host[64:96], host[192:224]]))
    strided = K.build_table([(0, (4, 64), Box((0, 0), (4, 8)))])
    bufs.pack(strided, [src], stage[:32])
    assert [e[0] for e in cp.cuda.standin.log].count("launch") == 1
