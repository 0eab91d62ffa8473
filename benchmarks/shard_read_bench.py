"""What reading a jax array's shards costs, and how much of it is jax calling one Python function per shard.

Every way to read a shard's buffer address from jax (``addressable_shards``, ``addressable_data(i)``,
``_arrays``) builds a single-device ``jax.Array`` object per shard; in jax 0.10 the runtime (C++) calls the
Python function ``jax._src.sharding_impls.make_single_device_sharding`` for each one, and that call is about
half the cost. This script times, for a pytree of ``--leaves`` arrays of 128x128 float32 sharded over 4 of 8 CPU
devices (the many-leaf case of ``transfer_bench.py``; a fresh array object each time, as a train step makes):

- ``_arrays`` of every leaf, as jax ships (alternated with the next row, each first in turn);
- the same with ``make_single_device_sharding`` replaced, for this measurement only, by a version that returns
  one sharding object per (device, memory kind) (shardings are immutable, so sharing them changes no result);
- ``unsafe_buffer_pointer()`` of every shard, once its object exists.

jreshard does not replace jax's function: the second row is what jax itself could save a many-leaf
``transfer``/``transfer_into`` (about a tenth of a 1,000-leaf call).

Run: ``JAX_PLATFORMS=cpu .venv/bin/python benchmarks/shard_read_bench.py [--leaves 1000] [--repeats 15]``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUM_CPU_DEVICES"] = "8"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def fresh(tree: list) -> list:
    """New array objects over the same shard buffers (nothing jax caches on an object carries over)."""
    from jax._src.array import ArrayImpl

    return [ArrayImpl(a.aval, a.sharding, list(a._arrays), committed=True) for a in tree]


def timed(fn, tree: list) -> float:
    """Milliseconds of ``fn`` over fresh array objects of ``tree`` (built, and garbage collected, first)."""
    leaves = fresh(tree)
    gc.collect()
    t0 = time.perf_counter()
    fn(leaves)
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leaves", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    devs = np.array(jax.devices())
    fsdp = NamedSharding(Mesh(devs[:4], ("fsdp",)), P("fsdp"))
    fill = jax.jit(
        lambda: [jnp.full((128, 128), i, jnp.float32) for i in range(args.leaves)], out_shardings=[fsdp] * args.leaves
    )
    tree = jax.block_until_ready(fill())
    shards = sum(len(a._arrays) for a in tree)

    def read(leaves: list) -> None:
        for a in leaves:
            a._arrays  # noqa: B018 - the read is what is timed

    def pointers(leaves: list) -> float:
        arrays = [a._arrays for a in leaves]
        t0 = time.perf_counter()
        [s.unsafe_buffer_pointer() for arrs in arrays for s in arrs]
        return (time.perf_counter() - t0) * 1e3

    from jax._src import sharding_impls

    original = sharding_impls.make_single_device_sharding
    shared: dict = {}

    def one_per_device(device, *, memory_kind=None):
        key = (device, memory_kind)
        if key not in shared:
            shared[key] = original(device, memory_kind=memory_kind)
        return shared[key]

    plain: list[float] = []
    cached: list[float] = []
    ptrs: list[float] = []
    for k in range(args.repeats + 1):  # the two alternated, in turn first; the first round is a warm-up
        for which in ("plain", "cached") if k % 2 else ("cached", "plain"):
            if which == "cached":
                sharding_impls.make_single_device_sharding = one_per_device
            try:
                took = timed(read, tree)
            finally:
                sharding_impls.make_single_device_sharding = original
            if k:
                (cached if which == "cached" else plain).append(took)
        leaves = fresh(tree)
        if k:
            ptrs.append(pointers(leaves))

    def spread(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}] ms"

    print(f"jax {jax.__version__}, {args.leaves} leaves, {shards} shards, median [min-max] of {args.repeats}")
    print(f"  _arrays of every leaf, as jax ships:                      {spread(plain)}")
    print(f"  _arrays with one sharding object per device (measured only): {spread(cached)}")
    print(f"  unsafe_buffer_pointer() of every shard:                    {spread(ptrs)}")
    print(f"shard objects: {statistics.median(plain) / statistics.median(cached):.2f}x faster with shared shardings")


if __name__ == "__main__":
    main()
