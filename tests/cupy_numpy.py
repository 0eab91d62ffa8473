"""A numpy-backed stand-in of ``cupy`` (with ``cupy.cuda``, ``cupy.cuda.runtime``, ``cupy.cuda.nccl``) and
``pynvml`` that moves real bytes, for running ``benchmarks/gpu_stages.py`` and the GPU design tests on CPU.

"Device memory" is host memory: every array is a numpy array at a 512-byte aligned address,
and ``data.ptr`` is that address, so the launch tables jreshard builds from pointers are real
addresses. The pack/unpack/copy kernel runs its numpy model (``kernels.unit_addresses``:
every unit each block and thread would copy) over those addresses, and the cast kernel its own
(``casts.element_addresses``, values cast by ``views.casts``); NCCL sends and receives
are matched in issue order per (sender, receiver) and copy the bytes when both are posted.
Work runs when it is issued, so stream order always holds here; what the stand-in checks is
*which* stream each operation was issued on and in what order: every operation is appended
to :attr:`NumpyCuda.log` as ``(what, stream pointer, ...)``. The legacy default stream is
``Stream.null`` with pointer 0, the current stream until another one is entered, as in CuPy.

The real modules' names, argument names and constants that this mirrors are compared with the
installed CuPy, NCCL and pynvml by ``tests/test_contract_cupy.py`` and ``test_contract_nvml.py``.

:func:`install` puts the stand-ins into ``sys.modules`` and makes jax's CPU arrays accept the
DLPack calls jreshard makes on GPUs (a ``stream`` argument; a producer that reports a CUDA
device): for the ``--standin`` runs of ``gpu_stages.py`` only, in their own process.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import time
import types
import weakref
from collections import defaultdict, deque
from typing import Any

import numpy as np

from jreshard.cuda import casts as CC
from jreshard.cuda import kernels as CK
from jreshard.schedule import kernels as K
from jreshard.sharding.dtypes import numpy_dtype
from jreshard.views.casts import cast_chain

ALIGN = 512  # CuPy's pool hands out 512-byte aligned blocks
NCCL_VERSION = 23203


def _raw(addr: int, n: int) -> np.ndarray:
    """``n`` bytes of host memory at ``addr`` as a writable uint8 array (no copy)."""
    if n == 0:
        return np.zeros(0, np.uint8)
    return np.frombuffer((ctypes.c_uint8 * n).from_address(addr), dtype=np.uint8)


class CUDARuntimeError(RuntimeError):
    """``cupy.cuda.runtime.CUDARuntimeError``: constructed from a ``cudaError_t``."""

    def __init__(self, status: int):
        self.status = int(status)
        super().__init__(f"cudaError {status}")


class OutOfMemoryError(MemoryError):
    """``cupy.cuda.memory.OutOfMemoryError``."""


class NcclError(RuntimeError):
    """``cupy.cuda.nccl.NcclError``."""

    def __init__(self, status: int):
        self.status = int(status)
        super().__init__(f"NCCL error {status}")


class NumpyCuda:
    """``cupy.cuda``: devices, streams and events, with the log of every operation."""

    def __init__(self, ndev: int = 1):
        self.ndev = ndev
        self.log: list[tuple] = []
        self.order = StreamOrder()
        self.device = 0
        self._ptr = itertools.count(1001)
        self._stack: list[Any] = []
        cuda = self

        class Stream:
            def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
                self.ptr = 0 if null else next(cuda._ptr)
                self.device_id = cuda.device
                self.non_blocking = non_blocking
                if not null:
                    cuda.log.append(("stream", self.ptr, non_blocking))

            def __enter__(self):
                if self.ptr and self.device_id != cuda.device:
                    raise RuntimeError(
                        f"Stream.__enter__: the device that the stream is created on ({self.device_id}) does not "
                        f"match the current device ({cuda.device})"
                    )
                cuda._stack.append(cuda.current.get(cuda.device))
                cuda.current[cuda.device] = self
                return self

            def __exit__(self, *exc):
                cuda.current[cuda.device] = cuda._stack.pop()

            def record(self, event=None):
                event = event or Event()
                event.record(self)
                return event

            def wait_event(self, event):
                cuda.log.append(("wait_event", self.ptr, event.stream_ptr, event.ptr))
                cuda.order.wait(self.ptr, event.ptr)

            def synchronize(self):
                if self.ptr in cuda.capturing:
                    raise CUDARuntimeError(900)  # cudaErrorStreamCaptureUnsupported
                cuda.log.append(("synchronize", self.ptr))
                cuda.order.host_waits(cuda.order._of(self.ptr))

            # Capture: what is issued on a stream under capture is kept, not run; the graph runs it in
            # order, on this stream, at each launch (the kernels read their tables then, as on a GPU).
            def begin_capture(self, mode=None):
                if self.ptr == 0 or self.ptr in cuda.capturing:
                    raise CUDARuntimeError(900)  # the legacy stream, or a capture already under way
                cuda.capturing[self.ptr] = []
                cuda.log.append(("begin_capture", self.ptr))

            def end_capture(self):
                if self.ptr not in cuda.capturing:
                    raise CUDARuntimeError(901)  # cudaErrorStreamCaptureInvalidated
                cuda.log.append(("end_capture", self.ptr))
                return Graph(self, cuda.capturing.pop(self.ptr))

            def is_capturing(self):
                return self.ptr in cuda.capturing

            @property
            def done(self):
                return True

        class Event:
            def __init__(self, block=False, disable_timing=False, interprocess=False):
                self.ptr = next(cuda._ptr)
                self.stream_ptr: int | None = None
                self.t = 0.0

            def record(self, stream=None):
                s = stream if stream is not None else cuda.get_current_stream()
                self.stream_ptr = s.ptr
                self.t = time.perf_counter()
                cuda.log.append(("record", s.ptr, self.ptr))
                cuda.order.record(s.ptr, self.ptr)

            def synchronize(self):
                cuda.log.append(("event_synchronize", self.stream_ptr))
                cuda.order.host_waits(cuda.order.events.get(self.ptr, {}))

            @property
            def done(self):
                return True

        class Device:
            def __init__(self, device=None):
                self.id = cuda.device if device is None else int(device)
                if not 0 <= self.id < cuda.ndev:
                    raise CUDARuntimeError(101)  # cudaErrorInvalidDevice

            def __enter__(self):
                cuda._stack.append(cuda.device)
                cuda.device = self.id
                return self

            def __exit__(self, *exc):
                cuda.device = cuda._stack.pop()

            def synchronize(self):
                cuda.log.append(("device_synchronize", self.id))
                for clock in list(cuda.order.clock.values()):
                    cuda.order.host_waits(clock)

        class Graph:
            """``cupy.cuda.graph.Graph``: the operations captured on ``stream``."""

            def __init__(self, stream, ops):
                self.stream, self.ops = stream, ops

            def launch(self, stream=None):
                s = stream if stream is not None else cuda.get_current_stream()
                cuda.log.append(("graph_launch", s.ptr, len(self.ops)))
                with Device(self.stream.device_id), self.stream:
                    for op in self.ops:
                        op()

            def upload(self, stream=None):
                cuda.log.append(("graph_upload", 0 if stream is None else stream.ptr))

        Stream.null = Stream(null=True)
        self.Stream, self.Event, self.Device, self.Graph = Stream, Event, Device, Graph
        self.current: dict[int, Any] = {}
        self.capturing: dict[int, list] = {}  # stream pointer -> the operations captured on it

    def get_current_stream(self, device_id=-1):
        return self.current.get(self.device if device_id == -1 else device_id) or self.Stream.null

    def captured(self, stream: Any, op: Any) -> bool:
        """Keep ``op`` (a call that redoes the operation) when ``stream`` (a stream or its pointer; default the
        current one) is under capture; whether it was kept."""
        s = stream if stream is not None else self.get_current_stream()
        ops = self.capturing.get(s if isinstance(s, int) else s.ptr)
        if ops is None:
            return False
        ops.append(op)
        return True

    def get_elapsed_time(self, start_event, end_event):
        return 1e3 * (end_event.t - start_event.t)

    def note(self, what: str, *rest: Any, stream: Any = None, reads: Any = (), writes: Any = ()) -> None:
        """Log an operation issued on ``stream`` (default: the current one) and check its memory
        accesses (``reads``/``writes``: ``(address, nbytes)`` runs or arrays of byte addresses)
        against every earlier one it conflicts with: CUDA must order it after them."""
        s = stream if stream is not None else self.get_current_stream()
        ptr = s if isinstance(s, int) else s.ptr
        self.log.append((what, ptr, *rest))
        self.order.issue(ptr, f"{what} {rest[:2]}", reads, writes)


HOST = -1  # the host, as a stream of its own in the order below


def _runs(access: Any) -> tuple[np.ndarray, np.ndarray]:
    """An access as sorted, disjoint byte runs ``(starts, ends)``: from ``(address, nbytes)``, or from
    ``(unit addresses, width)`` (each unit ``width`` bytes)."""
    if not isinstance(access[0], np.ndarray):
        addr, n = int(access[0]), int(access[1])
        return (np.array([addr]), np.array([addr + n])) if n else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    units, width = access
    if len(units) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    st = np.unique(units.astype(np.int64))
    en = st + int(width)
    brk = np.nonzero(st[1:] > en[:-1])[0] + 1  # a new run where a unit starts past the last one's end
    starts = st[np.concatenate([[0], brk])]
    ends = np.maximum.reduceat(en, np.concatenate([[0], brk]))
    return starts, ends


def _overlap(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    (ast, aen), (bst, ben) = a, b
    if not len(ast) or not len(bst) or ast[0] >= ben[-1] or bst[0] >= aen[-1]:
        return False
    j = np.searchsorted(bst, aen, side="left") - 1  # the last run of b starting before each run of a ends
    ok = j >= 0
    return bool(np.any(ben[j[ok]] > ast[ok]))


class StreamOrder:
    """What CUDA orders before what, as vector clocks: streams run their work in issue order, an
    event wait orders a stream after what was recorded, and the host's syncs order later work after
    what it waited for. Every access that conflicts with an earlier one (either writes, same bytes)
    must be ordered after it; :attr:`races` lists those that were not."""

    def __init__(self) -> None:
        self.clock: dict[int, dict[int, int]] = {}
        self.events: dict[int, dict[int, int]] = {}
        self.accesses: list[tuple[tuple, bool, int, int, str]] = []
        self.races: list[str] = []
        self._n = itertools.count()

    def _of(self, stream: int) -> dict[int, int]:
        return self.clock.setdefault(stream, {})

    def issue(self, stream: int, what: str, reads: Any, writes: Any) -> None:
        c = self._of(stream)
        for k, v in self._of(HOST).items():  # work issued after the host saw something finish
            c[k] = max(c.get(k, -1), v)
        i = next(self._n)
        new = [(_runs(a), False) for a in reads] + [(_runs(a), True) for a in writes]
        new = [(r, w) for r, w in new if len(r[0])]
        for runs, write in new:
            for old, owrite, ostream, oi, owhat in self.accesses:
                if (write or owrite) and ostream != stream and c.get(ostream, -1) < oi and _overlap(runs, old):
                    self.races.append(f"{what} on stream {stream} is not ordered after {owhat} on stream {ostream}")
        c[stream] = i
        self.accesses.extend((runs, write, stream, i, what) for runs, write in new)
        if len(self.accesses) > 4096:  # keep the newest; an access ordered before every stream is settled
            self.accesses = self.accesses[-2048:]

    def record(self, stream: int, event: int) -> None:
        c = self._of(stream)
        for k, v in self._of(HOST).items():
            c[k] = max(c.get(k, -1), v)
        self.events[event] = dict(c)

    def wait(self, stream: int, event: int) -> None:
        c = self._of(stream)
        for k, v in self.events.get(event, {}).items():
            c[k] = max(c.get(k, -1), v)

    def host_waits(self, clock: dict[int, int]) -> None:
        h = self._of(HOST)
        for k, v in clock.items():
            h[k] = max(h.get(k, -1), v)

    def forget(self, lo: int, hi: int) -> None:
        """Memory at ``[lo, hi)`` was freed: its history ends."""
        self.accesses = [a for a in self.accesses if not _overlap(a[0], (np.array([lo]), np.array([hi])))]


class Memory:
    """``cupy.cuda.UnownedMemory`` / a pool block: ``ptr`` and ``size``, keeping ``owner`` alive."""

    def __init__(self, ptr: int, size: int, owner: Any = None, device_id: int = 0):
        self.ptr, self.size, self.owner, self.device_id = int(ptr), int(size), owner, int(device_id)


class MemoryPointer:
    """``cupy.cuda.MemoryPointer``: an address inside a :class:`Memory`."""

    def __init__(self, mem: Memory, offset: int):
        self.mem, self.ptr = mem, mem.ptr + int(offset)
        self.device_id = mem.device_id

    def copy_from_device_async(self, src, size, stream=None):
        _CUDA.note("memcpy", size, stream=stream, reads=[(src.ptr, size)], writes=[(self.ptr, size)])
        _raw(self.ptr, size)[:] = _raw(src.ptr, size)


class _Held:
    """The memory of ``a`` seen through ``__array_interface__``, so a numpy array of it keeps ``owner`` alive."""

    def __init__(self, a: np.ndarray, owner: Any):
        self.__array_interface__ = a.__array_interface__
        self.owner = owner


class ndarray:  # the name of cupy.ndarray
    """``cupy.ndarray`` over host memory: ``ndarray(shape, dtype, memptr)``."""

    def __init__(self, shape, dtype=np.uint8, memptr: MemoryPointer | None = None, _array=None):
        if _array is None:
            assert memptr is not None
            shape = tuple(int(n) for n in (shape if isinstance(shape, tuple | list) else (shape,)))
            dt = np.dtype(dtype)
            n = int(np.prod(shape)) * dt.itemsize
            _array = _raw(memptr.ptr, n).view(dt).reshape(shape)
            self._owner: Any = memptr.mem
            self._device = memptr.device_id
        else:
            self._owner = None
            self._device = _CUDA.device
        self._a = _array

    @classmethod
    def wrap(cls, a: np.ndarray, device: int, owner: Any = None) -> ndarray:
        out = cls((), _array=a)
        out._device, out._owner = device, owner
        return out

    # ---- attributes
    @property
    def data(self) -> MemoryPointer:
        return MemoryPointer(Memory(self._a.ctypes.data, self._a.nbytes, self, self._device), 0)

    @property
    def device(self):
        return types.SimpleNamespace(id=self._device)

    shape = property(lambda self: self._a.shape)
    size = property(lambda self: self._a.size)
    dtype = property(lambda self: self._a.dtype)
    nbytes = property(lambda self: self._a.nbytes)
    ndim = property(lambda self: self._a.ndim)

    def __len__(self):
        return len(self._a)

    def __bool__(self):
        return bool(self._a)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "data": (self._a.ctypes.data, False),
            "shape": self._a.shape,
            "typestr": self._a.dtype.str,
            "strides": None if self._a.flags.c_contiguous else self._a.strides,
            "version": 3,
        }

    # ---- views and copies
    def _same(self, a: np.ndarray) -> ndarray:
        return ndarray.wrap(a, self._device, self if self._owner is None else self._owner)

    def view(self, dtype):
        return self._same(self._a.view(np.dtype(dtype)))

    def reshape(self, *shape):
        return self._same(self._a.reshape(*shape))

    def __getitem__(self, key):
        return self._same(self._a[key])

    def __setitem__(self, key, value):
        view = self._a[key]
        reads = [_bytes_of(value._a)] if isinstance(value, ndarray) else []
        _CUDA.note("fill", int(np.asarray(view).size), reads=reads, writes=[_bytes_of(view)])
        self._a[key] = value._a if isinstance(value, ndarray) else value

    def __ne__(self, other):
        return self._same(self._a != (other._a if isinstance(other, ndarray) else other))

    def fill(self, value):
        _CUDA.note("fill", self._a.nbytes, writes=[_bytes_of(self._a)])
        self._a.fill(value)

    def set(self, arr, stream=None):
        _CUDA.note("set", int(arr.nbytes), stream=stream, writes=[_bytes_of(self._a)])
        self._a[...] = np.asarray(arr).reshape(self._a.shape)

    def get(self, stream=None, order="C", out=None, blocking=True):
        _CUDA.note("get", int(self._a.nbytes), stream=stream, reads=[_bytes_of(self._a)])
        s = stream if stream is not None else _CUDA.get_current_stream()
        _CUDA.order.host_waits(_CUDA.order._of(s.ptr))  # a blocking copy to the host
        return self._a.copy()

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        # As CuPy's capsule does, the export keeps this array (and the memory it views) alive.
        return np.asarray(_Held(self._a, self)).__dlpack__()

    def __dlpack_device__(self):
        return (2, self._device)


class _Pool:
    def __init__(self):
        self.log: list[str] = []

    def free_bytes(self) -> int:
        return 0

    def free_all_blocks(self) -> None:
        self.log.append("free_all_blocks")


class RawKernel:
    """``cupy.RawKernel``: ``jreshard_copy`` and ``jreshard_cast`` run their kernel's numpy model over real
    addresses (the cast kernel's values from ``views.casts``, which its C source matches bit for bit:
    ``tests/test_cuda_casts.py``); ``spin`` waits."""

    def __init__(self, code, name, options=(), backend="nvrtc", translate_cucomplex=False, **kwargs):
        self.code, self.name, self.options = code, name, tuple(options)

    def __call__(self, grid, block, args, **kwargs):
        if _CUDA.captured(None, lambda: self(grid, block, args, **kwargs)):
            return
        if self.name == "jreshard_cast":
            self._cast(grid, block, args)
            return
        if self.name != "jreshard_copy":
            _CUDA.note("launch", self.name, tuple(grid), tuple(block))
            return
        table, nrows = args
        lt = table._a.reshape(-1, CK.LAUNCH_COLUMNS)[: int(nrows)]
        assert int(grid[0]) == CK.grid_size(lt) and int(block[0]) == CK.THREADS, (grid, block)
        src, dst, width = CK.unit_addresses(lt)
        reads = [_bytes_of(table._a)] + [_units(src[width == w], int(w)) for w in np.unique(width)]
        writes = [_units(dst[width == w], int(w)) for w in np.unique(width)]
        _CUDA.note("launch", self.name, tuple(grid), tuple(block), reads=reads, writes=writes)
        if len(src) == 0:
            return
        lo = int(min(src.min(), dst.min()))
        hi = int(max(src.max(), dst.max())) + 16
        mem = _raw(lo, hi - lo)
        for w in np.unique(width):
            sel = width == w
            off = np.arange(int(w), dtype=np.int64)
            s = (src[sel] - lo)[:, None] + off
            d = (dst[sel] - lo)[:, None] + off
            mem[d.reshape(-1)] = mem[s.reshape(-1)]

    def _cast(self, grid, block, args) -> None:
        table, nrows = args
        lt = table._a.reshape(-1, CK.LAUNCH_COLUMNS)[: int(nrows)]
        assert int(grid[0]) == CC.grid_size(lt) and int(block[0]) == CK.THREADS, (grid, block)
        src, dst, row = CC.element_addresses(lt)
        chains = lt[row, CC.CHAIN]
        parts = []
        for code in np.unique(chains):
            chain = K.chain_of(code)
            a, b = (int(numpy_dtype(chain[i]).itemsize) for i in (0, -1))
            parts.append((chain, chains == code, a, b))
        reads = [_bytes_of(table._a)] + [_units(src[sel], a) for _, sel, a, _ in parts]
        writes = [_units(dst[sel], b) for _, sel, _, b in parts]
        _CUDA.note("launch", self.name, tuple(grid), tuple(block), reads=reads, writes=writes)
        if len(src) == 0:
            return
        lo = int(min(src.min(), dst.min()))
        mem = _raw(lo, int(max(src.max(), dst.max())) + 4 - lo)
        for chain, sel, a, b in parts:
            x = np.ascontiguousarray(mem[(src[sel] - lo)[:, None] + np.arange(a)]).view(numpy_dtype(chain[0]))
            y = np.ascontiguousarray(cast_chain(x.reshape(-1), chain[1:]))
            mem[(dst[sel] - lo)[:, None] + np.arange(b)] = y.view(np.uint8).reshape(-1, b)


def _bytes_of(a: np.ndarray) -> Any:
    """The bytes a numpy view covers: one run when contiguous, else every byte's address."""
    if a.size == 0:
        return (0, 0)
    if a.flags.c_contiguous:
        return (a.ctypes.data, a.nbytes)
    idx = np.indices(a.shape).reshape(a.ndim, -1)
    return (a.ctypes.data + (idx * np.array(a.strides)[:, None]).sum(axis=0), a.itemsize)


