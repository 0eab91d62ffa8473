"""In one process: :class:`LocalComm`, and the direct path with no messages at all.

When every rank's buffers are visible (a single-controller program on CPU
devices, or one host's GPUs), a transfer needs no staging and no messages:
each piece of each destination shard is copied straight from a source shard that
holds it (:class:`DirectProgram`). Each destination byte is written exactly once,
which is the memory-copy floor. :class:`LocalComm` runs the message-passing engine
in one process instead (the path MPI and NCCL take), for tests and comparisons.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
from collections.abc import Sequence

import numpy as np

from jreshard.errors import PeerError
from jreshard.nccl import kernels
from jreshard.nccl.comm import Communicator, RecvOp, SendOp
from jreshard.sharding.box import Box
from jreshard.sharding.layout import Layout
from jreshard.sharding.pieces import pieces_of, source_index

__all__ = ["DirectProgram", "LocalComm", "direct_copies", "match_and_copy"]


def match_and_copy(sends: Sequence[SendOp], recvs: Sequence[RecvOp]) -> list[tuple[SendOp, RecvOp]]:
    """Match every send to the receive with its ``(src, dst, tag)``, in listed order, and copy its bytes.

    Raises:
      PeerError: a send or receive has no partner, or partners differ in size.
    """
    waiting: dict[tuple[int, int, int], list[RecvOp]] = {}
    for r in recvs:
        waiting.setdefault((r.src, r.dst, r.tag), []).append(r)
    pairs = []
    for s in sends:
        queue = waiting.get((s.src, s.dst, s.tag))
        if not queue:
            raise PeerError(f"send {s.src}->{s.dst} tag {s.tag} ({len(s.buffer)} B) has no matching receive")
        r = queue.pop(0)
        if len(r.buffer) != len(s.buffer):
            raise PeerError(
                f"send {s.src}->{s.dst} tag {s.tag} has {len(s.buffer)} B but its receive expects {len(r.buffer)} B"
            )
        pairs.append((s, r))
    left = [k for k, q in waiting.items() if q]
    if left:
        raise PeerError(f"receives {left[:8]} (src, dst, tag) have no matching send in this group")
    for s, r in pairs:
        r.buffer[...] = s.buffer
    return pairs


class LocalComm(Communicator):
    """Message passing between ranks of one process: a send is a copy into the matching receive (final).

    Example:
      >>> import numpy as np
      >>> comm = LocalComm(ranks=[0, 1])
      >>> a, b = np.arange(4, dtype=np.uint8), np.zeros(4, np.uint8)
      >>> comm.exchange([SendOp(0, 1, 7, a)], [RecvOp(0, 1, 7, b)], timeout_s=1.0)
      >>> b.tolist()
      [0, 1, 2, 3]
    """

    def __init__(self, ranks: Sequence[int]):
        self._ranks = tuple(sorted(int(r) for r in ranks))

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self._ranks

    def exchange(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> None:
        outside = sorted(({s.src for s in sends} | {r.dst for r in recvs}) - set(self._ranks))
        if outside:
            raise PeerError(f"LocalComm over ranks {self._ranks} was given ops of ranks {outside}")
        match_and_copy(sends, recvs)


@functools.lru_cache(maxsize=8192)
def direct_copies(src: Layout, dst: Layout) -> tuple[tuple[int, int, Box], ...]:
    """The direct copies of one tensor: ``(dst_rank, src_rank, box)`` for every piece of every
    destination shard, from a source rank holding it (the same rank when it does, else the
    holders in turn).

    >>> import numpy as np
    >>> a = Layout.from_mesh(np.arange(2), ("x",), ("x",), (4,), "int8")
    >>> b = Layout.from_mesh(np.arange(2, 4), ("x",), (None,), (4,), "int8")
    >>> direct_copies(a, b)[:2]
    ((2, 0, Box(lo=(0,), hi=(2,))), (2, 1, Box(lo=(2,), hi=(4,))))
    """
    sidx = source_index(src)
    out = []
    for q, r in enumerate(dst.ranks):
        for k, (box, j) in enumerate(pieces_of(dst.box_of(r), sidx)):
            if box.volume == 0:
                continue
            holders = sidx.holders[j]
            h = r if r in holders else holders[(q + k) % len(holders)]
            out.append((r, h, box))
    return tuple(out)


_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jreshard-copy")
    return _POOL


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class DirectProgram:
    """Direct copies for many tensors, as two descriptor tables cut into balanced parts.

    Row ``i`` of ``src_table`` (buffer index into the source buffer list) is copied
    into row ``i`` of ``dst_table`` (buffer index into the destination buffer list).
    Rows are ordered by source position (:func:`kernels.by_source`), so the copies
    of one source piece into its destination replicas run back to back and the
    second one reads from cache. ``parts`` are row ranges of near-equal bytes, one
    per copy thread: numpy's copies release the GIL, so on a multi-core host they
    run in parallel.
    """

    src_table: np.ndarray
    dst_table: np.ndarray
    parts: tuple[tuple[int, int], ...]
    nbytes: int

    @classmethod
    def build(
        cls,
        pairs: Sequence[tuple[int, Sequence[int], Box, int, Sequence[int], Box]],
        *,
        threads: int | None = None,
        min_part_bytes: int = 4 << 20,
    ) -> DirectProgram:
        """From ``(src_buf, src_byte_shape, src_box, dst_buf, dst_byte_shape, dst_box)`` pairs
        (see :func:`kernels.build_copy_tables`)."""
        st, dt = kernels.by_source(*kernels.build_copy_tables(pairs))
        total = kernels.table_bytes(dt)
        # Every core: one core's strided copies reach about half of the memory bandwidth (6.6 GB/s
        # for 4 KiB rows on the development host, 12.0 GB/s with two threads when the second core
        # is idle). On a host whose other cores are busy, extra threads do not pay: set
        # Options(copy_threads=1).
        threads = threads or max(1, os.cpu_count() or 1)
        n = max(1, min(threads, total // max(min_part_bytes, 1)))
        if n > 1:
            st, dt = kernels.split_rows(st, dt, -(-total // (2 * n)))
        return cls(st, dt, kernels.balanced_parts(dt, n), total)

    def run(self, src: Sequence[object], dst: Sequence[object]) -> None:
        """Copy, with one thread per part."""
        if len(self.parts) <= 1:
            kernels.copy_cpu(self.src_table, src, self.dst_table, dst)
            return
        pool = _pool(len(self.parts))
        futures = [
            pool.submit(kernels.copy_cpu, self.src_table[a:b], src, self.dst_table[a:b], dst) for a, b in self.parts
        ]
        for f in futures:
            f.result()
