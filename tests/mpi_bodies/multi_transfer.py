"""Multi-controller transfer between random layouts, checked against numpy on every process.

Each process starts jax.distributed over MPI_COMM_WORLD; every process calls ``transfer_multiprocess``
with the same seeded random source and target shardings (meshes on disjoint, equal or overlapping
device sets, drawn from all devices of the cluster), over dtypes of one to eight bytes (bfloat16, bool,
float8, complex) and a zero-size shape. Each addressable target shard must hold the bytes of the numpy
global array at its index; processes with no target device must get an array with no addressable shards.
"""

import numpy as np
from _common import main


def body() -> dict:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard.call.routes import transfer_multiprocess
    from jreshard.mpi.cluster import initialize
    from jreshard.options import Options

    initialize()
    devs = jax.devices()
    n = len(devs)
    rng = np.random.default_rng(1234)
    checked, empty = 0, 0
    dtypes = [np.float32, np.int16, np.int8, "bfloat16", np.bool_, "float8_e4m3fn", np.uint32, np.complex64]
    for case in range(16):

        def sharding(k):
            chosen = [devs[i] for i in rng.permutation(n)[:k]]
            if k % 2 == 0 and k > 1 and rng.integers(2):
                mesh = jax.sharding.Mesh(np.array(chosen).reshape(2, k // 2), ("a", "b"))
                spec = [P("a", "b"), P("b", None), P(None, ("a", "b")), P(), P("b", "a")][rng.integers(5)]
            else:
                mesh = jax.sharding.Mesh(np.array(chosen), ("a",))
                spec = [P("a"), P(None, "a"), P()][rng.integers(3)]
            return NamedSharding(mesh, spec)

        ks = [k for k in (1, 2, 4, 8) if k <= n]
        src, dst = sharding(int(rng.choice(ks))), sharding(int(rng.choice(ks)))
        shape = (0, 16) if case % 4 == 3 else (8, 16)
        dtype = np.dtype(jax.numpy.dtype(dtypes[case % len(dtypes)]))
        g = ((np.arange(np.prod(shape)) * (case + 1)) % 97).reshape(shape).astype(dtype)
        x = jax.make_array_from_callback(shape, src, lambda idx, g=g: g[idx], dtype=dtype)
        y = transfer_multiprocess(
            {"w": x, "b": x}, {"w": dst, "b": src}, options=Options(chunk_bytes=96, staging_bytes=4096, timeout_s=60)
        )
        for leaf, sh in ((y["w"], dst), (y["b"], src)):
            assert leaf.sharding == sh and leaf.shape == shape and leaf.dtype == dtype
            mine = [d for d in sh.device_set if d.process_index == jax.process_index()]
            assert len(leaf.addressable_shards) == len(mine)
            if not mine:
                empty += 1
            for s in leaf.addressable_shards:
                got, want = np.asarray(s.data), g[s.index]
                assert got.shape == want.shape and got.tobytes() == want.tobytes(), (case, dtype, s.device)
                checked += 1
    return {"checked": checked, "empty": empty, "devices": n}


if __name__ == "__main__":
    main("multi", body)
