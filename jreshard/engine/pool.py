"""BufferPool: destination buffers that jax has released, handed out again warm.

Why. On the CPU hosts jreshard is measured on, writing into freshly allocated
memory runs at a third of the speed of writing into memory the process already
touched: every new page is faulted in and zeroed (and, in a VM, backed by the
host) on first touch. ``jax.device_put`` hides this because glibc recycles the
freed shards of the previous call from its heap (shards under glibc's 32 MiB
mmap threshold); jreshard makes the recycling explicit, for every size.

How. :meth:`BufferPool.take` returns a 1-D ``uint8`` numpy array that owns no
memory of its own: it is a view of a raw, ``ALIGN``-aligned block that the pool
keeps. Every view derived from it (the typed array handed to
``jax.dlpack.from_dlpack``, its DLPack capsule, slices) keeps the lease alive,
because numpy stops collapsing view chains at the lease, whose base is a
memoryview. When the last of them dies (jax deleted the imported array and
called the DLPack deleter), a ``weakref.finalize`` hook puts the raw block back
on the free list of its size, and the next ``take`` of that size gets it: warm
memory, no page faults. A block is never handed out while anything can still
read or write it through an earlier lease.

Blocks are matched by exact size (rounded up to ``ALIGN``), which is what a
refit loop asks for: the same shapes every step. The pool holds at most
``max_bytes`` of released blocks (``None``: no cap); :meth:`clear` frees them.
Finalizers may run on any thread that drops the last reference, so they only
append to a deque; every other change happens under a lock.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from collections.abc import Sequence

import numpy as np

from jreshard.options import as_int

__all__ = ["SHARED_BELOW", "BufferPool", "PoolStats", "default_pool", "staging_pool"]

ALIGN = 64  # bytes; jax imports CPU buffers zero-copy only at this alignment
SHARED_BELOW = 1 << 20  # bytes; :meth:`BufferPool.take_many` cuts buffers under this from one block per call


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PoolStats:
    """A snapshot of a :class:`BufferPool`.

    Attributes:
      retained_bytes: bytes of released blocks the pool holds, ready to hand out.
      leased_bytes: bytes handed out and not yet released.
      hits: ``take`` calls served with a released block (warm memory).
      misses: ``take`` calls that allocated a new block (fresh memory).
      fresh_bytes: bytes allocated by the misses.
    """

    retained_bytes: int
    leased_bytes: int
    hits: int
    misses: int
    fresh_bytes: int


def _aligned_block(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    skip = (-raw.ctypes.data) % ALIGN
    return raw[skip : skip + nbytes]


class BufferPool:
    """Hands out aligned 1-D ``uint8`` buffers and takes them back when their last view dies (final).

    Args:
      max_bytes: the most bytes of released blocks kept for reuse (``None``: no cap).
        A released block that would exceed it is freed instead.

    Example:
      >>> pool = BufferPool()
      >>> a = pool.take(1000)
      >>> typed = a.view(np.float32).reshape(10, 25)   # a derived view keeps the lease
      >>> addr = a.ctypes.data
      >>> del a
      >>> pool.stats().retained_bytes
      0
      >>> del typed                                     # the last view: the block comes back
      >>> pool.take(1000).ctypes.data == addr, pool.stats().hits
      (True, 1)
    """

    __slots__ = ("_free", "_fresh", "_hits", "_leased", "_lock", "_max", "_misses", "_retained", "_returned")

    def __init__(self, *, max_bytes: int | None = None):
        limit = None if max_bytes is None else as_int(max_bytes)
        if max_bytes is not None and (limit is None or limit < 0):
            raise ValueError(f"BufferPool: max_bytes={max_bytes!r} must be None or an int >= 0")
        self._max = limit
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}
        self._returned: collections.deque[tuple[int, np.ndarray]] = collections.deque()
        self._retained = self._leased = self._hits = self._misses = self._fresh = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A 1-D ``uint8`` buffer of ``nbytes``, ``ALIGN``-aligned, uninitialised (a released block when one fits)."""
        n = int(nbytes)
        if n < 0:
            raise ValueError(f"BufferPool.take: nbytes={nbytes!r} must be >= 0")
        key = -(-n // ALIGN) * ALIGN
        with self._lock:
            self._drain()
            free = self._free.get(key)
            if free:
                raw = free.pop()
                self._retained -= key
                self._hits += 1
            else:
                raw = None
                self._misses += 1
                self._fresh += key
            self._leased += key
        if raw is None:
            raw = _aligned_block(key)
        lease = np.frombuffer(memoryview(raw), dtype=np.uint8)  # type: ignore[arg-type]  # numpy arrays are buffers
        fin = weakref.finalize(lease, self._returned.append, (key, raw))
        fin.atexit = False
        return lease[:n]

    def take_many(self, sizes: Sequence[int]) -> list[np.ndarray]:
        """Buffers of ``sizes`` bytes, as :meth:`take` gives one, where those under ``SHARED_BELOW`` are cut from one
        block (each ``ALIGN``-aligned): one lease for all the small ones, whose block comes back when the last of
        them dies, and a lease of its own for each larger one. A call for many small shards (a tree of many leaves)
        then costs one lease, where a lease costs microseconds; a buffer that outlives the others holds at most
        the small ones' block.

        Example:
          >>> pool = BufferPool()
          >>> a, b, c = pool.take_many([100, 3 << 20, 7])
          >>> aligned = all(x.ctypes.data % ALIGN == 0 for x in (a, b, c))
          >>> (a.size, b.size, c.size), c.ctypes.data - a.ctypes.data, aligned
          ((100, 3145728, 7), 128, True)
        """
        out: list[np.ndarray | None] = [None] * len(sizes)
        small, starts, pos = [], [], 0
        for i, n in enumerate(sizes):
            n = int(n)
            if n < 0:
                raise ValueError(f"BufferPool.take_many: sizes[{i}]={n} must be >= 0")
            if n < SHARED_BELOW:
                small.append(i)
                starts.append(pos)
                pos += max(ALIGN, -(-n // ALIGN) * ALIGN)
            else:
                out[i] = self.take(n)
        if small:
            block = self.take(pos)
            for i, st in zip(small, starts, strict=True):
                out[i] = block[st : st + int(sizes[i])]
        return out  # type: ignore[return-value]

    def _drain(self) -> None:
        while self._returned:
            key, raw = self._returned.popleft()
            self._leased -= key
            if self._max is not None and self._retained + key > self._max:
                continue  # over the cap: let it go
            self._free.setdefault(key, []).append(raw)
            self._retained += key

    def stats(self) -> PoolStats:
        """Counters after taking back every block released so far."""
        with self._lock:
            self._drain()
            return PoolStats(
                retained_bytes=self._retained,
                leased_bytes=self._leased,
                hits=self._hits,
                misses=self._misses,
                fresh_bytes=self._fresh,
            )

    def clear(self) -> int:
        """Free every retained block; returns the bytes freed. Leased buffers are not affected."""
        with self._lock:
            self._drain()
            freed, self._retained = self._retained, 0
            self._free.clear()
        return freed


_DEFAULT = BufferPool()
_STAGING = BufferPool()


def default_pool() -> BufferPool:
    """The process-wide pool that ``jreshard.transfer`` allocates destination shards from on CPU.

    Call ``default_pool().clear()`` to give its retained memory back.
    """
    return _DEFAULT


def staging_pool() -> BufferPool:
    """The process-wide pool that the engine's staging arenas come from on CPU.

    A refit asks for the same arenas every step: from here they come back warm (no page faults in
    the first pack), at the same addresses, so a transport that registers memory (NIXL) registers
    each once. Kept apart from :func:`default_pool`, whose counts are the reports' fresh destination
    bytes. Call ``staging_pool().clear()`` to give its retained memory back.
    """
    return _STAGING
