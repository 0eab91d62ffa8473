"""Benchmark jreshard.transfer against jax.device_put and the memcpy floor, in one process on 8 CPU devices.

Cases (DESIGN.md section 4, issue 4):

- ``refit``: a stack of transformer layers (attention in bfloat16, MLP and norms in
  float32, a bfloat16 embedding), >= 1 GiB, from a trainer layout (FSDP over
  devices 0-3) to an inference layout (TP2 x DP2 over devices 4-7, Megatron
  column/row-parallel).
- ``tensor``: one 512 MiB float32 tensor, TP4 (devices 0-3) -> TP2 x DP2 (devices 4-7).

For each: seconds of ``jreshard.transfer`` (fresh destination buffers, plan cached
after the first call), ``jreshard.transfer_into`` (existing, warm destinations),
``jax.device_put``, and the memcpy floor: the destination bytes written once at the
``np.copyto`` bandwidth measured in this run, into fresh and into warm memory. The
ratios are ``device_put / transfer`` (speed-up) and ``transfer / floor``.

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


def copy_bandwidth(nbytes: int = 256 * MiB, repeats: int = 3) -> tuple[float, float]:
    """(fresh, warm) np.copyto bandwidth in bytes/s: into newly allocated memory, and into touched memory."""
    src = aligned_empty(nbytes)
    src[:] = 1
    warm = aligned_empty(nbytes)
    warm[:] = 0
    fresh_t, warm_t = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        dst = aligned_empty(nbytes)
        np.copyto(dst, src)
        fresh_t.append(time.perf_counter() - t)
        del dst
        t = time.perf_counter()
        np.copyto(warm, src)
        warm_t.append(time.perf_counter() - t)
    return nbytes / min(fresh_t), nbytes / min(warm_t)


def timed(fn, repeats: int) -> tuple[float, float]:
    """(first call, best of the next ``repeats`` calls) in seconds; each result is freed before the next.

    The best, not the median: on a shared 2-core host other processes only ever add time."""
    times = []
    for _ in range(repeats + 1):
        gc.collect()
        t = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
        del out
    return times[0], min(times[1:])


def run_case(name: str, x, target, repeats: int, bw: tuple[float, float]) -> dict:
    first, jr = timed(lambda: jreshard.transfer(x, target), repeats)
    held = [jax.block_until_ready(jreshard.transfer(x, target))]
    nbytes = dest_bytes(held[0])
    _, jr_into = timed(lambda: jreshard.transfer_into(x, held[0]), repeats)
    held.clear()
    _, dp = timed(lambda: jax.device_put(x, target), max(1, repeats - 1))
    return {
        "case": name,
        "bytes": nbytes,
        "first": first,
        "transfer": jr,
        "into": jr_into,
        "device_put": dp,
        "floor_fresh": nbytes / bw[0],
        "floor_warm": nbytes / bw[1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--tensor-mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"jax {jax.__version__}, {len(jax.devices())} CPU devices, {os.cpu_count()} cores")
    bw = copy_bandwidth()
    print(f"np.copyto bandwidth: fresh {bw[0] / 1e9:.2f} GB/s, warm {bw[1] / 1e9:.2f} GB/s")
    rows = []
    x, target = refit_case(args.layers, args.d_model)
    src_bytes = sum(a.nbytes for a in jax.tree.leaves(x))
    rows.append(
        run_case(f"refit {len(jax.tree.leaves(x))} leaves, {src_bytes / 2**30:.2f} GiB", x, target, args.repeats, bw)
    )
    del x, target
    gc.collect()
    x, target = tensor_case(args.tensor_mib)
    rows.append(run_case(f"tensor {args.tensor_mib} MiB TP4->TP2xDP2", x, target, args.repeats, bw))
    del x
    print()
    cols = [
        "case",
        "dest MiB",
        "jreshard.transfer s (first call)",
        "transfer_into s",
        "jax.device_put s",
        "memcpy floor s fresh / warm",
        "device_put / transfer",
        "transfer / floor fresh",
        "into / floor warm",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * (len(cols) - 1))
    for r in rows:
        cells = [
            r["case"],
            f"{r['bytes'] / MiB:.0f}",
            f"{r['transfer']:.3f} ({r['first']:.3f})",
            f"{r['into']:.3f}",
            f"{r['device_put']:.3f}",
            f"{r['floor_fresh']:.3f} / {r['floor_warm']:.3f}",
            f"{r['device_put'] / r['transfer']:.1f}x",
            f"{r['transfer'] / r['floor_fresh']:.2f}",
            f"{r['into'] / r['floor_warm']:.2f}",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
