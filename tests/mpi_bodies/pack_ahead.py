"""Packing ahead over MPI: a float32 -> bfloat16 transfer whose senders pack every chunk (a strided box of
their shard) into staging, in small chunks, so each sender packs the next round while MPI moves the round
before.

Every destination shard is checked against numpy's cast; the result counts the groups this process's schedule
posts ahead (a start with packs before its wait, :mod:`jreshard.engine.replay`) and the rounds it packed ahead.
"""

import numpy as np
from _common import main


def body() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jreshard
    from jreshard.engine import replay, rounds
    from jreshard.mpi.cluster import initialize

    initialize()
    devs = jax.devices()
    mine = [d for d in devs if d.process_index == 0]
    theirs = [d for d in devs if d.process_index == 1]
    src = NamedSharding(Mesh(np.array(mine), ("x",)), P("x", None))
    dst = NamedSharding(Mesh(np.array(theirs), ("x",)), P(None, "x"))  # every piece a strided box of its source
    shape = (64, 256)
    g = (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) * np.float32(1.0001)) - 5000
    x = jax.make_array_from_callback(shape, src, lambda idx: g[idx], dtype=np.float32)
    starts = [0]
    ops_of = replay.ops_of

    def counted(*args, **kwargs):
        ops = ops_of(*args, **kwargs)
        starts[0] += sum(op[0] == replay.START for op in ops.ops)
        return ops

    rounds.ops_of = counted
    ahead = [0]
    compile_rounds = rounds.compile_rounds

    def spy(*args, **kwargs):
        compiled = compile_rounds(*args, **kwargs)
        ahead[0] = max(ahead[0], sum(compiled.ahead))
        return compiled

    rounds.compile_rounds = spy
    topo = jreshard.Topology.from_devices(devs, domain_of={d: d.process_index for d in devs})
    opts = jreshard.Options(backend="mpi", chunk_bytes=2048, staging_bytes=1 << 16)
    out = jreshard.transfer(x, jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=dst), topology=topo, options=opts)
    want = g.astype(jnp.bfloat16)
    checked = 0
    for s in out.addressable_shards:
        assert s.data.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(s.data).view(np.uint16), want[s.index].view(np.uint16))
        checked += s.data.size
    return {"process": jax.process_index(), "starts": starts[0], "ahead": ahead[0], "checked": checked}


if __name__ == "__main__":
    main("ahead", body)