def _units(addresses: np.ndarray, width: int) -> tuple[np.ndarray, int]:
    return (addresses, width)


def _alloc(nbytes: int, device: int) -> np.ndarray:
    raw = np.empty(int(nbytes) + ALIGN, np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    lo = raw.ctypes.data
    weakref.finalize(raw, _CUDA.order.forget, lo, lo + raw.nbytes)
    return raw[off : off + int(nbytes)]


def make_cupy(cuda: NumpyCuda | None = None) -> types.ModuleType:
    """The ``cupy`` stand-in over ``cuda`` (a new :class:`NumpyCuda` by default)."""
    global _CUDA
    cuda = cuda or NumpyCuda()
    _CUDA = cuda
    cp = types.ModuleType("cupy")
    pool = _Pool()

    def empty(shape, dtype=np.uint8):
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        cuda.note("empty", n)
        return ndarray.wrap(_alloc(n, cuda.device).view(dt).reshape(shape), cuda.device)

    def zeros(shape, dtype=np.uint8):
        a = empty(shape, dtype)
        a._a.fill(0)
        cuda.note("fill", a.nbytes, writes=[_bytes_of(a._a)])
        return a

    def asarray(a, dtype=None):
        if isinstance(a, ndarray):
            return a
        host = np.ascontiguousarray(a, dtype=dtype)
        a = empty(host.shape, host.dtype)
        a._a[...] = host
        cuda.note("upload", host.nbytes, writes=[_bytes_of(a._a)])
        return a

    def arange(start, stop=None, step=1, dtype=None):
        return asarray(np.arange(start, stop, step, dtype=dtype))

    def asnumpy(a, stream=None):
        if not isinstance(a, ndarray):
            return np.asarray(a)
        s = stream if stream is not None else cuda.get_current_stream()
        cuda.note("get", a.nbytes, stream=s, reads=[_bytes_of(a._a)])
        cuda.order.host_waits(cuda.order._of(s.ptr))  # CuPy synchronizes the stream it copied on
        return a._a.copy()

    def array_equal(a1, a2):
        return ndarray.wrap(np.array(np.array_equal(asnumpy(a1), asnumpy(a2))), cuda.device)

    class _CpuView:
        def __init__(self, obj):
            self.obj = obj

        def __dlpack__(self, **kwargs):
            return self.obj.__dlpack__()

        def __dlpack_device__(self):
            return (1, 0)

    def from_dlpack(array, *, device=None, copy=None):
        dev = array.__dlpack_device__()[1]
        a = np.from_dlpack(_CpuView(array))  # read-only when the producer is jax; CuPy's views are writable
        writable = _raw(a.ctypes.data, a.nbytes).view(a.dtype).reshape(a.shape)
        weakref.finalize(a, cuda.order.forget, a.ctypes.data, a.ctypes.data + a.nbytes)  # jax may reuse it
        return ndarray.wrap(writable, dev, (array, a))

    runtime = types.ModuleType("cupy.cuda.runtime")
    runtime.CUDARuntimeError = CUDARuntimeError
    runtime.memcpyDeviceToDevice = 3

    def eventQuery(event):
        cuda.order.host_waits(cuda.order.events.get(int(event), {}))  # done: the host saw it finish
        return 0

    runtime.eventQuery = eventQuery
    runtime.getDevice = lambda: cuda.device
    runtime.getDeviceCount = lambda: cuda.ndev
    runtime.memGetInfo = lambda: (64 << 30, 80 << 30)
    runtime.runtimeGetVersion = lambda: 13000
    runtime.driverGetVersion = lambda: 13000
    runtime.getDeviceProperties = lambda device: {"name": b"numpy stand-in", "multiProcessorCount": 1}
    runtime.deviceGetPCIBusId = lambda device: f"0000:{device:02x}:00.0"
    runtime.deviceCanAccessPeer = lambda device, peerDevice: True
    runtime.deviceEnablePeerAccess = lambda peerDevice: None

    def memcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream):
        if cuda.captured(stream, lambda: memcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream)):
            return
        rows = np.arange(int(height), dtype=np.int64)
        reads = [(src + rows * spitch, int(width))]
        writes = [(dst + rows * dpitch, int(width))]
        cuda.note("memcpy", width * height, stream=stream, reads=reads, writes=writes)
        for r in range(int(height)):
            _raw(dst + r * dpitch, width)[:] = _raw(src + r * spitch, width)

    def memcpyPeerAsync(dst, dstDevice, src, srcDevice, size, stream):
        if cuda.captured(stream, lambda: memcpyPeerAsync(dst, dstDevice, src, srcDevice, size, stream)):
            return
        cuda.note("memcpy", size, stream=stream, reads=[(src, size)], writes=[(dst, size)])
        _raw(dst, size)[:] = _raw(src, size)

    def memcpyAsync(dst, src, size, kind, stream):
        if cuda.captured(stream, lambda: memcpyAsync(dst, src, size, kind, stream)):
            return
        cuda.note("memcpy", size, stream=stream, reads=[(src, size)], writes=[(dst, size)])
        _raw(dst, size)[:] = _raw(src, size)

    runtime.memcpy2DAsync, runtime.memcpyPeerAsync, runtime.memcpyAsync = memcpy2DAsync, memcpyPeerAsync, memcpyAsync

    cuda_mod = types.ModuleType("cupy.cuda")
    for name in ("Stream", "Event", "Device", "get_current_stream", "get_elapsed_time"):
        setattr(cuda_mod, name, getattr(cuda, name))
    cuda_mod.graph = types.SimpleNamespace(Graph=cuda.Graph)
    cuda_mod.runtime = runtime
    cuda_mod.memory = types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError)
    cuda_mod.UnownedMemory = Memory
    cuda_mod.MemoryPointer = MemoryPointer
    cuda_mod.nccl = make_nccl(cuda)
    cuda_mod.standin = cuda

    cp.__version__ = "14.2.0+numpy-standin"
    cp.cuda = cuda_mod
    cp.ndarray, cp.RawKernel = ndarray, RawKernel
    cp.uint8, cp.float32, cp.dtype = np.uint8, np.float32, np.dtype
    cp.empty, cp.zeros, cp.asarray, cp.arange, cp.asnumpy, cp.array_equal = (
        empty,
        zeros,
        asarray,
        arange,
        asnumpy,
        array_equal,
    )
    cp.from_dlpack = from_dlpack
    cp.get_default_memory_pool = lambda: pool
    return cp


