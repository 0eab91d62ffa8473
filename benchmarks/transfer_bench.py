"""Benchmark jreshard.transfer / transfer_into against jax.device_put and the memcpy floor, 8 CPU devices.

Cases, all measured in one run (these hosts are shared and noisy: read the ratios):

- ``leaves``: pytrees of many small leaves, FSDP over devices 0-3 -> TP2 x DP2 over
  devices 4-7 (1000 and 200 leaves of 128x128 float32, 1000 leaves of 8x8): the
  case users hit first. Besides the time, the *fixed cost per leaf*:
  ``(time - destination bytes / warm copy bandwidth) / leaves``.
- ``first call``: the 1000-leaf pytree after ``jreshard.clear_caches()`` (planning
  included), against the cached call.
- ``tensor``: one 256 MiB float32 tensor, TP4 -> TP2 x DP2, against the warm memcpy
  floor of the destination bytes.
- ``refit``: a stack of transformer layers (bfloat16 attention, float32 MLP and norms)
  from FSDP4 to Megatron TP2 x DP2.

Every time is wall clock over ``--repeats`` calls after a warm-up call, each result
freed before the next; the table prints the median and [min-max]. Every contender runs
on new arrays over the same source buffers each call (:func:`rewrap`, done before the
clock starts), as in a refit where every step brings new weights: repeating a call on one
array object would reuse what jax caches on it (``jax.device_put``'s host copy, the shard
list jreshard reads). The floor is the destination bytes at the ``np.copyto`` bandwidth
into warm memory, measured in this run with 8 MiB calls.

Run:  JAX_PLATFORMS=cpu .venv/bin/python benchmarks/transfer_bench.py   (``--quick``: fewer repeats)
"""

from __future__ import annotations

import argparse
import gc
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard.nccl.buffers import aligned_empty
from jreshard.nccl.pool import default_pool

MiB = 1 << 20


def _fill(shape, dtype, sharding, seed):
    f = jax.jit(
        lambda: (jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) * 1e-6 + seed).astype(dtype),
        out_shardings=sharding,
    )
    return f().block_until_ready()


def refit_case(layers: int, d: int):
    devs = np.array(jax.devices())
    train = Mesh(devs[:4], ("fsdp",))
    infer = Mesh(devs[4:].reshape(2, 2), ("dp", "tp"))
    fsdp, col, row = NamedSharding(train, P("fsdp")), NamedSharding(infer, P(None, "tp")), NamedSharding(infer, P("tp"))
    rep = NamedSharding(infer, P())
    f = 4 * d
    src, dst = {"layers": []}, {"layers": []}
    for i in range(layers):
        shapes = {
            "wq": ((d, d), jnp.bfloat16, col),
            "wk": ((d, d), jnp.bfloat16, col),
            "wv": ((d, d), jnp.bfloat16, col),
            "wo": ((d, d), jnp.bfloat16, row),
            "w_gate": ((d, f), jnp.float32, col),
            "w_up": ((d, f), jnp.float32, col),
            "w_down": ((f, d), jnp.float32, row),
            "norm1": ((d,), jnp.float32, rep),
            "norm2": ((d,), jnp.float32, rep),
        }
        src["layers"].append({k: _fill(s, dt, fsdp, i) for k, (s, dt, _) in shapes.items()})
        dst["layers"].append({k: t for k, (_, _, t) in shapes.items()})
    src["embed"] = _fill((8 * d, d), jnp.bfloat16, fsdp, -1)
    dst["embed"] = NamedSharding(infer, P("tp"))
    return src, dst


