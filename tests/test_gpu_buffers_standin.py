"""CupyBuffers and run_plan against stand-ins that check the current CUDA device as CuPy does (CPU).

These check which device jreshard allocates on and which device is current when it
enters a stream; the stand-ins move no bytes (``tests/cupy_standins.py``).
"""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest
from cupy_standins import RecordingCuda, fake_cupy

from jreshard.cuda.buffers import CupyBuffers
from jreshard.cuda.dlpack import Typed as _Typed
from jreshard.engine.buffers import CpuBuffers
from jreshard.engine.loopback import LocalComm
from jreshard.errors import TransferError
from jreshard.options import Options
from jreshard.sharding.box import Box
from jreshard.sharding.layout import Layout
from jreshard.sharding.planner import plan_layouts
from jreshard.sharding.topology import Topology


def gpu(ordinal: int):
    return types.SimpleNamespace(local_hardware_id=ordinal)


class Exported:
    """A CuPy array stand-in whose ``__dlpack__`` notes the device and stream current at export."""

    def __init__(self, cuda: RecordingCuda):
        self.cuda, self.seen = cuda, []

    def __dlpack__(self, stream=None):
        self.seen.append((self.cuda.device, self.cuda.current.get(self.cuda.device), stream))
        return np.arange(8, dtype=np.uint8).__dlpack__()


def test_import_exports_on_the_buffers_gpu_whatever_device_is_current():
    cuda = RecordingCuda()
    with cuda.Device(1):
        s1 = cuda.Stream(non_blocking=True)
    array = Exported(cuda)
    assert cuda.device == 0  # the caller's current device is another GPU
    capsule = _Typed(array, 1, 8, s1, 1, cuda).__dlpack__(stream=77)
    assert type(capsule).__name__ == "PyCapsule"
    assert array.seen == [(1, s1, 77)] and cuda.device == 0


def test_staging_lands_on_the_named_gpu():
    cp = fake_cupy()
    bufs = CupyBuffers(cupy=cp)
    assert bufs.staging(1000, gpu(3)).device.id == 3 and cp.cuda.device == 0
    with cp.cuda.Device(5):
        assert bufs.staging(8).device.id == 5  # no device: the current one


def test_too_little_gpu_memory_names_the_xla_settings():
    bufs = CupyBuffers(cupy=fake_cupy(free=1 << 20, total=80 << 30))
    with pytest.raises(
        TransferError, match=r"XLA_PYTHON_CLIENT_PREALLOCATE=false.*XLA_PYTHON_CLIENT_MEM_FRACTION"
    ) as e:
        bufs.staging(64 << 20, gpu(0))
    assert "67108864 bytes on GPU 0" in str(e.value) and e.value.destination_intact is True


def test_release_hands_the_pool_back():
    cp = fake_cupy()
    bufs = CupyBuffers(cupy=cp)
    bufs.staging(100, gpu(0))
    assert bufs.release() == 0 and cp.get_default_memory_pool().log == ["free_all_blocks"]


class DeviceRecordingBuffers(CpuBuffers):
    """CpuBuffers that note the device each staging arena is asked for."""

    def __init__(self):
        super().__init__()
        self.asked: list[tuple[int, object]] = []

    def staging(self, nbytes, device=None):
        self.asked.append((int(nbytes), device))
        return super().staging(nbytes, device)


def test_run_schedule_stages_each_rank_on_its_own_device():
    from schedule_oracle import build_schedule

    from jreshard.engine.driver import run_schedule

    devs = jax.devices()[:3]
    shape = (16, 64)
    src = Layout.from_boxes(shape, "float32", {devs[0].id: Box((0, 0), shape)})
    dst = Layout.from_boxes(shape, "float32", {devs[1].id: Box((0, 0), (16, 32)), devs[2].id: Box((0, 32), shape)})
    topo = Topology.from_domains({d.id: i for i, d in enumerate(devs)})
    plan = plan_layouts([(src, dst)], topo, Options(chunk_bytes=1 << 10, staging_bytes=1 << 12))
    host = np.arange(16 * 64, dtype=np.float32).reshape(shape)
    backend = DeviceRecordingBuffers()
    out, _ = run_schedule(
        plan.tensors,
        build_schedule(plan),
        LocalComm([d.id for d in devs]),
        {(0, devs[0].id): jax.device_put(host, devs[0])},
        {(0, devs[1].id): devs[1], (0, devs[2].id): devs[2]},
        options=plan.options,
        buffers=backend,
    )
    np.testing.assert_array_equal(np.asarray(out[(0, devs[2].id)]), host[:, 32:])
    assert any(n > 0 for n, _ in backend.asked)  # the plan packs through staging
    assert [d for _, d in backend.asked] == devs  # rank by rank, each arena on the rank's own device


