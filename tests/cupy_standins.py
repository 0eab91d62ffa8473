"""Stand-ins for ``cupy.cuda.nccl``, ``cupy.cuda`` (with ``runtime``) and ``pynvml`` in the CPU tests.

They record what jreshard calls and in what order; they move no bytes and know
nothing of NCCL's or CUDA's semantics. Where they mirror the real modules (the
argument lists, ``NCCL_UINT8``, ``NcclError(int status)``, the unique id's type,
streams and events tied to the device current when they were made) the contract
tests (``tests/test_contract_cupy.py``, ``tests/test_contract_nvml.py``) compare
them with the installed CuPy and pynvml in the same run.
"""

from __future__ import annotations

import ctypes
import types

import numpy as np

CUDA_ERROR_NOT_READY = 600
UID14 = bytes(range(128))  # what CuPy 14's get_unique_id returns: 128 bytes
UID13 = tuple(range(-64, 64))  # CuPy 13: 128 C char values


class NcclError(RuntimeError):
    """``cupy.cuda.nccl.NcclError``: constructed from an ``ncclResult_t``."""

    def __init__(self, status: int):
        if not isinstance(status, int):
            raise TypeError("an integer is required")
        self.status = status
        super().__init__(f"NCCL error {status}")


class CUDARuntimeError(RuntimeError):
    """``cupy.cuda.runtime.CUDARuntimeError``: constructed from a ``cudaError_t``."""

    def __init__(self, status: int):
        self.status = int(status)
        super().__init__(f"cudaError {status}")


class RecordingCuda:
    """Stand-in for ``cupy.cuda``: devices, streams and events that log, and check the
    current device as CuPy does (entering a stream, recording on it)."""

    def __init__(self):
        self.log: list[tuple] = []
        self.capturing: set[int] = set()  # the streams under capture
        self.device = 0
        self.event_status = 0  # what cudaEventQuery returns for every event
        self._ptr = 1000
        cuda = self

        class Event:
            def __init__(self, stream):
                cuda._ptr += 1
                self.ptr = cuda._ptr
                self.stream = stream
                self.device = cuda.device

        class Stream:
            def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
                cuda._ptr += 1
                self.ptr = cuda._ptr
                self.device_id = cuda.device
                cuda.log.append(("stream", self.ptr, cuda.device, non_blocking))

            def _check(self, what):
                if self.device_id != cuda.device:
                    raise RuntimeError(
                        f"{what}: the device that the stream is created on ({self.device_id}) does not match "
                        f"the current device ({cuda.device})"
                    )

            def __enter__(self):
                self._check("Stream.__enter__")
                cuda.stack.append(cuda.current.get(cuda.device))
                cuda.current[cuda.device] = self
                return self

            def __exit__(self, *exc):
                cuda.current[self.device_id] = cuda.stack.pop()

            def record(self, event=None):
                self._check("Stream.record")  # cudaEventRecord: event and stream on one device
                cuda.log.append(("record", self.ptr))
                return Event(self)

            def wait_event(self, event):
                cuda.log.append(("wait_event", self.ptr, event.stream.ptr))

            def synchronize(self):
                cuda.log.append(("synchronize", self.ptr))

            def begin_capture(self, mode=None):
                self._check("Stream.begin_capture")
                cuda.capturing.add(self.ptr)
                cuda.log.append(("begin_capture", self.ptr))

            def end_capture(self):
                cuda.capturing.discard(self.ptr)
                cuda.log.append(("end_capture", self.ptr))
                return Graph(self)

            def is_capturing(self):
                return self.ptr in cuda.capturing

        class Graph:
            """``cupy.cuda.graph.Graph``, as ``Stream.end_capture`` returns it: launches and uploads log."""

            def __init__(self, stream):
                self.stream = stream

            def launch(self, stream=None):
                cuda.log.append(("graph_launch", None if stream is None else stream.ptr, self.stream.ptr))

            def upload(self, stream=None):
                cuda.log.append(("graph_upload", None if stream is None else stream.ptr, self.stream.ptr))

        class Device:
            def __init__(self, device=None):
                self.id = cuda.device if device is None else int(device)

            def __enter__(self):
                cuda.stack.append(cuda.device)
                cuda.device = self.id
                return self

            def __exit__(self, *exc):
                cuda.device = cuda.stack.pop()

        def event_query(event):
            cuda.log.append(("eventQuery", event))
            return cuda.event_status

        self.Stream, self.Device, self.Event, self.Graph = Stream, Device, Event, Graph

        def memcpy_async(dst, src, size, kind, stream):
            cuda.log.append(("memcpy", dst, src, size, stream))

        self.runtime = types.SimpleNamespace(
            eventQuery=event_query,
            CUDARuntimeError=CUDARuntimeError,
            getDevice=lambda: cuda.device,
            memcpyAsync=memcpy_async,
            memcpyDeviceToDevice=3,
        )
        self.current: dict[int, object] = {}
        self.stack: list = []

    def get_current_stream(self, device_id=-1):
        d = self.device if device_id == -1 else device_id
        if self.current.get(d) is None:
            with self.Device(d):
                self.current[d] = self.Stream()
        return self.current[d]


