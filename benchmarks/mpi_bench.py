"""jreshard vs gather-broadcast (MPI collectives) across 8 processes: 4 source, 4 destination.

Run: ``.venv/bin/mpiexec -n 8 .venv/bin/python benchmarks/mpi_bench.py`` (JAX_PLATFORMS=cpu,
JAX_NUM_CPU_DEVICES=1 are set here). Declared topology: the 4 source processes are one domain, the
4 destination processes another. ``mpiexec -n 2`` (or 4) runs the same 8 devices as 1 (or 2) source and
destination processes of 4 (or 2) CPU devices each: with no more processes than cores, each process has
a core of its own (``-bind-to core``), so the senders' casts need not share one with the receivers' copies.
``--chunk-mib`` sets ``Options.chunk_bytes`` (default 8). The comparison with gather-broadcast runs at 8
processes only (one device each, so the plan's bytes between devices are bytes between processes).

Cases: one float32 tensor TP4 -> TP2 x DP2, and a refit-like pytree (FSDP -> TP x DP), and a fused float32
-> bfloat16 ``qkv`` (the server's recipe: ``astype(concat([q, k, v], axis=1, groups=2), bfloat16)`` from
float32 q, k, v TP4 into bfloat16 TP2 x DP2), timed in the same run as the plain TP4 -> TP2 x DP2 case and
compared per destination byte (the bytes of every destination shard, replicas included). The fused case has
as many destination bytes as the plain one (q 4096 x 4096, k and v 4096 x 2048: a bfloat16 qkv of 4096 x
8192), so the costs every call pays whatever its size (the group's votes, assembling the arrays) weigh the
same in both, and the two are called in alternating order (``ALTERNATIONS`` calls each), so a load that
drifts weighs on both alike. Wall time is the slowest process's, median [min-max] of ``REPEATS`` calls after
a warm-up;
bytes on the wire are what the processes sent to another process (jreshard: network + fast-link
bytes of the plan; baseline: Gatherv sends to the root + the root's Bcast payload per receiver).

For the fused and plain cases it also prints the CPU seconds all processes spent per call together
(``time.process_time``, summed) and how busy that kept the cores, and the CPU of the senders' cast
alone: the source processes casting their float32 shards with the kernel the fused refit packs with.
When the processes outnumber the cores, the time follows that CPU.
"""

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 devices in all, whatever the process count (the launcher's PMI_SIZE, before jax reads the variable)
os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(8 // max(1, int(os.environ.get("PMI_SIZE", "8")))))

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

from jreshard import views
from jreshard.engine.buffers import export_source
from jreshard.mpi.baseline import GatherBroadcast
from jreshard.mpi.cluster import initialize
from jreshard.options import Options
from jreshard.refit import RefitGroup
from jreshard.sharding.topology import Link
from jreshard.views.casts import cast_into

world = MPI.COMM_WORLD
assert world.Get_size() in (2, 4, 8), "run with mpiexec -n 8 (or -n 2, -n 4: 8 devices in all)"
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--chunk-mib", type=float, default=8.0, help="Options.chunk_bytes in MiB (default 8)")
args = parser.parse_args()
REPEATS = 5
ALTERNATIONS = 16  # plain and fused calls, alternated, for the per-destination-byte comparison
me = world.Get_rank()
half = world.Get_size() // 2
role = "source" if me < half else "destination"
side = world.Split(0 if role == "source" else 1, me)
initialize(side)
devs = jax.devices()  # this side's 4 devices
assert len(devs) == 4, f"each side needs 4 CPU devices in all, this one has {len(devs)}"
CHUNK = int(args.chunk_mib * (1 << 20))


def cases():
    n = 4096
    if role == "source":
        tp = NamedSharding(jax.sharding.Mesh(np.array(devs), ("tp",)), P(None, "tp"))
    else:
        tp = NamedSharding(jax.sharding.Mesh(np.array(devs).reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    yield "TP4 -> TP2 x DP2, 4096x4096 f32", {"w": jax.ShapeDtypeStruct((n, n), np.float32, sharding=tp)}
    d, f, layers = 1024, 4096, 4
    shapes = {"embed": (8192, d)} | {
        f"l{i}_{k}": s
        for i in range(layers)
        for k, s in (("wqkv", (d, 3 * d)), ("wo", (d, d)), ("w1", (d, f)), ("w2", (f, d)), ("norm", (d,)))
    }
    tree = {}
    for k, s in shapes.items():
        if role == "source":
            sh = NamedSharding(jax.sharding.Mesh(np.array(devs), ("fsdp",)), P("fsdp") if len(s) == 2 else P())
        else:
            mesh = jax.sharding.Mesh(np.array(devs).reshape(2, 2), ("dp", "tp"))
            spec = P() if len(s) == 1 else P("tp", None) if k.endswith(("wo", "w2")) else P(None, "tp")
            sh = NamedSharding(mesh, spec)
        tree[k] = jax.ShapeDtypeStruct(s, np.float32, sharding=sh)
    yield f"refit-like pytree, {len(shapes)} tensors", tree


def _quietly(request) -> None:
    """Wait for a non-blocking collective by polling with short sleeps. MPICH's blocking collectives spin
    (sched_yield) while they wait: a process that reaches one early would take a core from the processes
    still inside the timed call whenever the processes outnumber the cores."""
    while not request.Test():
        time.sleep(20e-6)


def barrier() -> None:
    _quietly(world.Ibarrier())


def slowest(seconds):
    out = np.zeros(1)
    _quietly(world.Iallreduce(np.array([seconds], float), out, op=MPI.MAX))
    return float(out[0])


def destination_bytes(tree) -> int:
    """The bytes of every destination shard of ``tree`` (ShapeDtypeStructs of the destination side)."""
    total = 0
    for s in tree.values():
        shard = s.sharding.shard_shape(s.shape)
        total += int(np.prod(shard)) * np.dtype(s.dtype).itemsize * len(s.sharding.device_set)
    return world.bcast(total if role == "destination" else None, root=half)


CPU: dict[int, list[float]] = {}  # id(group) -> the CPU seconds of every process together, per call


def once(group, arrays, like, version: int) -> float:
    """The slowest process's seconds of one refit (and, in ``CPU``, the CPU seconds of all processes)."""
    barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    if role == "source":
        group.push(arrays, version=version)
    else:
        group.pull(like=like)
    cpu = time.process_time() - c0
    wall = slowest(time.perf_counter() - t0)
    CPU.setdefault(id(group), []).append(world.allreduce(cpu))
    return wall


def cast_alone(arrays) -> list[float]:
    """The CPU seconds, all source processes together, of casting this process's float32 shards of ``arrays`` to
    bfloat16 with the kernel the fused refit packs with (``REPEATS`` times after a warm-up): the senders' cast
    of the fused case with nothing else, the work it has and the plain case has not."""
    out = []
    shards = [] if arrays is None else [sh.data for a in arrays.values() for sh in a.addressable_shards]
    host = [np.asarray(x) for x in shards]
    into = [np.empty(x.shape, jax.numpy.bfloat16) for x in host]
    for rep in range(REPEATS + 1):
        barrier()
        c0 = time.process_time()
        for x, y in zip(host, into, strict=True):
            cast_into(y, x, ("bfloat16",))
        total = world.allreduce(time.process_time() - c0 if role == "source" else 0.0)
        if rep:
            out.append(total)
    return out


def timed(group, arrays, like) -> list[float]:
    """The slowest process's seconds of ``REPEATS`` refits, after one untimed warm-up refit."""
    return [once(group, arrays, like, version=rep) for rep in range(REPEATS + 1)][1:]


def fused_case():
    """float32 q, k, v (TP4) -> one bfloat16 qkv (TP2 x DP2) made by the server's recipe: as many destination
    bytes as the plain TP4 -> TP2 x DP2 case."""
    n = 4096
    shapes = {"q": (n, n), "k": (n, n // 2), "v": (n, n // 2)}
    if role == "source":
        tp = NamedSharding(jax.sharding.Mesh(np.array(devs), ("tp",)), P(None, "tp"))
        sds = {k: jax.ShapeDtypeStruct(s, np.float32, sharding=tp) for k, s in shapes.items()}
        arrays = {
            k: jax.make_array_from_callback(s, tp, lambda i, s=s: np.full(s, 1.7, np.float32)[i])
            for k, s in shapes.items()
        }
        return sds, arrays, None, None
    tp = NamedSharding(jax.sharding.Mesh(np.array(devs).reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    src = {k: views.param(f"['{k}']", s, np.float32) for k, s in shapes.items()}
    qkv = views.astype(views.concat([src["q"], src["k"], src["v"]], axis=1, groups=2), "bfloat16")
    like = {"qkv": jax.ShapeDtypeStruct(qkv.shape, jax.numpy.bfloat16, sharding=tp)}
    return like, None, like, {"qkv": qkv}


opts = Options(timeout_s=120, chunk_bytes=CHUNK, staging_bytes=64 << 20)
rows = []
# Against gather-broadcast with one device per process only: with several, the plan's fast-link bytes
# between a process's own devices are no message between processes, and the two columns would disagree.
for name, sds in cases() if world.Get_size() == 8 else ():
    arrays = None
    if role == "source":
        arrays = {
            k: jax.make_array_from_callback(s.shape, s.sharding, lambda i, s=s: np.ones(s.shape, np.float32)[i])
            for k, s in sds.items()
        }
    group = RefitGroup(role, sds, domain=0 if role == "source" else 1, options=opts)
    j_times = timed(group, arrays, sds)
    if not rows:  # the plain TP4 -> TP2 x DP2 case: the reference for the fused case, per destination byte
        plain = (destination_bytes(sds), j_times)
    st = group.plan.stats()
    j_bytes = st.network_bytes + st.fast_bytes
    # Baseline over the same processes, same global layouts (group ranks), MPI collectives.
    gb = GatherBroadcast(world, range(half), range(half, world.Get_size()))
    pairs = [(t.src, t.dst) for t in group.plan.tensors]
    rank_process = {r: group._comm.process_of(r) for r in group.topology.ranks}
    local = {}
    if role == "source":
        for t, k in enumerate(group.names):
            key = k.strip("[]'")
            for sh in arrays[key].addressable_shards:
                r = group._rank_of(sh.device)
                local[(t, r)] = export_source(sh.data).view(np.float32).reshape(sh.data.shape)
    b_times = []
    for rep in range(REPEATS + 1):
        gb.wire_bytes = 0
        barrier()
        t0 = time.perf_counter()
        gb.run(pairs, rank_process, local)
        dt = slowest(time.perf_counter() - t0)
        if rep:
            b_times.append(dt)
    b_bytes = world.allreduce(gb.wire_bytes)
    rows.append((name, j_bytes, j_times, b_bytes, b_times))
    group.close()

# The fused case and the plain TP4 -> TP2 x DP2 case again, call for call in alternating order (a load
# that drifts over the run weighs on both alike), both groups open at once.
decl, arrays, like, recipe = fused_case()
fused_group = RefitGroup(role, decl, domain=0 if role == "source" else 1, options=opts, recipe=recipe)
plain_sds = next(cases())[1]
plain_arrays = None
if role == "source":
    plain_arrays = {
        k: jax.make_array_from_callback(s.shape, s.sharding, lambda i, s=s: np.ones(s.shape, np.float32)[i])
        for k, s in plain_sds.items()
    }
plain_group = RefitGroup(role, plain_sds, domain=0 if role == "source" else 1, options=opts)
plain_times: list[float] = []
fused_times: list[float] = []
order = [(plain_group, plain_arrays, plain_sds, plain_times), (fused_group, arrays, like, fused_times)]
for g, a, lk, _ in order:
    once(g, a, lk, version=0)  # warm-up
for rep in range(1, ALTERNATIONS + 1):
    for g, a, lk, out in order if rep % 2 else order[::-1]:
        out.append(once(g, a, lk, version=rep))
plain = (destination_bytes(plain_sds), plain_times)
fused = (destination_bytes(like if role == "destination" else {}), fused_times)
fused_wire = world.allreduce(fused_group.sent_bytes.get(Link.NETWORK, 0) + fused_group.sent_bytes.get(Link.FAST, 0))
plain_wire = world.allreduce(plain_group.sent_bytes.get(Link.NETWORK, 0) + plain_group.sent_bytes.get(Link.FAST, 0))
plain_cpu, fused_cpu = CPU[id(plain_group)][1:], CPU[id(fused_group)][1:]  # the timed calls
cast_cpu = cast_alone(arrays)
fused_group.close()
plain_group.close()


def _stats(ts: list[float]) -> str:
    return f"{np.median(ts):.3f} [{min(ts):.3f}-{max(ts):.3f}]"


affinity = world.gather(sorted(os.sched_getaffinity(0)), root=0)
if me == 0:
    extra = "" if args.chunk_mib == 8.0 else f" --chunk-mib {args.chunk_mib:g}"
    print(f"$ .venv/bin/mpiexec -n {world.Get_size()} .venv/bin/python benchmarks/mpi_bench.py{extra}")
    print(
        f"jax {jax.__version__}, {world.Get_size()} processes x {8 // world.Get_size()} CPU devices, "
        f"{os.cpu_count()} cores; the processes' cores: {affinity}; chunks of {args.chunk_mib:g} MiB"
    )
    if rows:
        print(
            "| case | jreshard wire MB | jreshard s, median [min-max] | gather-broadcast wire MB | "
            "gather-broadcast s | time ratio |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for name, jb, jt, bb, bt in rows:
            ratio = np.median(bt) / np.median(jt)
            print(f"| {name} | {jb / 1e6:.1f} | {_stats(jt)} | {bb / 1e6:.1f} | {_stats(bt)} | {ratio:.2f}x |")
        print()
    print("| case (same run) | destination MB | jreshard wire MB | s, median [min-max] | ns per destination byte |")
    print("|---|---:|---:|---:|---:|")
    per = {}
    for name, (nbytes, ts), wire in (
        ("plain float32 TP4 -> TP2 x DP2", plain, plain_wire),
        ("fused qkv float32 -> bfloat16 TP4 -> TP2 x DP2", fused, fused_wire),
    ):
        per[name] = np.median(ts) / nbytes
        print(f"| {name} | {nbytes / 1e6:.1f} | {wire / 1e6:.1f} | {_stats(ts)} | {per[name] * 1e9:.3f} |")
    a, b = per.values()
    pairs = [f / p for p, f in zip(plain[1], fused[1], strict=True)]
    print(
        f"fused / plain time per destination byte: {b / a:.2f}x (ratio of medians; aim <= 1.15x); "
        f"per alternation {np.median(pairs) * plain[0] / fused[0]:.2f}x median "
        f"[{min(pairs) * plain[0] / fused[0]:.2f}-{max(pairs) * plain[0] / fused[0]:.2f}]"
    )
    p_cpu, f_cpu, c_cpu = (float(np.median(x)) for x in (plain_cpu, fused_cpu, cast_cpu))
    print(
        f"CPU seconds per call, all {world.Get_size()} processes together, median: plain {p_cpu:.3f}, "
        f"fused {f_cpu:.3f} ({f_cpu / p_cpu:.2f}x); "
        f"the cores were busy {p_cpu / np.median(plain[1]) / os.cpu_count():.0%} and "
        f"{f_cpu / np.median(fused[1]) / os.cpu_count():.0%} of the wall time"
    )
    print(
        f"the senders' cast alone (the same kernel over the same float32 shards): {c_cpu:.3f} CPU s; "
        f"plain + cast = {(p_cpu + c_cpu) / p_cpu:.2f}x the plain case's CPU"
    )
