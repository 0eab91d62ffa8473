"""Contract tests against the installed CuPy, NCCL and NVRTC (marker ``cupy_contract``; no GPU needed).

Every CuPy call jreshard's GPU path makes is driven here with the argument types and
order jreshard uses, as far as a machine without a GPU allows: the call must reach
the library and fail there (an ``NcclError`` or ``CUDARuntimeError``), never with a
``TypeError`` from the binding. The stand-ins of ``tests/cupy_standins.py`` are
compared with the real modules' signatures and constants in the same run, and the
CUDA sources of the pack/unpack kernel and of the cast kernel are compiled to PTX by NVRTC for sm_90.

Everything skips, with the reason, where CuPy (or its NCCL, or NVRTC) is not installed.
"""

from __future__ import annotations

import inspect
import re
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
from cupy_standins import CUDARuntimeError, NcclError, RecordingCuda, RecordingNccl

from jreshard.cuda import casts as CC
from jreshard.cuda import kernels as CK
from jreshard.cuda.runtime import event_done
from jreshard.nccl.cupy_nccl import NcclComm, device_pointer
from jreshard.nccl.nccl_support import uid_argument, uid_to_bytes
from jreshard.nccl.rendezvous import KeyValueRendezvous

pytestmark = pytest.mark.cupy_contract


@pytest.fixture(scope="module")
def cupy():
    return pytest.importorskip("cupy", reason="CuPy is not installed (make test installs jreshard[cuda12])")


@pytest.fixture(scope="module")
def nccl(cupy):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CuPy warns on import when libnccl is missing
        mod = pytest.importorskip("cupy.cuda.nccl", reason="cupy.cuda.nccl does not import")
    if mod.available is not True:
        pytest.skip("cupy.cuda.nccl imports but did not load libnccl (install nvidia-nccl-cu12)")
    return mod


@pytest.fixture(scope="module")
def runtime(cupy):
    return cupy.cuda.runtime


def declared(fn) -> list[str]:
    """Parameter names of a Cython function from the signature line of its docstring."""
    head = (fn.__doc__ or "").lstrip().split("\n", 1)[0]
    args = head[head.index("(") + 1 : head.rindex(")")]
    names = [a.split("=")[0].strip().split(" ")[-1] for a in args.split(",") if a.strip()]
    return [n for n in names if n != "self"]


def params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def raises_library_error(call, *errors):
    """``call()`` fails inside the library (one of ``errors``), not in argument conversion."""
    with pytest.raises(errors) as info:
        call()
    assert not isinstance(info.value, TypeError)
    return info.value


# ---- NCCL ----------------------------------------------------------------------


def test_unique_id_type_and_communicator_take_what_jreshard_passes(nccl):
    made = nccl.get_unique_id()
    raw = uid_to_bytes(made)
    assert len(raw) == 128
    assert isinstance(made, bytes | tuple)
    for uid in (uid_argument(nccl, raw, made), uid_argument(nccl, raw)):  # maker and receiver
        assert type(uid) is type(made)
        # Reaches ncclCommInitRank, which fails without a GPU: an NCCL error, not a TypeError.
        raises_library_error(lambda uid=uid: nccl.NcclCommunicator(1, uid, 0), nccl.NcclError)


def test_the_wrong_id_type_is_what_fails_with_a_type_error(nccl):
    made = nccl.get_unique_id()
    wrong = tuple(made) if isinstance(made, bytes) else uid_to_bytes(made)
    with pytest.raises(TypeError, match="commId"):
        nccl.NcclCommunicator(1, wrong, 0)


def test_send_recv_and_error_calls_reach_nccl(nccl):
    """On a communicator with no NCCL handle (made without ncclCommInitRank), each call
    jreshard makes converts its arguments and returns NCCL's invalid-argument error."""
    comm = nccl.NcclCommunicator.__new__(nccl.NcclCommunicator)
    ptr, n = device_pointer(types.SimpleNamespace(__cuda_array_interface__={
        "data": (4096, False), "shape": (64,), "typestr": "|u1", "strides": None, "version": 3,
    }))  # fmt: skip
    stream_ptr = 0
    for call in (
        lambda: comm.send(ptr, n, nccl.NCCL_UINT8, 0, stream_ptr),
        lambda: comm.recv(ptr, n, nccl.NCCL_UINT8, 0, stream_ptr),
        comm.check_async_error,
    ):
        err = raises_library_error(call, nccl.NcclError)
        assert "INVALID_ARGUMENT" in str(err)
    nccl.groupStart()
    nccl.groupEnd()
    comm.abort()  # no handle: nothing to abort, no error


