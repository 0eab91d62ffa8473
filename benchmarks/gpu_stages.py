"""The stages of ``benchmarks/gpu_check.py``, one per process: ``python gpu_stages.py NAME RESULTS.jsonl [--quick]``.

Each stage appends one JSON line per result to the results file, flushed at once, and
ends with one ``summary`` line (the row of gpu_check's table). ``--standin`` runs a
stage against the numpy stand-ins of CuPy, NCCL and NVML (``tests/cupy_numpy.py``) on
jax's CPU devices: what CI checks the stages with. Not yet run on a GPU: written
against the CuPy 14 and jax 0.11 documentation, with every CuPy call's argument types
checked by ``tests/test_contract_cupy.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MiB, GiB = 1 << 20, 1 << 30
# Keeps a stream busy for about n GPU clocks, so a missing stream wait shows as a wrong sum.
SPIN_SOURCE = r'extern "C" __global__ void spin(long long n) { long long t = clock64(); while (clock64() - t < n) {} }'
# The GPU tests, as gpu_check runs them: the project's addopts (doctest modules) and cache off,
# warnings shown rather than raised, only tests/test_gpu.py and tests/test_gpu_casts.py collected.
PYTEST_STAGE = "pytest -m gpu tests/test_gpu.py tests/test_gpu_casts.py"  # the stage's check name
PYTEST_ARGS = (
    "-o",
    "addopts=",
    "-p",
    "no:cacheprovider",
    "-W",
    "default",
    "-m",
    "gpu",
    "tests/test_gpu.py",
    "tests/test_gpu_casts.py",
)
STANDIN = False  # set by --standin: the numpy stand-ins on CPU devices


def pytest_command(python: str, *, collect_only: bool = False) -> list[str]:
    """The pytest command of the ``pytest`` stage (``collect_only``: what CI runs to check the imports)."""
    return [python, "-m", "pytest", *PYTEST_ARGS, *(("--collect-only", "-q") if collect_only else ("-x", "-q", "-rs"))]


class Results:
    def __init__(self, path: str, stage: str):
        self.path, self.stage = Path(path), stage

    def __call__(self, check: str, status: str, **data) -> None:
        rec = {"stage": self.stage, "check": check, "status": status, "time": time.time(), **data}
        with self.path.open("a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())


def stats(seconds: list[float], nbytes: int | None = None, clock: str = "cuda events") -> dict:
    out = {
        "median_ms": 1e3 * float(np.median(seconds)),
        "min_ms": 1e3 * min(seconds),
        "max_ms": 1e3 * max(seconds),
        "clock": clock,
    }
    if nbytes:
        out["bytes"] = nbytes
        out["gbps_median"] = nbytes / max(float(np.median(seconds)), 1e-12) / 1e9
    return out


def event_times(cp, stream, fn: Callable[[], Any], reps: int, wait: Callable[[], None] | None = None) -> list[float]:
    """Seconds of ``fn()`` between CUDA events on ``stream``, after one warm-up call.

    ``wait`` (default: the end event's ``synchronize``) waits for the end event; pass a
    bounded wait where ``fn`` involves a peer.
    """
    fn()
    (wait or stream.synchronize)()
    out = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        (wait or end.synchronize)()
        out.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return out


def wall_times(fn: Callable[[], Any], reps: int) -> list[float]:
    """Host seconds of ``fn()`` (which waits for its own result), after one warm-up call."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def gpu():
    import jax

    return jax.devices()[0] if STANDIN else jax.devices("gpu")[0]


def self_comm(o: int, namespace: str):
    """NcclComm over ranks 0, 1 and 2, all on GPU ``o``: NCCL rank 0 sends to itself."""
    from jreshard.nccl.cupy_nccl import NcclComm
    from jreshard.nccl.rendezvous import KeyValueRendezvous

    return NcclComm(
        devices={0: 0, 1: 0, 2: 0},
        local_devices={0: o, 1: o, 2: o},
        rendezvous=KeyValueRendezvous.in_process(),
        namespace=namespace,
        timeout_s=60.0,
    )


class EndTimed:
    """A buffer backend that records a CUDA event on its stream just before the engine's final
    wait, so the engine's GPU time is read from events, not from the host wait around it."""

    def __init__(self, bufs, cp, ordinal: int):
        self._bufs, self._cp, self._o = bufs, cp, ordinal
        self.end = None

    def __getattr__(self, name):
        return getattr(self._bufs, name)

    def synchronize(self) -> None:
        with self._cp.cuda.Device(self._o):  # after the pack and unpack streams too
            self.end = self._bufs.streams.join(self._o).record()
        self._bufs.synchronize()


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
    ok = type(passed) is type(made)
    emit("nccl unique id", "ok" if ok else "FAILED", available=nccl.available, nccl=nccl.get_version(),
         id_type=type(made).__name__, id_len=len(made), receiver_passes=type(passed).__name__)  # fmt: skip
    emit("summary", "ok" if ok else "FAILED", text=f"{name}, CUDA {cp.cuda.runtime.runtimeGetVersion()}, "
         f"jax {jax.__version__}, CuPy {cp.__version__}, NCCL {nccl.get_version()}")  # fmt: skip


def nvml(emit, quick):
    """The NVML calls of topology discovery: this GPU's fast-link domain key."""
    import socket

    import pynvml

    from jreshard.cuda.nvml import local_domain_keys

    o = gpu().local_hardware_id
    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    keys = local_domain_keys([o])
    key = keys[o]
    ok = key == f"host:{socket.gethostname()}" or key.startswith("nvlink:")
    emit("domain key", "ok" if ok else "FAILED", key=key, nvml_devices=count)
    emit("summary", "ok" if ok else "FAILED", text=f"domain key {key.split(':')[0]}:..., {count} NVML device(s)")


def kernel(emit, quick):
    import cupy as cp

    from jreshard.cuda.buffers import CupyBuffers
    from jreshard.schedule import kernels as K
    from jreshard.sharding.box import Box

    g = gpu()
    o = g.local_hardware_id
    bufs = CupyBuffers()
    table = K.build_table([(0, (64, 4096), Box((3, 16), (60, 3000)))])
    host = np.random.default_rng(0).integers(0, 256, 64 * 4096, dtype=np.uint8)
    with cp.cuda.Device(o), bufs.streams.pack(o):  # where the pack runs
        src = cp.asarray(host)
        out = cp.zeros(K.table_bytes(table), cp.uint8)
    t0 = time.perf_counter()
    bufs.pack(table, [src], out)
    bufs.synchronize()
    first = time.perf_counter() - t0
    want = np.zeros(K.table_bytes(table), np.uint8)
    K.pack_cpu(table, [host], want)
    ok = np.array_equal(cp.asnumpy(out), want)
    emit("compile + first launch", "ok" if ok else "FAILED", seconds=first, bytes=int(want.size), clock="wall")
    emit("summary", "ok" if ok else "FAILED", text=f"compile + first launch {first:.2f} s")
    bufs.release()


def dlpack(emit, quick):
    import cupy as cp
    import jax
    import jax.numpy as jnp

    from jreshard.cuda.buffers import CupyBuffers

    g = gpu()
    o = g.local_hardware_id
    bufs = CupyBuffers()
    x = jax.device_put(np.arange(1 << 20, dtype=np.float32), g)
    view = bufs.export_source(x)
    exp = view.data.ptr == x.unsafe_buffer_pointer()
    emit("export zero-copy", "ok" if exp else "FAILED")
    n = (16 if quick else 256) * MiB // 4
    (dst,) = bufs.allocate([n * 4], g)
    y = bufs.import_shard(dst, (n,), np.dtype(np.float32), g)
    imp = y.unsafe_buffer_pointer() == dst.data.ptr
    emit("import zero-copy", "ok" if imp else "FAILED")
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
    ok = exp and imp and not wrong
    emit("summary", "ok" if ok else "FAILED",
         text=f"zero-copy export {exp}, import {imp}; ordering wrong in {len(wrong)} of 20")  # fmt: skip
    bufs.release()


def kernel_cases(emit, quick):
    import cupy as cp

    from jreshard.cuda.buffers import CupyBuffers
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
        with cp.cuda.Device(o), bufs.streams.pack(o):  # where the pack runs
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
    emit("summary", "FAILED" if bad else "ok", text=f"{len(seeds) * 2 - len(bad)} of {len(seeds) * 2} equal to numpy")
    bufs.release()


def sweep(emit, quick):
    """Pack and unpack bandwidth per unit width and piece rank, against memcpy of the same bytes."""
    import cupy as cp

    from jreshard.cuda import kernels as CK
    from jreshard.schedule import kernels as K
    from jreshard.sharding.box import Box

    g = gpu()
    o = g.local_hardware_id
    total = (MiB // 4) if STANDIN else (16 if quick else 256) * MiB  # the stand-in runs the kernel's numpy model
    reps = 1 if STANDIN else 10
    rt = cp.cuda.runtime
    worst = None
    with cp.cuda.Device(o):
        s = cp.cuda.Stream(non_blocking=True)
        with s:  # zeroed where the copies run (a non-blocking stream does not wait for the legacy one)
            a = cp.zeros(4 * total + 64, cp.uint8)
            b = cp.zeros(4 * total + 64, cp.uint8)
        memcpy = event_times(cp, s, lambda: b.data.copy_from_device_async(a.data, total, s), reps)
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
                    t = event_times(cp, s, lambda lt=lt: CK.launch(lt, s, cp), reps)
                    rec = stats(t, nbytes)
                    rec["vs_memcpy"] = float(np.median(memcpy)) * nbytes / total / float(np.median(t))
                    if rank == 2:
                        m2d = event_times(
                            cp,
                            s,
                            lambda run=run, rows=rows: rt.memcpy2DAsync(
                                b.data.ptr, run, a.data.ptr, 2 * run, run, rows, rt.memcpyDeviceToDevice, s.ptr
                            ),
                            reps,
                        )
                        rec["vs_memcpy2d"] = float(np.median(m2d)) / float(np.median(t))  # fmt: skip
                    emit(f"{kind} width {width} {rank}-D", "ok", **rec)
                    if worst is None or rec["vs_memcpy"] < worst[0]:
                        worst = (rec["vs_memcpy"], f"{kind} width {width} {rank}-D")
    if worst is not None:
        emit("summary", "ok", text=f"slowest {worst[1]} at {worst[0]:.2f}x memcpy")


def small_leaves(emit, quick):
    """1000 small leaves (16 KiB each) moved by ``transfer_into`` and by ``jax.device_put`` on one GPU."""
    import jax
    import jax.numpy as jnp

    import jreshard

    g = gpu()
    n = 1000
    xs = [jax.device_put(jnp.full((64, 64), float(i), jnp.float32), g) for i in range(n)]
    reps = 3 if quick else 5

    def ours():
        nonlocal into
        into = jreshard.transfer_into(xs, into)
        jax.block_until_ready(into)

    def put():
        jax.block_until_ready(jax.device_put(xs, g, may_alias=False))

    into = [jax.device_put(jnp.zeros((64, 64), jnp.float32), g) for _ in range(n)]
    t_ours = wall_times(ours, reps)
    t_put = wall_times(put, reps)
    same = all(bool(jnp.array_equal(a, b)) for a, b in zip(into[::97], xs[::97], strict=True))
    nbytes = n * 64 * 64 * 4
    emit("transfer_into, 1000 leaves", "ok" if same else "FAILED", **stats(t_ours, nbytes, "wall"), leaves=n)
    emit("jax.device_put(may_alias=False), 1000 leaves", "ok", **stats(t_put, nbytes, "wall"), leaves=n)
    ratio = float(np.median(t_ours)) / float(np.median(t_put))
    emit("ratio", "info", transfer_into_over_device_put=ratio)
    emit("summary", "ok" if same else "FAILED",
         text=f"transfer_into {1e3 * float(np.median(t_ours)):.2f} ms, device_put {1e3 * float(np.median(t_put)):.2f} "
         f"ms: {ratio:.2f}x device_put's time")  # fmt: skip


def nccl(emit, quick):
    import cupy as cp

    from jreshard.engine.comm import RecvOp, SendOp
    from jreshard.nccl.cupy_nccl import destroy_cached_communicators

    g = gpu()
    o = g.local_hardware_id
    comm = self_comm(o, "gpu-check-nccl")
    try:
        bufs = comm.buffers(timeout_s=60.0)  # exchanges ordered on the stream: timed by its events
        s = comm.stream(0)
        total = (8 if STANDIN else 64 if quick else 1024) * MiB
        with cp.cuda.Device(o), s:
            src = cp.arange(total, dtype=cp.uint8)
            dst = cp.zeros(total, cp.uint8)
        bufs.synchronize()
        with cp.cuda.Device(o):
            base = event_times(cp, s, lambda: dst.data.copy_from_device_async(src.data, total, s), 5,
                               wait=bufs.synchronize)  # fmt: skip
        emit("device memcpy (baseline)", "ok", **stats(base, total))
        rates = []
        for chunk in (8 * MiB, 64 * MiB):
            chunk = min(chunk, total)
            k = total // chunk
            sends = [SendOp(0, 1, i, src[i * chunk : (i + 1) * chunk]) for i in range(k)]
            recvs = [RecvOp(0, 1, i, dst[i * chunk : (i + 1) * chunk]) for i in range(k)]
            with cp.cuda.Device(o), s:
                dst.fill(0)
            times = event_times(cp, s, lambda sends=sends, recvs=recvs: comm.exchange(sends, recvs, timeout_s=60.0),
                                3, wait=bufs.synchronize)  # fmt: skip
            same = bool(cp.array_equal(src, dst))
            st = stats(times, total)
            rates.append((chunk // MiB, st["gbps_median"], same))
            emit(f"self send/recv in {chunk // MiB} MiB chunks", "ok" if same else "FAILED", **st,
                 vs_memcpy=float(np.median(base)) / float(np.median(times)))  # fmt: skip
        # The per-process schedule's mail: int64 payloads through device buffers, on the deferred streams.
        from jreshard.engine.mail import comm_mail
        from jreshard.schedule.pairsched import COUNT_OUT, ROUNDS

        out = {(0, 1, COUNT_OUT): np.array([3, 1], np.int64), (0, 1, ROUNDS + 1): np.arange(7, dtype=np.int64)}
        t0 = time.perf_counter()
        got = comm_mail(comm, 60.0, buffers=bufs, devices={0: g, 1: g})(out, {k: v.size for k, v in out.items()})
        mail = all(np.array_equal(got[k], v) for k, v in out.items())
        emit("scheduling mail in device buffers", "ok" if mail else "FAILED", seconds=time.perf_counter() - t0,
             clock="wall")  # fmt: skip
        ok = mail and all(same for *_, same in rates)
        emit("summary", "ok" if ok else "FAILED",
             text=", ".join(f"{c} MiB chunks {r:.3g} GB/s" for c, r, _ in rates) + f"; mail {mail}")  # fmt: skip
        bufs.release()
    finally:
        emit("communicators destroyed", "info", count=destroy_cached_communicators())


def transfer(emit, quick):
    import cupy as cp
    import jax
    import jax.numpy as jnp

    import jreshard
    from jreshard.nccl.cupy_nccl import destroy_cached_communicators

    g = gpu()
    o = g.local_hardware_id
    nbytes = (4 * MiB) if STANDIN else (64 * MiB) if quick else 4 * GiB
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
    ok = same and all(m == nbytes for m in moved)
    emit("transfer_into", "ok" if ok else "FAILED", **stats(times[1:], nbytes, "wall"), moved_bytes=moved,
         aliases_into=aliased, values_equal=same)  # fmt: skip
    put = wall_times(lambda: jax.device_put(x, g, may_alias=False).block_until_ready(), 3)
    emit("jax.device_put(may_alias=False)", "ok", **stats(put, nbytes, "wall"))
    with cp.cuda.Device(o):
        a, b = cp.empty(nbytes, cp.uint8), cp.empty(nbytes, cp.uint8)
        s = cp.cuda.Stream(non_blocking=True)
        mem = event_times(cp, s, lambda: b.data.copy_from_device_async(a.data, nbytes, s), 3)
        a = b = None  # give the 8 GiB back before the engine stage
    emit("device memcpy", "ok", **stats(mem, nbytes))
    med = float(np.median(times[1:]))
    emit("ratios", "info", transfer_into_vs_device_put=float(np.median(put)) / med,
         transfer_into_vs_memcpy=float(np.median(mem)) / med)  # fmt: skip
    try:
        split_ok, split_gbps = engine_split(emit, x, g, o, nbytes, shape)
    finally:
        emit("communicators destroyed", "info", count=destroy_cached_communicators())
    emit("summary", "ok" if ok and split_ok else "FAILED",
         text=f"transfer_into {nbytes / med / 1e9:.3g} GB/s ({float(np.median(put)) / med:.2f}x device_put's speed, "
         f"aliases into {all(aliased[1:])}); engine split {split_gbps:.3g} GB/s")  # fmt: skip


def engine_split(emit, x, g, o, nbytes, shape) -> tuple[bool, float]:
    """The engine moving ``x`` from rank 0 to a column split over ranks 1 and 2 (one GPU, NCCL to itself)."""
    import cupy as cp

    from jreshard.engine.driver import schedule_local
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
    opts = Options(backend="nccl", timeout_s=60.0)
    comm = self_comm(o, "gpu-check-engine")
    bufs = comm.buffers(timeout_s=60.0)  # the path backend="nccl" takes: stream-ordered
    # the rounds the front door runs: each rank's own plan, paced pair by pair (the mail on the GPU)
    _, _, sched = schedule_local([(src, dst)], ["x"], topo, opts, comm, bufs, {0: g, 1: g, 2: g})
    timed = EndTimed(bufs, cp, o)
    d1, d2 = bufs.allocate([nbytes // 2, nbytes // 2], g)
    shards = Shards(src={(0, 0): bufs.export_source(x)}, dst={(0, 1): d1, (0, 2): d2})
    times = []
    for _ in range(3):
        with cp.cuda.Device(o):
            start = bufs.stream(o).record()
        execute(sched, comm, shards, options=opts, buffers=timed, devices={0: g, 1: g, 2: g})
        times.append(cp.cuda.get_elapsed_time(start, timed.end) / 1e3)
    y = bufs.import_shard(d2, (shape[0], half), np.dtype("float32"), g)
    ok = bool(np.array_equal(np.asarray(y[:64]), np.asarray(x[:64, half:])))
    st = stats(times[1:], nbytes)
    emit("engine column split through NCCL (different boxes)", "ok" if ok else "FAILED", **st,
         fast_bytes=plan_layouts([(src, dst)], topo, opts).stats().fast_bytes)  # fmt: skip
    bufs.release()
    return ok, st["gbps_median"]


def graph(emit, quick):
    """A prepared refit of many small rounds captured as one CUDA graph (``NcclComm(graphs=True)``) against the
    eager engine, same schedule, same buffers: host wall time per step (the graph's point: the host's per-round
    work goes), each result checked against the source."""
    import cupy as cp
    import jax
    import jax.numpy as jnp

    from jreshard.engine import replay
    from jreshard.engine.driver import schedule_local
    from jreshard.engine.rounds import Shards, execute
    from jreshard.nccl.cupy_nccl import NcclComm, destroy_cached_communicators
    from jreshard.nccl.rendezvous import KeyValueRendezvous
    from jreshard.options import Options
    from jreshard.sharding.box import Box
    from jreshard.sharding.layout import Layout
    from jreshard.sharding.topology import Topology

    g = gpu()
    o = g.local_hardware_id
    rows = 64 if STANDIN else 256 if quick else 1024
    shape = (rows, 4096)  # float32: 16 KiB rows, 64 KiB chunks, a 2 x 2 tiling of column stripes: many rounds
    half_r, half_c = rows // 2, shape[1] // 2
    src_boxes = {0: Box((0, 0), (rows, half_c)), 3: Box((0, half_c), shape)}
    dst_boxes = {1: Box((0, 0), (half_r, half_c)), 2: Box((0, half_c), (half_r, shape[1])),
                 4: Box((half_r, 0), (rows, half_c)), 5: Box((half_r, half_c), shape)}  # fmt: skip
    src = Layout.from_boxes(shape, "float32", src_boxes)
    dst = Layout.from_boxes(shape, "float32", dst_boxes)
    ranks = sorted([*src_boxes, *dst_boxes])
    opts = Options(backend="nccl", chunk_bytes=64 << 10, staging_bytes=256 << 10, timeout_s=60.0)
    topo = Topology.from_domains(dict.fromkeys(ranks, 0), devices={r: r for r in ranks})
    x = jax.device_put(jnp.arange(shape[0] * shape[1], dtype=jnp.float32).reshape(shape), g).block_until_ready()
    host = np.asarray(x)

    def part(box):
        return np.ascontiguousarray(host[tuple(slice(a, b) for a, b in zip(box.lo, box.hi, strict=True))])

    out: dict[str, list[float]] = {}
    ok = True
    reps = 5 if STANDIN else 20
    for graphs in (False, True):
        comm = NcclComm(devices=dict.fromkeys(ranks, 0), local_devices=dict.fromkeys(ranks, o),
                        rendezvous=KeyValueRendezvous.in_process(), namespace=f"gpu-check-graph-{graphs}",
                        timeout_s=60.0, graphs=graphs)  # fmt: skip
        bufs = comm.buffers(timeout_s=60.0)
        # the rounds the front door runs: each rank's own plan, paced pair by pair (the mail on the GPU)
        _, _, sched = schedule_local([(src, dst)], ["x"], topo, opts, comm, bufs, dict.fromkeys(ranks, g))
        with cp.cuda.Device(o):
            srcs = {(0, r): cp.asarray(part(b).reshape(-1).view(np.uint8)) for r, b in src_boxes.items()}
            dsts = {(0, r): cp.zeros(part(b).nbytes, cp.uint8) for r, b in dst_boxes.items()}
            cp.cuda.Device(o).synchronize()

        def step(comm=comm, bufs=bufs, srcs=srcs, dsts=dsts, sched=sched):
            execute(sched, comm, Shards(src=srcs, dst=dsts), options=opts, buffers=bufs)

        times = wall_times(step, reps)
        for r, b in dst_boxes.items():
            got = cp.asnumpy(dsts[(0, r)]).view(np.float32).reshape(part(b).shape)
            ok = ok and bool(np.array_equal(got, part(b)))
        rep = list(replay._by_comm[comm].values())[-1]  # the refit's prepared schedule (the mail's come before it)
        name = "graph" if graphs else "eager"
        out[name] = times
        extra = {"captures": rep.graph.captures, "launches": rep.graph.launches} if graphs else {}
        emit(f"{name} engine", "ok" if ok else "FAILED", **stats(times, clock="wall"), rounds=rep.ops.rounds,
             **extra)  # fmt: skip
        bufs.release()
    emit("communicators destroyed", "info", count=destroy_cached_communicators())
    graph_ms, eager_ms = 1e3 * float(np.median(out["graph"])), 1e3 * float(np.median(out["eager"]))
    emit("summary", "ok" if ok else "FAILED",
         text=f"graph replay {graph_ms:.2f} ms a step, eager {eager_ms:.2f} ms ({eager_ms / graph_ms:.2f}x); "
         f"values equal {ok}")  # fmt: skip


def prealloc(emit, quick):
    """With XLA's default preallocation (75% of the GPU) left on: one ``transfer_into``, and the
    engine's two allocations, destination shards (through XLA) and staging (CuPy's pool)."""
    import cupy as cp
    import jax
    import jax.numpy as jnp

    import jreshard
    from jreshard.cuda.buffers import CupyBuffers
    from jreshard.errors import TransferError

    g = gpu()
    o = g.local_hardware_id
    nbytes = (16 if STANDIN or quick else 256) * MiB
    shape = (nbytes // 4 // 1024, 1024)
    x = jax.device_put(jnp.arange(shape[0] * shape[1], dtype=jnp.float32).reshape(shape), g).block_until_ready()
    into = jax.device_put(jnp.zeros(shape, jnp.float32), g).block_until_ready()
    with cp.cuda.Device(o):
        free, total = cp.cuda.runtime.memGetInfo()
    emit("memory with jax started", "info", free=free, total=total,
         preallocate=os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"))  # fmt: skip
    bufs = CupyBuffers()

    def results():
        (buf,) = bufs.allocate([nbytes], g)
        y = bufs.import_shard(buf, shape, np.dtype(np.float32), g)
        return bool(y.shape == shape)

    def staging():
        return bufs.staging(nbytes // 4, g).size == nbytes // 4

    out = []
    for what, call in (
        ("transfer_into", lambda: bool(jnp.array_equal(jreshard.transfer_into(x, into), x))),
        ("destination shards through XLA", results),
        ("staging from CuPy's pool", staging),
    ):
        try:
            ok = call()
            emit(what, "ok" if ok else "FAILED", bytes=nbytes)
            out.append(f"{what} {'ok' if ok else 'wrong'}")
        except TransferError as err:
            emit(what, "FAILED", error=f"{type(err).__name__}: {err}")
            out.append(f"{what} {type(err).__name__}")
    bufs.synchronize()
    bufs.release()
    passed = all(r.endswith(" ok") for r in out)
    emit("summary", "ok" if passed else "FAILED", text=", ".join(out) + f" ({free / total:.0%} free at start)")


def pytest_gpu(emit, quick, limit: float = 75.0):
    cmd = pytest_command(sys.executable)
    env = dict(os.environ)
    if STANDIN:
        env["JRESHARD_GPU_STANDIN"] = "1"  # read by the env fixtures of tests/test_gpu.py and test_gpu_casts.py only
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(limit - 8, 5), env=env)
    except subprocess.TimeoutExpired as err:
        tail = (err.stdout or b"")[-2000:]
        emit(PYTEST_STAGE, "TIMEOUT", tail=tail.decode() if isinstance(tail, bytes) else tail)
        emit("summary", "TIMEOUT", text="timed out")
        return
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else proc.stderr[-300:]
    status = "FAILED" if proc.returncode else ("SKIPPED" if "skipped" in summary or "passed" not in summary else "ok")
    emit(PYTEST_STAGE, status, rc=proc.returncode, summary=summary, cmd=cmd[2:], tail=lines[-25:])
    emit("summary", status, text=summary.strip("= "))


# The stage functions by name; gpu_check.STAGES gives their order and limits. One more stage
# (the xla backend's, from benchmarks/gpu_xla_stage.py) is added here and in gpu_check.STAGES.
def xla(emit, quick):
    """Backend xla's computation on the GPU (benchmarks/gpu_xla_stage.py), and the stage's summary line."""
    from gpu_xla_stage import xla_stage  # (benchmarks/ is on sys.path: this file's folder)

    seen: list[str] = []

    def counted(check, status, **data):
        seen.append(status)
        emit(check, status, **data)

    xla_stage(counted, quick)
    failed = seen.count("FAILED")
    emit("summary", "FAILED" if failed else "ok", text=f"{len(seen) - failed} of {len(seen)} xla checks ok")


STAGES: dict[str, Callable[..., None]] = {
    "versions": versions,
    "nvml": nvml,
    "kernel": kernel,
    "dlpack": dlpack,
    "kernel_cases": kernel_cases,
    "sweep": sweep,
    "small_leaves": small_leaves,
    "nccl": nccl,
    "transfer": transfer,
    "prealloc": prealloc,
    "xla": xla,
    "graph": graph,
    "pytest": pytest_gpu,
}


def main(argv: list[str] | None = None) -> int:
    global STANDIN
    args = list(sys.argv[1:] if argv is None else argv)
    name, path, rest = args[0], args[1], args[2:]
    emit = Results(path, name)
    limit = float(rest[rest.index("--limit") + 1]) if "--limit" in rest else 75.0
    if "--standin" in rest:
        STANDIN = True
        sys.path.insert(0, str(ROOT / "tests"))
        from cupy_numpy import install

        install()
    try:
        if name == "pytest":
            pytest_gpu(emit, "--quick" in rest, limit)
        else:
            STAGES[name](emit, "--quick" in rest)
    except Exception as err:
        emit("stage body", "FAILED", error=f"{type(err).__name__}: {err}", trace=traceback.format_exc()[-2000:])
        emit("summary", "FAILED", text=f"{type(err).__name__}: {str(err)[:120]}")
        return 1
    if STANDIN:  # what the stand-in saw issued out of stream order (a race on a GPU)
        import cupy

        races = cupy.cuda.standin.order.races
        emit("stream order", "FAILED" if races else "ok", races=races[:10], count=len(races))
        return 1 if races else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
