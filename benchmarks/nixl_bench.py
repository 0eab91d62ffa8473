"""One refit over NIXL and over MPI, side by side in one run: same layouts, same tree, same machine.

Run: ``.venv/bin/python benchmarks/nixl_bench.py [--mib 64] [--repeats 9] [--rounds 4]``. A pair is
a ``RefitGroup`` of one source and one destination process, each with 2 CPU devices: the source
FSDP-shards a refit-like pytree over its 2 devices, the destination TP-shards it over its 2. Over
MPI the pair is one MPMD launch (``mpiexec -n 2``); over NIXL it is two separate launches
(``RefitGroup.connect(..., transport="nixl")``). Both use the same Options (chunking, staging).

Each launch pushes ``--warmup`` versions untimed (the first refit makes the plan, the NIXL agent,
the registrations and the first pages of every buffer), then times ``push`` (from the begin vote
to every process having committed) for ``--repeats`` versions. Launches alternate, MPI NIXL NIXL
MPI ... over ``--rounds`` rounds (each round one launch of each), so a change in the machine's load
during the run falls on both alike.

Printed: per transport, bytes per refit, the first (cold) push, median [min-max] seconds of all
timed pushes, GB/s at the median; per round, the NIXL / MPI ratio of the two launches' medians;
then the ratio of the medians of all timed pushes, and the load average before and after.
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


def worker(transport: str, role: str, address: str, result: str, mib: int, warmup: int, repeats: int) -> None:
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
        for v in range(warmup + repeats):
            t0 = time.perf_counter()
            group.push(params, version=v)
            times.append(time.perf_counter() - t0)
    else:
        for _ in range(warmup + repeats):
            tree, _ = group.pull(like=like)
            del tree
    group.close()
    nbytes = sum(4 * int(np.prod(s)) for s in shapes.values())
    if role == "source":  # a file of its own: the two processes of an mpiexec launch share stdout
        with open(result, "w") as f:
            json.dump({"first": times[0], "times": times[warmup:], "bytes": nbytes}, f)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env |= {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2", "JRESHARD_SECRET": SECRET}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _result(path: str, output: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise RuntimeError(f"the source wrote no result:\n{output[-3000:]}") from None


def _args(mib: int, warmup: int, repeats: int, result: str) -> list[str]:
    return ["--mib", str(mib), "--warmup", str(warmup), "--repeats", str(repeats), "--result", result]


def run_mpi(mib: int, warmup: int, repeats: int) -> dict:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        me = [sys.executable, __file__, "--worker", "mpi", *_args(mib, warmup, repeats, result)]
        cmd = [str(mpiexec), "-n", "1", *me, "--role", "source", ":", "-n", "1", *me, "--role", "destination"]
        out = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=900, check=False)
        return _result(result, out.stdout + out.stderr)


def run_nixl(mib: int, warmup: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        args = ["--worker", "nixl", *_args(mib, warmup, repeats, result), "--address", os.path.join(tmp, "address")]
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
        return _result(result, "\n".join(outs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--worker", choices=["mpi", "nixl"])
    ap.add_argument("--role", choices=["source", "destination"])
    ap.add_argument("--address", default="")
    ap.add_argument("--result", default="")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.role, a.address, a.result, a.mib, a.warmup, a.repeats)
        return
    if a.warmup < 1 or a.repeats < 1 or a.rounds < 1:
        ap.error("--warmup, --repeats and --rounds must be at least 1")
    load0 = os.getloadavg()
    runs: dict[str, list[dict]] = {"mpi": [], "nixl": []}
    launch = {"mpi": run_mpi, "nixl": run_nixl}
    for i in range(a.rounds):  # MPI NIXL, NIXL MPI, ...: a drift in load falls on both alike
        for name in ("mpi", "nixl") if i % 2 == 0 else ("nixl", "mpi"):
            runs[name].append(launch[name](a.mib, a.warmup, a.repeats))
    load1 = os.getloadavg()
    print("| transport | MB per refit | first push, s | s, median [min-max] | GB/s (median) |")
    print("|---|---|---|---|---|")
    med = {}
    for name, rs in runs.items():
        t = [x for r in rs for x in r["times"]]
        med[name] = statistics.median(t)
        first = statistics.median(r["first"] for r in rs)
        gbs = rs[0]["bytes"] / med[name] / 1e9
        print(
            f"| {name} | {rs[0]['bytes'] / 1e6:.1f} | {first:.4f} | {med[name]:.4f} [{min(t):.4f}-{max(t):.4f}] "
            f"| {gbs:.2f} |"
        )
    pairs = zip(runs["mpi"], runs["nixl"], strict=True)
    rounds = [statistics.median(n["times"]) / statistics.median(m["times"]) for m, n in pairs]
    print(f"NIXL / MPI per round (launch medians): {' '.join(f'{r:.2f}' for r in rounds)}")
    print(
        f"NIXL / MPI time ratio (medians of {len(rounds) * a.repeats} timed pushes each): "
        f"{med['nixl'] / med['mpi']:.2f}"
    )
    print(f"load average (1 min) before {load0[0]:.2f}, after {load1[0]:.2f}")


if __name__ == "__main__":
    main()
