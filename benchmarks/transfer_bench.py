"""Benchmark jreshard.transfer against jax.device_put and the memcpy floor, in one process on 8 CPU devices.

Cases (DESIGN.md section 4, issue 4):

- ``refit``: a stack of transformer layers (attention in bfloat16, MLP and norms in
  float32, a bfloat16 embedding), >= 1 GiB, from a trainer layout (FSDP over
  devices 0-3) to an inference layout (TP2 x DP2 over devices 4-7, Megatron
  column/row-parallel).
- ``tensor``: one 512 MiB float32 tensor, TP4 (devices 0-3) -> TP2 x DP2 (devices 4-7).

Every time is wall clock; "median" is the median of ``--repeats`` calls after the
first, each result freed before the next call. Which floor applies to which call:

- ``transfer`` first call: destination memory is new to the process (plan built,
  pool empty), so it is compared with the *fresh* floor.
- ``transfer`` median: the previous call's destination buffers were released by
  jax and handed out again by jreshard's pool (``report.fresh_bytes`` is printed to
  show it), so it is compared with the *warm* floor.
- ``transfer_into`` median: writes into existing destinations: the *warm* floor.
- ``jax.device_put`` median: on new source arrays over the same buffers each call
  (:func:`rewrap`), as in a refit where every step brings new weights. Its
  allocator recycles freed memory too where glibc's heap serves the size (shards
  under 32 MiB). Between these meshes it gathers the whole array to the host and
  caches it on the source array, so repeating it on the *same* array (printed in
  brackets) skips the gather: not what a refit can do, and not the ratio's basis.

The floors are the destination bytes written once at the ``np.copyto`` bandwidth
measured in this run with 256 MiB calls, into fresh and into warm memory. glibc
switches to non-temporal stores for copies this large (above about 128-256 MiB on
the development host), which no piece-by-piece copy gets, so the bandwidth of
8 MiB calls into warm memory is printed beside it for reference.

Run:  JAX_PLATFORMS=cpu .venv/bin/python benchmarks/transfer_bench.py
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


def _median(times: list[float]) -> float:
    return float(np.median(times))


def copy_bandwidth(nbytes: int = 256 * MiB, repeats: int = 5) -> tuple[float, float, float]:
    """(fresh, warm, warm in 8 MiB calls) np.copyto bandwidth in bytes/s, medians of ``repeats``."""
    src = aligned_empty(nbytes)
    src[:] = 1
    warm = aligned_empty(nbytes)
    warm[:] = 0
    fresh_t, warm_t, piece_t = [], [], []
    step = 8 * MiB
    for _ in range(repeats):
        t = time.perf_counter()
        dst = aligned_empty(nbytes)
        np.copyto(dst, src)
        fresh_t.append(time.perf_counter() - t)
        del dst
        t = time.perf_counter()
        np.copyto(warm, src)
        warm_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(0, nbytes, step):
            np.copyto(warm[i : i + step], src[i : i + step])
        piece_t.append(time.perf_counter() - t)
    return nbytes / _median(fresh_t), nbytes / _median(warm_t), nbytes / _median(piece_t)


def timed(fn, repeats: int) -> tuple[float, float, object]:
    """(first call, median of the next ``repeats`` calls, the last call's report or None) in seconds;
    each result is freed before the next call."""
    times, last = [], None
    for _ in range(repeats + 1):
        gc.collect()
        t = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
        if isinstance(out, tuple):
            last = out[1]
        del out
    return times[0], _median(times[1:]), last


def run_case(name: str, x, target, repeats: int, bw: tuple[float, float, float]) -> dict:
    pool = default_pool()
    pool.clear()
    first, jr, rep = timed(lambda: jreshard.transfer(x, target, report=True), repeats)
    held = [jreshard.transfer(x, target)]
    nbytes = dest_bytes(held[0])
    _, jr_into, rep_into = timed(lambda: jreshard.transfer_into(x, held[0], report=True), repeats)
    held.clear()
    pool.clear()
    dp_first, dp, _ = timed(lambda: jax.device_put(rewrap(x), target), repeats)
    _, dp_cached, _ = timed(lambda: jax.device_put(x, target), repeats)
    return {
        "case": name,
        "bytes": nbytes,
        "first": first,
        "transfer": jr,
        "into": jr_into,
        "dp_first": dp_first,
        "device_put": dp,
        "dp_cached": dp_cached,
        "floor_fresh": nbytes / bw[0],
        "floor_warm": nbytes / bw[1],
        "floor_pieces": nbytes / bw[2],
        "report": rep,
        "report_into": rep_into,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--tensor-mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"jax {jax.__version__}, {len(jax.devices())} CPU devices, {os.cpu_count()} cores; medians of {args.repeats}")
    bw = copy_bandwidth()
    print(
        f"np.copyto bandwidth, 256 MiB calls: fresh {bw[0] / 1e9:.2f} GB/s, warm {bw[1] / 1e9:.2f} GB/s; "
        f"warm in 8 MiB calls: {bw[2] / 1e9:.2f} GB/s"
    )
    rows = []
    x, target = refit_case(args.layers, args.d_model)
    src_bytes = sum(a.nbytes for a in jax.tree.leaves(x))
    name = f"refit {len(jax.tree.leaves(x))} leaves, {src_bytes / 2**30:.2f} GiB"
    rows.append(run_case(name, x, target, args.repeats, bw))
    del x, target
    gc.collect()
    x, target = tensor_case(args.tensor_mib)
    rows.append(run_case(f"tensor {args.tensor_mib} MiB TP4->TP2xDP2", x, target, args.repeats, bw))
    # Identical shardings: nothing moves, the arrays come back as they are.
    same = jreshard.transfer(x, x.sharding)
    assert same is x
    ts = []
    for _ in range(1001):
        t0 = time.perf_counter()
        jreshard.transfer(x, x.sharding)
        ts.append(time.perf_counter() - t0)
    identical_us = sorted(ts)[len(ts) // 2] * 1e6
    del x, same
    default_pool().clear()
    print()
    cols = [
        "case",
        "dest MiB",
        "transfer first s / fresh floor",
        "transfer s / warm floor",
        "transfer_into s / warm floor",
        "device_put s (first) [same x, host-cached]",
        "device_put / transfer",
        "fresh floor s",
        "warm floor s (8 MiB calls)",
    ]
    print(f"transfer between identical shardings ({args.tensor_mib} MiB tensor): {identical_us:.1f} us, median of 1001")
    print("| " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * (len(cols) - 1))
    for r in rows:
        cells = [
            r["case"],
            f"{r['bytes'] / MiB:.0f}",
            f"{r['first']:.3f} / {r['first'] / r['floor_fresh']:.2f}x",
            f"{r['transfer']:.3f} / {r['transfer'] / r['floor_warm']:.2f}x",
            f"{r['into']:.3f} / {r['into'] / r['floor_warm']:.2f}x",
            f"{r['device_put']:.3f} ({r['dp_first']:.3f}) [{r['dp_cached']:.3f}]",
            f"{r['device_put'] / r['transfer']:.2f}x",
            f"{r['floor_fresh']:.3f}",
            f"{r['floor_warm']:.3f} ({r['floor_pieces']:.3f})",
        ]
        print("| " + " | ".join(cells) + " |")
    print()
    for r in rows:
        print(f"{r['case']}, last transfer: {r['report'].summary()}")
        print(f"{r['case']}, last transfer_into: {r['report_into'].summary()}")


if __name__ == "__main__":
    main()