def test_nccl_stand_in_matches_the_real_module(nccl):
    made = nccl.get_unique_id()
    fake = RecordingNccl(RecordingCuda(), 14 if isinstance(made, bytes) else 13)
    assert fake.NCCL_UINT8 == nccl.NCCL_UINT8
    assert type(fake.get_unique_id()) is type(made) and len(fake.get_unique_id()) == len(made)
    real_init = declared(nccl.NcclCommunicator)
    assert params(fake.NcclCommunicator.__init__)[: len(real_init)] == real_init
    assert (
        fake.NcclCommunicator.__doc__.split("(", 1)[1]
        == nccl.NcclCommunicator.__doc__.lstrip().split("\n")[0].split("(", 1)[1]
    )
    for name in ("send", "recv", "check_async_error", "abort", "destroy"):
        assert params(getattr(fake.NcclCommunicator, name)) == declared(getattr(nccl.NcclCommunicator, name)), name
    for name in ("groupStart", "groupEnd", "get_unique_id"):
        assert params(getattr(fake, name)) == declared(getattr(nccl, name)), name
    # NcclError is made from an ncclResult_t, in both.
    assert isinstance(nccl.NcclError(2), RuntimeError) and isinstance(NcclError(2), RuntimeError)
    for cls in (nccl.NcclError, NcclError):
        with pytest.raises(TypeError):
            cls("NCCL_ERROR_SYSTEM_ERROR")


def test_nccl_comm_creation_with_the_real_modules_fails_in_cuda(cupy, nccl):
    """NcclComm end to end with the real modules: the first CUDA call fails (no driver or
    device), as a CUDA error from inside the communicator's creation."""

    with pytest.raises((cupy.cuda.runtime.CUDARuntimeError, nccl.NcclError)):
        NcclComm(
            devices={0: 0},
            local_devices={0: 0},
            rendezvous=KeyValueRendezvous.in_process(),
            namespace="contract",
            timeout_s=30.0,
        )


# ---- CUDA runtime and streams ------------------------------------------------


def test_event_status_is_read_and_errors_raised_as_cuda_errors(runtime):
    status = runtime.eventQuery(0)  # returns the status, does not raise
    assert isinstance(status, int)
    if status in (0, 600):
        pytest.skip(f"cudaEventQuery returned {status} here: a working CUDA driver")
    with pytest.raises(runtime.CUDARuntimeError) as info:
        event_done(types.SimpleNamespace(ptr=0), runtime)
    assert info.value.status == status


@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning"
)  # CuPy's Stream.__del__ after a failed init
def test_every_runtime_call_reaches_cuda(cupy, runtime):
    calls = {
        "Stream(non_blocking=True)": lambda: cupy.cuda.Stream(non_blocking=True),
        "Device(0).__enter__": lambda: cupy.cuda.Device(0).__enter__(),
        "Device().id": lambda: cupy.cuda.Device().id,
        "get_current_stream": cupy.cuda.get_current_stream,
        "memGetInfo": runtime.memGetInfo,
        "memcpyPeerAsync": lambda: runtime.memcpyPeerAsync(4096, 1, 8192, 0, 64, 0),
        "memcpy2DAsync": lambda: runtime.memcpy2DAsync(4096, 64, 8192, 128, 64, 4, runtime.memcpyDeviceToDevice, 0),
        "memcpyAsync": lambda: runtime.memcpyAsync(4096, 8192, 64, runtime.memcpyDeviceToDevice, 0),
        "deviceCanAccessPeer": lambda: runtime.deviceCanAccessPeer(0, 1),
        "deviceEnablePeerAccess": lambda: runtime.deviceEnablePeerAccess(1),
        "deviceGetPCIBusId": lambda: runtime.deviceGetPCIBusId(0),
        "getDeviceCount": runtime.getDeviceCount,
        "empty": lambda: cupy.empty(64, cupy.uint8),
        "pool.free_bytes": lambda: cupy.get_default_memory_pool().free_bytes(),
        "pool.free_all_blocks": lambda: cupy.get_default_memory_pool().free_all_blocks(),
    }
    reached = {}
    for name, call in calls.items():
        try:
            call()
            reached[name] = "ok"
        except runtime.CUDARuntimeError as err:
            reached[name] = err.status
    if all(v == "ok" for v in reached.values()):
        pytest.skip("every CUDA call succeeded: this machine has a GPU (the gpu tests cover it)")
    assert all(v == "ok" or isinstance(v, int) for v in reached.values()), reached
    assert isinstance(cupy.cuda.memory.OutOfMemoryError, type)


