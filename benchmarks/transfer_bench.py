"""Benchmark jreshard.transfer / transfer_into against jax.device_put and the memcpy floor, 8 CPU devices.

Cases, all measured in one run (these hosts are shared and noisy: read the ratios):

- ``leaves``: pytrees of many small leaves, FSDP over devices 0-3 -> TP2 x DP2 over
  devices 4-7 (1000 and 200 leaves of 128x128 float32, 1000 leaves of 8x8): the
  case users hit first. Besides the time, the *fixed cost per leaf*:
  ``(time - floor) / leaves``; and *jax's own calls*: what any in-place transfer of the tree must ask of
  jax (wait for the new sources, read the address of every source shard, donate ``into``), timed alone in
  the same run, so ``device_put`` over it is the most ``transfer_into`` could reach on this jax and machine.
- ``first call``: the 1000-leaf pytree after ``jreshard.clear_caches()`` (planning
  included), against the cached call.
- ``tensor``: one 256 MiB float32 tensor, TP4 -> TP2 x DP2, against the warm memcpy
  floor of the destination bytes.
- ``refit``: a stack of transformer layers (bfloat16 attention, float32 MLP and norms)
  from FSDP4 to Megatron TP2 x DP2.
- ``fused``: a float32 -> bfloat16 fused refit with views (``jreshard.views``): float32
  ``q, k, v, o, gate, up, down`` stacked over layers, FSDP4, into per-layer bfloat16
  ``qkv`` (fused, TP-grouped, the key/value heads repeated for TP2), ``gate_up``,
  ``o`` and ``down`` on TP2 x DP2; against a jitted ``jnp`` fuse-and-cast on the
  trainer's mesh followed by ``jax.device_put`` (the path without views), checked
  equal bit for bit. Run twice: with the compiled cast kernels (``jreshard.views.native``),
  and with numpy's casts alone, as where they were not built.

The ``xla`` column is ``jreshard.transfer(..., options=Options(backend="xla"))`` (the plan compiled
into one jitted ``shard_map`` of ``ppermute``s, ``jreshard.xla``) in the same run, for the cases
named by ``--xla-cases`` (default ``tensor,refit``: a computation of 1000 leaves takes minutes to
compile on these hosts); its warm-up call compiles the computation, which is printed apart.

Every time is wall clock over ``--repeats`` calls after a warm-up call, each result
freed before the next; the table prints the median and [min-max]. Every contender runs
on new arrays over the same source buffers each call (:func:`rewrap`, done before the
clock starts), as in a refit where every step brings new weights: repeating a call on one
array object would reuse what jax caches on it (``jax.device_put``'s host copy, the shard
list jreshard reads). The floor is ``np.copyto`` of the case's destination bytes into warm
memory in 8 MiB calls, timed before every call of every contender (the median): the
bandwidth of a shared host drifts over a run, and this way the floor sees what they see.

Run:  JAX_PLATFORMS=cpu .venv/bin/python benchmarks/transfer_bench.py   (``--quick``: fewer repeats)
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
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

import jreshard
from jreshard import views
from jreshard.engine import strided
from jreshard.engine.buffers import aligned_empty
from jreshard.engine.pool import default_pool
from jreshard.views import native

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


def fused_case(layers: int, d: int, tp: int = 2):
    """Trainer params (float32, stacked over layers, FSDP4) and the server's per-layer fused shardings."""
    devs = np.array(jax.devices())
    trainer, server = Mesh(devs[:4], ("fsdp",)), Mesh(devs[4:].reshape(2, tp), ("dp", "tp"))
    shapes = {"q": (d, d), "k": (d, d // 8), "v": (d, d // 8), "o": (d, d), "gate": (d, 4 * d), "up": (d, 4 * d)}
    shapes["down"] = (4 * d, d)
    params = {
        n: _fill((layers, *s), jnp.float32, NamedSharding(trainer, P(None, "fsdp")), i)
        for i, (n, s) in enumerate(shapes.items())
    }
    col, row = NamedSharding(server, P(None, "tp")), NamedSharding(server, P("tp", None))
    target = [{"qkv": col, "gate_up": col, "o": row, "down": row} for _ in range(layers)]
    return params, target


_NAMES = ("q", "k", "v", "o", "gate", "up", "down")


def fused_views(p, tp: int = 2):
    """The server's tree as views of the trainer's arrays: nothing is computed until it is transferred."""
    out = []
    for i in range(p["q"].shape[0]):
        q, k, v, o, g, u, dn = (views.unstack(p[n])[i] for n in _NAMES)
        kk, vv = (views.concat([x] * tp, axis=1) for x in (k, v))  # one key/value head group: repeat it per TP rank
        out.append(
            {
                "qkv": views.astype(views.concat([q, kk, vv], axis=1, groups=tp), jnp.bfloat16),
                "gate_up": views.astype(views.concat([g, u], axis=1, groups=tp), jnp.bfloat16),
                "o": views.astype(o, jnp.bfloat16),
                "down": views.astype(dn, jnp.bfloat16),
            }
        )
    return out


def jnp_fused(p, tp: int = 2):
    """The same tree built with jnp on full arrays (what a user writes without views)."""

    def grouped(xs):
        return jnp.concatenate([jnp.split(x, tp, axis=-1)[g] for g in range(tp) for x in xs], axis=-1)

    out = []
    for i in range(p["q"].shape[0]):
        q, k, v, o, g, u, dn = (p[n][i] for n in _NAMES)
        kk, vv = jnp.concatenate([k] * tp, axis=1), jnp.concatenate([v] * tp, axis=1)
        out.append(
            {
                "qkv": grouped([q, kk, vv]).astype(jnp.bfloat16),
                "gate_up": grouped([g, u]).astype(jnp.bfloat16),
                "o": o.astype(jnp.bfloat16),
                "down": dn.astype(jnp.bfloat16),
            }
        )
    return out


def compare_fused(layers: int, d: int, repeats: int, compiled: bool = True) -> dict:
    """transfer and transfer_into of the views against jit(jnp fuse) + device_put, new source arrays every call.

    ``compiled=False`` runs the views with numpy's casts only (as where the C kernels were not built)."""
    if not compiled:
        saved = native.KERNELS, native.SCATTER
        native.KERNELS, native.SCATTER = {}, {}
        jreshard.clear_caches()
        try:
            row = compare_fused(layers, d, repeats)
        finally:
            native.KERNELS, native.SCATTER = saved
            jreshard.clear_caches()
        return {**row, "case": row["case"] + " (numpy casts)"}
    params, target = fused_case(layers, d)
    held = [jreshard.transfer(fused_views(params), target)]
    nbytes = dest_bytes(held[0])
    floor = Floor(nbytes)

    def fresh() -> list:
        return [rewrap(params) for _ in range(repeats + 1)]

    t_tr = timings(lambda ps: jreshard.transfer(fused_views(ps), target), repeats, fresh(), floor)

    def into(ps):
        held[0] = jreshard.transfer_into(fused_views(ps), held[0])
        return held[0]

    t_in = timings(into, repeats, fresh(), floor)
    fuse = jax.jit(jnp_fused)
    t_dp = timings(lambda ps: jax.device_put(fuse(ps), target), repeats, fresh(), floor)
    ref = jax.device_put(fuse(params), target)
    exact = all(
        np.array_equal(np.asarray(s.data).view(np.uint16), np.asarray(r.data).view(np.uint16))
        for x, y in zip(jax.tree.leaves(held[0]), jax.tree.leaves(ref), strict=True)
        for s, r in zip(x.addressable_shards, y.addressable_shards, strict=True)
    )
    src_mib = sum(a.nbytes for a in params.values()) / MiB
    name = f"fused f32->bf16 {layers} layers {src_mib:.0f} MiB"
    return {
        "case": name,
        "bytes": nbytes,
        "transfer": t_tr,
        "into": t_in,
        "device_put": t_dp,
        "floor": floor.seconds(),
        "exact": exact,
    }


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


class Floor:
    """The floor of a case: ``np.copyto`` of its destination bytes into warm memory in 8 MiB calls,
    timed once before every call of every contender, so it sees the machine as they do."""

    def __init__(self, nbytes: int, step: int = 8 * MiB):
        self.src, self.dst, self.step = aligned_empty(max(nbytes, 1)), aligned_empty(max(nbytes, 1)), step
        self.src[:] = 1
        self.dst[:] = 0
        self.times: list[float] = []

    def __call__(self) -> None:
        t = time.perf_counter()
        for i in range(0, self.src.size, self.step):
            np.copyto(self.dst[i : i + self.step], self.src[i : i + self.step])
        self.times.append(time.perf_counter() - t)

    def seconds(self) -> float:
        return _median(self.times)


def timings(fn, repeats: int, sources: list | None = None, floor: Floor | None = None) -> list[float]:
    """Seconds of ``repeats`` calls after one warm-up call; each result freed before the next.

    ``sources``: call ``k`` gets ``sources[k]`` (new arrays every call, built before the clock starts);
    ``floor``: timed before each call."""
    out = []
    for k in range(repeats + 1):
        if floor is not None:
            floor()
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


XLA = jreshard.Options(backend="xla")


def compare(name: str, x, target, repeats: int, leaves: int | None = None, xla: bool = False) -> dict:
    """transfer, transfer_into and device_put on one case.

    Every call of every contender gets new source arrays (over the same shard buffers, made
    before the clock starts), as a refit does after each train step: nothing jax caches on an
    array object (its host copy, its shard list) carries over from one call to the next."""
    held = [jreshard.transfer(x, target)]
    nbytes = dest_bytes(held[0])

    def fresh() -> list:
        return [rewrap(x) for _ in range(repeats + 1)]

    floor_copy = Floor(nbytes)
    t_tr = timings(lambda xs: jreshard.transfer(xs, target), repeats, fresh(), floor_copy)

    def into(xs):
        held[0] = jreshard.transfer_into(xs, held[0])
        return held[0]

    t_in = timings(into, repeats, fresh(), floor_copy)
    _, rep = jreshard.transfer(rewrap(x), target, report=True)
    held.clear()
    t_dp = timings(lambda xs: jax.device_put(xs, target), repeats, fresh(), floor_copy)
    row = {"case": name, "bytes": nbytes, "transfer": t_tr, "into": t_in, "device_put": t_dp}
    if xla:
        t0 = time.perf_counter()
        _, row["xla_report"] = jreshard.transfer(rewrap(x), target, options=XLA, report=True)
        row["xla_first_s"] = time.perf_counter() - t0
        row["xla"] = timings(lambda xs: jreshard.transfer(xs, target, options=XLA), repeats, fresh(), floor_copy)
    floor = floor_copy.seconds()
    row["floor"] = floor
    row["report"] = rep
    if leaves:
        row["per_leaf_us"] = {k: (np.median(row[k]) - floor) / leaves * 1e6 for k in ("transfer", "into")}
        row["jax_calls"] = timings(jax_calls(x, target), repeats, fresh(), floor_copy)
    return row


def jax_calls(x, target):
    """What any in-place transfer of ``x`` asks of jax, and nothing else: wait for the new source arrays, read
    the buffer address of each of their shards (``_arrays``, the cheapest way jax offers: one object a shard),
    and take ``into``'s memory over (its arrays donated to one identity computation, as ``jax.jit(...,
    donate_argnums=...)`` hands memory over). No byte is copied.

    Its time bounds ``transfer_into`` from below on this jax and this machine, whatever jreshard does (the copies
    could run beside it on another core), so ``device_put`` over it bounds the ratio ``transfer_into`` can reach."""
    held = [jax.tree.leaves(jreshard.transfer(x, target))]
    n = len(held[0])
    take_over = jax.jit(lambda *a: a, donate_argnums=tuple(range(n)), out_shardings=target)

    def run(xs):
        leaves = jax.tree.leaves(xs)
        jax.block_until_ready(leaves)
        for a in leaves:
            for s in a._arrays:
                s.unsafe_buffer_pointer()
        held[0] = list(take_over(*held[0]))
        return held[0]

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--tensor-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 repeats, 4 layers")
    ap.add_argument(
        "--xla-cases", default="tensor,refit", help="cases that also run backend xla (leaves, tensor, refit)"
    )
    ap.add_argument(
        "--cases",
        default="leaves,tensor,refit,fused",
        help="comma-separated subset of: leaves, tensor, refit, fused (default all)",
    )
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.layers = 3, 4
    print("$ JAX_PLATFORMS=cpu python benchmarks/transfer_bench.py " + shlex.join(sys.argv[1:]))
    kernel = "compiled" if strided.compiled() else "numpy (jreshard/engine/_strided.c not built)"
    print(f"in-process copies: {kernel}")
    print(f"jax {jax.__version__}, {len(jax.devices())} CPU devices, {os.cpu_count()} cores, {args.repeats} repeats")
    bw = warm_bandwidth()
    print(f"warm np.copyto bandwidth at the start (8 MiB calls): {bw / 1e9:.2f} GB/s")
    rows = []
    cases = set(args.cases.split(","))
    xla_cases = set(args.xla_cases.split(",")) if args.xla_cases else set()
    first_row = None
    for n, side in ((1000, 128), (200, 128), (1000, 8)) if "leaves" in cases else ():
        x, t = leaves_case(n, side)
        rows.append(compare(f"{n} leaves {side}x{side} f32", x, t, args.repeats, leaves=n, xla="leaves" in xla_cases))
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
        rows.append(
            compare(f"tensor {args.tensor_mib} MiB TP4->TP2xDP2", x, t, args.repeats, xla="tensor" in xla_cases)
        )
        del x
    if "refit" in cases:
        x, t = refit_case(args.layers, args.d_model)
        src_bytes = sum(a.nbytes for a in jax.tree.leaves(x))
        name = f"refit {len(jax.tree.leaves(x))} leaves {src_bytes / MiB:.0f} MiB"
        rows.append(compare(name, x, t, args.repeats, xla="refit" in xla_cases))
        del x
    if "fused" in cases:
        rows.append(compare_fused(2, args.d_model, args.repeats))
        if native.available():
            rows.append(compare_fused(2, args.d_model, args.repeats, compiled=False))
    default_pool().clear()
    print()
    print(
        "times in ms: median [min-max]; floor = np.copyto of the destination bytes into warm memory, "
        "timed before every call of the case (median)"
    )
    cols = [
        "case",
        "dest MiB",
        "transfer",
        "transfer_into",
        "jax.device_put (fused: jnp fuse + device_put)",
        "device_put / transfer",
        "device_put / transfer_into",
        "transfer / floor",
        "transfer_into / floor",
        "fixed us/leaf (tr, into)",
        "xla",
        "xla / floor",
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
            stats(r["xla"]) if "xla" in r else "not run",
            f"{float(np.median(r['xla'])) / r['floor']:.2f}x" if "xla" in r else "",
        ]
        print("| " + " | ".join(cells) + " |")
    if first_row is not None:
        firsts, cached = first_row
        print(
            f"\nfirst call on 1000 leaves (clear_caches, planning included): {stats(firsts)} ms; "
            f"cached: {stats(cached)} ms; ratio {np.median(firsts) / np.median(cached):.2f}x"
        )
    for r in rows:
        if "jax_calls" in r:
            calls, dp = float(np.median(r["jax_calls"])), float(np.median(r["device_put"]))
            print(
                f"\n{r['case']}: jax's own calls for one transfer_into (wait for the sources, read every source "
                f"shard's address, donate into; no copy): {stats(r['jax_calls'])} ms, so transfer_into can be at most "
                f"{dp / calls:.2f}x faster than jax.device_put here; it is {dp / float(np.median(r['into'])):.2f}x"
            )
    during = ", ".join(f"{r['bytes'] / r['floor'] / 1e9:.2f}" for r in rows)
    print(f"\nfloor bandwidth (GB/s) during each case: {during}")
    for r in rows:
        if "exact" in r:
            print(f"\n{r['case']}: views equal jnp fuse + device_put bit for bit: {r['exact']}")
    print("\nwhere the time goes (last transfer of each case, TransferReport phases):")
    for r in rows:
        if "report" in r:
            print(f"  {r['case']}: {r['report'].summary()}")
        if "xla_report" in r:
            x = r["xla_report"]
            print(
                f"  {r['case']}, backend xla, first call {r['xla_first_s']:.2f} s (compile {x.compile_s:.2f} s, "
                f"padding {x.padding_bytes} B): {x.summary()}"
            )


if __name__ == "__main__":
    main()
