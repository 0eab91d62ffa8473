"""What a cast refit of many leaves costs in one process: float32 trainer leaves to bfloat16 server leaves.

One process, 8 CPU devices: ``--leaves`` arrays of ``--side`` x ``--side`` float32, FSDP over devices 0-3, go to
bfloat16 TP2 x DP2 over devices 4-7, each call made four ways, in turns (each repeat runs them in a rotated order,
so whatever else the machine runs falls on all alike):

- ``views``: ``jreshard.transfer`` of ``views.astype(x, bfloat16)`` per leaf (cast while copying);
- ``sds``: ``jreshard.transfer`` of the arrays to ``jax.ShapeDtypeStruct(..., bfloat16, sharding=...)`` targets;
- ``into``: ``jreshard.transfer_into`` of the views, donating the last call's results (a server's steady loop;
  its first call also makes, with ``transfer``, the arrays it then donates);
- ``jax``: the baseline, jax alone: one jitted cast of every leaf on the trainer's devices, then one
  ``jax.device_put`` of the tree.

Each is run for the many leaves and for one leaf of the same bytes (``leaves * side`` rows); the first two calls
of each compile and are not timed (the first call of the many leaves is printed apart: what planning and compiling
cost once). Printed per way: the median [min-max] ms of ``--repeats`` calls, the fixed cost per leaf
``(many - one) / leaves`` in us, and the baseline's time over it (same run).

Run: ``JAX_PLATFORMS=cpu .venv/bin/python benchmarks/cast_leaves_bench.py [--leaves 1000] [--side 16] [--repeats 9]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--leaves", type=int, default=1000)
    ap.add_argument("--side", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jreshard
    from jreshard import views

    devs = jax.devices()
    fsdp = NamedSharding(Mesh(np.array(devs[:4]), ("fsdp",)), P("fsdp"))
    tp = NamedSharding(Mesh(np.array(devs[4:8]).reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    n, side = args.leaves, args.side
    shapes = {"many": [(side, side)] * n, "one": [(n * side, side)]}
    make = {
        name: jax.jit(
            lambda v, sh=sh: [jnp.full(s, v + k, np.float32) for k, s in enumerate(sh)], out_shardings=[fsdp] * len(sh)
        )
        for name, sh in shapes.items()
    }
    cast = jax.jit(lambda xs: [x.astype(jnp.bfloat16) for x in xs])
    sds = {name: [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=tp) for s in sh] for name, sh in shapes.items()}
    held: dict[str, list] = {}

    def run(way: str, name: str, x: list) -> list:
        if way == "views":
            return jreshard.transfer([views.astype(a, jnp.bfloat16) for a in x], [tp] * len(x))
        if way == "sds":
            return jreshard.transfer(x, sds[name])
        if way == "into":
            if name not in held:
                held[name] = jreshard.transfer([views.astype(a, jnp.bfloat16) for a in x], [tp] * len(x))
            held[name] = jreshard.transfer_into([views.astype(a, jnp.bfloat16) for a in x], held[name])
            return held[name]
        return jax.device_put(cast(x), [tp] * len(x))

    ways = ["views", "sds", "into", "jax"]
    times: dict[tuple[str, str], list[float]] = {(w, m): [] for w in ways for m in shapes}
    first: dict[str, float] = {}  # each way's first call of the many leaves (it plans, lowers and compiles)
    for rep in range(args.repeats + 2):
        for k in range(len(ways)):
            way = ways[(rep + k) % len(ways)]
            for name in ("many", "one") if rep % 2 else ("one", "many"):
                x = jax.block_until_ready(make[name](float(rep)))
                t = time.perf_counter()
                y = jax.block_until_ready(run(way, name, x))
                if rep >= 2:
                    times[(way, name)].append(time.perf_counter() - t)
                elif name == "many":
                    first.setdefault(way, time.perf_counter() - t)
                got = float(np.asarray(y[-1].addressable_shards[0].data).astype(np.float32)[0, 0])
                if got != float(jnp.bfloat16(rep + len(x) - 1)):
                    raise SystemExit(f"cast_leaves_bench: {way} {name} moved {got}, not {rep + len(x) - 1}")
    print(
        f"{n} leaves of {side}x{side} float32 -> bfloat16 (FSDP4 -> TP2 x DP2) against one leaf of the same "
        f"{n * side * side * 4 / 2**20:.1f} MiB, {args.repeats} calls each, jax {jax.__version__}, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    for way in ways:
        many = [t * 1e3 for t in times[(way, "many")]]
        fixed = (med[(way, "many")] - med[(way, "one")]) / n * 1e6
        ratio = "" if way == "jax" else f"; jax / this {med[('jax', 'many')] / med[(way, 'many')]:.2f}x"
        print(
            f"{way:>5}: {n} leaves {statistics.median(many):.1f} [{min(many):.1f}-{max(many):.1f}] ms, one leaf "
            f"{med[(way, 'one')] * 1e3:.1f} ms; fixed cost {fixed:.0f} us a leaf{ratio}"
        )
    print("first call of the many leaves (planning and compiling): " + ", ".join(f"{w} {first[w]:.2f} s" for w in ways))


if __name__ == "__main__":
    main()
