"""``jreshard.transfer(..., report=True)`` over MPI: every process reports the bytes and messages it sent.

The sums over processes must equal the plan's statistics (the test adds them up).
"""

import numpy as np
from _common import main


def body() -> dict:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jreshard
    from jreshard.mpi.cluster import initialize

    initialize()
    devs = jax.devices()
    n = len(devs)
    src = NamedSharding(Mesh(np.array(devs), ("fsdp",)), P("fsdp"))
    half = np.array(devs[::-1]).reshape(2, n // 2)
    dst = NamedSharding(Mesh(half, ("dp", "tp")), P(None, "tp"))
    topo = jreshard.Topology.from_devices(devs, domain_of={d: d.process_index for d in devs})
    shape = (8 * n, 4 * n)
    g = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    x = {
        "w": jax.make_array_from_callback(shape, src, lambda idx: g[idx]),
        "b": jax.make_array_from_callback(shape, src, lambda idx: g[idx] + 1),
    }
    target = {"w": dst, "b": None}
    out, rep = jreshard.transfer(x, target, topology=topo, options=jreshard.Options(backend="mpi"), report=True)
    for s in out["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), g[s.index])
    assert out["b"] is x["b"]  # a None target keeps the leaf, on the MPI path too
    stats = jreshard.plan(x["w"], dst, topo).stats()
    return {
        "backend": rep.backend.value,
        "network": rep.network_bytes,
        "fast": rep.fast_bytes,
        "same_device": rep.same_device_bytes,
        "messages": rep.messages,
        "plan": [stats.network_bytes, stats.fast_bytes, stats.same_device_bytes, stats.messages],
    }


if __name__ == "__main__":
    main("report", body)