def test_gpu_tests_fill_buffers_on_the_stream_their_kernels_use():
    """The GPU tests upload and zero on CupyBuffers' pack stream, where the packs that read them
    run, not the legacy default stream (which a non-blocking stream does not wait for)."""
    from test_gpu import upload, zeros_on

    cp = fake_cupy()
    bufs = CupyBuffers(cupy=cp)
    upload(cp, bufs, 2, np.zeros(16, np.uint8))
    zeros_on(cp, bufs, 2, 8)
    fills = [e for e in cp.cuda.log if e[0] in ("asarray", "zeros")]
    pack = bufs.streams.pack(2).ptr
    assert fills == [("asarray", 16, 2, pack), ("zeros", 8, 2, pack)]


def test_gpu_nccl_test_skips_when_cupy_has_no_libnccl(monkeypatch):
    import sys

    from test_gpu import nccl_or_skip

    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", types.SimpleNamespace(available=False))
    with pytest.raises(pytest.skip.Exception, match=r"available is False.*jreshard\[cuda1"):
        nccl_or_skip()


class CountingBuffers(CpuBuffers):
    """CpuBuffers that count host waits and fences."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def synchronize(self):
        self.calls.append("synchronize")

    def fence(self):
        self.calls.append("fence")


def test_the_engine_fences_between_rounds_and_waits_once_at_the_end():
    from schedule_oracle import build_schedule

    from jreshard.engine.rounds import Shards, execute

    shape = (32, 64)
    src = Layout.from_boxes(shape, "float32", {0: Box((0, 0), shape)})
    dst = Layout.from_boxes(shape, "float32", {1: Box((0, 0), (32, 32)), 2: Box((0, 32), shape)})
    plan = plan_layouts([(src, dst)], Topology.from_domains({0: 0, 1: 1, 2: 1}),
                        Options(chunk_bytes=1 << 10, staging_bytes=1 << 11))  # fmt: skip
    host = np.arange(32 * 64, dtype=np.float32).reshape(shape)
    d1, d2 = np.zeros(32 * 32 * 4, np.uint8), np.zeros(32 * 32 * 4, np.uint8)
    backend = CountingBuffers()
    stats = execute(build_schedule(plan, plan.options), LocalComm([0, 1, 2]),
                    Shards(src={(0, 0): host.reshape(-1).view(np.uint8)}, dst={(0, 1): d1, (0, 2): d2}),
                    options=plan.options, buffers=backend)  # fmt: skip
    assert stats.rounds > 1
    assert backend.calls.count("synchronize") == 1 and backend.calls[-1] == "synchronize"
    assert backend.calls.count("fence") == stats.rounds + 1  # after the same-device copies, before each exchange
    np.testing.assert_array_equal(d2.view(np.float32).reshape(32, 32), host[:, 32:])


def test_pack_and_unpack_run_on_their_own_streams_of_the_staging_gpu(monkeypatch):
    """Pack on GPU 1's pack stream; unpack on its unpack stream, after an event of the comm stream
    (where the receives land); the current stream is never used."""
    from jreshard.cuda import kernels as CK
    from jreshard.schedule import kernels as K

    monkeypatch.setattr(CK, "_KERNELS", {})  # the stand-in's kernels, cached per device
    cp = fake_cupy()
    bufs = CupyBuffers(cupy=cp)
    staging = bufs.staging(4096, gpu(1))
    with cp.cuda.Device(1):
        src = cp.empty(256)
    table = K.build_table([(0, (4, 64), Box((1, 16), (3, 48)))])
    cp.cuda.log.clear()
    bufs.pack(table, [src], staging)
    bufs.unpack(table, staging, [src])
    pack, unpack, comm = bufs.streams.pack(1).ptr, bufs.streams.unpack(1).ptr, bufs.stream(1).ptr
    launches = [e for e in cp.cuda.log if e[0] == "launch"]
    assert [(e[2], e[3]) for e in launches] == [(1, pack), (1, unpack)]
    log = [e for e in cp.cuda.log if e[0] in ("record", "wait_event", "launch")]
    assert log == [launches[0], ("record", comm), ("wait_event", unpack, comm), launches[1], ("record", unpack)]
    assert cp.cuda.current.get(1) is None  # no stream is left current on GPU 1


def test_mail_goes_up_and_down_on_the_buffers_gpu_and_stream():
    """upload/download (the scheduling mail) copy on the named GPU and this backend's stream there,
    whatever device is current, and hand the host an array of the buffer's length."""
    cp = fake_cupy()
    bufs = CupyBuffers(cupy=cp)
    host = np.arange(16, dtype=np.uint8)
    up = bufs.upload(host, gpu(2))
    assert (up.device.id, up.size, cp.cuda.device) == (2, 16, 0)
    s2 = bufs.stream(2)
    assert ("set", 16, 2, s2.ptr) in cp.cuda.log
    down = bufs.download(up[8:16])
    assert isinstance(down, np.ndarray) and down.shape == (8,) and down.dtype == np.uint8
    assert ("get", 8, 2, s2.ptr) in cp.cuda.log and cp.cuda.device == 0
    empty = bufs.upload(np.zeros(0, np.uint8), gpu(1))
    assert empty.size == 0 and not any(e[0] == "set" and e[2] == 1 for e in cp.cuda.log)
