"""The streams of :class:`~jreshard.cuda.buffers.CupyBuffers` on each GPU, and the events that link them.
Not run on GPU.

Three streams per GPU, none of them the legacy default stream:

- the **comm** stream: NCCL's (``NcclComm.stream``), where sends and receives run, and where
  JAX's stream waits before it reads an imported destination;
- the **pack** stream: packs into staging, and the same-device copies;
- the **unpack** stream: unpacks out of staging.

Staging is double-buffered (the engine alternates two arenas by round), so the pack of
round ``k + 1`` runs while round ``k`` is on the wire. The events:

- at each :meth:`fence` (before round ``k``'s exchange) an event on the comm stream marks the
  end of the exchanges up to round ``k - 1``: it *releases* the arenas those rounds used,
  and the comm stream then waits for the packs (and unpacks) issued so far;
- a pack into an arena waits for that arena's release and for the unpack that last read it,
  never for the exchange in flight, except where the engine has only one arena (the staging
  bound holds one): a pack into the arena of the exchange just posted waits for the comm
  stream as it is then, as that exchange still reads the arena; a pack that reads a destination shard (bytes received
  earlier and forwarded now) also waits for the comm and unpack streams, as they wrote it;
- an unpack waits for the comm stream as it is when the unpack is issued (the exchange of
  its round, just posted).

Everything is issued from the host in the engine's order, so "as it is when issued" is exact.
"""

from __future__ import annotations

from typing import Any

from jreshard.types import CudaStream, CupyModule

__all__ = ["GpuStreams"]


class GpuStreams:
    """Comm, pack and unpack streams per GPU, and the events of the staging arenas (final). Not run on GPU.

    Args:
      cupy: the ``cupy`` module (or the stand-in).
      comm: ``{CUDA ordinal: stream}`` to use as the comm streams (NCCL's); others are made.
    """

    __slots__ = ("_comm", "_cp", "_fences", "_last_unpack", "_pack", "_release", "_unpack", "_used")

    def __init__(self, cupy: CupyModule, comm: dict[int, Any] | None = None):
        self._cp = cupy
        self._comm: dict[int, Any] = dict(comm or {})
        self._pack: dict[int, Any] = {}
        self._unpack: dict[int, Any] = {}
        self._release: dict[int, list[Any]] = {}  # arena pointer -> events its next pack waits on
        self._used: dict[int, tuple[int, int]] = {}  # arena pointer -> (ordinal, fence count at its last pack)
        self._last_unpack: dict[int, Any] = {}
        self._fences = 0

    def _make(self, table: dict[int, Any], o: int) -> CudaStream:
        if o not in table:
            with self._cp.cuda.Device(o):
                table[o] = self._cp.cuda.Stream(non_blocking=True)
        return table[o]

    def comm(self, o: int) -> CudaStream:
        """The comm stream of GPU ``o`` (NCCL's, where it was given)."""
        return self._make(self._comm, o)

    def pack(self, o: int) -> CudaStream:
        return self._make(self._pack, o)

    def unpack(self, o: int) -> CudaStream:
        return self._make(self._unpack, o)

    def ordinals(self) -> list[int]:
        return sorted(set(self._comm) | set(self._pack) | set(self._unpack))

    def streams(self, o: int) -> list[Any]:
        return [t[o] for t in (self._comm, self._pack, self._unpack) if o in t]

    def before_pack(self, o: int, arena: int | None, reads_received: bool) -> CudaStream:
        """The pack stream of GPU ``o``, made to wait for what must finish before writing ``arena``
        (``None``: no staging, a same-device copy) and, if ``reads_received``, for the comm and unpack streams."""
        s = self.pack(o)
        with self._cp.cuda.Device(o):
            for event in self._release.pop(arena, []) if arena is not None else []:
                s.wait_event(event)
            used = self._used.get(arena) if arena is not None else None
            if used is not None and used[1] < self._fences:  # one arena: sent from since, not yet released
                s.wait_event(self.comm(used[0]).record())
            if reads_received:
                s.wait_event(self.comm(o).record())
                if o in self._unpack:
                    s.wait_event(self._unpack[o].record())
        return s

    def after_pack(self, o: int, arena: int | None) -> None:
        if arena is not None:
            self._used[arena] = (o, self._fences)

    def fence(self) -> None:
        """Before an exchange: release the arenas of the exchanges before it, and make each comm
        stream wait for the packs and unpacks issued so far."""
        for o in self.ordinals():
            with self._cp.cuda.Device(o):
                comm = self.comm(o)
                done = comm.record()  # the exchanges posted so far (the rounds before this one)
                for arena, (ao, at) in list(self._used.items()):
                    if ao == o and at < self._fences:
                        self._release.setdefault(arena, []).append(done)
                        del self._used[arena]
                for other in (self._pack, self._unpack):
                    if o in other:
                        comm.wait_event(other[o].record())
        self._fences += 1

    def before_unpack(self, o: int, arena: int) -> CudaStream:
        """The unpack stream of GPU ``o``, after the comm stream's work so far (this round's exchange)."""
        s = self.unpack(o)
        with self._cp.cuda.Device(o):
            s.wait_event(self.comm(o).record())
        return s

    def after_unpack(self, o: int, arena: int) -> None:
        with self._cp.cuda.Device(o):
            event = self.unpack(o).record()
        self._last_unpack[o] = event
        self._release.setdefault(arena, []).append(event)  # the next pack into the arena waits for it

    def join(self, o: int) -> CudaStream:
        """The comm stream of GPU ``o``, made to wait for the pack and unpack streams (before JAX reads)."""
        comm = self.comm(o)
        with self._cp.cuda.Device(o):
            for other in (self._pack, self._unpack):
                if o in other:
                    comm.wait_event(other[o].record())
        return comm

    def reset(self) -> None:
        """Forget the arenas' events (a refit ended: its staging is released)."""
        self._release.clear()
        self._used.clear()
        self._last_unpack.clear()
