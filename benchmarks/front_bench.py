"""What the front door costs a many-leaf call: the plain path against the full checks, alternated in one process.

A *plain* call (every leaf a live, row-major ``jax.Array``; ``transfer`` to ``NamedSharding`` or
``SingleDeviceSharding`` targets or ``transfer_into`` live arrays; this process's CPU devices) is checked, routed
and planned from its key in one pass over the leaves, with what depends on the key alone cached per key
(``jreshard/call/front.py``, ``plain_key``).
Every other call takes the full path: the normalization of targets, the scan for leaves to repack, the routing and
:func:`~jreshard.call.front.prepare`'s checks, each a pass over the leaves. This script times both on the same
pytree, call after call in turn (the full path forced by replacing ``jreshard.api._plain``, for the measurement
only), so the two see the machine alike; every call gets new source arrays over the same shard buffers, as a
refit does after each train step; ``transfer_into`` writes into the results of the call before it.

The case is ``transfer_bench.py``'s: ``--leaves`` arrays of 128x128 float32, FSDP over devices 0-3 to TP2 x DP2
over devices 4-7. Printed: each path's median [min-max] in ms, and the median over pairs of (full / plain), the
factor by which the plain path is faster.

Run: ``JAX_PLATFORMS=cpu .venv/bin/python benchmarks/front_bench.py [--leaves 1000] [--repeats 15]``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUM_CPU_DEVICES"] = "8"

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer_bench import leaves_case, rewrap, stats

import jreshard
import jreshard.api as api


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--leaves", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=15, help="calls of each path and mode (after one warm-up)")
    args = ap.parse_args()
    x, target = leaves_case(args.leaves, 128)
    plain, full = api._plain, (lambda *a: None)
    held = [jreshard.transfer(x, target)]

    def into(xs):
        held[0] = jreshard.transfer_into(xs, held[0])
        return held[0]

    calls = {"transfer": lambda xs: jreshard.transfer(xs, target), "transfer_into": into}
    times: dict[tuple[str, str], list[float]] = {(m, p): [] for m in calls for p in ("plain", "full")}
    try:
        for k in range(args.repeats + 1):
            for mode, call in calls.items():
                for path, fn in (("plain", plain), ("full", full)) if k % 2 else (("full", full), ("plain", plain)):
                    api._plain = fn
                    xs = rewrap(x)
                    gc.collect()
                    t = time.perf_counter()
                    jax.block_until_ready(call(xs))
                    if k:
                        times[(mode, path)].append(time.perf_counter() - t)
    finally:
        api._plain = plain
    cores = os.cpu_count()
    print(f"jax {jax.__version__}, {args.leaves} leaves of 128x128 float32, {cores} cores, {args.repeats} calls a path")
    for mode in calls:
        p, f = times[(mode, "plain")], times[(mode, "full")]
        ratio = statistics.median(b / a for a, b in zip(p, f, strict=True))
        print(f"{mode}: plain path {stats(p)} ms, full checks {stats(f)} ms; full / plain per pair {ratio:.2f}x")


if __name__ == "__main__":
    main()
