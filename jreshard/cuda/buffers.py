"""CupyBuffers: shard, staging and destination buffers on CUDA GPUs. Not run on GPU.

The GPU :class:`~jreshard.engine.buffers.Buffers`. Buffers are 1-D ``uint8``
CuPy arrays; pack, unpack and copy are one ``RawKernel`` launch per descriptor
table (:mod:`jreshard.cuda.kernels`), or plain ``cudaMemcpyAsync`` calls when
a table is a few contiguous runs; a table's cast rows (a view's casts) launch the cast
kernel of :mod:`jreshard.cuda.casts` on the same stream, after its byte rows.
The launch tables of a whole schedule are built and uploaded once
(:meth:`CupyBuffers.prepare`, which the engine calls before its first round). Pack,
send/receive and unpack run on three streams per GPU linked by events, with
double-buffered staging (:mod:`jreshard.cuda.streams`); none is the legacy
default stream.

Destination shards are allocated through XLA (one jitted allocation per device and
call, viewed by CuPy), so they count against XLA's memory, not beside it: with XLA's
default preallocation (75% of the GPU) the results fit where jax would put them.
Only staging comes from CuPy's pool, and :meth:`CupyBuffers.release` hands it back.

Stream-correct DLPack, both ways:

- *Export.* A source shard is exported with ``shard.__dlpack__(stream=s)``, where
  ``s`` is the pack stream on the shard's GPU: JAX makes ``s`` wait for the
  computation that produces the shard, without blocking the host; the kernels that
  read the view run on ``s``, and sends from it on the comm stream, which waits for
  ``s`` at each fence.
- *Import.* A destination buffer is handed to ``jax.dlpack.from_dlpack`` through a
  holder whose ``__dlpack__(stream=j)`` exports the CuPy array with ``stream=j``
  from inside ``with c:``, where the comm stream ``c`` has first waited for the pack
  and unpack streams, so JAX's stream ``j`` waits for everything that filled it.

Dtypes travel as bytes: the DLPack capsule is re-typed to an unsigned integer of
the same width before CuPy reads it, and back to the real DLPack type (bfloat16,
float8_*) before JAX reads it, so bf16 and fp8 need no dtype support in CuPy.
Destination buffers are carved at 256-byte boundaries of an XLA allocation, which
JAX imports again without a copy.

The exported views keep the JAX source buffers alive (and not donatable):
:meth:`CupyBuffers.release` drops them; call it when a refit ends.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jreshard.cuda import casts as CC
from jreshard.cuda import kernels as CK
from jreshard.cuda.dlpack import Typed
from jreshard.cuda.runtime import event_done
from jreshard.cuda.streams import GpuStreams
from jreshard.engine.arrays import zeros_on
from jreshard.engine.buffers import KDLCUDA, Buffers, Capsule, carrier, dlpack_type, retype_capsule
from jreshard.errors import BackendUnavailableError, TransferError, TransferTimeoutError, cuda_extra
from jreshard.schedule import kernels as K
from jreshard.types import Array, CudaStream, CupyArray, CupyModule, Device

__all__ = ["GPU_ALIGN", "CupyBuffers"]

GPU_ALIGN = 256  # bytes: the alignment of every destination and staging buffer
# The final wait polls every 20 µs, backing off to at most 100 µs (not more: it is the refit's end).
POLL_MIN_S, POLL_MAX_S = 20e-6, 100e-6
SMALL_BYTES = 1 << 20  # destination buffers under this share one XLA block per device and call
MAX_PLAIN_COPIES = 4  # a table of at most this many contiguous runs is copied with cudaMemcpyAsync


def _no_room(what: str, nbytes: int, ordinal: int, free: int, total: int) -> str:
    return (
        f"CupyBuffers: {what} of {nbytes} bytes on GPU {ordinal} do not fit: {free} of {total} bytes are free. "
        "XLA preallocates 75% of GPU memory when jax starts; the fix is XLA_PYTHON_CLIENT_PREALLOCATE=false "
        "or a lower XLA_PYTHON_CLIENT_MEM_FRACTION (e.g. 0.6) set before jax starts, or a smaller "
        "Options.staging_bytes"
    )


def _ordinal(device: Device) -> int:
    """The CUDA ordinal of a jax GPU device."""
    return int(device.local_hardware_id)


class CupyBuffers(Buffers[CupyArray]):
    """CuPy buffers on jax CUDA devices (final). Not run on GPU.

    Stream order, no host waits until the end. On each GPU, packs and same-device copies run
    on a pack stream, sends and receives on the comm stream (``NcclComm``'s, with
    :meth:`NcclComm.buffers`), unpacks on an unpack stream; :meth:`fence` (before each
    exchange) and the staging arenas' events order them (:mod:`jreshard.cuda.streams`),
    and the engine alternates two staging arenas by round (:attr:`staging_buffers`), so
    round ``k + 1`` packs while round ``k`` is on the wire. Only :meth:`synchronize`
    (the end of a refit) blocks the host, polling events every 20-100 µs for at most
    ``timeout_s``, raising a CUDA error as one, and asking ``watcher`` (``NcclComm.buffers()``
    passes the communicator) for NCCL errors while it waits and to abort at the deadline.

    Args:
      streams: ``{CUDA ordinal: CuPy stream}`` to use as comm streams (``NcclComm.stream(rank)``,
        or use ``NcclComm.buffers()``); others are made as needed.
      cupy: the ``cupy`` module (imported when not given).
      timeout_s: how long :meth:`synchronize` may wait.
      watcher: polled while :meth:`synchronize` waits (``check_errors()``) and aborted
        (``abort()``) when it times out.

    Raises:
      BackendUnavailableError: CuPy does not import.
    """

    __slots__ = ("_cp", "_peers", "_s", "_tables", "_timeout_s", "_views", "_watcher", "uploads")

    staging_buffers = 2  # double-buffered staging: the engine alternates two arenas by round
    # The streams order a pack into an arena after the exchanges that packed it and the unpacks that read it,
    # not after a later send from a landed arena: forwards are packed from the destination shard here.
    host_ordered = False

    def __init__(
        self,
        *,
        streams: Mapping[int, Any] | None = None,
        cupy: CupyModule = None,
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
        self._s = GpuStreams(cupy, dict(streams or {}))
        self._views: list[Any] = []
        self._peers: set[tuple[int, int]] = set()
        self._timeout_s = float(timeout_s)
        self._watcher = watcher
        self._tables: dict[tuple, tuple[Any, int, int]] = {}  # prepared launch tables on the device
        self.uploads = 0  # host-to-device copies of launch tables (one per GPU per prepared schedule)

    def stream(self, ordinal: int) -> CudaStream:
        """The comm stream on GPU ``ordinal``: NCCL's, and where JAX waits before reading a result."""
        return self._s.comm(ordinal)

    @property
    def cupy(self) -> CupyModule:
        """The ``cupy`` module in use (or its stand-in)."""
        return self._cp

    @property
    def streams(self) -> GpuStreams:
        """The comm, pack and unpack streams of every GPU in use."""
        return self._s

    # ----- DLPack ----------------------------------------------------------
    def _view(self, array: Array, o: int, stream: CudaStream) -> CupyArray:
        """A 1-D uint8 CuPy view of a single-device jax array, ``stream`` ordered after its producer."""
        cp = self._cp
        code, bits, _ = carrier(array.dtype.itemsize * 8)  # complex128: itself (no uint128)
        with cp.cuda.Device(o), stream:
            capsule = retype_capsule(array.__dlpack__(stream=stream.ptr), code, bits)
            return cp.from_dlpack(Capsule(capsule, o, KDLCUDA)).reshape(-1).view(cp.uint8)

    def export_source(self, shard: Array) -> CupyArray:
        """A zero-copy 1-D uint8 CuPy view of a single-device jax array, ordered after the
        computation that produces it (on the pack stream, which orders the comm stream
        at each fence). Not run on GPU."""
        cp = self._cp
        (device,) = shard.devices()
        o = _ordinal(device)
        if shard.size == 0:
            with cp.cuda.Device(o), self._s.pack(o):
                return cp.zeros(0, cp.uint8)
        view = self._view(shard, o, self._s.pack(o))
        self._views.append(view)
        return view

    def writable_view(self, array: Array) -> CupyArray:
        """A writable 1-D uint8 view of a donated single-device jax array, ordered after its
        producer on the pack stream (no host wait). Not run on GPU. The caller keeps ``array`` alive."""
        cp = self._cp
        (device,) = array.devices()
        o = _ordinal(device)
        if array.size == 0:
            with cp.cuda.Device(o), self._s.pack(o):
                return cp.zeros(0, cp.uint8)
        view = self._view(array, o, self._s.pack(o))
        self._views.append(view)
        return view

    def allocate(self, sizes: Sequence[int], device: Device) -> list[Any]:
        """Uninitialised uint8 buffers on ``device`` that XLA allocates (jitted ``zeros`` on the
        device), so XLA's preallocated memory holds them: the buffers under ``SMALL_BYTES``
        share one block (one allocation and one DLPack view for many small leaves), each
        larger one has its own; every buffer starts at a 256-byte boundary. Not run on GPU.

        Raises:
          TransferError: XLA has no room.
        """
        out: list[Any] = [None] * len(sizes)
        small = [i for i, n in enumerate(sizes) if int(n) < SMALL_BYTES]
        groups = [small] if small else []
        groups += [[i] for i, n in enumerate(sizes) if int(n) >= SMALL_BYTES]
        for idx in groups:
            starts, pos = [], 0
            for i in idx:
                starts.append(pos)
                pos += -(-int(sizes[i]) // GPU_ALIGN) * GPU_ALIGN
            block = self._xla_block(pos, device)
            for i, st in zip(idx, starts, strict=True):
                out[i] = block[st : st + int(sizes[i])]
        return out

    def _xla_block(self, nbytes: int, device: Device) -> Array:
        """A CuPy view of ``nbytes`` (rounded up) that XLA allocated on ``device``; the view holds the jax array."""
        import jax.numpy as jnp

        total = max(int(nbytes), GPU_ALIGN) + GPU_ALIGN  # room to start at a 256-byte boundary
        total = -(-total // (1 << 20)) * (1 << 20) if total > (1 << 20) else total  # fewer shapes to compile
        o = _ordinal(device)
        try:
            block = zeros_on(device, (total,), jnp.uint8)
        except Exception as err:  # XlaRuntimeError: RESOURCE_EXHAUSTED
            if "RESOURCE_EXHAUSTED" not in str(err) and "out of memory" not in str(err).lower():
                raise
            free, whole = self._memory(o)
            raise TransferError(
                _no_room("destination buffers", total, o, free, whole), destination_intact=True
            ) from err
        view = self._view(block, o, self._s.pack(o))  # ordered after XLA's zeros on the pack stream
        return view[(-int(view.data.ptr)) % GPU_ALIGN :]

    def import_shard(self, buffer: CupyArray, shape: Sequence[int], dtype: np.dtype, device: Device) -> Array:
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
        out = jax.dlpack.from_dlpack(Typed(typed, code, bits, self._s.join(o), o, self._cp.cuda))
        if out.dtype != dtype:
            raise TransferError(f"CupyBuffers.import_shard: asked jax for {dtype} and got {out.dtype}")
        return out

    def release(self) -> int:
        """Drop every exported DLPack view (so the jax buffers behind them can be donated
        again), the prepared launch tables, and hand CuPy's cached free blocks (the staging
        of the refit) back to the driver, so XLA can use them; returns how many views. The
        engine must hold no views or staging of its own by then. Not run on GPU."""
        n = len(self._views)
        self._views.clear()
        self._tables.clear()
        self._s.reset()
        self._cp.get_default_memory_pool().free_all_blocks()
        return n

    def _memory(self, ordinal: int) -> tuple[int, int]:
        cp = self._cp
        with cp.cuda.Device(ordinal):
            free, total = cp.cuda.runtime.memGetInfo()
        return free + cp.get_default_memory_pool().free_bytes(), total

    def _empty(self, nbytes: int, ordinal: int, what: str) -> CupyArray:
        """``nbytes`` uninitialised bytes from CuPy's pool on GPU ``ordinal`` (staging, mail), or an
        error that says how to make room.

        CuPy allocates outside XLA's allocator, and XLA preallocates 75% of each GPU's
        memory by default; the check counts what the device has free plus what CuPy's
        pool holds unused. Not run on GPU.

        Raises:
          TransferError: too little GPU memory (nothing was written).
        """
        cp = self._cp
        free, total = self._memory(ordinal)
        if nbytes > free:
            raise TransferError(_no_room(what, nbytes, ordinal, free, total), destination_intact=True)
        with cp.cuda.Device(ordinal), self._s.comm(ordinal):  # the pool reuses the block in this stream's order
            try:
                return cp.empty(nbytes, cp.uint8)
            except cp.cuda.memory.OutOfMemoryError as err:
                raise TransferError(_no_room(what, nbytes, ordinal, free, total), destination_intact=True) from err

    # ----- kernels -----------------------------------------------------------
    def staging(self, nbytes: int, device: Device = None) -> CupyArray:
        """A uint8 staging buffer on ``device`` (default: the current CuPy device), at most
        ``Options.staging_bytes`` (the schedule's bound); freed by :meth:`release`. Not run on GPU.

        Raises:
          TransferError: too little GPU memory, naming the XLA settings that leave room.
        """
        o = self._cp.cuda.Device().id if device is None else _ordinal(device)
        return self._empty(max(int(nbytes), 0), o, "staging")

    def upload(self, data: np.ndarray, device: Device) -> CupyArray:
        """``data`` (host uint8) copied into a new buffer on ``device``, on the comm stream
        (the mail of the per-process schedule, a few integers; a view's block-FP8 bytes
        quantised on the host, :mod:`jreshard.engine.viewrun`). Not run on GPU."""
        o = _ordinal(device)
        buf = self._empty(int(data.size), o, "uploaded host bytes")
        if data.size:
            with self._cp.cuda.Device(o):
                buf.set(np.ascontiguousarray(data, np.uint8), stream=self._s.comm(o))
        return buf

    def download(self, buffer: CupyArray) -> np.ndarray:
        """``buffer``'s bytes on the host, copied on the comm stream after what it ordered
        there (with ``NcclComm.buffers()``, the receives); a buffer other streams wrote
        (a source shard's producer, an unpack) is read after :meth:`synchronize`, as the
        block-FP8 jobs of :mod:`jreshard.engine.viewrun` do. Not run on GPU."""
        o = buffer.device.id
        with self._cp.cuda.Device(o):
            return np.asarray(buffer.get(stream=self._s.comm(o)))

    @staticmethod
    def _pointers(buffers: Sequence[Any]) -> list[int]:
        return [0 if b is None else int(b.data.ptr) for b in buffers]

    @staticmethod
    def _key(kind: str, kernel: str, table: np.ndarray, pointers: Sequence[int], staging: int) -> tuple:
        return (kind, kernel, table.__array_interface__["data"][0], table.shape, tuple(pointers), staging)

    @staticmethod
    def _launches(byte: np.ndarray, cast: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """The parts of a table (:func:`casts.split`) that launch a kernel: ``("copy", byte rows)``
        unless they are a few contiguous runs (``cudaMemcpyAsync``), ``("cast", cast rows)``."""
        out = [("copy", byte)] if len(byte) and not _plain(byte, byte) else []
        return out + ([("cast", cast)] if len(cast) else [])

    @staticmethod
    def _launch_table(kind: str, kernel: str, part: np.ndarray, pointers: list[int], staging: int) -> np.ndarray:
        m = CK if kernel == "copy" else CC
        if kind == "pack":
            return m.pack_launch(part, pointers, staging)
        return m.unpack_launch(part, staging, pointers)

    def prepare(self, jobs: Iterable[tuple[str, np.ndarray, Sequence[Any], Any]]) -> None:
        """Build the launch tables of every ``("pack" | "unpack", table, buffers, staging)`` of a
        schedule and upload them in one copy per GPU, before the first round; :meth:`pack` and
        :meth:`unpack` then launch them with no host work but the launch. Not run on GPU."""
        by_gpu: dict[int, list[tuple[tuple, np.ndarray]]] = {}
        for kind, table, buffers, staging in jobs:
            if len(table) == 0:
                continue
            ptrs = self._pointers(buffers)
            arena = int(staging.data.ptr)
            for kernel, part in self._launches(*CC.split(table)):
                key = self._key(kind, kernel, table, ptrs, arena)
                if key not in self._tables:
                    lt = self._launch_table(kind, kernel, part, ptrs, arena)
                    by_gpu.setdefault(staging.device.id, []).append((key, lt))
        for o, items in sorted(by_gpu.items()):
            with self._cp.cuda.Device(o):
                done = CK.upload([lt for _, lt in items], self._s.pack(o), self._cp)
            self.uploads += 1
            self._tables.update({key: d for (key, _), d in zip(items, done, strict=True)})

    def _run(
        self, kind: str, table: np.ndarray, buffers: Sequence[Any], staging: CupyArray, stream: CudaStream
    ) -> None:
        """The kernels of ``table`` on ``stream``: its byte rows (copies for a few contiguous runs, else
        the byte kernel), then its cast rows (the cast kernel)."""
        ptrs = self._pointers(buffers)
        arena = int(staging.data.ptr)
        byte, cast = CC.split(table)
        if len(byte) and _plain(byte, byte):
            at = _addresses(byte, ptrs)
            runs = [(arena + int(r[K.STAGE]), a, int(r[K.NBYTES])) for r, a in zip(byte, at, strict=True)]
            self._memcpy(runs if kind == "pack" else [(a, st, n) for st, a, n in runs], stream)
        for kernel, part in self._launches(byte, cast):
            found = self._tables.get(self._key(kind, kernel, table, ptrs, arena))
            m = CK if kernel == "copy" else CC
            if found is None:  # not prepared: built and uploaded now
                self.uploads += 1
                m.launch(self._launch_table(kind, kernel, part, ptrs, arena), stream, self._cp)
            else:
                m.launch_uploaded(*found, stream, self._cp)

    def _memcpy(self, pairs: Sequence[tuple[int, int, int]], stream: CudaStream) -> None:
        rt = self._cp.cuda.runtime
        for dst, src, n in pairs:
            rt.memcpyAsync(dst, src, n, rt.memcpyDeviceToDevice, stream.ptr)

    def pack(self, table: np.ndarray, buffers: Sequence[Any], staging: CupyArray) -> None:
        """One kernel launch (or a few ``cudaMemcpyAsync`` for contiguous runs) gathering ``table``'s
        pieces into ``staging``, on the pack stream. Not run on GPU."""
        if len(table) == 0:
            return
        o = staging.device.id
        arena = int(staging.data.ptr)
        reads_received = bool(np.any(table[:, K.BUF] % 2 == 1))  # a destination shard: bytes forwarded
        with self._cp.cuda.Device(o):
            s = self._s.before_pack(o, arena, reads_received)
            self._run("pack", table, buffers, staging, s)
            self._s.after_pack(o, arena)

    def unpack(self, table: np.ndarray, staging: CupyArray, buffers: Sequence[Any]) -> None:
        """One kernel launch (or a few ``cudaMemcpyAsync``) scattering ``staging`` into ``table``'s
        pieces, on the unpack stream after this round's receives (an event, no host wait). Not run on GPU."""
        if len(table) == 0:
            return
        o = staging.device.id
        arena = int(staging.data.ptr)
        with self._cp.cuda.Device(o):
            s = self._s.before_unpack(o, arena)
            self._run("unpack", table, buffers, staging, s)
            self._s.after_unpack(o, arena)

    def copy(self, src_table: np.ndarray, src: Sequence[Any], dst_table: np.ndarray, dst: Sequence[Any]) -> None:
        """Piece ``i`` of ``src_table`` into piece ``i`` of ``dst_table``, on the destination GPU's
        pack stream: ``cudaMemcpyAsync`` for a few contiguous runs, else one kernel reading other
        GPUs through peer access where the hardware allows it, else pack there,
        ``cudaMemcpyPeerAsync``, unpack here. Not run on GPU."""
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
                    event = self._s.pack(s).record()
                self._s.pack(d).wait_event(event)
            cast = st[:, K.CAST] != 0
            sb, db, sc, dc = st[~cast], dt[~cast], st[cast], dt[cast]
            with cp.cuda.Device(d):
                stream = self._s.before_pack(d, None, False)
                if len(sb) and _plain(sb, db):
                    pairs = zip(
                        _addresses(db, self._pointers(dst)),
                        _addresses(sb, self._pointers(src)),
                        sb[:, K.NBYTES],
                        strict=True,
                    )
                    self._memcpy([(int(a), int(b), int(n)) for a, b, n in pairs], stream)
                elif len(sb):
                    CK.launch(CK.copy_launch(sb, self._pointers(src), db, self._pointers(dst)), stream, cp)
                if len(sc):
                    CC.launch(CC.copy_launch(sc, self._pointers(src), dc, self._pointers(dst)), stream, cp)

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
        """Pack on GPU ``s`` (casting the cast rows there, into the destination's dtype), copy to GPU
        ``d``, and unpack there as bytes. Not run on GPU."""
        cp = self._cp
        nbytes = dst_table[:, K.NBYTES]  # what lands: the destination's dtype
        stage = np.concatenate([[0], np.cumsum(nbytes)[:-1]])
        st, dt = np.array(src_table), np.array(dst_table)
        st[:, K.STAGE] = stage
        dt[:, K.STAGE] = stage
        cast = st[:, K.CAST] != 0
        unpack = dt[~cast]
        if cast.any():
            unpack = np.concatenate([unpack, CC.byte_rows(dt[cast], CC.itemsizes(dt[cast])[1])])
        total = int(nbytes.sum())
        ps, pd = self._s.pack(s), self._s.pack(d)
        with cp.cuda.Device(s), ps:
            here = cp.empty(total, cp.uint8)
            CK.launch(CK.pack_launch(st[~cast], self._pointers(src), here.data.ptr), ps, cp)
            CC.launch(CC.pack_launch(st[cast], self._pointers(src), here.data.ptr), ps, cp)
            event = ps.record()
        with cp.cuda.Device(d), pd:
            there = cp.empty(total, cp.uint8)
            pd.wait_event(event)
            cp.cuda.runtime.memcpyPeerAsync(there.data.ptr, d, here.data.ptr, s, total, pd.ptr)
            CK.launch(CK.unpack_launch(unpack, there.data.ptr, self._pointers(dst)), pd, cp)
        pd.synchronize()  # ``here`` may be freed once the peer copy has run

    def fence(self) -> None:
        """Order the packs and unpacks issued so far before the next exchange on each GPU's comm
        stream, and release the staging arenas of the exchanges before it (events, no host
        wait). Not run on GPU."""
        self._s.fence()

    def synchronize(self) -> None:
        """Wait on the host, at most ``timeout_s``, for every kernel and copy issued on this
        backend's streams (with ``NcclComm.buffers()``: every send and receive too). Not run on GPU.

        Polls every 20 µs, backing off to 100 µs at most.

        Raises:
          TransferError: CUDA reported an error on a stream (e.g. an illegal address).
          TransferTimeoutError: not done within ``timeout_s``; the watcher was aborted.
          PeerError: the watcher reported an NCCL error.
        """
        cp = self._cp
        events = {}
        for o in self._s.ordinals():
            with cp.cuda.Device(o):
                for i, s in enumerate(self._s.streams(o)):
                    events[(o, i)] = s.record()
        deadline = time.monotonic() + self._timeout_s
        pause = POLL_MIN_S
        while events:
            for key in sorted(events):
                try:
                    done = event_done(events[key], cp.cuda.runtime)
                except cp.cuda.runtime.CUDARuntimeError as err:
                    if self._watcher is not None:
                        self._watcher.abort()
                    raise TransferError(
                        f"CupyBuffers: CUDA reported {err} on GPU {key[0]}", destination_intact=False
                    ) from err
                if done:
                    del events[key]
            if not events:
                return
            if self._watcher is not None:
                self._watcher.check_errors()
            if time.monotonic() > deadline:
                if self._watcher is not None:
                    self._watcher.abort()
                raise TransferTimeoutError(
                    f"CupyBuffers: the work on GPUs {sorted({o for o, _ in events})} did not finish within "
                    f"timeout_s={self._timeout_s}" + ("; communicators aborted" if self._watcher is not None else ""),
                    destination_intact=False,
                )
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)


def _plain(src_table: np.ndarray, dst_table: np.ndarray) -> bool:
    """Whether a table is a few contiguous runs on both sides: cheaper as ``cudaMemcpyAsync`` calls."""
    return len(src_table) <= MAX_PLAIN_COPIES and bool(
        np.all(src_table[:, K.NDIM] == 1) and np.all(dst_table[:, K.NDIM] == 1)
    )


def _addresses(table: np.ndarray, pointers: Sequence[int]) -> list[int]:
    """The address of each row's first byte in its buffer."""
    return [int(pointers[int(r[K.BUF])]) + int(r[K.OFF]) for r in table]