_CUDA: NumpyCuda = NumpyCuda()


def make_nccl(cuda: NumpyCuda) -> types.ModuleType:
    """``cupy.cuda.nccl``: sends and receives matched in issue order per (uid, sender, receiver)."""
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.NCCL_UINT8, nccl.NcclError, nccl.available = 1, NcclError, True
    sends: dict[tuple, deque] = defaultdict(deque)
    recvs: dict[tuple, deque] = defaultdict(deque)
    uids = itertools.count()

    def match(key) -> None:
        while sends[key] and recvs[key]:
            (sp, sn), (rp, rn) = sends[key].popleft(), recvs[key].popleft()
            if sn != rn:
                raise NcclError(5)  # ncclInvalidUsage: a message's two sides disagree on its size
            _raw(rp, rn)[:] = _raw(sp, sn)

    class NcclCommunicator:
        """NcclCommunicator(int ndev, bytes commId, int rank, NcclConfig config=None)"""

        def __init__(self, ndev, commId, rank, config=None):
            if not isinstance(commId, bytes):
                raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(commId).__name__})")
            self.uid, self.rank, self.ndev = commId, int(rank), int(ndev)
            cuda.log.append(("nccl_init", rank))

        def send(self, sendbuf, count, datatype, peer, stream):
            if cuda.captured(stream, lambda: self.send(sendbuf, count, datatype, peer, stream)):
                return
            cuda.note("send", peer, count, stream=stream, reads=[(sendbuf, count)])
            key = (self.uid, self.rank, int(peer))
            sends[key].append((int(sendbuf), int(count)))
            match(key)

        def recv(self, recvbuf, count, datatype, peer, stream):
            if cuda.captured(stream, lambda: self.recv(recvbuf, count, datatype, peer, stream)):
                return
            cuda.note("recv", peer, count, stream=stream, writes=[(recvbuf, count)])
            key = (self.uid, int(peer), self.rank)
            recvs[key].append((int(recvbuf), int(count)))
            match(key)

        def check_async_error(self):
            pass

        def abort(self):
            cuda.log.append(("nccl_abort", self.rank))

        def destroy(self):
            cuda.log.append(("nccl_destroy", self.rank))

    nccl.NcclCommunicator = NcclCommunicator
    nccl.get_unique_id = lambda: next(uids).to_bytes(2, "little") + bytes(126)
    nccl.get_version = lambda: NCCL_VERSION
    nccl.groupStart = lambda: cuda.log.append(("groupStart",))
    nccl.groupEnd = lambda: cuda.log.append(("groupEnd",))
    return nccl


