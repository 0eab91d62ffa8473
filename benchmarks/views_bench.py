"""Benchmark a float32 -> bfloat16 fused refit with jreshard.views against jnp fusion + jax.device_put.

A trainer holds float32 ``q, k, v, o, gate, up, down`` stacked over layers, FSDP over devices 0-3; the
server wants per layer bfloat16 ``qkv`` (fused, TP-grouped, the key/value heads repeated for TP2),
``gate_up`` (fused, TP-grouped), ``o`` and ``down``, on TP2 x DP2 over devices 4-7. Three timings, in
one run, each the median (min-max) of ``--repeats`` calls after a warm-up call:

- ``views``: ``jreshard.views.transfer_into`` of the views into the server's arrays (warm memory);
- ``jnp + device_put``: a jitted function builds the fused bfloat16 arrays on the trainer mesh, then
  ``jax.device_put`` moves them to the server's shardings (the path a user has without views);
- ``warm floor``: the destination bytes written once at the ``np.copyto`` bandwidth measured here
  into warm memory (8 MiB calls).

Run:  JAX_PLATFORMS=cpu .venv/bin/python benchmarks/views_bench.py [--layers 2] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jreshard import views
from jreshard.nccl.buffers import aligned_empty

MiB = 1 << 20
TP = 2


def setup(layers: int, d: int):
    devs = np.array(jax.devices())
    trainer, server = Mesh(devs[:4], ("fsdp",)), Mesh(devs[4:].reshape(2, 2), ("dp", "tp"))
    shapes = {"q": (d, d), "k": (d, d // 8), "v": (d, d // 8), "o": (d, d), "gate": (d, 4 * d), "up": (d, 4 * d)}
    shapes["down"] = (4 * d, d)
    params = {}
    for i, (n, s) in enumerate(shapes.items()):
        x = jax.random.normal(jax.random.key(i), (layers, *s), jnp.float32)
        params[n] = jax.device_put(x, NamedSharding(trainer, P(None, "fsdp")))
    col, row = NamedSharding(server, P(None, "tp")), NamedSharding(server, P("tp", None))
    target = [{"qkv": col, "gate_up": col, "o": row, "down": row}] * layers
    return params, target, trainer


def fused_views(p, layers: int):
    out = []
    for i in range(layers):
        q, k, v, o, g, u, dn = (views.unstack(p[n])[i] for n in ("q", "k", "v", "o", "gate", "up", "down"))
        kk, vv = (views.concat([x, x], axis=1) for x in (k, v))  # one KV head group per TP rank: repeat for TP2
        out.append(
            {
                "qkv": views.astype(views.concat([q, kk, vv], axis=1, groups=TP), jnp.bfloat16),
                "gate_up": views.astype(views.concat([g, u], axis=1, groups=TP), jnp.bfloat16),
                "o": views.astype(o, jnp.bfloat16),
                "down": views.astype(dn, jnp.bfloat16),
            }
        )
    return out


def _grouped(xs, groups):
    return jnp.concatenate([jnp.split(x, groups, axis=-1)[g] for g in range(groups) for x in xs], axis=-1)


def jnp_fused(p, layers: int):
    out = []
    for i in range(layers):
        q, k, v, o, g, u, dn = (p[n][i] for n in ("q", "k", "v", "o", "gate", "up", "down"))
        kk, vv = jnp.concatenate([k, k], axis=1), jnp.concatenate([v, v], axis=1)
        out.append(
            {
                "qkv": _grouped([q, kk, vv], TP).astype(jnp.bfloat16),
                "gate_up": _grouped([g, u], TP).astype(jnp.bfloat16),
                "o": o.astype(jnp.bfloat16),
                "down": dn.astype(jnp.bfloat16),
            }
        )
    return out


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up: plans, compiles, first touch of memory
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t)
    return out


def copy_bandwidth(repeats: int = 5) -> float:
    src, dst = aligned_empty(64 * MiB), aligned_empty(64 * MiB)
    src[:] = 1
    dst[:] = 0
    best = []
    for _ in range(repeats):
        t = time.perf_counter()
        for j in range(8):
            np.copyto(dst[j * 8 * MiB : (j + 1) * 8 * MiB], src[j * 8 * MiB : (j + 1) * 8 * MiB])
        best.append(time.perf_counter() - t)
    return 64 * MiB / float(np.median(best))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    params, target, _ = setup(a.layers, a.hidden)
    served = views.transfer(fused_views(params, a.layers), target)
    dest = sum(s.data.nbytes for leaf in jax.tree.leaves(served) for s in leaf.addressable_shards)
    jit_fuse = jax.jit(lambda p: jnp_fused(p, a.layers))

    def views_refit():
        nonlocal served
        served = views.transfer_into(fused_views(params, a.layers), served)
        return served

    def jnp_refit():
        return jax.device_put(jit_fuse(params), target)

    t_views = timed(views_refit, a.repeats)
    t_jnp = timed(jnp_refit, a.repeats)
    ref = jnp_refit()
    exact = all(
        np.array_equal(
            np.asarray(x.addressable_shards[0].data).view(np.uint16),
            np.asarray(y.addressable_shards[0].data).view(np.uint16),
        )
        for x, y in zip(jax.tree.leaves(served), jax.tree.leaves(ref), strict=True)
    )
    floor = dest / copy_bandwidth()
    print("command:", " ".join([os.path.basename(sys.executable), *sys.argv]))
    src_mib = sum(x.nbytes for x in params.values()) / MiB
    print(
        f"{a.layers} layers, hidden {a.hidden}: {src_mib:.0f} MiB float32 at the trainer, {dest / MiB:.0f} MiB "
        f"bfloat16 written at the server (TP2 x DP2); results equal bit for bit: {exact}"
    )
    print(f"{'path':<20}{'median s':>10}{'min-max s':>18}{'/ warm floor':>14}")
    for label, t in (("views transfer_into", t_views), ("jnp + device_put", t_jnp)):
        print(f"{label:<20}{np.median(t):>10.3f}{f'{min(t):.3f}-{max(t):.3f}':>18}{np.median(t) / floor:>13.2f}x")
    print(f"{'warm floor':<20}{floor:>10.3f}")
    print(f"views / jnp + device_put: {np.median(t_views) / np.median(t_jnp):.2f}x (medians, this run)")


if __name__ == "__main__":
    main()
