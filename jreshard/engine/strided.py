"""Batched strided copies between raw CPU buffers: the in-process copy kernel.

A *copy class* is a set of pieces with one geometry: every piece is ``outer``
(a tuple of extents) blocks of ``run`` contiguous bytes, read with byte strides
``src_strides`` and written with byte strides ``dst_strides``. Pieces of one class
differ only in their two start addresses. A pytree of a thousand leaves that share
a layout pair gives a handful of classes with a thousand pieces each, so the copy
costs one numpy call per class and chunk, not one per piece:

- each side is seen as one numpy array over the address range its pieces touch
  (``__array_interface__`` over raw memory, no copy), of shape
  ``(span, *outer)`` and strides ``(1, *strides)`` with a ``V{run}`` (raw bytes)
  element, so "the piece starting at byte ``a``" is row ``a - base``;
- ``dst[rows_d] = src[rows_s]`` copies a chunk of pieces (a gather into a
  cache-sized temporary, then a scatter), with the GIL released, on two threads
  when the machine has two cores.

Where the compiled kernel was built (``_strided.c``, :func:`compiled`), a chunk of pieces is
one call of it instead: each run is copied straight from source to destination (no
temporary), runs of 256 bytes or more with streaming stores in calls that move at least
:data:`STREAM_MIN` bytes, and the GIL is released for the whole chunk. numpy's copies are the
reference it is tested against.

A :class:`Copier` starts a call's copies and returns at once: the compiled kernel's chunks run on
threads of its own (``_strided.Copies``) that never take the GIL, so the caller's Python work (making
the result arrays of a many-leaf call) runs beside them, where a copy thread of the pool would wait
for the GIL before each chunk; :meth:`Copier.wait` copies what is left on the calling thread too and
returns when every byte is written.

Large pieces (:data:`LARGE_PIECE`) are copied one by one with ``np.copyto`` on
views of the piece itself, cut along their outermost extent across threads.

Addresses come from the lowering (:mod:`jreshard.engine.copies`), which checks every
piece against the byte size of the shard it reads and the one it writes
(:func:`jreshard.sharding.dtypes.storage_bytes`). With the environment variable
``JRESHARD_CHECK_BOUNDS=1`` every copy also checks, before it runs, that each piece lies
inside one of the buffers the caller names (:class:`AddressRanges`), and raises
:class:`~jreshard.errors.TransferError` before writing anything otherwise: a debug mode,
for tests run under ``MALLOC_CHECK_=3`` and for new transports.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "LARGE_PIECE",
    "STREAM_MIN",
    "THREAD_MIN",
    "AddressRanges",
    "CopyClass",
    "Copier",
    "checking_bounds",
    "compiled",
    "copy_classes",
    "executor",
    "raw_view",
    "run_shared",
    "threads_for",
]

LARGE_PIECE = 256 << 10  # bytes: pieces at least this big are copied one by one
_CHUNK_BYTES = 1 << 20  # bytes of pieces per gather/scatter call: the temporary stays in cache
_MAX_VIEW_BYTES = 1 << 60  # numpy refuses arrays whose size in bytes overflows its index type
_KERNEL_CHUNK_BYTES = 4 << 20  # bytes of pieces per compiled call (no temporary: only the balance of threads)
STREAM_MIN = 1 << 20  # bytes: a class that moves at least this much is written with streaming stores
THREAD_MIN = 1 << 20  # bytes: a Copier with no thread yet copies less than this itself, at once

_kernel_module: ModuleType | None
try:
    from jreshard.engine import _strided as _kernel_module
except ImportError:  # not built (no compiler, or a checkout run in place): numpy's copies
    _kernel_module = None
_KERNEL: Any = _kernel_module


def compiled() -> bool:
    """Whether the compiled strided copies (``jreshard/engine/_strided.c``) were built and load."""
    return _KERNEL is not None


class _Raw:
    """An ``__array_interface__`` over raw memory (numpy reads the pointer, nothing is copied)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, addr: int, shape: tuple[int, ...], strides: tuple[int, ...], typestr: str):
        self.__array_interface__ = {
            "version": 3,
            "data": (int(addr), False),
            "shape": shape,
            "strides": strides,
            "typestr": typestr,
        }


def raw_view(addr: int, shape: tuple[int, ...], strides: tuple[int, ...], typestr: str = "|u1") -> np.ndarray:
    """A writable numpy view of raw memory at ``addr`` (the caller guarantees it is valid)."""
    return np.asarray(_Raw(addr, tuple(shape), tuple(strides), typestr))


