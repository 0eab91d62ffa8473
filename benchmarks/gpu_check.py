"""One-GPU check of jreshard's GPU path: the ``gpu`` tests, kernel bandwidth, and a 4 GiB transfer.

Run on a machine with one (or more) NVIDIA GPU, jax with CUDA, CuPy and NCCL::

    python benchmarks/gpu_check.py            # about 2-4 minutes on one H200

It runs, each step guarded so a failure prints one line and the rest still run:

1. ``pytest -m gpu`` (DLPack round trips without copies, bf16/fp8, stream ordering
   against a pending jax computation, pack/unpack kernels against numpy, a one-GPU
   NCCL communicator sending to itself through the engine);
2. pack and unpack bandwidth of the descriptor-table kernel, for strided pieces of
   64 KiB to 16 MiB with 1 KiB and 16 KiB contiguous runs, against a plain
   device-to-device copy of the same bytes (``cudaMemcpyAsync``; target: >= 80%);
3. ``jreshard.transfer`` of a 4 GiB float32 array between two shardings of the one
   GPU against ``jax.device_put(..., may_alias=False)`` (a forced copy).

It prints one table: bytes, seconds (median of timed repeats, CUDA events for the
kernels), GB/s (1e9 bytes per second) and the ratio to the copy ceiling.
Not yet run on a GPU: written against the CuPy and jax documentation.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cuda,cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave memory for CuPy

import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROWS: list[tuple[str, str, str, str, str, str]] = []
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def row(check: str, nbytes: int | None, seconds: float | None, ratio: float | None, status: str) -> None:
    gbps = nbytes / seconds / 1e9 if nbytes and seconds else None
    ROWS.append(
        (
            check,
            f"{nbytes / MiB:.1f} MiB" if nbytes is not None else "",
            f"{seconds * 1e3:.3f} ms" if seconds is not None else "",
            f"{gbps:.1f}" if gbps is not None else "",
            f"{ratio:.2f}" if ratio is not None else "",
            status,
        )
    )


def guarded(name: str):
    def wrap(fn):
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as err:
                print(f"FAILED {name}: {type(err).__name__}: {err}", flush=True)
                traceback.print_exc(limit=3)
                row(name, None, None, None, f"FAILED: {type(err).__name__}")
                return None

        return run

    return wrap


@guarded("pytest -m gpu")
def run_gpu_tests() -> None:
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "tests"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    dt = time.perf_counter() - t0
    tail = [line for line in proc.stdout.splitlines() if line.strip()][-12:]
    print("\n".join(tail), flush=True)
    summary = tail[-1] if tail else proc.stderr[-200:]
    if proc.returncode != 0:
        status = "FAILED: "
    elif "skipped" in summary or "passed" not in summary:
        status = "SKIPPED (see the reasons above): "
    else:
        status = "ok: "
    row("pytest -m gpu", None, dt, None, status + summary.strip("= "))


def _time_events(cp, fn, reps: int) -> float:
    """Median seconds of ``fn()`` between CUDA events on the current stream."""
    fn()  # warm-up (compiles the kernel)
    times = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return float(np.median(times))


@guarded("kernel bandwidth")
def kernel_bandwidth() -> None:
    import cupy as cp

    from jreshard.nccl import cuda_kernels as CK
    from jreshard.nccl import kernels as K
    from jreshard.sharding.box import Box

    total = 512 * MiB
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        a = cp.empty(total * 2, cp.uint8)
        b = cp.empty(total * 2, cp.uint8)
        a.fill(1)

        def memcpy():
            b.data.copy_from_device_async(a.data, total, stream)

        ceiling = _time_events(cp, memcpy, 10)
    row("device-to-device copy (ceiling)", total, ceiling, 1.0, "ok")
    for piece in (64 * KiB, 1 * MiB, 16 * MiB):
        for run in (1 * KiB, 16 * KiB):
            # Shard rows of 2 * run bytes; each piece takes the first half of piece/run rows.
            rows_per_piece = piece // run
            n_pieces = total // piece
            outer = (n_pieces * rows_per_piece, 2 * run)
            pieces = [
                (0, outer, Box((i * rows_per_piece, 0), ((i + 1) * rows_per_piece, run))) for i in range(n_pieces)
            ]
            table = K.build_table(pieces)
            for kind in ("pack", "unpack"):
                if kind == "pack":
                    lt = CK.pack_launch(table, [a.data.ptr], b.data.ptr)
                else:
                    lt = CK.unpack_launch(table, b.data.ptr, [a.data.ptr])
                with stream:
                    dev_table = cp.asarray(lt)
                    kernel = CK._kernel(cp)
                    grid = CK.grid_size(lt)
                    rows = len(lt)

                    def go(kernel=kernel, dev_table=dev_table, grid=grid, n=rows):
                        kernel((grid,), (CK.THREADS,), (dev_table, np.int32(n)))

                    t = _time_events(cp, go, 10)
                ratio = ceiling / t
                status = "ok" if ratio >= 0.8 else "below 80% target"
                row(f"{kind} {piece // KiB} KiB pieces, {run // KiB} KiB runs", total, t, ratio, status)
    # Correctness of the last launch against numpy, on a slice (cheap).
    small = K.build_table([(0, (64, 4096), Box((3, 16), (60, 3000)))])
    host = np.random.default_rng(0).integers(0, 256, 64 * 4096, dtype=np.uint8)
    with stream:
        src = cp.asarray(host)
        out = cp.zeros(K.table_bytes(small), cp.uint8)
        CK.launch(CK.pack_launch(small, [src.data.ptr], out.data.ptr), stream, cp)
    stream.synchronize()
    want = np.zeros(K.table_bytes(small), np.uint8)
    K.pack_cpu(small, [host], want)
    row("pack kernel vs numpy", int(want.size), None, None, "ok" if np.array_equal(cp.asnumpy(out), want) else "FAILED")


@guarded("transfer 4 GiB")
def transfer_4gib() -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    import jreshard

    gpu = jax.devices("gpu")[0]
    n = 4 * GiB // 4
    shape = (n // 8192, 8192)
    src_sharding = SingleDeviceSharding(gpu)
    dst_sharding = NamedSharding(Mesh(np.array([gpu]).reshape(1, 1), ("dp", "tp")), P("dp", "tp"))
    x = jax.jit(lambda: jnp.arange(shape[0] * shape[1], dtype=jnp.float32).reshape(shape), out_shardings=src_sharding)()
    x.block_until_ready()

    def put():
        return jax.device_put(x, dst_sharding, may_alias=False).block_until_ready()

    def ours():
        return jax.block_until_ready(jreshard.transfer(x, dst_sharding))

    results = {}
    for name, fn in (("jax.device_put (forced copy)", put), ("jreshard.transfer", ours)):
        fn()  # warm-up: plans, compiles, allocates once
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            y = fn()
            times.append(time.perf_counter() - t0)
        results[name] = (float(np.median(times)), y)
    base = results["jax.device_put (forced copy)"][0]
    for name, (t, y) in results.items():
        same = bool(jnp.array_equal(y, x)) and y.sharding.is_equivalent_to(dst_sharding, x.ndim)
        row(name, 4 * GiB, t, base / t, "ok" if same else "FAILED: values or sharding differ")


def print_table() -> None:
    head = ("check", "bytes", "time", "GB/s", "vs ceiling", "status")
    widths = [max(len(str(r[i])) for r in [head, *ROWS]) for i in range(len(head))]
    line = "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))
    print("\n" + line + "\n" + "-" * len(line))
    for r in ROWS:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))


def describe() -> str:
    try:
        import cupy as cp
        import jax

        props = cp.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        return f"{name}; jax {jax.__version__}; cupy {cp.__version__}; python {sys.version.split()[0]}"
    except Exception as err:
        return f"(could not describe the GPU: {type(err).__name__}: {err})"


def main() -> int:
    t0 = time.perf_counter()
    print(f"jreshard gpu_check, {time.strftime('%Y-%m-%d')}: {describe()}", flush=True)
    run_gpu_tests()
    kernel_bandwidth()
    transfer_4gib()
    print_table()
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 1 if any(r[-1].startswith("FAILED") for r in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
