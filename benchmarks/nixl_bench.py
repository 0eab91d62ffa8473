"""One refit over NIXL and over MPI, side by side in one run: same layouts, same tree, same machine.

Run: ``.venv/bin/python benchmarks/nixl_bench.py [--mib 64] [--repeats 7]``. It launches, one after
the other, a ``RefitGroup`` of one source and one destination process over MPI (``mpiexec -n 2``,
one MPMD launch) and the same group over NIXL (two separate launches, ``RefitGroup.connect(...,
transport="nixl")``), each process with 2 CPU devices: the source FSDP-shards a refit-like pytree
over its 2 devices, the destination TP-shards it over its 2. Each worker times ``push`` (from the
begin vote to every process having committed) for ``--repeats`` versions after one warm-up, and
prints the times; this prints bytes, median [min-max] seconds, GB/s of each, and the ratio
NIXL / MPI. Chunking and staging are the same Options for both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECRET = "nixl-bench-shared-key-0123456789"


def tree_shapes(mib: int) -> dict[str, tuple[int, ...]]:
    """A refit-like tree of about ``mib`` MiB of float32: layers of (d, 3d), (d, d), (d, 4d), (4d, d) and a norm."""
    d = 512
    per_layer = 4 * (3 * d * d + d * d + 4 * d * d + 4 * d * d + d)
    layers = max(1, (mib << 20) // per_layer)
    return {
        f"l{i}_{k}": s
        for i in range(layers)
        for k, s in (("wqkv", (d, 3 * d)), ("wo", (d, d)), ("w1", (d, 4 * d)), ("w2", (4 * d, d)), ("norm", (d,)))
    }


def worker(transport: str, role: str, address: str, mib: int, repeats: int) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard import Options, RefitGroup

    shapes = tree_shapes(mib)
    devs = jax.devices()
    if role == "source":
        mesh = Mesh(np.array(devs), ("fsdp",))
        sharding = {k: NamedSharding(mesh, P("fsdp") if len(s) == 2 else P()) for k, s in shapes.items()}
    else:
        mesh = Mesh(np.array(devs).reshape(1, 2), ("dp", "tp"))
        spec = {
            k: P() if len(s) == 1 else P("tp", None) if k.endswith(("wo", "w2")) else P(None, "tp")
            for k, s in shapes.items()
        }
        sharding = {k: NamedSharding(mesh, spec[k]) for k in shapes}
    like = {k: jax.ShapeDtypeStruct(s, np.float32, sharding=sharding[k]) for k, s in shapes.items()}
    opts = Options(timeout_s=120.0, chunk_bytes=8 << 20, staging_bytes=64 << 20)
    if transport == "nixl":
        group = RefitGroup.connect(role, like, address=address, transport="nixl", options=opts)
    else:
        group = RefitGroup(role, like, options=opts)
    times = []
    if role == "source":
        params = {
            k: jax.make_array_from_callback(s, sharding[k], lambda i, s=s: np.ones(s, np.float32)[i])
            for k, s in shapes.items()
        }
        for v in range(repeats + 1):
            t0 = time.perf_counter()
            group.push(params, version=v)
            times.append(time.perf_counter() - t0)
    else:
        for _ in range(repeats + 1):
            tree, _ = group.pull(like=like)
            del tree
    group.close()
    nbytes = sum(4 * int(np.prod(s)) for s in shapes.values())
    print(json.dumps({"role": role, "times": times[1:], "bytes": nbytes}), flush=True)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env |= {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2", "JRESHARD_SECRET": SECRET}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _result(outs: list[str]) -> dict:
    for out in outs:
        for line in out.splitlines():
            if line.startswith("{") and '"source"' in line:
                return json.loads(line)
    raise RuntimeError("no source result:\n" + "\n".join(o[-3000:] for o in outs))


def run_mpi(mib: int, repeats: int) -> dict:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    me = [sys.executable, __file__, "--worker", "mpi", "--mib", str(mib), "--repeats", str(repeats)]
    cmd = [str(mpiexec), "-n", "1", *me, "--role", "source", ":", "-n", "1", *me, "--role", "destination"]
    out = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=900, check=False)
    return _result([out.stdout + out.stderr])


def run_nixl(mib: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        address = os.path.join(tmp, "address")
        args = ["--worker", "nixl", "--mib", str(mib), "--repeats", str(repeats), "--address", address]
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, *args, "--role", role],
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for role in ("source", "destination")
        ]
        outs = [p.communicate(timeout=900)[0] for p in procs]
    return _result(outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--worker", choices=["mpi", "nixl"])
    ap.add_argument("--role", choices=["source", "destination"])
    ap.add_argument("--address", default="")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.role, a.address, a.mib, a.repeats)
        return
    results = {"mpi": run_mpi(a.mib, a.repeats), "nixl": run_nixl(a.mib, a.repeats)}
    print("| transport | MB per refit | s, median [min-max] | GB/s (median) |")
    print("|---|---|---|---|")
    med = {}
    for name, r in results.items():
        t = r["times"]
        med[name] = statistics.median(t)
        gbs = r["bytes"] / med[name] / 1e9
        print(f"| {name} | {r['bytes'] / 1e6:.1f} | {med[name]:.4f} [{min(t):.4f}-{max(t):.4f}] | {gbs:.2f} |")
    print(f"NIXL / MPI time ratio (medians): {med['nixl'] / med['mpi']:.2f}")


if __name__ == "__main__":
    main()
