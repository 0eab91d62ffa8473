"""Gather-and-broadcast over MPI's own collectives, for side-by-side measurement with jreshard.

Per tensor: every source process sends its shards to one root source process
(``Gatherv``), which assembles the full tensor; the root broadcasts the full
tensor to every destination process (``Bcast`` over a communicator of the root
and the destination processes); each destination keeps its slices. This is the
seed baseline (gather-broadcast), executed with MPI's collectives rather than through
jreshard's engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from jreshard.sharding.layout import Layout
from jreshard.types import MpiCommunicator

__all__ = ["GatherBroadcast"]


class GatherBroadcast:
    """The baseline between fixed sets of source and destination processes (final).

    Args:
      comm: an intracommunicator spanning both sides.
      sources: the source processes; the lowest is the root.
      destinations: the destination processes.

    Collective: every process of ``comm`` constructs it and calls :meth:`run`.
    """

    def __init__(self, comm: MpiCommunicator, sources: Sequence[int], destinations: Sequence[int]):
        self.comm = comm
        me = comm.Get_rank()
        self.sources, self.destinations = sorted(sources), sorted(destinations)
        self.root = self.sources[0]  # rank 0 of the gather communicator (ranks keep world order)
        self.gather_comm = comm.Split(0 if me in self.sources else 1, me)
        in_bcast = me == self.root or me in self.destinations
        self.bcast_comm = comm.Split(0 if in_bcast else 1, 0 if me == self.root else me + 1)
        self.wire_bytes = 0  # bytes this process sent

    def run(
        self,
        layouts: Sequence[tuple[Layout, Layout]],
        rank_process: Mapping[int, int],
        local_sources: Mapping[tuple[int, int], np.ndarray],
    ) -> dict[tuple[int, int], np.ndarray]:
        """Move every tensor; returns ``{(tensor, rank): destination shard}`` for this process's ranks."""
        me = self.comm.Get_rank()
        out: dict[tuple[int, int], np.ndarray] = {}
        for t, (src, dst) in enumerate(layouts):
            # Only the root and the destinations hold the full tensor (the others keep an empty stand-in).
            full = np.empty(src.shape if me in (self.root, *self.destinations) else (0,), src.np_dtype)
            if me in self.sources:
                # One replica per source box: the lowest rank holding it.
                owners = {b: min(rs) for b, rs in src.replica_groups()}
                mine = [(b, r) for b, r in sorted(owners.items()) if rank_process[r] == me]
                send = (
                    np.concatenate([local_sources[(t, r)].reshape(-1) for _, r in mine])
                    if mine
                    else np.zeros(0, src.np_dtype)
                )
                counts = self.gather_comm.gather(send.size, root=0)
                recv = np.empty(sum(counts) if me == self.root else 0, src.np_dtype)
                self.gather_comm.Gatherv(send, [recv, counts] if me == self.root else None, root=0)
                if me != self.root:
                    self.wire_bytes += send.nbytes
                else:
                    order = sorted(owners.items(), key=lambda kv: (self.sources.index(rank_process[kv[1]]), kv[0]))
                    pos = 0
                    for b, _ in order:
                        n = b.volume
                        full[b.slices()] = recv[pos : pos + n].reshape(b.shape)
                        pos += n
            if me in (self.root, *self.destinations):
                self.bcast_comm.Bcast(full, root=0)
                if me == self.root:
                    self.wire_bytes += full.nbytes * (self.bcast_comm.Get_size() - 1)
                for r, b in zip(dst.ranks, dst.boxes, strict=True):
                    if rank_process[r] == me:
                        out[(t, r)] = np.ascontiguousarray(full[b.slices()])
        return out