@dataclasses.dataclass(frozen=True, slots=True)
class CopyClass:
    """Pieces of one geometry: ``outer`` blocks of ``run`` bytes, strided on each side.

    Attributes:
      run: contiguous bytes per block (the innermost, merged extent).
      outer: block counts, outermost first (``()`` for one block).
      src_strides, dst_strides: byte strides of ``outer`` on each side.
    """

    run: int
    outer: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...]

    @property
    def piece_bytes(self) -> int:
        return self.run * math.prod(self.outer)

    def extent(self, strides: tuple[int, ...]) -> int:
        """Bytes from a piece's first byte to one past its last, with these strides."""
        return sum((n - 1) * s for n, s in zip(self.outer, strides, strict=True)) + self.run


def checking_bounds() -> bool:
    """Whether ``JRESHARD_CHECK_BOUNDS`` asks every copy to check its pieces against their buffers."""
    return os.environ.get("JRESHARD_CHECK_BOUNDS", "") not in ("", "0")


@dataclasses.dataclass(frozen=True, slots=True)
class AddressRanges:
    """Raw buffers as sorted, disjoint ``[start, end)`` address ranges, for the bounds check.

    Example:
      >>> b = AddressRanges.of([(100, 116), (200, 204)])
      >>> b.outside(np.array([100, 112, 201]), 4).tolist()
      [False, False, True]
    """

    starts: np.ndarray
    ends: np.ndarray

    @classmethod
    def of(cls, ranges: list[tuple[int, int]]) -> AddressRanges:
        r = sorted((int(a), int(b)) for a, b in ranges if b > a)
        return cls(np.array([a for a, _ in r], np.int64), np.array([b for _, b in r], np.int64))

    def outside(self, addrs: np.ndarray, extent: int) -> np.ndarray:
        """Per piece starting at ``addrs`` and ``extent`` bytes long, whether no single buffer holds it."""
        k = np.searchsorted(self.starts, addrs, side="right") - 1
        ok = (k >= 0) & (addrs + extent <= self.ends[np.maximum(k, 0)])
        return ~ok


def _check_bounds(
    work: list[tuple[CopyClass, np.ndarray, np.ndarray]], bounds: tuple[AddressRanges, AddressRanges]
) -> None:
    from jreshard.errors import TransferError

    src_bufs, dst_bufs = bounds
    for cls, src, dst in work:
        if not len(src) or cls.piece_bytes == 0:
            continue
        for side, addrs, bufs, strides in (
            ("read", src, src_bufs, cls.src_strides),
            ("write", dst, dst_bufs, cls.dst_strides),
        ):
            bad = bufs.outside(addrs, cls.extent(strides))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise TransferError(
                    f"bounds check: a copy would {side} {cls.extent(strides)} bytes at {int(addrs[i]):#x}, outside "
                    f"every buffer it was given ({int(bad.sum())} of {len(addrs)} pieces of {cls}); nothing was copied"
                )


_THREADS: concurrent.futures.ThreadPoolExecutor | None = None


def _cores() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def threads_for(threads: int | None) -> int:
    """Copy threads to use for ``Options.copy_threads``: ``None`` is one per core (up to 8), never above the cores."""
    return _cores() if threads is None else max(1, min(int(threads), _cores()))


def executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process's copy threads (one per core, up to 8), shared by every in-process copy."""
    global _THREADS
    if _THREADS is None:
        _THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=_cores(), thread_name_prefix="jreshard-copy")
    return _THREADS