def test_cuda_stand_in_matches_the_real_module(cupy, runtime):
    fake = RecordingCuda()
    assert params(fake.Stream.__init__) == declared(cupy.cuda.Stream.__init__)
    assert params(fake.Stream.record) == declared(cupy.cuda.Stream.record)
    assert params(fake.Stream.wait_event) == declared(cupy.cuda.Stream.wait_event)
    assert params(fake.get_current_stream) == declared(cupy.cuda.get_current_stream)
    assert params(fake.runtime.eventQuery) == declared(runtime.eventQuery) == ["event"]
    for name in ("begin_capture", "end_capture", "is_capturing"):  # CUDA graph capture (jreshard.nccl.graph)
        assert params(getattr(fake.Stream, name)) == declared(getattr(cupy.cuda.Stream, name)), name
    for name in ("launch", "upload"):
        assert params(getattr(fake.Graph, name)) == declared(getattr(cupy.cuda.graph.Graph, name)), name
    assert isinstance(runtime.CUDARuntimeError(700), RuntimeError) and CUDARuntimeError(700).status == 700
    assert runtime.CUDARuntimeError(600).status == 600  # cudaErrorNotReady: what event_done treats as pending
    assert "does not match the current device" in _stream_device_message(fake)


def _stream_device_message(cuda: RecordingCuda) -> str:
    with cuda.Device(1):
        s = cuda.Stream()
    with pytest.raises(RuntimeError) as info:
        with s:
            pass
    return str(info.value)


# ---- the kernel through NVRTC -------------------------------------------------


def ptx_of(source: str, name: str) -> str:
    """PTX for sm_90 from NVRTC (no GPU needed), or a skip when NVRTC does not load."""
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as err:
        pytest.skip(f"NVRTC does not load ({type(err).__name__}: {err}); install nvidia-cuda-nvrtc-cu12")
    prog = nvrtc.createProgram(source, name, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, ("--std=c++14", "-arch=compute_90"))
        except nvrtc.NVRTCError as err:
            pytest.fail(f"NVRTC rejected {name}: {err}\n{nvrtc.getProgramLog(prog)}")
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def test_gpu_check_spin_kernel_compiles(cupy):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from gpu_stages import SPIN_SOURCE

    assert ".entry spin" in ptx_of(SPIN_SOURCE, "spin.cu")


def test_cast_kernel_source_compiles_with_nvrtc(cupy):
    ptx = ptx_of(CC.CAST_SOURCE, "jreshard_cast.cu")
    assert ".entry jreshard_cast" in ptx
    assert re.search(rf"\.maxntid {CK.THREADS}, 1, 1", ptx)
    assert "ld.shared" in ptx  # the row is looked up once per block and shared
    # the conversions are integer code: no float arithmetic whose flush-to-zero or rounding flags could change a bit
    assert not re.search(r"\b(cvt|add|mul|fma|div)\.(rn|rz|rm|rp|ftz)?\.?f(16|32|64)\b", ptx)