class RecordingNccl:
    """Stand-in for ``cupy.cuda.nccl`` of CuPy ``major`` (13: tuple ids, 14: bytes ids)."""

    NCCL_UINT8 = 1  # ncclUint8 in nccl.h
    NcclError = NcclError
    available = True

    def __init__(self, cuda: RecordingCuda, major: int = 14):
        self.log: list[tuple] = cuda.log
        self.cuda = cuda
        self.major = major
        self.uid = UID14 if major >= 14 else UID13
        self.async_error: Exception | None = None
        self.fail_send = False
        self.block_group_end = None  # a threading.Event groupEnd waits on (an unresponsive peer)
        nccl = self
        id_type = bytes if major >= 14 else tuple
        sig = "bytes commId, int rank, NcclConfig config=None" if major >= 14 else "tuple commId, int rank"

        class NcclCommunicator:
            __doc__ = f"NcclCommunicator(int ndev, {sig})"

            def __init__(self, ndev, commId, rank, config=None):
                if not isinstance(commId, id_type):
                    raise TypeError(
                        f"Argument 'commId' has incorrect type (expected {id_type.__name__}, "
                        f"got {type(commId).__name__})"
                    )
                self.rank = rank
                nccl.log.append(("init", ndev, rank, nccl.cuda.device, commId == nccl.uid))

            def send(self, sendbuf, count, datatype, peer, stream):
                nccl.log.append(("send", self.rank, peer, sendbuf, count, datatype, stream, nccl.cuda.device))
                if nccl.fail_send:
                    raise NcclError(2)

            def recv(self, recvbuf, count, datatype, peer, stream):
                nccl.log.append(("recv", self.rank, peer, recvbuf, count, datatype, stream, nccl.cuda.device))

            def check_async_error(self):
                nccl.log.append(("check", self.rank))
                if nccl.async_error is not None:
                    raise nccl.async_error

            def abort(self):
                nccl.log.append(("abort", self.rank))
                if nccl.block_group_end is not None:
                    nccl.block_group_end.set()

            def destroy(self):
                nccl.log.append(("destroy", self.rank))

        self.NcclCommunicator = NcclCommunicator

    def get_unique_id(self):
        self.log.append(("get_unique_id",))
        return self.uid

    def groupStart(self):
        self.log.append(("groupStart",))

    def groupEnd(self):
        self.log.append(("groupEnd",))
        if self.block_group_end is not None:
            self.block_group_end.wait(30)
            raise NcclError(3)  # ncclInternalError: what a blocked group returns once aborted


class NVMLError(Exception):
    """``pynvml.NVMLError`` (the real one maps values to subclasses)."""

    def __init__(self, value):
        self.value = value
        super().__init__(value)


class GpuFabricInfo(ctypes.Structure):
    """``pynvml.c_nvmlGpuFabricInfo_t``."""

    _fields_ = [
        ("clusterUuid", ctypes.c_uint8 * 16),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint),
    ]