def tensor_case(mib: int):
    devs = np.array(jax.devices())
    tp4 = NamedSharding(Mesh(devs[:4], ("tp",)), P(None, "tp"))
    tp2dp2 = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    n = mib * MiB // 4
    return _fill((n // 4096, 4096), jnp.float32, tp4, 0), tp2dp2


def dest_bytes(tree) -> int:
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards)


def rewrap(tree):
    """New jax.Arrays over the same shard buffers (zero-copy), as a trainer's next step produces new arrays.

    ``jax.device_put`` between these meshes gathers the global array to the host and
    caches it on the source array (``_npy_value``); repeating it on the same array
    reuses that host copy, which a refit (new weights every step) never can."""
    return jax.tree.map(
        lambda a: jax.make_array_from_single_device_arrays(a.shape, a.sharding, [s.data for s in a.addressable_shards]),
        tree,
    )


def leaves_case(n: int, side: int):
    devs = np.array(jax.devices())
    fsdp = NamedSharding(Mesh(devs[:4], ("fsdp",)), P("fsdp"))
    tp = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    fill = jax.jit(lambda: [jnp.full((side, side), i, jnp.float32) for i in range(n)], out_shardings=[fsdp] * n)
    return jax.block_until_ready(fill()), tp


def _median(times: list[float]) -> float:
    return float(np.median(times))


def stats(times: list[float]) -> str:
    """``median [min-max]`` in milliseconds."""
    return f"{np.median(times) * 1e3:.1f} [{min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}]"


def timings(fn, repeats: int, sources: list | None = None) -> list[float]:
    """Seconds of ``repeats`` calls after one warm-up call; each result freed before the next.

    ``sources``: call ``k`` gets ``sources[k]`` (new arrays every call, built before the clock starts)."""
    out = []
    for k in range(repeats + 1):
        gc.collect()
        arg = () if sources is None else (sources[k],)
        t = time.perf_counter()
        r = fn(*arg)
        jax.block_until_ready(r)
        dt = time.perf_counter() - t
        del r
        if k:
            out.append(dt)
    return out


def warm_bandwidth(nbytes: int = 256 * MiB, step: int = 8 * MiB, repeats: int = 5) -> float:
    """np.copyto bandwidth into warm memory in ``step``-byte calls (bytes/s, median)."""
    src, dst = aligned_empty(nbytes), aligned_empty(nbytes)
    src[:] = 1
    dst[:] = 0
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        for i in range(0, nbytes, step):
            np.copyto(dst[i : i + step], src[i : i + step])
        ts.append(time.perf_counter() - t)
    return nbytes / _median(ts)


def compare(name: str, x, target, repeats: int, bw: float, leaves: int | None = None) -> dict:
    """transfer, transfer_into and device_put on one case.

    Every call of every contender gets new source arrays (over the same shard buffers, made
    before the clock starts), as a refit does after each train step: nothing jax caches on an
    array object (its host copy, its shard list) carries over from one call to the next."""
    held = [jreshard.transfer(x, target)]
    nbytes = dest_bytes(held[0])

    def fresh() -> list:
        return [rewrap(x) for _ in range(repeats + 1)]

    t_tr = timings(lambda xs: jreshard.transfer(xs, target), repeats, fresh())

    def into(xs):
        held[0] = jreshard.transfer_into(xs, held[0])
        return held[0]

    t_in = timings(into, repeats, fresh())
    _, rep = jreshard.transfer(rewrap(x), target, report=True)
    held.clear()
    t_dp = timings(lambda xs: jax.device_put(xs, target), repeats, fresh())
    floor = nbytes / bw
    row = {"case": name, "bytes": nbytes, "transfer": t_tr, "into": t_in, "device_put": t_dp, "floor": floor}
    row["report"] = rep
    if leaves:
        row["per_leaf_us"] = {k: (np.median(row[k]) - floor) / leaves * 1e6 for k in ("transfer", "into")}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--tensor-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 repeats, 4 layers")
    ap.add_argument(
        "--cases", default="leaves,tensor,refit", help="comma-separated subset of: leaves, tensor, refit (default all)"
    )
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.layers = 3, 4
    print(f"$ python benchmarks/transfer_bench.py{' --quick' if args.quick else ''}")
    print(f"jax {jax.__version__}, {len(jax.devices())} CPU devices, {os.cpu_count()} cores, {args.repeats} repeats")
    bw = warm_bandwidth()
    print(f"warm np.copyto bandwidth (8 MiB calls): {bw / 1e9:.2f} GB/s")
    rows = []
    cases = set(args.cases.split(","))
    first_row = None
    for n, side in ((1000, 128), (200, 128), (1000, 8)) if "leaves" in cases else ():
        x, t = leaves_case(n, side)
        rows.append(compare(f"{n} leaves {side}x{side} f32", x, t, args.repeats, bw, leaves=n))
        if (n, side) == (1000, 128):
            firsts, cached = [], []
            for _ in range(3):
                a, b = rewrap(x), rewrap(x)
                jreshard.clear_caches()
                t0 = time.perf_counter()
                jax.block_until_ready(jreshard.transfer(a, t))
                firsts.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                jax.block_until_ready(jreshard.transfer(b, t))
                cached.append(time.perf_counter() - t0)
            first_row = (firsts, cached)
        del x
    if "tensor" in cases:
        x, t = tensor_case(args.tensor_mib)
        rows.append(compare(f"tensor {args.tensor_mib} MiB TP4->TP2xDP2", x, t, args.repeats, bw))
        del x
    if "refit" in cases:
        x, t = refit_case(args.layers, args.d_model)
        src_bytes = sum(a.nbytes for a in jax.tree.leaves(x))
        name = f"refit {len(jax.tree.leaves(x))} leaves {src_bytes / MiB:.0f} MiB"
        rows.append(compare(name, x, t, args.repeats, bw))
        del x
    default_pool().clear()
    print()
    print("times in ms: median [min-max]; floor = destination bytes at the warm copy bandwidth")
    cols = [
        "case",
        "dest MiB",
        "transfer",
        "transfer_into",
        "jax.device_put",
        "device_put / transfer",
        "device_put / transfer_into",
        "transfer / floor",
        "transfer_into / floor",
        "fixed us/leaf (tr, into)",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * (len(cols) - 1))
    for r in rows:
        med = {k: float(np.median(r[k])) for k in ("transfer", "into", "device_put")}
        per_leaf = r.get("per_leaf_us")
        cells = [
            r["case"],
            f"{r['bytes'] / MiB:.0f}",
            stats(r["transfer"]),
            stats(r["into"]),
            stats(r["device_put"]),
            f"{med['device_put'] / med['transfer']:.2f}x",
            f"{med['device_put'] / med['into']:.2f}x",
            f"{med['transfer'] / r['floor']:.2f}x",
            f"{med['into'] / r['floor']:.2f}x",
            f"{per_leaf['transfer']:.0f}, {per_leaf['into']:.0f}" if per_leaf else "",
        ]
        print("| " + " | ".join(cells) + " |")
    if first_row is not None:
        firsts, cached = first_row
        print(
            f"\nfirst call on 1000 leaves (clear_caches, planning included): {stats(firsts)} ms; "
            f"cached: {stats(cached)} ms; ratio {np.median(firsts) / np.median(cached):.2f}x"
        )
    print("\nwhere the time goes (last transfer of each case, TransferReport phases):")
    for r in rows:
        print(f"  {r['case']}: {r['report'].summary()}")


if __name__ == "__main__":
    main()
