"""The engine over MpiComm, one jreshard rank per process, with bounded exchange groups.

Every process builds the same seeded refit of small tensors (half the ranks hold the source, the
other half the destination, domains of 4 ranks), runs the engine with ``max_group_ops`` from
``JRESHARD_MAX_GROUP_OPS`` (default: the Options default), checks its destination shards byte for
byte against numpy, and reports the bytes it sent and the operations of every exchange it posted.
``case`` is imported by the single-process tests too.
"""

from __future__ import annotations

import os

import numpy as np

SENTINEL = 0xA5


def case(n_ranks: int):
    """(plan, layout pairs, global arrays): 6 tensors with 1-d to 3-d shapes, sharded many ways."""
    import jreshard
    from jreshard.sharding.layout import Layout

    half = n_ranks // 2
    src_ranks, dst_ranks = np.arange(half), np.arange(half, n_ranks)
    rng = np.random.default_rng(7)
    pairs, globals_ = [], []
    shapes = [
        (half * 4,),
        (half * 2, half * 2),
        (half * 2, 2, half),
        (half, 3, 4),
        (half * 8, half),
        (2, half * 2, half * 2),
    ]
    for t, shape in enumerate(shapes):
        dtype = ["float32", "int16", "uint8"][t % 3]
        sd = next(d for d, n in enumerate(shape) if n % half == 0)  # the first divisible dimension
        src = Layout.from_mesh(
            src_ranks, ("x",), tuple("x" if d == sd else None for d in range(len(shape))), shape, dtype
        )
        if t % 2:  # destination: TP over pairs, replicated over the rest
            mesh = dst_ranks.reshape(-1, 2)
            dd = next(d for d, n in enumerate(shape) if n % 2 == 0)
            spec = tuple("tp" if d == dd else None for d in range(len(shape)))
            dst = Layout.from_mesh(mesh, ("dp", "tp"), spec, shape, dtype)
        else:  # destination: sharded over every rank on the last divisible dimension
            dd = max(d for d, n in enumerate(shape) if n % half == 0)
            dst = Layout.from_mesh(
                dst_ranks, ("y",), tuple("y" if d == dd else None for d in range(len(shape))), shape, dtype
            )
        pairs.append((src, dst))
        raw = rng.integers(0, 256, size=src.nbytes, dtype=np.uint8)
        globals_.append(raw.view(src.np_dtype).reshape(shape))
    topo = jreshard.Topology.uniform(range(n_ranks), domain_size=4)
    plan = jreshard.plan([s for s, _ in pairs], [d for _, d in pairs], topo)
    return plan, pairs, globals_


def shards_for(pairs, globals_, ranks):
    from jreshard.engine.rounds import Shards

    src, dst = {}, {}
    for t, ((s, d), g) in enumerate(zip(pairs, globals_, strict=True)):
        for r, b in zip(s.ranks, s.boxes, strict=True):
            if r in ranks:
                src[(t, r)] = np.ascontiguousarray(g[b.slices()]).reshape(-1).view(np.uint8)
        for r, b in zip(d.ranks, d.boxes, strict=True):
            if r in ranks:
                dst[(t, r)] = np.full(b.volume * d.itemsize, SENTINEL, np.uint8)
    return Shards(src=src, dst=dst)


def check(pairs, globals_, shards) -> int:
    checked = 0
    for t, ((_, d), g) in enumerate(zip(pairs, globals_, strict=True)):
        for r, b in zip(d.ranks, d.boxes, strict=True):
            if (t, r) in shards.dst:
                want = np.ascontiguousarray(g[b.slices()]).reshape(-1).view(np.uint8)
                np.testing.assert_array_equal(shards.dst[(t, r)], want)
                checked += want.size
    return checked


def body() -> dict:
    from mpi4py import MPI
    from schedule_oracle import build_schedule

    from jreshard.engine.comm import Communicator
    from jreshard.engine.rounds import execute
    from jreshard.mpi.comm import MpiComm
    from jreshard.options import Options

    class Counting(Communicator):
        """Delegates to MpiComm and logs every exchange's (sends, receives) per local rank."""

        def __init__(self, inner):
            self.inner, self.calls = inner, []

        @property
        def local_ranks(self):
            return self.inner.local_ranks

        def exchange(self, sends, recvs, *, timeout_s):
            self.calls.append(
                ([(s.src, s.dst, s.tag, len(s.buffer)) for s in sends], [(r.src, r.dst, r.tag) for r in recvs])
            )
            self.inner.exchange(sends, recvs, timeout_s=timeout_s)

    world = MPI.COMM_WORLD
    n = world.Get_size()
    plan, pairs, globals_ = case(n)
    comm = Counting(MpiComm(world, {r: r for r in range(n)}))
    max_ops = int(os.environ.get("JRESHARD_MAX_GROUP_OPS", str(Options().max_group_ops)))
    opts = Options(chunk_bytes=64, staging_bytes=4096, timeout_s=60, max_group_ops=max_ops)
    shards = shards_for(pairs, globals_, set(comm.local_ranks))
    stats = execute(build_schedule(plan, opts), comm, shards, options=opts)
    checked = check(pairs, globals_, shards)
    comm.inner.close()
    return {
        "checked": checked,
        "sent": {lk.name: v for lk, v in stats.sent_bytes.items()},
        "exchanges": len(comm.calls),
        "max_ops": max((len(s) + len(r) for s, r in comm.calls), default=0),
        "sends": [m for s, _ in comm.calls for m in s],
    }


if __name__ == "__main__":
    from _common import main

    main("groups", body)