def test_kernel_source_compiles_with_nvrtc_and_keeps_loads_in_flight(cupy):
    ptx = ptx_of(CK.CUDA_SOURCE, "jreshard_copy.cu")
    assert ".entry jreshard_copy" in ptx
    lines = [line.strip() for line in ptx.splitlines()]
    # The 16-byte path: UNROLL vector loads issued before the first vector store.
    v4 = [i for i, line in enumerate(lines) if re.match(r"(ld|st)\.global(\.nc)?\.v4\.", line)]
    first_store = next(i for i in v4 if lines[i].startswith("st."))
    assert sum(1 for i in v4 if i < first_store) >= CK.UNROLL
    assert "ld.shared" in ptx  # the row is looked up once per block and shared
    # __launch_bounds__(THREADS, MIN_BLOCKS): the compiler holds registers to fit MIN_BLOCKS blocks a multiprocessor
    assert re.search(rf"\.maxntid {CK.THREADS}, 1, 1", ptx) and re.search(rf"\.minnctapersm {CK.MIN_BLOCKS}\b", ptx)


def test_launch_tables_are_what_the_kernel_reads(cupy):
    """The launch table is C-contiguous int64 with the column count the CUDA source defines."""
    cols = int(re.search(r"#define JR_COLS (\d+)", CK.CUDA_SOURCE).group(1))
    assert cols == CK.LAUNCH_COLUMNS
    assert int(re.search(r"#define JR_THREADS (\d+)", CK.CUDA_SOURCE).group(1)) == CK.THREADS
    assert int(re.search(r"#define JR_UNROLL (\d+)", CK.CUDA_SOURCE).group(1)) == CK.UNROLL
    assert np.dtype(np.int64).itemsize == 8


def test_the_cupy_signatures_jreshard_and_gpu_check_call_with(cupy, nccl):
    """The argument names (and so the order and keywords) of every other CuPy call in
    cuda/buffers.py, cuda/kernels.py and benchmarks/gpu_stages.py, as the installed CuPy declares them."""
    want = {
        cupy.cuda.Event.record: ["stream"],
        cupy.cuda.get_elapsed_time: ["start_event", "end_event"],
        cupy.cuda.MemoryPointer.copy_from_device_async: ["src", "size", "stream"],
        cupy.ndarray.set: ["arr", "stream"],
        cupy.ndarray.get: ["stream", "order", "out", "blocking"],
        cupy.cuda.UnownedMemory: ["ptr", "size", "owner", "device_id"],
        cupy.cuda.MemoryPointer: ["mem", "offset"],
        cupy.from_dlpack: ["array", "*", "device", "copy"],
        cupy.cuda.runtime.getDeviceProperties: ["device"],
        cupy.cuda.runtime.memcpyPeerAsync: ["dst", "dstDevice", "src", "srcDevice", "size", "stream"],
        cupy.cuda.runtime.memcpyAsync: ["dst", "src", "size", "kind", "stream"],
        cupy.cuda.runtime.deviceCanAccessPeer: ["device", "peerDevice"],
        cupy.cuda.runtime.deviceEnablePeerAccess: ["peerDevice"],
    }
    for fn, names in want.items():
        assert declared(fn) == names, (fn.__doc__ or "").strip().split("\n")[0]
    assert declared(cupy.ndarray.__dlpack__)[:2] == ["*", "stream"]  # stream is keyword-only
    assert declared(cupy.RawKernel)[:3] == ["code", "name", "options"]
    for name in ("runtimeGetVersion", "driverGetVersion", "memcpyDeviceToDevice"):
        assert hasattr(cupy.cuda.runtime, name), name


def test_export_hands_cupy_a_legacy_capsule_it_reads(cupy, runtime):
    """export_source's hand-over: cupy.from_dlpack on a re-typed legacy capsule that reports
    a CUDA device ends in a CUDA error (no GPU here), not a TypeError from the binding. Whether
    CuPy reads the capsule before it calls CUDA is not visible from here."""
    from jreshard.engine.buffers import KDLCUDA, Capsule, _DLTensor, _get_pointer, retype_capsule

    x = np.arange(16, dtype=np.float32)
    capsule = x.__dlpack__()
    _DLTensor.from_address(_get_pointer(capsule, b"dltensor")).device.device_type = 2  # kDLCUDA
    capsule = retype_capsule(capsule, 1, 32)
    try:
        cupy.from_dlpack(Capsule(capsule, 0, KDLCUDA))
    except runtime.CUDARuntimeError:
        return
    pytest.skip("CUDA works here: the gpu tests cover the real hand-over")