def _kernel_calls(cls: CopyClass, src: np.ndarray, dst: np.ndarray, threads: int) -> list[tuple[Any, ...]]:
    """The compiled kernel's calls that copy pieces ``src[i] -> dst[i]`` (absolute addresses), a chunk of
    pieces a call (at least one chunk per thread): ``copy_pieces`` arguments, then the two address
    tables the first two of them point into (whoever runs the call keeps them alive until it ends)."""
    src = np.ascontiguousarray(src, dtype=np.int64)
    dst = np.ascontiguousarray(dst, dtype=np.int64)
    n = len(src)
    stream = cls.piece_bytes * n >= STREAM_MIN
    step = max(1, min(_KERNEL_CHUNK_BYTES // max(cls.piece_bytes, 1), -(-n // threads)))
    outer, ss, ds = cls.outer, cls.src_strides, cls.dst_strides
    calls = []
    for a in range(0, n, step):
        b = min(a + step, n)
        s, d = src[a:b], dst[a:b]
        calls.append((s.ctypes.data, d.ctypes.data, b - a, cls.run, outer, ss, ds, stream, (s, d)))
    return calls


def _compiled(cls: CopyClass, src: np.ndarray, dst: np.ndarray, threads: int) -> list[Callable[[], None]]:
    """Jobs that copy pieces ``src[i] -> dst[i]`` (absolute addresses) with the compiled kernel, a chunk of
    pieces a call (at least one chunk per thread)."""
    kernel = _KERNEL

    def job(call: tuple[Any, ...]) -> Callable[[], None]:
        # (the closure keeps the address tables, call[-1], alive while the call runs)
        return lambda: kernel.copy_pieces(*call[:-1])

    return [job(call) for call in _kernel_calls(cls, src, dst, threads)]


def _batched(cls: CopyClass, src: np.ndarray, dst: np.ndarray, threads: int) -> list[Callable[[], None]]:
    """Jobs that copy pieces ``src[i] -> dst[i]`` (absolute addresses): the compiled kernel's where it was
    built, else through fancy indexing."""
    if _KERNEL is not None and len(cls.outer) <= 8:
        return _compiled(cls, src, dst, threads)
    jobs: list[Callable[[], None]] = []
    lo_s, lo_d = int(src.min()), int(dst.min())
    span_s = int(src.max()) - lo_s + 1
    span_d = int(dst.max()) - lo_d + 1
    typestr = f"|V{cls.run}"
    # The address-range view has one row per byte; its nominal size must fit numpy's index type.
    nominal = max(span_s, span_d) * cls.piece_bytes
    if nominal >= _MAX_VIEW_BYTES:
        return _one_by_one(cls, src, dst, threads)
    sv = np.asarray(_Raw(lo_s, (span_s, *cls.outer), (1, *cls.src_strides), typestr))
    dv = np.asarray(_Raw(lo_d, (span_d, *cls.outer), (1, *cls.dst_strides), typestr))
    rs, rd = src - lo_s, dst - lo_d
    step = max(1, _CHUNK_BYTES // max(cls.piece_bytes, 1))
    bounds = [(a, min(a + step, len(rs))) for a in range(0, len(rs), step)]
    n = min(threads, len(bounds))
    for k in range(n):
        mine = bounds[k::n]

        def job(mine: list[tuple[int, int]] = mine) -> None:
            for a, b in mine:
                dv[rd[a:b]] = sv[rs[a:b]]

        jobs.append(job)
    return jobs


def _one_by_one(cls: CopyClass, src: np.ndarray, dst: np.ndarray, threads: int) -> list[Callable[[], None]]:
    """Jobs that copy each piece with ``np.copyto``, big pieces cut along their outermost extent."""
    shape = (*cls.outer, cls.run)
    s_str, d_str = (*cls.src_strides, 1), (*cls.dst_strides, 1)
    n = threads
    cuts = n if cls.outer and cls.outer[0] >= n and cls.piece_bytes >= 4 * LARGE_PIECE else 1
    jobs: list[Callable[[], None]] = []

    def job(a: int, b: int, part: tuple[int, ...]) -> Callable[[], None]:
        return lambda: np.copyto(raw_view(b, part, d_str), raw_view(a, part, s_str))

    for a, b in zip(src.tolist(), dst.tolist(), strict=True):
        if cuts == 1:
            jobs.append(job(a, b, shape))
            continue
        rows = cls.outer[0]
        for k in range(cuts):
            r0, r1 = rows * k // cuts, rows * (k + 1) // cuts
            jobs.append(job(a + r0 * s_str[0], b + r0 * d_str[0], (r1 - r0, *shape[1:])))
    return jobs


def copy_classes(
    work: list[tuple[CopyClass, np.ndarray, np.ndarray]],
    threads: int | None = None,
    bounds: tuple[AddressRanges, AddressRanges] | None = None,
) -> int:
    """Copy every piece of every class; returns the bytes copied.

    Args:
      work: ``(class, src_addresses, dst_addresses)``; the address arrays are int64,
        one entry per piece. Pieces of one call must not overlap on the destination
        side, nor read bytes another piece of the call writes.
      threads: copy threads (numpy's copies release the GIL); ``None``: one per core, up to 8.
      bounds: the buffers pieces may read and write; when given, every piece is checked
        against them before anything is copied (the ``JRESHARD_CHECK_BOUNDS`` mode).

    Raises:
      TransferError: (with ``bounds``) a piece lies outside every buffer; nothing was copied.
    """
    if bounds is not None:
        _check_bounds(work, bounds)
    threads = threads_for(threads)
    jobs: list[Callable[[], None]] = []
    total = 0
    for cls, src, dst in work:
        if not len(src) or cls.piece_bytes == 0:
            continue
        total += cls.piece_bytes * len(src)
        if cls.piece_bytes >= LARGE_PIECE or len(src) == 1:
            jobs.extend(_one_by_one(cls, src, dst, threads))
        else:
            jobs.extend(_batched(cls, src, dst, threads))
    if len(jobs) <= 1 or threads == 1 or total < (1 << 20):
        for job in jobs:
            job()
        return total
    run_shared(jobs, threads)
    return total


class Copier:
    """Copies that run while their caller goes on: :meth:`start` queues work and returns, :meth:`wait`
    returns once every piece is written. The caller must reach :meth:`wait` (in a ``finally``) before it
    lets go of, or hands out, any buffer the copies read or write.

    The compiled kernel's chunks run on up to ``threads - 1`` threads of its own (``_strided.Copies``,
    one more started with each chunk queued) that never take the GIL, and on the calling thread in
    :meth:`wait`. What is not worth a thread (less than :data:`THREAD_MIN` bytes in a copier that has none
    yet), large pieces (copied one by one) and every piece where the kernel was not built are copied in
    :meth:`start`, before it returns.

    Example:
      >>> src, dst = np.arange(1 << 20, dtype=np.uint8), np.zeros(1 << 20, np.uint8)
      >>> cls = CopyClass(run=4096, outer=(), src_strides=(), dst_strides=())
      >>> at = np.arange(256, dtype=np.int64) * 4096
      >>> copier = Copier(threads=2)
      >>> copier.start([(cls, src.ctypes.data + at, dst.ctypes.data + at)])
      >>> copier.wait()
      >>> bool((src == dst).all())
      True
    """

    __slots__ = ("_batch", "threads")

    def __init__(self, threads: int | None = None):
        self.threads = threads_for(threads)
        self._batch: Any = None

    def start(
        self,
        work: list[tuple[CopyClass, np.ndarray, np.ndarray]],
        bounds: tuple[AddressRanges, AddressRanges] | None = None,
    ) -> None:
        """Begin copying every piece of every class of ``work`` (as :func:`copy_classes` copies them).

        Raises:
          TransferError: (with ``bounds``) a piece lies outside every buffer; nothing of ``work`` was copied.
        """
        if bounds is not None:
            _check_bounds(work, bounds)
        # (A kernel built before the batches has none: its pieces are copied here, as copy_classes does.)
        batch_type: Any = getattr(_KERNEL, "Copies", None)
        now: list[tuple[CopyClass, np.ndarray, np.ndarray]] = []
        later: list[tuple[CopyClass, np.ndarray, np.ndarray]] = []
        for cls, src, dst in work:
            if not len(src) or cls.piece_bytes == 0:
                continue
            queued = batch_type is not None and cls.piece_bytes < LARGE_PIECE and len(src) > 1 and len(cls.outer) <= 8
            (later if queued else now).append((cls, src, dst))
        if self._batch is None and sum(c.piece_bytes * len(s) for c, s, _ in later) < THREAD_MIN:
            now, later = now + later, []
        for cls, src, dst in later:
            if self._batch is None:
                self._batch = batch_type(self.threads - 1)
            for call in _kernel_calls(cls, src, dst, self.threads):
                self._batch.post(*call)
        copy_classes(now, self.threads)

    def wait(self) -> None:
        """Copy what is still queued on this thread too; return once every piece started is written."""
        batch, self._batch = self._batch, None
        if batch is not None:
            batch.wait()


def run_shared(jobs: list[Callable[[], None]], threads: int) -> None:
    """Run ``jobs`` on ``threads`` threads that take the next job as each finishes: the calling thread
    and ``threads - 1`` pool threads (the caller is already on a core; a woken pool thread may wait
    milliseconds for one on a busy host). Returns when every job has ended; the first error is raised.

    >>> out = []
    >>> run_shared([lambda i=i: out.append(i) for i in range(5)], 2)
    >>> sorted(out)
    [0, 1, 2, 3, 4]
    """
    lock, pending = threading.Lock(), list(reversed(jobs))

    def work() -> None:
        while True:
            with lock:
                if not pending:
                    return
                job = pending.pop()
            job()

    # The caller takes the first (largest) job before a pool thread can: it is on a core already, and so
    # it always does a share of the work, however late the pool threads wake.
    first = pending.pop() if pending else None
    futures = [executor().submit(work) for _ in range(min(threads, len(jobs)) - 1)]
    try:
        if first is not None:
            first()
        work()
    finally:
        concurrent.futures.wait(futures)  # no thread is left writing, whatever failed
    for f in futures:
        f.result()
