"""One refit over NIXL and over MPI, side by side in one run: same processes, layouts, tree and Options.

Run: ``.venv/bin/python benchmarks/nixl_bench.py [--mib 64] [--warmup 1] [--repeats 25]``. One launch
(``mpiexec -n 2``) starts a source and a destination process, each with 2 CPU devices: the source
FSDP-shards a refit-like pytree over its 2 devices, the destination TP-shards it over its 2. The two
processes form two ``RefitGroup`` objects with the same declaration and Options (chunking,
staging, and ``delta="off"``: every version sends the whole tree, as a first refit does; with deltas the
unchanged tree would send next to nothing): one over MPI (``COMM_WORLD``), one over NIXL
(``RefitGroup.connect(..., transport="nixl")``, which meets at an address file and uses no MPI). Then they
push version after version, each version once over each transport, in alternating order (MPI NIXL, NIXL
MPI, ...), so whatever else the machine runs at a moment falls on all alike. Each version runs, in both processes:

- ``mpi``: the MPI group (one MPI universe: nothing digested);
- ``mpi-observed``: a second MPI group behind a digesting communicator that digests nothing: its compiled
  replay runs in parts, back in Python around every start and wait (what a digested refit over MPI runs,
  without the digests: the two parts of verify's cost);
- ``mpi-verify``: a third MPI group with ``Options(verify=True)`` (every message hashed with XXH3-128 on
  both sides, the digests compared in the commit vote);
- ``mpi-verify-overlap``: the same group with the hashes computed on a worker thread (``DigestComm.overlap``);
- ``nixl``: the NIXL group as jreshard runs it (the box MACs: every message's AES-GMAC tag on both sides,
  compared in the commit vote);
- ``nixl-overlap``: the same group with the box MACs computed on a worker thread beside the transfer
  (``DigestComm.overlap``) instead of in the refit's own thread where it waits for its peer (the two
  placements of the same work);
- ``nixl-plain``: the same group with the box MACs switched off (a switch of this benchmark only, by
  swapping the group's communicator for its transport): its ratio to ``nixl`` is the cost of the MACs;
- ``nixl-tags``: the same group with NIXL's per-message tags instead (what the box MACs replaced: each
  message's tag sent beside its WRITE and checked as it lands), for comparison;
- ``nixl-encrypt``: a NIXL group with ``Options(encrypt=True)`` (every message sealed with AES-256-GCM
  before it leaves and opened after it lands; the box MACs on too, as jreshard runs it).

The first ``--warmup`` versions are not timed (the first refit of each group makes its schedule, the
NIXL agent's first registrations and the first pages of every buffer); then ``--repeats`` versions
are. A push is timed on the source from its begin vote to every process having committed. The CPU
time of the source's push and of the destination's pull (user + system, from ``getrusage``) is
recorded beside it. Both groups must have sent the same bytes on every link (checked).

Printed: per transport, bytes per refit, median [min-max] seconds of the timed pushes, GB/s at the
median, the median CPU milliseconds per refit of the source and of the destination, and the median
seconds each side spent digesting (``DigestCost``: on the digest thread, and the part the refit waited
for), and the bytes digested; then the ratios (the
ratio of the medians, and the median and the [min-max] of the same version's ratios), and the load
average before and after. The last line is the cost of the box MACs, of ``verify`` and of ``encrypt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECRET = "nixl-bench-shared-key-0123456789"
TRANSPORTS = (
    "mpi",
    "mpi-observed",
    "mpi-verify",
    "mpi-verify-overlap",
    "nixl",
    "nixl-overlap",
    "nixl-plain",
    "nixl-tags",
    "nixl-encrypt",
)
GROUP = {"nixl-plain": "nixl", "nixl-tags": "nixl", "nixl-overlap": "nixl", "mpi-verify-overlap": "mpi-verify"}


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


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def worker(role: str, address: str, result: str, mib: int, warmup: int, repeats: int) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard import Options, RefitGroup
    from jreshard.engine.digest import DigestComm
    from jreshard.refit import boxes

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
    # every refit whole; messages of at most 2 MiB in every group, as a digested refit cuts them (boxes.digested),
    # so that a row with digests and one without move the same messages
    opts = Options(timeout_s=120.0, chunk_bytes=boxes.DIGEST_CHUNK, staging_bytes=64 << 20, delta="off")
    groups = {
        "mpi": RefitGroup(role, like, options=opts),
        "mpi-observed": RefitGroup(role, like, options=opts),
        "mpi-verify": RefitGroup(role, like, options=dataclasses.replace(opts, verify=True)),
        "nixl": RefitGroup.connect(role, like, address=address, transport="nixl", options=opts),
        "nixl-encrypt": RefitGroup.connect(
            role, like, address=address + ".encrypt", transport="nixl", options=dataclasses.replace(opts, encrypt=True)
        ),
    }
    params = None
    if role == "source":
        params = {
            k: jax.make_array_from_callback(s, sharding[k], lambda i, s=s: np.ones(s, np.float32)[i])
            for k, s in shapes.items()
        }
    groups["mpi-observed"]._comm = DigestComm(groups["mpi-observed"]._comm)  # no digests begun: the parts only
    nixl = groups["nixl"]
    boxed, wire = nixl._comm, nixl._wire  # the benchmark's switch: the group's digesting communicator, or not
    seconds: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
    cpu: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
    digest: dict[str, list[list[float]]] = {t: [] for t in TRANSPORTS}  # [seconds, bytes, waited] per refit
    pushed: dict = {}  # group -> its last version
    for v in range(warmup + repeats):
        for name in TRANSPORTS if v % 2 == 0 else TRANSPORTS[::-1]:
            plain = name in ("nixl-plain", "nixl-tags")
            nixl._comm, nixl._digest_kind = (wire, None) if plain else (boxed, "mac")
            wire.tags = name == "nixl-tags"
            boxed.overlap = name == "nixl-overlap"
            groups["mpi-verify"]._comm.overlap = name == "mpi-verify-overlap"
            group = groups[GROUP.get(name, name)]
            c0, t0 = _cpu_s(), time.perf_counter()
            if params is not None:
                pushed[group] = pushed.get(group, -1) + 1
                group.push(params, version=pushed[group])
            else:
                tree, _ = group.pull(like=like)
                del tree
            seconds[name].append(time.perf_counter() - t0)
            cpu[name].append(_cpu_s() - c0)
            cost = None if plain else group.digest_cost
            digest[name].append([0.0, 0, 0.0] if cost is None else [cost.seconds, cost.nbytes, cost.waited_s])
    sent = {t: {link.name: n for link, n in g.sent_bytes.items()} for t, g in groups.items()}
    for g in groups.values():
        g.close()
    nbytes = sum(4 * int(np.prod(s)) for s in shapes.values())
    out = {"bytes": nbytes, "sent": sent}
    out |= {"seconds": {t: seconds[t][warmup:] for t in TRANSPORTS}, "cpu": {t: cpu[t][warmup:] for t in TRANSPORTS}}
    out |= {"digest": {t: digest[t][warmup:] for t in TRANSPORTS}}
    with open(f"{result}.{role}", "w") as f:  # a file each: the two processes share stdout
        json.dump(out, f)


def run(mib: int, warmup: int, repeats: int) -> tuple[dict, dict]:
    """One launch of the pair: ``(source's record, destination's record)``."""
    env = dict(os.environ)
    env |= {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2", "JRESHARD_SECRET": SECRET}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    mpiexec = Path(sys.executable).parent / "mpiexec"
    with tempfile.TemporaryDirectory() as tmp:
        result, address = os.path.join(tmp, "result"), os.path.join(tmp, "address")
        me = [sys.executable, __file__, "--worker", "--mib", str(mib), "--warmup", str(warmup)]
        me += ["--repeats", str(repeats), "--result", result, "--address", address]
        cmd = [str(mpiexec), "-n", "1", *me, "--role", "source", ":", "-n", "1", *me, "--role", "destination"]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
        try:
            with open(f"{result}.source") as s, open(f"{result}.destination") as d:
                return json.load(s), json.load(d)
        except FileNotFoundError:
            raise RuntimeError(f"a worker wrote no result:\n{(out.stdout + out.stderr)[-3000:]}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--role", choices=["source", "destination"])
    ap.add_argument("--address", default="")
    ap.add_argument("--result", default="")
    a = ap.parse_args()
    if a.worker:
        worker(a.role, a.address, a.result, a.mib, a.warmup, a.repeats)
        return
    if a.warmup < 1 or a.repeats < 1:
        ap.error("--warmup and --repeats must be at least 1")
    load0 = os.getloadavg()[0]
    src, dst = run(a.mib, a.warmup, a.repeats)
    load1 = os.getloadavg()[0]
    if not src["sent"]["mpi"] == src["sent"]["nixl"] == src["sent"]["nixl-encrypt"] == src["sent"]["mpi-verify"]:
        raise RuntimeError(f"the groups sent different bytes: {src['sent']}")
    print(
        "| transport | MB per refit | s, median [min-max] | GB/s (median) | CPU ms per refit, source + destination "
        "| digest ms per refit, source + destination (of it waited for) | MB digested |"
    )
    print("|---|---|---|---|---|---|---|")
    med = {}
    for name in TRANSPORTS:
        t = src["seconds"][name]
        med[name] = statistics.median(t)
        cpu_s, cpu_d = (1e3 * statistics.median(r["cpu"][name]) for r in (src, dst))
        dig_s, dig_d = (1e3 * statistics.median(d[0] for d in r["digest"][name]) for r in (src, dst))
        wait_s, wait_d = (1e3 * statistics.median(d[2] for d in r["digest"][name]) for r in (src, dst))
        hashed = statistics.median(d[1] for d in dst["digest"][name]) / 1e6
        print(
            f"| {name} | {src['bytes'] / 1e6:.1f} | {med[name]:.4f} "
            f"[{min(t):.4f}-{max(t):.4f}] | {src['bytes'] / med[name] / 1e9:.2f} | {cpu_s:.0f} + {cpu_d:.0f} "
            f"| {dig_s:.1f} + {dig_d:.1f} ({wait_s:.1f} + {wait_d:.1f}) | {hashed:.1f} |"
        )
    ratio = {}
    for top, bottom, label in (
        ("nixl", "mpi", "NIXL / MPI"),
        ("nixl", "nixl-plain", "box MACs: NIXL / NIXL without them"),
        ("nixl-overlap", "nixl-plain", "box MACs on a worker thread: NIXL / NIXL without them"),
        ("nixl-tags", "nixl-plain", "per-message tags (replaced): NIXL tagged / NIXL plain"),
        ("mpi-verify", "mpi", "verify: MPI verify=True / MPI"),
        ("mpi-verify-overlap", "mpi", "verify's hashes on a worker thread: MPI verify=True / MPI"),
        ("mpi-observed", "mpi", "verify's replay in parts alone: MPI in parts / MPI"),
        ("nixl-encrypt", "nixl", "encrypt: NIXL encrypted / NIXL"),
        ("nixl-encrypt", "nixl-plain", "encrypt + box MACs: NIXL encrypted / NIXL plain"),
    ):
        per = [n / m for n, m in zip(src["seconds"][top], src["seconds"][bottom], strict=True)]
        ratio[top, bottom] = statistics.median(per)
        print(
            f"{label} time: {med[top] / med[bottom]:.2f} (medians of {a.repeats} pushes each); "
            f"{ratio[top, bottom]:.2f} [{min(per):.2f}-{max(per):.2f}] (median [min-max] of the {a.repeats} "
            "versions' ratios)"
        )
    print(f"load average (1 min) before {load0:.2f}, after {load1:.2f}")
    print(
        f"cost over a plain refit (median of per-version ratios): box MACs "
        f"{100 * (ratio['nixl', 'nixl-plain'] - 1):+.0f}%, verify {100 * (ratio['mpi-verify', 'mpi'] - 1):+.0f}%, "
        f"encrypt {100 * (ratio['nixl-encrypt', 'nixl'] - 1):+.0f}% (on top of the MACs)"
    )


if __name__ == "__main__":
    main()