def test_numpy_stand_in_matches_the_real_module(cupy, nccl):
    """The byte-moving stand-in of ``tests/cupy_numpy.py`` (gpu_check --standin, the GPU design tests)
    declares what the installed CuPy and NCCL declare, for every call jreshard and gpu_check make."""
    from cupy_numpy import make_cupy

    fake = make_cupy()
    rt, frt = cupy.cuda.runtime, fake.cuda.runtime
    pairs = {
        "Stream": (fake.cuda.Stream.__init__, cupy.cuda.Stream.__init__),
        "Stream.record": (fake.cuda.Stream.record, cupy.cuda.Stream.record),
        "Stream.wait_event": (fake.cuda.Stream.wait_event, cupy.cuda.Stream.wait_event),
        "Event": (fake.cuda.Event.__init__, cupy.cuda.Event.__init__),
        "Event.record": (fake.cuda.Event.record, cupy.cuda.Event.record),
        "get_current_stream": (fake.cuda.get_current_stream, cupy.cuda.get_current_stream),
        "get_elapsed_time": (fake.cuda.get_elapsed_time, cupy.cuda.get_elapsed_time),
        "UnownedMemory": (fake.cuda.UnownedMemory.__init__, cupy.cuda.UnownedMemory),
        "MemoryPointer": (fake.cuda.MemoryPointer.__init__, cupy.cuda.MemoryPointer),
        "copy_from_device_async": (
            fake.cuda.MemoryPointer.copy_from_device_async,
            cupy.cuda.MemoryPointer.copy_from_device_async,
        ),
        "ndarray.set": (fake.ndarray.set, cupy.ndarray.set),
        "ndarray.get": (fake.ndarray.get, cupy.ndarray.get),
        "ndarray.fill": (fake.ndarray.fill, cupy.ndarray.fill),
        "from_dlpack": (fake.from_dlpack, cupy.from_dlpack),
        # CUDA graph capture (jreshard.nccl.graph): the stand-in keeps what a stream under capture is given
        "Stream.begin_capture": (fake.cuda.Stream.begin_capture, cupy.cuda.Stream.begin_capture),
        "Stream.end_capture": (fake.cuda.Stream.end_capture, cupy.cuda.Stream.end_capture),
        "Stream.is_capturing": (fake.cuda.Stream.is_capturing, cupy.cuda.Stream.is_capturing),
        "Graph.launch": (fake.cuda.graph.Graph.launch, cupy.cuda.graph.Graph.launch),
        "Graph.upload": (fake.cuda.graph.Graph.upload, cupy.cuda.graph.Graph.upload),
    }
    for name in ("eventQuery", "memcpy2DAsync", "memcpyPeerAsync", "memcpyAsync", "getDeviceProperties",
                 "deviceGetPCIBusId", "deviceCanAccessPeer", "deviceEnablePeerAccess"):  # fmt: skip
        pairs[name] = (getattr(frt, name), getattr(rt, name))
    for name, (ours, real) in pairs.items():
        assert params(ours) == [p for p in declared(real) if p != "*"], name
    for name in ("send", "recv"):
        ours, real = getattr(fake.cuda.nccl.NcclCommunicator, name), getattr(nccl.NcclCommunicator, name)
        assert params(ours) == declared(real), name
    for name in ("empty", "zeros", "asarray", "arange", "asnumpy", "array_equal"):  # plain Python functions
        real = [p for p in inspect.signature(getattr(cupy, name)).parameters][:2]
        assert params(getattr(fake, name))[:2] == real, name
    assert params(fake.RawKernel.__init__)[:3] == declared(cupy.RawKernel)[:3]
    first = fake.cuda.nccl.NcclCommunicator.__doc__.strip().split("\n")[0]
    assert first == nccl.NcclCommunicator.__doc__.lstrip().split("\n")[0]
    assert fake.cuda.nccl.NCCL_UINT8 == nccl.NCCL_UINT8 and frt.memcpyDeviceToDevice == rt.memcpyDeviceToDevice
    assert cupy.cuda.Stream.null.ptr == fake.cuda.Stream.null.ptr == 0  # the legacy default stream
    assert len(fake.cuda.nccl.get_unique_id()) == len(nccl.get_unique_id()) == 128
