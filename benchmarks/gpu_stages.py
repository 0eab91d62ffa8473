"""The stages of ``benchmarks/gpu_check.py``, one per process: ``python gpu_stages.py NAME RESULTS.jsonl [--quick]``.

Each stage appends one JSON line per result to the results file, flushed at once.
Not yet run on a GPU: written against the CuPy 14 and jax 0.11 documentation, with
every CuPy call's argument types checked by ``tests/test_contract_cupy.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MiB, GiB = 1 << 20, 1 << 30
# Keeps a stream busy for about n GPU clocks, so a missing stream wait shows as a wrong sum.
SPIN_SOURCE = r'extern "C" __global__ void spin(long long n) { long long t = clock64(); while (clock64() - t < n) {} }'


class Results:
    def __init__(self, path: str, stage: str):
        self.path, self.stage = Path(path), stage

    def __call__(self, check: str, status: str, **data) -> None:
        rec = {"stage": self.stage, "check": check, "status": status, "time": time.time(), **data}
        with self.path.open("a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())


def stats(seconds: list[float], nbytes: int | None = None) -> dict:
    out = {"median_ms": 1e3 * float(np.median(seconds)), "min_ms": 1e3 * min(seconds), "max_ms": 1e3 * max(seconds)}
    if nbytes:
        out["bytes"] = nbytes
        out["gbps_median"] = nbytes / float(np.median(seconds)) / 1e9
    return out


def event_times(cp, stream, fn, reps: int) -> list[float]:
    """Seconds of ``fn()`` between CUDA events on ``stream``, after one warm-up call."""
    fn()
    out = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        out.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return out


def gpu():
    import jax

    return jax.devices("gpu")[0]


def self_comm(o: int, namespace: str):
    """NcclComm over ranks 0 and 1, both on GPU ``o``: NCCL rank 0 sends to itself."""
    from jreshard.nccl.cupy_nccl import NcclComm
    from jreshard.nccl.rendezvous import KeyValueRendezvous

    return NcclComm(
        devices={0: 0, 1: 0, 2: 0},
        local_devices={0: o, 1: o, 2: o},
        rendezvous=KeyValueRendezvous.in_process(),
        namespace=namespace,
        timeout_s=120.0,
    )


# ---- stages ---------------------------------------------------------------------


def versions(emit, quick):
    import cupy as cp
    import jax

    from jreshard.nccl.nccl_support import uid_argument, uid_to_bytes

    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    emit("versions", "info", python=sys.version.split()[0], numpy=np.__version__, jax=jax.__version__,
         cupy=cp.__version__, cuda_runtime=cp.cuda.runtime.runtimeGetVersion(),
         cuda_driver=cp.cuda.runtime.driverGetVersion(), gpu=name, jax_devices=[str(d) for d in jax.devices()],
         env={k: os.environ.get(k) for k in ("JAX_PLATFORMS", "XLA_PYTHON_CLIENT_PREALLOCATE",
                                              "XLA_PYTHON_CLIENT_MEM_FRACTION")})  # fmt: skip
    from cupy.cuda import nccl

    made = nccl.get_unique_id()
    passed = uid_argument(nccl, uid_to_bytes(made), None)
    emit("nccl unique id", "ok" if type(passed) is type(made) else "FAILED", available=nccl.available,
         nccl=nccl.get_version(), id_type=type(made).__name__, id_len=len(made),
         receiver_passes=type(passed).__name__)  # fmt: skip


def kernel(emit, quick):
    import cupy as cp

    from jreshard.nccl.gpu_buffers import CupyBuffers
    from jreshard.schedule import kernels as K
    from jreshard.sharding.box import Box

    g = gpu()
    o = g.local_hardware_id
    bufs = CupyBuffers()
    table = K.build_table([(0, (64, 4096), Box((3, 16), (60, 3000)))])
    host = np.random.default_rng(0).integers(0, 256, 64 * 4096, dtype=np.uint8)
    with cp.cuda.Device(o), bufs.stream(o):
        src = cp.asarray(host)
        out = cp.zeros(K.table_bytes(table), cp.uint8)
    t0 = time.perf_counter()
    bufs.pack(table, [src], out)
    bufs.synchronize()
    first = time.perf_counter() - t0
    want = np.zeros(K.table_bytes(table), np.uint8)
    K.pack_cpu(table, [host], want)
    ok = np.array_equal(cp.asnumpy(out), want)
    emit("compile + first launch", "ok" if ok else "FAILED", seconds=first, bytes=int(want.size))


def dlpack(emit, quick):
    import cupy as cp
    import jax
    import jax.numpy as jnp

    from jreshard.nccl.gpu_buffers import CupyBuffers

    g = gpu()
    o = g.local_hardware_id
    bufs = CupyBuffers()
    x = jax.device_put(np.arange(1 << 20, dtype=np.float32), g)
    view = bufs.export_source(x)
    emit("export zero-copy", "ok" if view.data.ptr == x.unsafe_buffer_pointer() else "FAILED")
    n = (16 if quick else 256) * MiB // 4
    (dst,) = bufs.allocate([n * 4], g)
    y = bufs.import_shard(dst, (n,), np.dtype(np.float32), g)
    emit("import zero-copy", "ok" if y.unsafe_buffer_pointer() == dst.data.ptr else "FAILED")
    spin = cp.RawKernel(SPIN_SOURCE, "spin")
    wrong = []
    for i in range(20):
        (dst,) = bufs.allocate([n * 4], g)
        s = bufs.stream(o)
        with cp.cuda.Device(o), s:
            spin((1,), (1,), (np.int64(2_000_000),))  # ~1 ms of GPU time before the write
            dst.view(cp.float32).fill(float(i + 1))
        y = bufs.import_shard(dst, (n,), np.dtype(np.float32), g)  # no host sync: jax must wait on s
        seen = int(jnp.sum(y != float(i + 1)))  # elements jax read before the write landed
        if seen:
            wrong.append((i, seen))
    emit("ordering: CuPy write on a non-default stream, then jax sum, 20x", "FAILED" if wrong else "ok",
         wrong=wrong[:5], bytes=n * 4)  # fmt: skip
    bufs.release()


def kernel_cases(emit, quick):
    import cupy as cp

    from jreshard.nccl.gpu_buffers import CupyBuffers
    from jreshard.schedule import kernels as K
    from jreshard.sharding.box import Box, intersect

    g = gpu()
    o = g.local_hardware_id
    bufs = CupyBuffers()
    bad = []
    seeds = range(10 if quick else 60)
    for seed in seeds:  # the generator of tests/test_cuda_kernels_math.random_case, on device buffers
        rng = np.random.default_rng(seed)
        itemsize = int(rng.choice([1, 2, 4, 8]))
        ndim = int(rng.integers(1, 5))
        shapes, hosts = [], []
        for _ in range(int(rng.integers(1, 4))):
            shape = tuple(int(v) for v in rng.integers(1, 9, size=ndim))
            shapes.append(shape)
            hosts.append(rng.integers(0, 256, int(np.prod(K.byte_shape(shape, itemsize))), dtype=np.uint8))
        pieces, taken = [], []
        for _ in range(int(rng.integers(1, 6))):
            b = int(rng.integers(0, len(shapes)))
            lo = [int(rng.integers(0, n)) for n in shapes[b]]
            box = Box(tuple(lo), tuple(int(rng.integers(v + 1, n + 1)) for v, n in zip(lo, shapes[b], strict=True)))
            if any(pb == b and intersect(box, other) is not None for pb, other in taken):
                continue
            taken.append((b, box))
            pieces.append((b, K.byte_shape(shapes[b], itemsize), K.byte_box(box, itemsize)))
        table = K.build_table(pieces)
        with cp.cuda.Device(o), bufs.stream(o):
            dev = [cp.asarray(h) for h in hosts]
            stage = cp.zeros(K.table_bytes(table), cp.uint8)
        want = np.zeros(K.table_bytes(table), np.uint8)
        K.pack_cpu(table, hosts, want)
        bufs.pack(table, dev, stage)
        bufs.synchronize()
        if not np.array_equal(cp.asnumpy(stage), want):
            bad.append(("pack", seed))
        fresh = rng.integers(0, 256, want.size, dtype=np.uint8)
        expect = [h.copy() for h in hosts]
        K.unpack_cpu(table, fresh, expect)
        with cp.cuda.Device(o):
            stage.set(fresh, stream=bufs.stream(o))
        bufs.unpack(table, stage, dev)
        bufs.synchronize()
        if not all(np.array_equal(cp.asnumpy(d), e) for d, e in zip(dev, expect, strict=True)):
            bad.append(("unpack", seed))
    emit(f"{len(seeds)} random cases, pack and unpack vs numpy", "FAILED" if bad else "ok", bad=bad[:10])


def nccl(emit, quick):
    import cupy as cp

    from jreshard.engine.comm import RecvOp, SendOp

    g = gpu()
    o = g.local_hardware_id
    comm = self_comm(o, "gpu-check-nccl")
    total = (64 if quick else 1024) * MiB
    with cp.cuda.Device(o), comm.stream(0):
        src = cp.arange(total, dtype=cp.uint8)
        dst = cp.zeros(total, cp.uint8)
        cp.cuda.get_current_stream().synchronize()
        s = cp.cuda.Stream(non_blocking=True)
        base = event_times(cp, s, lambda: dst.data.copy_from_device_async(src.data, total, s), 5)
    emit("device memcpy (baseline)", "ok", **stats(base, total))
    for chunk in (8 * MiB, 64 * MiB):
        k = total // chunk
        sends = [SendOp(0, 1, i, src[i * chunk : (i + 1) * chunk]) for i in range(k)]
        recvs = [RecvOp(0, 1, i, dst[i * chunk : (i + 1) * chunk]) for i in range(k)]
        times = []
        for rep in range(4):
            with cp.cuda.Device(o):
                dst.fill(0)
                cp.cuda.Device(o).synchronize()
            t0 = time.perf_counter()
            comm.exchange(sends, recvs, timeout_s=120.0)
            if rep:
                times.append(time.perf_counter() - t0)
        same = bool(cp.array_equal(src, dst))
        st = stats(times, total)
        emit(f"self send/recv in {chunk // MiB} MiB chunks", "ok" if same else "FAILED", **st,
             vs_memcpy=float(np.median(base)) / float(np.median(times)))  # fmt: skip
    # The rank-local schedule's mail: int64 payloads through device buffers, on the deferred streams.
    from jreshard.engine.mail import comm_mail
    from jreshard.schedule.pairsched import COUNT_OUT, ROUNDS

    out = {(0, 1, COUNT_OUT): np.array([3, 1], np.int64), (0, 1, ROUNDS + 1): np.arange(7, dtype=np.int64)}
    t0 = time.perf_counter()
    got = comm_mail(comm, 60.0, buffers=comm.buffers(), devices={0: g, 1: g})(out, {k: v.size for k, v in out.items()})
    same = all(np.array_equal(got[k], v) for k, v in out.items())
    emit("scheduling mail in device buffers", "ok" if same else "FAILED", seconds=time.perf_counter() - t0)


def transfer(emit, quick):
    import cupy as cp
    import jax
    import jax.numpy as jnp

    import jreshard

    g = gpu()
    o = g.local_hardware_id
    nbytes = (64 * MiB) if quick else 4 * GiB
    shape = (nbytes // 4 // 8192, 8192)
    make = jax.jit(lambda: jnp.arange(shape[0] * shape[1], dtype=jnp.uint32).reshape(shape).astype(jnp.float32))
    x = jax.device_put(make(), g).block_until_ready()
    into = jax.device_put(jnp.zeros(shape, jnp.float32), g).block_until_ready()
    times, moved, aliased = [], [], []
    for _ in range(4):
        ptr = into.unsafe_buffer_pointer()
        t0 = time.perf_counter()
        out, rep = jreshard.transfer_into(x, into, report=True)
        out.block_until_ready()
        times.append(time.perf_counter() - t0)
        moved.append(rep.moved_bytes)
        aliased.append(out.unsafe_buffer_pointer() == ptr)
        into = out
    same = bool(jnp.array_equal(into, x))
    # In one process on GPUs transfer_into runs the engine into new arrays (into is left as it is), so
    # aliasing is reported, not required; the bytes moved and the values are.
    ok = same and all(m == nbytes for m in moved)
    emit("transfer_into", "ok" if ok else "FAILED", **stats(times[1:], nbytes), moved_bytes=moved,
         aliases_into=aliased, values_equal=same)  # fmt: skip
    put = []
    for _ in range(4):
        t0 = time.perf_counter()
        jax.device_put(x, g, may_alias=False).block_until_ready()
        put.append(time.perf_counter() - t0)
    emit("jax.device_put(may_alias=False)", "ok", **stats(put[1:], nbytes))
    with cp.cuda.Device(o):
        a, b = cp.empty(nbytes, cp.uint8), cp.empty(nbytes, cp.uint8)
        s = cp.cuda.Stream(non_blocking=True)
        mem = event_times(cp, s, lambda: b.data.copy_from_device_async(a.data, nbytes, s), 3)
        a = b = None  # give the 8 GiB back before the engine stage
    emit("device memcpy", "ok", **stats(mem, nbytes))
    med = float(np.median(times[1:]))
    emit("ratios", "info", transfer_into_vs_device_put=float(np.median(put[1:])) / med,
         transfer_into_vs_memcpy=float(np.median(mem)) / med)  # fmt: skip
    engine_split(emit, x, g, o, nbytes, shape)


def engine_split(emit, x, g, o, nbytes, shape):
    """The engine moving ``x`` from rank 0 to a column split over ranks 1 and 2 (one GPU, NCCL to itself)."""
    from jreshard.engine.rounds import Shards, execute
    from jreshard.options import Options
    from jreshard.sharding.box import Box
    from jreshard.sharding.layout import Layout
    from jreshard.sharding.planner import plan_layouts
    from jreshard.sharding.topology import Topology

    half = shape[1] // 2
    src = Layout.from_boxes(shape, "float32", {0: Box((0, 0), shape)})
    dst = Layout.from_boxes(shape, "float32", {1: Box((0, 0), (shape[0], half)), 2: Box((0, half), shape)})
    topo = Topology.from_domains({0: 0, 1: 0, 2: 0}, devices={0: 0, 1: 1, 2: 2})
    opts = Options(backend="nccl", timeout_s=120.0)
    plan = plan_layouts([(src, dst)], topo, opts)
    comm = self_comm(o, "gpu-check-engine")
    bufs = comm.buffers(timeout_s=120.0)  # the path backend="nccl" takes: stream-ordered
    d1, d2 = bufs.allocate([nbytes // 2, nbytes // 2], g)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        execute(plan, comm, Shards(src={(0, 0): bufs.export_source(x)}, dst={(0, 1): d1, (0, 2): d2}),
                options=opts, backend=bufs, devices={0: g, 1: g, 2: g})  # fmt: skip
        times.append(time.perf_counter() - t0)
    y = bufs.import_shard(d2, (shape[0], half), np.dtype("float32"), g)
    ok = bool(np.array_equal(np.asarray(y[:64]), np.asarray(x[:64, half:])))
    emit("engine column split through NCCL (different boxes)", "ok" if ok else "FAILED",
         **stats(times[1:], nbytes), fast_bytes=plan.stats().fast_bytes)  # fmt: skip
    bufs.release()


def sweep(emit, quick):
    """Pack and unpack bandwidth per unit width and piece rank, against memcpy of the same bytes."""
    import cupy as cp

    from jreshard.nccl import cuda_kernels as CK
    from jreshard.schedule import kernels as K
    from jreshard.sharding.box import Box

    g = gpu()
    o = g.local_hardware_id
    total = (16 if quick else 256) * MiB
    rt = cp.cuda.runtime
    with cp.cuda.Device(o):
        s = cp.cuda.Stream(non_blocking=True)
        a = cp.zeros(4 * total + 64, cp.uint8)
        b = cp.zeros(4 * total + 64, cp.uint8)
        memcpy = event_times(cp, s, lambda: b.data.copy_from_device_async(a.data, total, s), 10)
        emit("memcpy (baseline)", "ok", **stats(memcpy, total))
        for width in (1, 2, 4, 16):
            run = 4096 if width == 16 else 4096 + width  # the widest unit that divides it is `width`
            for rank in (2, 3):
                rows = total // run
                shape = (rows, 2 * run) if rank == 2 else (rows // 8, 16, 2 * run)
                box = Box((0, 0), (rows, run)) if rank == 2 else Box((0, 0, 0), (rows // 8, 8, run))
                table = K.build_table([(0, shape, box)])
                nbytes = K.table_bytes(table)
                for kind in ("pack", "unpack"):
                    lt = (CK.pack_launch(table, [a.data.ptr], b.data.ptr) if kind == "pack"
                          else CK.unpack_launch(table, b.data.ptr, [a.data.ptr]))  # fmt: skip
                    if int(lt[0, CK.WIDTH]) != width:
                        emit(f"{kind} width {width} {rank}-D", "FAILED", why=f"unit width {int(lt[0, CK.WIDTH])}")
                        continue
                    t = event_times(cp, s, lambda lt=lt: CK.launch(lt, s, cp), 10)
                    rec = stats(t, nbytes)
                    rec["vs_memcpy"] = float(np.median(memcpy)) * nbytes / total / float(np.median(t))
                    if rank == 2:
                        m2d = event_times(
                            cp,
                            s,
                            lambda run=run, rows=rows: rt.memcpy2DAsync(
                                b.data.ptr, run, a.data.ptr, 2 * run, run, rows, rt.memcpyDeviceToDevice, s.ptr
                            ),
                            10,
                        )
                        rec["vs_memcpy2d"] = float(np.median(m2d)) / float(np.median(t))  # fmt: skip
                    emit(f"{kind} width {width} {rank}-D", "ok", **rec)


def pytest_gpu(emit, quick):
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-x", "-q", "-rs", "-p", "no:cacheprovider", "tests"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170 if quick else 230)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else proc.stderr[-300:]
    status = "FAILED" if proc.returncode else ("SKIPPED" if "skipped" in summary or "passed" not in summary else "ok")
    emit("pytest -m gpu -x", status, rc=proc.returncode, summary=summary, tail=lines[-25:])


STAGES = {"versions": versions, "kernel": kernel, "dlpack": dlpack, "kernel_cases": kernel_cases, "nccl": nccl,
          "transfer": transfer, "sweep": sweep, "pytest": pytest_gpu}  # fmt: skip


def main() -> int:
    name, path = sys.argv[1], sys.argv[2]
    emit = Results(path, name)
    try:
        STAGES[name](emit, "--quick" in sys.argv[3:])
    except Exception as err:
        emit("stage body", "FAILED", error=f"{type(err).__name__}: {err}", trace=traceback.format_exc()[-2000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