def make_pynvml() -> types.ModuleType:
    """``pynvml`` for one GPU without an NVLink fabric: the fabric query answers NotSupported."""
    from cupy_standins import fake_nvml

    fake = fake_nvml({f"0000:{d:02x}:00.0": None for d in range(_CUDA.ndev)})
    mod = types.ModuleType("pynvml")
    for k, v in vars(fake).items():
        setattr(mod, k, v)
    return mod


def install(ndev: int = 1) -> types.ModuleType:
    """Put the stand-ins into ``sys.modules`` (``cupy``, ``cupy.cuda``, ``cupy.cuda.runtime``,
    ``cupy.cuda.nccl``, ``pynvml``) and let jax's CPU arrays take the DLPack calls of the GPU path."""
    import jax
    import jax.dlpack
    from jax._src import array as jax_array

    cp = make_cupy(NumpyCuda(ndev))
    names = ("cupy", "cupy.cuda", "cupy.cuda.runtime", "cupy.cuda.nccl", "pynvml")
    _UNDO.append(({n: sys.modules.get(n) for n in names}, jax_array.ArrayImpl.__dlpack__, jax.dlpack.from_dlpack))
    sys.modules.update({"cupy": cp, "cupy.cuda": cp.cuda, "cupy.cuda.runtime": cp.cuda.runtime,
                        "cupy.cuda.nccl": cp.cuda.nccl, "pynvml": make_pynvml()})  # fmt: skip

    dlpack = jax_array.ArrayImpl.__dlpack__

    def cpu_dlpack(self, *, stream=None, **kwargs):  # jax's CPU arrays take no stream
        return dlpack(self, **kwargs)

    jax_array.ArrayImpl.__dlpack__ = cpu_dlpack
    from_dlpack = jax.dlpack.from_dlpack

    class AsCpu:
        def __init__(self, obj):
            self.obj = obj

        def __dlpack__(self, *args, **kwargs):
            return self.obj.__dlpack__(stream=None)

        def __dlpack_device__(self):
            return (1, self.obj.__dlpack_device__()[1])  # CPU device i stands for GPU i

    def cpu_from_dlpack(external_array, *args, **kwargs):
        dev = getattr(external_array, "__dlpack_device__", None)
        if dev is not None and dev()[0] == 2:  # a "CUDA" producer: its bytes are host memory here
            external_array = AsCpu(external_array)
        return from_dlpack(external_array, *args, **kwargs)

    jax.dlpack.from_dlpack = cpu_from_dlpack
    return cp


_UNDO: list[tuple[dict[str, Any], Any, Any]] = []


def uninstall() -> None:
    """Undo the last :func:`install`: the modules and jax's DLPack calls as they were."""
    import jax.dlpack
    from jax._src import array as jax_array

    modules, dlpack, from_dlpack = _UNDO.pop()
    for name, mod in modules.items():
        if mod is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = mod
    jax_array.ArrayImpl.__dlpack__ = dlpack
    jax.dlpack.from_dlpack = from_dlpack
