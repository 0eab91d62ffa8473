"""The backend-xla stage of the GPU check, as one function: :func:`xla_stage`.

    python benchmarks/gpu_xla_stage.py RESULTS.jsonl [--quick]       # alone: one JSON line per check
    JAX_PLATFORMS=cpu python benchmarks/gpu_xla_stage.py /tmp/xla.jsonl --quick   # the same on a CPU device

To register it with ``benchmarks/gpu_check.py`` (its stages are ``fn(emit, quick)`` in ``gpu_stages.STAGES``)::

    from gpu_xla_stage import xla_stage
    STAGES["xla"] = xla_stage

Not yet run on a GPU: on CPU it runs on one CPU device (``tests/test_gpu_xla_stage.py``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MiB = 1 << 20

Emit = Callable[..., None]


def _stats(seconds: list[float], nbytes: int) -> dict:
    med = float(np.median(seconds))
    return {
        "median_ms": 1e3 * med,
        "min_ms": 1e3 * min(seconds),
        "max_ms": 1e3 * max(seconds),
        "bytes": nbytes,
        "gbps_median": nbytes / med / 1e9 if med > 0 else 0.0,
    }


def xla_stage(emit: Emit, quick: bool) -> None:
    """Compile and run backend xla's computation for a transfer between two sharding kinds on one device.

    Signature (the GPU check's stage contract): ``xla_stage(emit, quick) -> None``.

    Args:
      emit: ``emit(check: str, status: str, **data)``, called once per result: ``status`` is ``"ok"``,
        ``"FAILED"``, ``"info"`` or ``"skipped"``; ``data`` is JSON-serialisable (times in ms, bytes).
      quick: 16 MiB instead of 1 GiB.

    Checks (on ``jax.devices()[0]``, a GPU where there is one):

    - ``xla compile``: the computation of a ``bfloat16`` transfer from a ``SingleDeviceSharding`` to a
      ``NamedSharding`` over a 1-device mesh splitting the columns: compile seconds, the computation's
      ``ppermute`` count (0 on one device: the plan is one same-device copy inside the computation);
    - ``xla transfer``: values equal bit for bit, the report's bytes equal the array's, and the
      time of 5 calls after the compiling one (median, min, max);
    - ``xla transfer_into``: the same into a donated array: the result is in the donated memory
      (buffer pointers equal), the donated array is deleted, values equal; times;
    - ``xla ppermute``: where the process has 2 or more devices of that platform (never on one
      GPU; always under the CPU test), the transfer between two devices, checked the same way, so
      the collective path runs too; otherwise ``skipped``.

    Every check emits ``FAILED`` with the values it saw rather than raising, so later checks run.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    import jreshard
    from jreshard.sharding.layout import Layout
    from jreshard.xla.run import compiled_for

    xla = jreshard.Options(backend="xla")
    jreshard.clear_caches()  # the compile is measured, not found in the cache
    dev = jax.devices()[0]
    nbytes = 16 * MiB if quick else 1 << 30
    shape = (nbytes // 2 // 4096, 4096)
    src = SingleDeviceSharding(dev)
    dst = NamedSharding(Mesh(np.array([dev]), ("x",)), P(None, "x"))
    make = jax.jit(lambda: jnp.arange(shape[0] * shape[1], dtype=jnp.uint32).reshape(shape).astype(jnp.bfloat16))
    x = jax.device_put(make(), src).block_until_ready()
    bits = jax.jit(lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16))

    def same(a: Any) -> bool:
        return bool(jnp.array_equal(bits(jax.device_put(a, dev)), bits(x)))

    t0 = time.perf_counter()
    out, rep = jreshard.transfer(x, dst, options=xla, report=True)
    out.block_until_ready()
    first = time.perf_counter() - t0
    pair = (Layout.from_sharding(src, shape, x.dtype), Layout.from_sharding(dst, shape, x.dtype))
    compiled, _ = compiled_for([pair], None, xla)
    emit(
        "xla compile",
        "ok" if rep.compile_s > 0 else "FAILED",
        platform=dev.platform,
        device=str(dev),
        compile_s=rep.compile_s,
        first_call_s=first,
        ppermutes=compiled.plan.stats.permutations,
    )
    ok = same(out) and rep.moved_bytes == nbytes and out.sharding == dst
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jreshard.transfer(x, dst, options=xla).block_until_ready()
        times.append(time.perf_counter() - t0)
    emit("xla transfer", "ok" if ok else "FAILED", **_stats(times, nbytes), moved_bytes=rep.moved_bytes,
         values_equal=same(out), padding_bytes=rep.padding_bytes)  # fmt: skip
    del out
    into = jax.device_put(jnp.zeros(shape, jnp.bfloat16), dst).block_until_ready()
    times, aliased, deleted = [], [], []
    for _ in range(6):
        ptr = into.addressable_shards[0].data.unsafe_buffer_pointer()
        t0 = time.perf_counter()
        got = jreshard.transfer_into(x, into, options=xla)
        got.block_until_ready()
        times.append(time.perf_counter() - t0)
        aliased.append(got.addressable_shards[0].data.unsafe_buffer_pointer() == ptr)
        deleted.append(into.is_deleted())
        into = got
    ok = all(aliased) and all(deleted) and same(into)
    emit("xla transfer_into", "ok" if ok else "FAILED", **_stats(times[1:], nbytes), in_place=aliased,
         into_deleted=deleted, values_equal=same(into))  # fmt: skip
    del into
    peers = [d for d in jax.local_devices() if d.platform == dev.platform]
    if len(peers) < 2:
        emit("xla ppermute", "skipped", reason=f"{len(peers)} {dev.platform} device(s) in this process")
        return
    a = NamedSharding(Mesh(np.array(peers[:1]), ("x",)), P("x"))
    b = NamedSharding(Mesh(np.array(peers[1:2]), ("x",)), P(None, "x"))
    y = jax.device_put(x, a)
    got, rep = jreshard.transfer(y, b, options=xla, report=True)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        jreshard.transfer(y, b, options=xla).block_until_ready()
        times.append(time.perf_counter() - t0)
    ok = same(got) and rep.network_bytes + rep.fast_bytes == nbytes and rep.padding_bytes == 0
    emit("xla ppermute", "ok" if ok else "FAILED", **_stats(times, nbytes), devices=[str(d) for d in peers[:2]],
         moved_bytes=rep.moved_bytes, compile_s=rep.compile_s)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0])
    failed = []

    def emit(check: str, status: str, **data: Any) -> None:
        rec = {"stage": "xla", "check": check, "status": status, "time": time.time(), **data}
        with path.open("a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        print(json.dumps(rec, default=str))
        if status == "FAILED":
            failed.append(check)

    xla_stage(emit, "--quick" in args[1:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
