"""CupyBuffers: shard, staging and destination buffers on CUDA GPUs. Not run on GPU.

The GPU :class:`~jreshard.engine.buffers.BufferBackend`. Buffers are 1-D ``uint8``
CuPy arrays; pack, unpack and copy are one ``RawKernel`` launch per descriptor
table (:mod:`jreshard.nccl.cuda_kernels`).

Stream-correct DLPack, both ways:

- *Export.* A source shard is exported with ``shard.__dlpack__(stream=s)``, where
  ``s`` is this backend's stream on the shard's GPU: JAX makes ``s`` wait for the
  computation that produces the shard, without blocking the host, and every kernel
  that reads the view runs on ``s``.
- *Import.* A destination buffer is handed to ``jax.dlpack.from_dlpack`` through a
  holder whose ``__dlpack__(stream=j)`` exports the CuPy array with ``stream=j``
  from inside ``with s:``, so JAX's stream ``j`` waits for the kernels on ``s``
  that filled it.

Dtypes travel as bytes: the DLPack capsule is re-typed to an unsigned integer of
the same width before CuPy reads it, and back to the real DLPack type (bfloat16,
float8_*) before JAX reads it, so bf16 and fp8 need no dtype support in CuPy.
Destination buffers are CuPy allocations carved at 256-byte boundaries, which
JAX imports without a copy.

The exported views keep the JAX source buffers alive (and not donatable):
:meth:`CupyBuffers.release` drops them; call it when a refit ends.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jreshard.engine.buffers import KDLCUDA, BufferBackend, Capsule, dlpack_type, retype_capsule
from jreshard.errors import BackendUnavailableError, TransferError, TransferTimeoutError, cuda_extra
from jreshard.nccl import cuda_kernels as CK
from jreshard.nccl.gpu_dlpack import Typed
from jreshard.nccl.nccl_support import event_done
from jreshard.schedule import kernels as K

__all__ = ["GPU_ALIGN", "CupyBuffers"]

GPU_ALIGN = 256  # bytes: the alignment of every destination and staging buffer
_UINT = 1


def _no_room(what: str, nbytes: int, ordinal: int, free: int, total: int) -> str:
    return (
        f"CupyBuffers: {what} of {nbytes} bytes on GPU {ordinal} do not fit: {free} of {total} bytes are free. "
        "XLA preallocates 75% of GPU memory when jax starts; the fix is XLA_PYTHON_CLIENT_PREALLOCATE=false "
        "or a lower XLA_PYTHON_CLIENT_MEM_FRACTION (e.g. 0.6) set before jax starts, or a smaller "
        "Options.staging_bytes"
    )


def _ordinal(device: Any) -> int:
    """The CUDA ordinal of a jax GPU device."""
    return int(device.local_hardware_id)


class CupyBuffers(BufferBackend):
    """CuPy buffers on jax CUDA devices (final). Not run on GPU.

    Stream order, no host waits until the end: :meth:`fence` (before each exchange)
    makes each GPU's current stream, which ``NcclComm`` waits on, wait for this
    backend's stream with an event; only :meth:`synchronize` (the end of a refit)
    blocks the host, polling events for at most ``timeout_s``, raising a CUDA
    error as one, and asking ``watcher`` (``NcclComm.buffers()`` passes the
    communicator) for NCCL errors while it waits and to abort at the deadline.
    Staging and destination blocks are allocated on this backend's stream, so
    CuPy's pool only hands them out again in that stream's order.

    Args:
      streams: ``{CUDA ordinal: CuPy stream}`` to run on (pass ``NcclComm.stream(rank)``
        so kernels and NCCL share one stream per GPU, or use ``NcclComm.buffers()``);
        others are made as needed.
      cupy: the ``cupy`` module (imported when not given).
      timeout_s: how long :meth:`synchronize` may wait.
      watcher: polled while :meth:`synchronize` waits (``check_errors()``) and aborted
        (``abort()``) when it times out.

    Raises:
      BackendUnavailableError: CuPy does not import.
    """

    __slots__ = ("_cp", "_peers", "_streams", "_timeout_s", "_views", "_watcher")

    def __init__(
        self,
        *,
        streams: Mapping[int, Any] | None = None,
        cupy: Any = None,
        timeout_s: float = 300.0,
        watcher: Any = None,
    ):
        if cupy is None:
            try:
                cupy = importlib.import_module("cupy")
            except (ImportError, OSError) as err:
                raise BackendUnavailableError(
                    f"CupyBuffers: cupy does not import ({type(err).__name__}: {err}); the fix is {cuda_extra()}"
                ) from err
        self._cp = cupy
        self._streams: dict[int, Any] = dict(streams or {})
        self._views: list[Any] = []
        self._peers: set[tuple[int, int]] = set()
        self._timeout_s = float(timeout_s)
        self._watcher = watcher

    def stream(self, ordinal: int) -> Any:
        """This backend's stream on GPU ``ordinal``."""
        if ordinal not in self._streams:
            with self._cp.cuda.Device(ordinal):
                self._streams[ordinal] = self._cp.cuda.Stream(non_blocking=True)
        return self._streams[ordinal]

    # ----- DLPack ----------------------------------------------------------
    def export_source(self, shard: Any) -> Any:
        """A zero-copy 1-D uint8 CuPy view of a single-device jax array, ordered after
        the computation that produces it (on this backend's stream). Not run on GPU."""
        cp = self._cp
        (device,) = shard.devices()
        o = _ordinal(device)
        if shard.size == 0:
            with cp.cuda.Device(o):
                return cp.zeros(0, cp.uint8)
        bits = shard.dtype.itemsize * 8
        if bits > 64:
            raise TransferError(f"CupyBuffers: dtype {shard.dtype} ({bits} bits) has no unsigned integer of its width")
        s = self.stream(o)
        with cp.cuda.Device(o), s:
            capsule = retype_capsule(shard.__dlpack__(stream=s.ptr), _UINT, bits)
            view = cp.from_dlpack(Capsule(capsule, o, KDLCUDA)).reshape(-1).view(cp.uint8)
        self._views.append(view)
        return view

    def writable_view(self, array: Any) -> Any:
        """A writable 1-D uint8 view of a donated single-device jax array. Not run on GPU.

        Waits for the array to be ready (host-side); the caller keeps ``array`` alive.
        """
        cp = self._cp
        (device,) = array.devices()
        o = _ordinal(device)
        nbytes = array.size * array.dtype.itemsize
        with cp.cuda.Device(o):
            if nbytes == 0:
                return cp.zeros(0, cp.uint8)
            array.block_until_ready()
            mem = cp.cuda.UnownedMemory(array.unsafe_buffer_pointer(), nbytes, array, o)
            view = cp.ndarray((nbytes,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))
        self._views.append(view)
        return view

    def allocate(self, sizes: Sequence[int], device: Any) -> list[Any]:
        """Uninitialised uint8 buffers on ``device``, each starting at a 256-byte boundary of one
        CuPy allocation (CuPy's pool hands out 512-byte-aligned blocks). Not run on GPU."""
        starts, pos = [], 0
        for n in sizes:
            starts.append(pos)
            pos += -(-int(n) // GPU_ALIGN) * GPU_ALIGN
        block = self._empty(max(pos, 1), _ordinal(device), "destination buffers")
        if block.data.ptr % GPU_ALIGN:
            raise TransferError(f"CupyBuffers: CuPy returned {block.data.ptr:#x}, not {GPU_ALIGN}-byte aligned")
        return [block[s : s + int(n)] for s, n in zip(starts, sizes, strict=True)]

    def import_shard(self, buffer: Any, shape: Sequence[int], dtype: np.dtype, device: Any) -> Any:
        """A jax array on ``device`` aliasing ``buffer``, after the kernels that wrote it. Not run on GPU.

        Raises:
          TransferError: jax produced another dtype than ``dtype``.
        """
        import jax

        shape = tuple(int(n) for n in shape)
        dtype = np.dtype(dtype)
        if buffer.size == 0:
            return jax.device_put(np.zeros(shape, dtype), device)
        code, bits = dlpack_type(dtype)
        o = _ordinal(device)
        typed = buffer.view(self._cp.dtype(f"uint{bits}")).reshape(shape)
        out = jax.dlpack.from_dlpack(Typed(typed, code, bits, self.stream(o), o, self._cp.cuda))
        if out.dtype != dtype:
            raise TransferError(f"CupyBuffers.import_shard: asked jax for {dtype} and got {out.dtype}")
        return out

    def release(self) -> int:
        """Drop every exported DLPack view (so the jax buffers behind them can be donated
        again) and hand CuPy's cached free blocks (the staging of the refit) back to the
        driver, so XLA can use them; returns how many views. The engine must hold no
        views or staging of its own by then. Not run on GPU."""
        n = len(self._views)
        self._views.clear()
        self._cp.get_default_memory_pool().free_all_blocks()
        return n

    def _empty(self, nbytes: int, ordinal: int, what: str) -> Any:
        """``nbytes`` uninitialised bytes on GPU ``ordinal``, or an error that says how to make room.

        CuPy allocates outside XLA's allocator, and XLA preallocates 75% of each GPU's
        memory by default; the check counts what the device has free plus what CuPy's
        pool holds unused. Not run on GPU.

        Raises:
          TransferError: too little GPU memory (nothing was written).
        """
        cp = self._cp
        with cp.cuda.Device(ordinal), self.stream(ordinal):  # the pool reuses the block in this stream's order
            free, total = cp.cuda.runtime.memGetInfo()
            free += cp.get_default_memory_pool().free_bytes()
            if nbytes > free:
                raise TransferError(_no_room(what, nbytes, ordinal, free, total), destination_intact=True)
            try:
                return cp.empty(nbytes, cp.uint8)
            except cp.cuda.memory.OutOfMemoryError as err:
                raise TransferError(_no_room(what, nbytes, ordinal, free, total), destination_intact=True) from err

    # ----- kernels -----------------------------------------------------------
    def staging(self, nbytes: int, device: Any = None) -> Any:
        """A uint8 staging buffer on ``device`` (default: the current CuPy device), at most
        ``Options.staging_bytes`` (the schedule's bound); freed by :meth:`release`. Not run on GPU.

        Raises:
          TransferError: too little GPU memory, naming the XLA settings that leave room.
        """
        o = self._cp.cuda.Device().id if device is None else _ordinal(device)
        return self._empty(max(int(nbytes), 0), o, "staging")

    def upload(self, data: np.ndarray, device: Any) -> Any:
        """``data`` (host uint8) copied into a new buffer on ``device``, on this backend's stream
        (the mail of the rank-local schedule: a few integers). Not run on GPU."""
        o = _ordinal(device)
        buf = self._empty(int(data.size), o, "scheduling mail")
        if data.size:
            with self._cp.cuda.Device(o):
                buf.set(np.ascontiguousarray(data, np.uint8), stream=self.stream(o))
        return buf

    def download(self, buffer: Any) -> np.ndarray:
        """``buffer``'s bytes on the host, copied on this backend's stream after what it ordered
        there (with ``NcclComm.buffers()``, the receives). Not run on GPU."""
        o = buffer.device.id
        with self._cp.cuda.Device(o):
            return np.asarray(buffer.get(stream=self.stream(o)))

    @staticmethod
    def _pointers(buffers: Sequence[Any]) -> list[int]:
        return [0 if b is None else int(b.data.ptr) for b in buffers]

    def pack(self, table: np.ndarray, buffers: Sequence[Any], staging: Any) -> None:
        """One kernel launch gathering ``table``'s pieces into ``staging``. Not run on GPU."""
        if len(table) == 0:
            return
        o = staging.device.id
        with self._cp.cuda.Device(o):
            CK.launch(CK.pack_launch(table, self._pointers(buffers), staging.data.ptr), self.stream(o), self._cp)

    def unpack(self, table: np.ndarray, staging: Any, buffers: Sequence[Any]) -> None:
        """One kernel launch scattering ``staging`` into ``table``'s pieces, after the work on the
        device's current stream (where a communicator that copies there, like ``LocalComm``,
        put the bytes; an event, no host wait). Not run on GPU."""
        if len(table) == 0:
            return
        o = staging.device.id
        with self._cp.cuda.Device(o):
            current = self._cp.cuda.get_current_stream()
            if current is not self.stream(o):
                self.stream(o).wait_event(current.record())
            CK.launch(CK.unpack_launch(table, staging.data.ptr, self._pointers(buffers)), self.stream(o), self._cp)

    def copy(self, src_table: np.ndarray, src: Sequence[Any], dst_table: np.ndarray, dst: Sequence[Any]) -> None:
        """Piece ``i`` of ``src_table`` into piece ``i`` of ``dst_table``: one kernel on the
        destination GPU, reading other GPUs through peer access where the hardware allows it,
        else pack there, ``cudaMemcpyPeerAsync``, unpack here. Not run on GPU."""
        if len(src_table) == 0:
            return
        cp = self._cp
        d = dst[int(dst_table[0, K.BUF])].device.id
        on = np.array([src[int(b)].device.id for b in src_table[:, K.BUF]])
        for s in sorted(set(on.tolist())):
            st, dt = src_table[on == s], dst_table[on == s]
            if s != d and not self._peer(d, s):
                self._copy_through_staging(st, src, dt, dst, s, d)
                continue
            if s != d:
                with cp.cuda.Device(s):
                    event = self.stream(s).record()
                self.stream(d).wait_event(event)
            with cp.cuda.Device(d):
                CK.launch(CK.copy_launch(st, self._pointers(src), dt, self._pointers(dst)), self.stream(d), cp)

    def _peer(self, d: int, s: int) -> bool:
        """Whether GPU ``d`` can read GPU ``s``'s memory, enabling peer access once."""
        rt = self._cp.cuda.runtime
        if (d, s) in self._peers:
            return True
        if not rt.deviceCanAccessPeer(d, s):
            return False
        with self._cp.cuda.Device(d):
            try:
                rt.deviceEnablePeerAccess(s)
            except rt.CUDARuntimeError as err:  # already enabled by someone else is fine
                if "PeerAccessAlreadyEnabled" not in str(err):
                    raise
        self._peers.add((d, s))
        return True

    def _copy_through_staging(self, src_table, src, dst_table, dst, s: int, d: int) -> None:
        cp = self._cp
        nbytes = src_table[:, K.NBYTES]
        stage = np.concatenate([[0], np.cumsum(nbytes)[:-1]])
        st, dt = np.array(src_table), np.array(dst_table)
        st[:, K.STAGE] = stage
        dt[:, K.STAGE] = stage
        total = int(nbytes.sum())
        with cp.cuda.Device(s):
            here = cp.empty(total, cp.uint8)
            self.pack(st, src, here)
            event = self.stream(s).record()
        with cp.cuda.Device(d):
            there = cp.empty(total, cp.uint8)
            self.stream(d).wait_event(event)
            cp.cuda.runtime.memcpyPeerAsync(there.data.ptr, d, here.data.ptr, s, total, self.stream(d).ptr)
            self.unpack(dt, there, dst)
        self.stream(d).synchronize()  # ``here`` may be freed once the peer copy has run

    def fence(self) -> None:
        """Order everything issued on this backend's streams before what is issued next on each
        GPU's current stream (where ``NcclComm`` takes its start), without a host wait. Not run on GPU."""
        cp = self._cp
        for o, s in sorted(self._streams.items()):
            with cp.cuda.Device(o):
                cp.cuda.get_current_stream().wait_event(s.record())

    def synchronize(self) -> None:
        """Wait on the host, at most ``timeout_s``, for every kernel issued on this backend's
        streams (with ``NcclComm.buffers()``: every send and receive too). Not run on GPU.

        Raises:
          TransferError: CUDA reported an error on a stream (e.g. an illegal address).
          TransferTimeoutError: not done within ``timeout_s``; the watcher was aborted.
          PeerError: the watcher reported an NCCL error.
        """
        cp = self._cp
        events = {}
        for o, s in sorted(self._streams.items()):
            with cp.cuda.Device(o):
                events[o] = s.record()
        deadline = time.monotonic() + self._timeout_s
        pause = 50e-6
        while events:
            for o in sorted(events):
                try:
                    done = event_done(events[o], cp.cuda.runtime)
                except cp.cuda.runtime.CUDARuntimeError as err:
                    if self._watcher is not None:
                        self._watcher.abort()
                    raise TransferError(
                        f"CupyBuffers: CUDA reported {err} on GPU {o}", destination_intact=False
                    ) from err
                if done:
                    del events[o]
            if not events:
                return
            if self._watcher is not None:
                self._watcher.check_errors()
            if time.monotonic() > deadline:
                if self._watcher is not None:
                    self._watcher.abort()
                raise TransferTimeoutError(
                    f"CupyBuffers: the work on GPUs {sorted(events)} did not finish within timeout_s={self._timeout_s}"
                    + ("; communicators aborted" if self._watcher is not None else ""),
                    destination_intact=False,
                )
            time.sleep(pause)
            pause = min(2 * pause, 5e-3)
