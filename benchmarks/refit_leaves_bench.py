"""What a refit between two programs costs per leaf: ``RefitGroup.push`` and ``pull`` of many small leaves against
one leaf of the same bytes, in the same run (``--call transfer``: ``jreshard.transfer`` in one multi-controller
program of the same two processes instead, every process calling it; ``--call elastic``: an ``ElasticTrainer`` and
an ``ElasticReplica`` in one process, over NIXL).

Two MPI processes (``mpiexec -n 1 ... source : -n 1 ... destination``, started by this script), each with 4 CPU
devices: the source holds ``--leaves`` arrays of ``--side`` x ``--side`` float32, FSDP over its 4 devices; the
destination holds them TP2 x DP2. Two groups over the same processes: one of the many leaves, one of a single
leaf of as many bytes (``leaves * side`` rows). Each step pushes (and pulls into the arrays held) a new version
of both, in turns; the first two steps prepare and are not counted. Printed per side: the median [min-max] of
each group's step in ms, and the fixed cost per leaf, ``(many - one) / leaves`` in us: what the declaration
check, reading each leaf's shards, and making each pulled array cost a step, beside the bytes.

With ``--call transfer`` the two processes form one ``jax.distributed`` cluster (``jreshard.mpi.cluster.initialize``)
and both call ``jreshard.transfer`` of the tree from the first process's FSDP sharding to the second's TP2 x DP2 one
(the multi-controller path, over MPI); each process's call is timed, and its result checked on the second.

With ``--call elastic`` one process of 8 CPU devices holds an ``ElasticTrainer`` (FSDP over devices 0-3) and an
``ElasticReplica`` (TP2 x DP2 over devices 4-7) of each tree, with a shared secret (every message MACed) and
``delta="off"``; a step is the trainer's ``push`` and then the replica's ``pull`` of that version, timed together.

With ``--cast`` the destination holds bfloat16: its ``RefitGroup`` (or elastic replica) is declared in bfloat16
(the source's float32 cast on the way), and ``--call transfer`` moves ``views.astype(x, bfloat16)`` of each leaf.

Run: ``JAX_PLATFORMS=cpu .venv/bin/python benchmarks/refit_leaves_bench.py [--leaves 1000] [--side 16] [--steps 12]
[--call refit|transfer|elastic] [--cast]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def side_main(role: str, leaves: int, side: int, steps: int, cast: bool = False) -> None:
    """One process of the launch: form both groups, run the steps, print its times as one JSON line (``cast``: the
    destination declares bfloat16)."""
    os.environ["JAX_NUM_CPU_DEVICES"] = "4"
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard.options import Options
    from jreshard.refit import RefitGroup

    devs = np.array(jax.devices())
    if role == "source":
        sh = NamedSharding(jax.sharding.Mesh(devs, ("fsdp",)), P("fsdp"))
    else:
        sh = NamedSharding(jax.sharding.Mesh(devs.reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    dtype = jax.numpy.bfloat16 if cast and role == "destination" else np.float32
    trees = {
        "many": {f"layer{i:05d}": jax.ShapeDtypeStruct((side, side), dtype, sharding=sh) for i in range(leaves)},
        "one": {"w": jax.ShapeDtypeStruct((leaves * side, side), dtype, sharding=sh)},
    }
    opts = Options(timeout_s=120, delta="off")
    groups = {name: RefitGroup(role, sds, options=opts) for name, sds in trees.items()}
    make = {
        name: jax.jit(
            lambda v, sds=sds: jax.tree.map(lambda s: jax.numpy.full(s.shape, v, s.dtype), sds),
            out_shardings=jax.tree.map(lambda s: s.sharding, sds),
        )
        for name, sds in trees.items()
    }
    held = {name: make[name](0.0) for name in trees} if role == "destination" else {}
    times: dict[str, list[float]] = {name: [] for name in trees}
    for v in range(1, steps + 1):
        for name in ("many", "one") if v % 2 else ("one", "many"):
            g = groups[name]
            if role == "source":
                x = jax.block_until_ready(make[name](float(v)))
                t = time.perf_counter()
                g.push(x, version=v)
            else:
                t = time.perf_counter()
                held[name], got = g.pull(into=held[name])
                if got != v or float(jax.tree.leaves(held[name])[-1][0, 0]) != v:
                    raise SystemExit(f"refit_leaves_bench: {name} pulled version {got}, not {v}")
            if v > 2:
                times[name].append(time.perf_counter() - t)
    for g in groups.values():
        g.close()
    print("RESULT " + json.dumps({"role": role, "times": times}), flush=True)


def transfer_main(leaves: int, side: int, steps: int, cast: bool = False) -> None:
    """One process of a ``--call transfer`` launch: one cluster, both calls, its times as one JSON line (``cast``:
    every leaf a ``views.astype`` to bfloat16)."""
    os.environ["JAX_NUM_CPU_DEVICES"] = "4"
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jreshard
    from jreshard import views
    from jreshard.mpi.cluster import initialize
    from jreshard.options import Options

    initialize()
    me = jax.process_index()
    src = np.array([d for d in jax.devices() if d.process_index == 0])
    dst = np.array([d for d in jax.devices() if d.process_index == 1])
    fsdp = NamedSharding(jax.sharding.Mesh(src, ("fsdp",)), P("fsdp"))
    tp = NamedSharding(jax.sharding.Mesh(dst.reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    shapes = {"many": [(side, side)] * leaves, "one": [(leaves * side, side)]}
    make = {
        name: jax.jit(
            lambda v, sh=sh: [jax.numpy.full(s, v + k, np.float32) for k, s in enumerate(sh)],
            out_shardings=[fsdp] * len(sh),
        )
        for name, sh in shapes.items()
    }
    opts = Options(timeout_s=120)
    times: dict[str, list[float]] = {name: [] for name in shapes}
    for v in range(1, steps + 1):
        for name in ("many", "one") if v % 2 else ("one", "many"):
            x = jax.block_until_ready(make[name](float(v)))
            t = time.perf_counter()
            if cast:
                y = jreshard.transfer([views.astype(a, jax.numpy.bfloat16) for a in x], [tp] * len(x), options=opts)
            else:
                y = jreshard.transfer(x, [tp] * len(x), options=opts)
            if v > 2:
                times[name].append(time.perf_counter() - t)
            got = np.asarray(y[-1].addressable_shards[0].data).astype(np.float32)[0, 0] if me == 1 else None
            if me == 1 and got != float(jax.numpy.asarray(v + len(x) - 1, y[-1].dtype)):
                raise SystemExit(f"refit_leaves_bench: {name} moved the wrong values at step {v}")
    print("RESULT " + json.dumps({"role": "source" if me == 0 else "destination", "times": times}), flush=True)


def elastic_main(leaves: int, side: int, steps: int, cast: bool = False) -> dict:
    """``--call elastic``: both sides in this process; ``{"many": [s, ...], "one": [...]}``."""
    os.environ["JAX_NUM_CPU_DEVICES"] = "8"
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard import Options
    from jreshard.elastic import ElasticReplica, ElasticTrainer

    devs = jax.devices()
    fsdp = NamedSharding(Mesh(np.array(devs[:4]), ("fsdp",)), P("fsdp"))
    tp = NamedSharding(Mesh(np.array(devs[4:8]).reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    opts = Options(timeout_s=120.0, secret=b"refit-leaves-bench-secret-0123", delta="off")
    shapes = {"many": {f"layer{i:05d}": (side, side) for i in range(leaves)}, "one": {"w": (leaves * side, side)}}
    make, pairs = {}, {}
    for name, tree in shapes.items():
        make[name] = jax.jit(
            lambda v, tree=tree: {k: jax.numpy.full(s, v, np.float32) for k, s in tree.items()}, out_shardings=fsdp
        )
        held = jax.numpy.bfloat16 if cast else np.float32  # a replica of bfloat16: the trainer's float32 cast to it
        like = {k: jax.ShapeDtypeStruct(s, held, sharding=tp) for k, s in tree.items()}
        trainer = ElasticTrainer(make[name](0.0), devices=list(devs[:4]), options=opts)
        replica = ElasticReplica(like, trainer.address, name=name, devices=list(devs[4:8]), options=opts)
        pairs[name] = (trainer, replica)
    times: dict[str, list[float]] = {name: [] for name in shapes}
    for v in range(1, steps + 1):
        for name in ("many", "one") if v % 2 else ("one", "many"):
            trainer, replica = pairs[name]
            x = jax.block_until_ready(make[name](float(v)))
            t = time.perf_counter()
            trainer.push(x, version=v)
            tree, got = replica.pull(newer_than=v - 1)
            if v > 2:
                times[name].append(time.perf_counter() - t)
            if got != v or float(jax.tree.leaves(tree)[-1][0, 0]) != v:
                raise SystemExit(f"refit_leaves_bench: {name} pulled version {got}, not {v}")
    for trainer, replica in pairs.values():
        replica.leave()
        trainer.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--leaves", type=int, default=1000)
    ap.add_argument("--side", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--call", choices=["refit", "transfer", "elastic"], default="refit")
    ap.add_argument(
        "--cast",
        action="store_true",
        help="the destination holds bfloat16 (declared so; --call transfer: views.astype)",
    )
    ap.add_argument("--side-of", choices=["source", "destination"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side_of:
        if args.call == "transfer":
            transfer_main(args.leaves, args.side, args.steps, args.cast)
        else:
            side_main(args.side_of, args.leaves, args.side, args.steps, args.cast)
        return

    cast = " cast to bfloat16" if args.cast else ""
    head = (
        f"{args.leaves} leaves of {args.side}x{args.side} float32{cast} (FSDP4 -> TP2 x DP2) against one leaf of "
        f"the same {args.leaves * args.side * args.side * 4 / 2**20:.1f} MiB, {args.steps - 2} steps each"
    )
    if args.call == "elastic":
        print(f"{head}, one process, {os.cpu_count()} cores")
        _print_row("elastic push + pull", elastic_main(args.leaves, args.side, args.steps, args.cast), args.leaves)
        return
    exe = Path(sys.executable)
    mpiexec = exe.parent / "mpiexec"
    me = str(Path(__file__).resolve())
    common = ["--leaves", str(args.leaves), "--side", str(args.side), "--steps", str(args.steps), "--call", args.call]
    common += ["--cast"] if args.cast else []
    cmd = [str(mpiexec)]
    for role in ("source", "destination"):
        cmd += ["-n", "1", str(exe), me, *common, "--side-of", role] + ([":"] if role == "source" else [])
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    results = [json.loads(ln[len("RESULT ") :]) for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or len(results) != 2:
        raise SystemExit(f"refit_leaves_bench: the launch failed (rc {done.returncode}):\n{done.stdout}\n{done.stderr}")
    print(f"{head}, 2 processes, {os.cpu_count()} cores")
    for r in sorted(results, key=lambda r: r["role"] != "source"):
        call = ("push" if r["role"] == "source" else "pull") if args.call == "refit" else f"transfer ({r['role']})"
        _print_row(call, r["times"], args.leaves)


def _print_row(call: str, times: dict[str, list[float]], leaves: int) -> None:
    import statistics

    t = {k: [x * 1e3 for x in v] for k, v in times.items()}
    many, one = statistics.median(t["many"]), statistics.median(t["one"])
    fixed = (many - one) / leaves * 1e3
    print(
        f"{call}: {leaves} leaves {many:.1f} [{min(t['many']):.1f}-{max(t['many']):.1f}] ms, one leaf "
        f"{one:.1f} [{min(t['one']):.1f}-{max(t['one']):.1f}] ms; fixed cost {fixed:.0f} us a leaf"
    )


if __name__ == "__main__":
    main()