class GpuFabricInfoV(ctypes.Structure):
    """``pynvml.c_nvmlGpuFabricInfoV_t`` (version 2)."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_uint8 * 16),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint),
        ("healthMask", ctypes.c_uint32),
    ]

    def __init__(self):
        super().__init__(version=0x02000024)


def fake_nvml(fabric: dict[str, object], *, versioned: bool = True):
    """A ``pynvml`` stand-in: ``fabric[bus_id]`` is (cluster uuid bytes, clique id, state),
    or None for NotSupported. Fabric info is written into the struct passed by reference,
    as NVML does; ``versioned=False`` leaves out ``nvmlDeviceGetGpuFabricInfoV`` (older NVML)."""
    log: list[str] = []

    def fill(handle, out, cls):
        info = getattr(out, "_obj", None)  # ctypes.byref(struct) keeps the struct as _obj
        if not isinstance(info, cls):
            raise TypeError(f"argument 2: expected byref({cls.__name__}), got {type(out).__name__}")
        f = fabric[handle]
        if f is None:
            raise NVMLError(3)  # NVML_ERROR_NOT_SUPPORTED
        uuid, clique, state = f
        info.clusterUuid[:] = list(uuid.ljust(16, b"\0"))
        info.cliqueId, info.state = clique, state
        return 0

    mod = types.SimpleNamespace(
        NVMLError=NVMLError,
        NVML_GPU_FABRIC_STATE_COMPLETED=3,
        c_nvmlGpuFabricInfo_t=GpuFabricInfo,
        nvmlInit=lambda: log.append("init"),
        nvmlShutdown=lambda: log.append("shutdown"),
        nvmlDeviceGetHandleByPciBusId=lambda pciBusId: pciBusId,
        nvmlDeviceGetCount=lambda: len(fabric),
        log=log,
    )

    def get_fabric(device, gpuFabricInfo):
        return fill(device, gpuFabricInfo, GpuFabricInfo)

    mod.nvmlDeviceGetGpuFabricInfo = get_fabric
    if versioned:

        def get_fabric_v(device, gpuFabricInfo):
            return fill(device, gpuFabricInfo, GpuFabricInfoV)

        mod.nvmlDeviceGetGpuFabricInfoV = get_fabric_v
        mod.c_nvmlGpuFabricInfoV_t = GpuFabricInfoV
    return mod


class OutOfMemoryError(MemoryError):
    """``cupy.cuda.memory.OutOfMemoryError``."""


class FakeDeviceArray:
    """A 1-D uint8 "device array": remembers the device current when it was made."""

    def __init__(self, n: int, device: int, ptr: int, cuda: RecordingCuda | None = None):
        self.cuda = cuda
        self.size, self.shape = n, (n,)
        self.device = types.SimpleNamespace(id=device)
        self.data = types.SimpleNamespace(ptr=ptr)

    def __getitem__(self, s: slice) -> FakeDeviceArray:
        start, stop, _ = s.indices(self.size)
        return FakeDeviceArray(stop - start, self.device.id, self.data.ptr + start, self.cuda)

    def __len__(self) -> int:
        return self.size

    # ``set``/``get`` as ``cupy.ndarray`` declares them (the contract test compares the names); they log
    # the device current and the stream, and move no bytes (``get`` answers zeros).
    def set(self, arr, stream=None):
        assert arr.shape == self.shape and arr.dtype == np.uint8, (arr.shape, arr.dtype)
        self._log("set", stream)

    def get(self, stream=None, order="C", out=None, blocking=True):
        self._log("get", stream)
        return np.zeros(self.size, np.uint8)

    def _log(self, what, stream):
        cuda = self.cuda
        if stream is not None:
            stream._check(f"ndarray.{what}")
        cuda.log.append((what, self.size, cuda.device, None if stream is None else stream.ptr))

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"data": (self.data.ptr, False), "shape": (self.size,), "typestr": "|u1", "strides": None, "version": 3}


def fake_cupy(cuda: RecordingCuda | None = None, *, free: int = 1 << 40, total: int = 1 << 40):
    """A ``cupy`` stand-in for :class:`CupyBuffers`: ``empty`` allocates on the current device
    (256-byte aligned addresses), ``runtime.memGetInfo`` answers ``(free, total)``."""
    cuda = cuda or RecordingCuda()
    pool_log: list[str] = []
    state = {"ptr": 1 << 20}

    def empty(n, dtype=None):
        n = int(n)
        if n > cuda.runtime.memGetInfo()[0]:
            raise OutOfMemoryError(f"out of memory allocating {n} bytes")
        ptr = state["ptr"]
        state["ptr"] += -(-max(n, 1) // 512) * 512
        cuda.log.append(("empty", n, cuda.device))
        return FakeDeviceArray(n, cuda.device, ptr, cuda)

    def filled(what):
        def make(data, *args, **kwargs):
            n = int(np.asarray(data).size) if what == "asarray" else int(data)
            stream = cuda.current.get(cuda.device)
            cuda.log.append((what, n, cuda.device, None if stream is None else stream.ptr))
            return FakeDeviceArray(n, cuda.device, 0, cuda)

        return make

    class RawKernel:
        def __init__(self, code, name, options=(), backend="nvrtc", translate_cucomplex=False, **kwargs):
            self.name = name

        def __call__(self, grid, block, args, **kwargs):
            stream = cuda.current.get(cuda.device)
            cuda.log.append(("launch", self.name, cuda.device, None if stream is None else stream.ptr, grid, block))

    cuda.runtime.memGetInfo = lambda: (free, total)
    cuda.memory = types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError)
    pool = types.SimpleNamespace(
        free_bytes=lambda: 0, free_all_blocks=lambda: pool_log.append("free_all_blocks"), log=pool_log
    )
    return types.SimpleNamespace(
        cuda=cuda,
        uint8="uint8",
        empty=empty,
        asarray=filled("asarray"),
        RawKernel=RawKernel,
        zeros=filled("zeros"),
        get_default_memory_pool=lambda: pool,
    )
