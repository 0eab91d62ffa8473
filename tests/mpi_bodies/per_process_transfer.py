"""``transfer_multiprocess`` plans only this process's ranks: every whole-plan function raises here.

Each process guards the whole-plan functions (``no_whole_plan.guard``), runs seeded random
transfers (as ``multi_transfer.py``) and checks its target shards against numpy; it reports the
ranks it computed a rank plan for and its own device ids. With the argument ``device`` the buffers
are ``device_like.DeviceLikeBuffers`` over an MPI transport that takes only their memory (as
NCCL takes only device memory), so the scheduling mail must travel in them too.
"""

import sys

import numpy as np
from _common import main


def body() -> dict:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from no_whole_plan import guard

    from jreshard.call.routes import transfer_multiprocess
    from jreshard.mpi.cluster import cluster_comm as _cluster_comm
    from jreshard.mpi.cluster import initialize
    from jreshard.options import Options

    initialize()
    planned_ranks = guard(setattr)
    extra, comm = {}, None
    if "device" in sys.argv[1:]:
        from device_like import DeviceLikeBuffers, DeviceOnlyComm
        from mpi4py import MPI

        buffers = DeviceLikeBuffers()
        comm = DeviceOnlyComm(_cluster_comm(MPI.COMM_WORLD), buffers)
        extra = {"transport": comm, "buffers": buffers}
    devs = jax.devices()
    n = len(devs)
    rng = np.random.default_rng(77)
    checked = 0
    for case in range(4):
        k_src, k_dst = (int(rng.choice([k for k in (1, 2, 4, 8) if k <= n])) for _ in range(2))
        src_mesh = jax.sharding.Mesh(np.array([devs[i] for i in rng.permutation(n)[:k_src]]), ("a",))
        dst_mesh = jax.sharding.Mesh(np.array([devs[i] for i in rng.permutation(n)[:k_dst]]), ("a",))
        src = NamedSharding(src_mesh, [P("a"), P(None, "a"), P()][case % 3])
        dst = NamedSharding(dst_mesh, [P(None, "a"), P("a"), P("a")][case % 3])
        shape = (8, 16)
        g = (np.arange(np.prod(shape)) * (case + 3)).reshape(shape).astype(np.float32)
        x = jax.make_array_from_callback(shape, src, lambda idx, g=g: g[idx], dtype=np.float32)
        y = transfer_multiprocess(x, dst, options=Options(chunk_bytes=64, staging_bytes=4096, timeout_s=60), **extra)
        for s in y.addressable_shards:
            np.testing.assert_array_equal(np.asarray(s.data), g[s.index])
            checked += 1
    mine = sorted(d.id for d in jax.local_devices())
    mail = {} if comm is None else {"mail_ops": comm.mail_ops, "chunk_ops": comm.chunk_ops}
    return {"checked": checked, "planned_ranks": sorted(set(planned_ranks)), "mine": mine, **mail}


if __name__ == "__main__":
    main("perprocess", body)
