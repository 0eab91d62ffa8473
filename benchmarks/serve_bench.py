"""Refit while serving: the server's steps/s and its pause per refit, background receive against blocking.

Run: ``.venv/bin/python benchmarks/serve_bench.py [--mib 32] [--every 20] [--refits 24] [--transports nixl,mpi]
[--placement both]``.

A launch (``mpiexec -n 1 : -n 1``) starts two programs, each on one CPU device: a *trainer* that
holds the parameters of a small transformer (float32, about ``--mib`` MiB) and pushes version after
version, and a *server* that runs a jitted decode loop over them: each step one forward pass of the
transformer over a batch of ``--batch`` sequences of ``--seq`` tokens, the argmax of the last position
appended as the next token (the step waits for its result, as a sampler does). Both programs form a
``RefitGroup`` over MPI (``COMM_WORLD``) and one over NIXL (``RefitGroup.connect(transport="nixl")``), with the same
declaration and Options. The server's XLA runs without its Eigen thread pool (``--server-threads 1``); it still
runs independent operations of a step side by side, so a step the OS may place on two cores takes both.

Two launches, one per *placement* of the threads on the cores (``--placement both``, the default):

- *pinned*: the server's steps, and every thread of the server program but the receive, on the first core; the
  receive thread on the others (``pull_async(cpus=...)``), with the trainer, which in a fleet runs on other
  hosts. A server that gives its steps their own cores runs this way: a refit then takes from the steps only what
  the two threads share (the GIL for the receive's Python bookkeeping, memory bandwidth, the caches).
- *shared*: no core set; the OS places the server's step, its receive thread and the trainer on the two cores as
  it likes, so a step idle gets both and a step during a refit shares them with the receive and the trainer.

Per transport and placement, the server runs three phases:

- *idle*: ``--idle-steps`` steps with no refit (a warm-up), then the ``--every`` steps between two
  refits of the next phase, each stretch timed: steps/s idle is their median, measured at the same
  times as the refits (other programs load this machine: a ratio of neighbours is what holds);
- *background*: every ``--every`` steps it starts ``group.pull_async(into=params, nice=--nice)`` (10 by
  default, as ``pull_async``: the receive thread yields the cores to the server's steps) and keeps stepping;
  between two steps, once ``handle.ready()``, ``handle.flip()`` switches to the new version;
  ``--refits`` times. Steps/s *during refit* counts the steps done between the start of a pull and its
  flip, over that time; *throughput during refit* is the steps of every refit window over their total
  time, against the steps of the stretches between refits over theirs (the two interleaved, so a load
  that drifts falls on both); per refit, the rate against the stretch just before it (min, median, max);
- *blocking*: every ``--every`` steps it calls ``group.pull(into=params)`` between two steps.

The *pause* of a refit is what the issue defines: from the end of the server's last step on the old
version to the start of its first step on the new one (background: the ``flip`` call and the loop
around it; blocking: the whole ``pull``). The first refit of each phase and transport is not counted
(it builds the schedule and registers the buffers). Every refit's ``ServeReport`` (wait for the
trainer, wire, assemble, receive CPU) is summed up beside it. Every version changes every
byte: with ``--delta auto`` (the default, as ``Options``) the first delta refit finds that, and the
refits after it go whole (it looks again after 1, 2, 4, ... up to 64 of them, a delta refit each time);
``--delta on`` compares and keeps copies every refit; ``--delta off`` never does. The trainer program shares the
machine's cores with the server (the shared placement: all of them; pinned: the receive's): its pack and send are
part of what the server competes with.

Printed: per transport a row of medians (steps/s idle, during background refits as a % of idle with
its range, pause median and max, blocking pause, wire ms, receive CPU ms, steps per refit); a second
row: an idle step, a step during a refit (median and 90th percentile), the first step on the new
version, and the *dispatch* time of a step (the Python
call that queues it, which needs the GIL) idle and during refits, median and 99th percentile: a receive
thread holding the GIL would show there; the load average before and after;
then a line of the steps/s idle and during refits per placement (the transport lowest during refits: the
placements' idle rates differ, and a ratio hides that), the shared placement's summary line, and last, the
pinned placement's, over every transport: ``serve: pause <median> ms (<max> max), throughput during refit
<pct>% of idle, blocking pause <ms> ms`` (pauses over every background refit of every transport;
throughput the lowest transport's).
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
SECRET = "serve-bench-shared-key-0123456789"


def model_shapes(mib: int, d: int = 256, vocab: int = 4096) -> dict[str, tuple[int, ...]]:
    """The transformer's parameters: an embedding, then layers of (norm, qkv, out, up, down) to about ``mib`` MiB."""
    per_layer = 4 * (d + 3 * d * d + d * d + 4 * d * d + 4 * d * d)
    layers = max(1, ((mib << 20) - 4 * vocab * d) // per_layer)
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, d)}
    for i in range(layers):
        shapes |= {f"l{i}_norm": (d,), f"l{i}_qkv": (d, 3 * d), f"l{i}_out": (d, d)}
        shapes |= {f"l{i}_up": (d, 4 * d), f"l{i}_down": (4 * d, d)}
    return shapes


def make_step(shapes: dict[str, tuple[int, ...]], heads: int = 4):
    """A jitted decode step: ``(params, tokens[B, T]) -> tokens[B, T]`` shifted left, the argmax appended."""
    import jax
    import jax.numpy as jnp

    layers = sum(1 for k in shapes if k.endswith("_qkv"))

    def forward(p, tokens):
        x = p["embed"][tokens]  # [B, T, d]
        b, t, d = x.shape
        mask = jnp.tril(jnp.ones((t, t), bool))
        for i in range(layers):
            h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p[f"l{i}_norm"]
            q, k, v = jnp.split(h @ p[f"l{i}_qkv"], 3, -1)
            q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
            a = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // heads)
            a = jax.nn.softmax(jnp.where(mask, a, -1e9), -1)
            x = x + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, d) @ p[f"l{i}_out"]
            x = x + jax.nn.gelu(x @ p[f"l{i}_up"]) @ p[f"l{i}_down"]
        logits = x[:, -1] @ p["embed"].T
        return jnp.concatenate([tokens[:, 1:], jnp.argmax(logits, -1)[:, None].astype(tokens.dtype)], 1)

    return jax.jit(forward)


def trainer(groups: dict, shapes: dict, versions: int) -> dict:
    import jax
    import numpy as np

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    rng = np.random.default_rng(0)
    base = {k: (rng.standard_normal(s).astype(np.float32) * 0.05) for k, s in shapes.items()}
    for group in groups.values():
        for v in range(1, versions + 1):
            group.push({k: jax.device_put(x + 1e-3 * v, sharding) for k, x in base.items()}, version=v)
    return {}


def server(groups: dict, shapes: dict, a: argparse.Namespace) -> dict:
    import jax
    import numpy as np

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = {k: jax.ShapeDtypeStruct(s, np.float32, sharding=sharding) for k, s in shapes.items()}
    step = make_step(shapes)
    out: dict = {}
    for name, group in groups.items():
        params, _ = group.pull(like=like)  # version 1: the server starts on it
        tokens = jax.device_put(np.arange(a.batch * a.seq, dtype=np.int32).reshape(a.batch, a.seq) % 4096)
        for _ in range(3):
            tokens = step(params, tokens).block_until_ready()

        def timed(params, tokens, into: list):
            """One step; ``into`` gets its dispatch time (the Python call, which needs the GIL)."""
            t = time.perf_counter()
            y = step(params, tokens)
            into.append(time.perf_counter() - t)
            return y.block_until_ready()

        dispatch: dict[str, list] = {"idle": [], "refit": []}

        def run(n: int, params, tokens, into: list):
            for _ in range(n):
                tokens = timed(params, tokens, into)
            return tokens

        t0 = time.perf_counter()
        tokens = run(a.idle_steps, params, tokens, [])
        idle = a.idle_steps / (time.perf_counter() - t0)
        rec: dict = {"idle": idle, "idle_rate": [], "bg_rate": [], "bg_pause": [], "block_pause": [], "reports": []}
        rec["first_step"], rec["idle_s"], rec["refit_step"] = [], [], []
        for k in range(a.refits + 1):  # background: the first is a warm-up
            t0 = time.perf_counter()
            tokens = run(
                a.every, params, tokens, dispatch["idle"]
            )  # the steps between two refits: idle, measured at the same times
            rec["idle_rate"].append(a.every / (time.perf_counter() - t0))
            rec["idle_s"].append(time.perf_counter() - t0)
            h = group.pull_async(into=params, nice=a.nice, cpus=cores(a.other_cores))
            t_start, steps = time.perf_counter(), 0
            while not h.ready():
                t_step = time.perf_counter()
                tokens = timed(params, tokens, dispatch["refit"])
                if k:
                    rec["refit_step"].append(time.perf_counter() - t_step)
                steps += 1
            end_old = time.perf_counter()
            params, _ = h.flip()
            start_new = time.perf_counter()
            tokens = step(params, tokens).block_until_ready()
            rec["first_step"].append(time.perf_counter() - start_new)
            rec["bg_rate"].append(steps / max(end_old - t_start, 1e-9))
            rec["bg_pause"].append(start_new - end_old)
            r = h.report
            rec["reports"].append([r.wait_s, r.wire_s, r.assemble_s, r.processing_s, steps, end_old - t_start])
        rec["dispatch"] = {k: sorted(v) for k, v in dispatch.items()}
        for _ in range(a.refits + 1):  # blocking
            tokens = run(a.every, params, tokens, dispatch["idle"])
            end_old = time.perf_counter()
            params, _ = group.pull(into=params)
            rec["block_pause"].append(time.perf_counter() - end_old)
        for k in ("idle_rate", "idle_s", "bg_rate", "bg_pause", "block_pause", "reports", "first_step"):
            rec[k] = rec[k][1:]
        out[name] = rec
    return out


def cores(spec: str) -> set[int] | None:
    """``--step-cores`` / ``--other-cores`` as a set of cores (``""``: None, the OS places the threads)."""
    return {int(c) for c in spec.split(",")} if spec else None


def worker(a: argparse.Namespace) -> None:
    # pinned: the server's steps (and every thread it starts but the receive) on --step-cores, the trainer on
    # --other-cores; the receive thread goes there too (pull_async(cpus=...)). Set before jax starts its threads.
    mine = cores(a.step_cores if a.role == "destination" else a.other_cores)
    if mine is not None:
        os.sched_setaffinity(0, mine)
    if a.role == "source" and a.trainer_nice:
        os.nice(a.trainer_nice)
    if a.role == "destination" and a.switch_interval:
        sys.setswitchinterval(a.switch_interval)
    import jax

    from jreshard import Options, RefitGroup

    shapes = model_shapes(a.mib)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    import numpy as np

    like = {k: jax.ShapeDtypeStruct(s, np.float32, sharding=sharding) for k, s in shapes.items()}
    opts = Options(timeout_s=300.0, chunk_bytes=4 << 20, staging_bytes=32 << 20, delta=a.delta)
    groups = {}
    for t in a.transports.split(","):
        if t == "mpi":
            groups[t] = RefitGroup(a.role, like, options=opts)
        else:
            groups[t] = RefitGroup.connect(a.role, like, address=a.address, transport="nixl", options=opts)
    versions = 1 + 2 * (a.refits + 1)
    result = trainer(groups, shapes, versions) if a.role == "source" else server(groups, shapes, a)
    for g in groups.values():
        g.close()
    nbytes = sum(4 * int(np.prod(s)) for s in shapes.values())
    with open(f"{a.result}.{a.role}", "w") as f:
        json.dump({"bytes": nbytes, "transports": result}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--every", type=int, default=20, help="server steps between two refits")
    ap.add_argument("--refits", type=int, default=24, help="timed refits per phase and transport")
    ap.add_argument("--idle-steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--transports", default="nixl,mpi")
    ap.add_argument(
        "--server-threads",
        type=int,
        default=1,
        choices=[0, 1],
        help="1: the server's XLA runs its step on one thread (the other core left to the receive and the trainer); "
        "0: XLA's default, every core",
    )
    ap.add_argument("--delta", default="auto", help="Options.delta of both groups (every version changes every byte)")
    ap.add_argument("--nice", type=int, default=10, help="pull_async's nice: the receive thread's priority")
    ap.add_argument("--trainer-nice", type=int, default=0, help="the trainer program's nice value")
    ap.add_argument(
        "--switch-interval", type=float, default=0.0, help="the server's sys.setswitchinterval (0: Python's)"
    )
    ap.add_argument(
        "--placement",
        choices=["both", "pinned", "shared"],
        default="both",
        help="pinned: the server's steps on the first core, its receive thread and the trainer on the others; "
        "shared: the OS places every thread; both (default): a launch of each, the last line pinned's",
    )
    ap.add_argument("--step-cores", default="", help=argparse.SUPPRESS)  # set per launch by --placement
    ap.add_argument("--other-cores", default="", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--role", choices=["source", "destination"])
    ap.add_argument("--address", default="")
    ap.add_argument("--result", default="")
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    have = sorted(os.sched_getaffinity(0))
    placements = ["pinned", "shared"] if a.placement == "both" else [a.placement]
    if "pinned" in placements and len(have) < 2:
        print(f"pinned placement needs 2 cores; this process has {have}: shared only")
        placements = ["shared"]
    runs = []
    for placement in placements:
        if placement == "pinned":
            a.step_cores, a.other_cores = str(have[0]), ",".join(map(str, have[1:]))
        else:
            a.step_cores = a.other_cores = ""
        runs.append(launch(a, placement))
    print(
        "steps/s idle and during refits (the transport lowest during refits): "
        + ", ".join(f"{p} {idle:.1f} and {during:.1f}" for p, (_, idle, during) in zip(placements, runs, strict=True))
    )
    for placement, (line, _, _) in list(zip(placements, runs, strict=True))[1:]:
        print(f"{placement}: {line}")
    print(runs[0][0])


def launch(a: argparse.Namespace, placement: str) -> tuple[str, float, float]:
    """Run the two programs once with ``a``'s cores and print their tables; :func:`report`'s summary."""
    env = dict(os.environ)
    env |= {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1", "JRESHARD_SECRET": SECRET}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    mpiexec = Path(sys.executable).parent / "mpiexec"
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result")
        me = [sys.executable, __file__, "--worker", "--address", os.path.join(tmp, "address"), "--result", result]
        for k in (
            "mib",
            "every",
            "refits",
            "idle_steps",
            "batch",
            "seq",
            "transports",
            "nice",
            "delta",
            "trainer_nice",
            "switch_interval",
            "step_cores",
            "other_cores",
        ):
            me += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
        xla = ["-env", "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false"] if a.server_threads == 1 else []
        cmd = [str(mpiexec), "-n", "1", *me, "--role", "source", ":", "-n", "1", *xla, *me, "--role", "destination"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
        try:
            with open(f"{result}.destination") as f:
                got = json.load(f)
        except FileNotFoundError:
            raise SystemExit(f"the server wrote no result:\n{(done.stdout + done.stderr)[-4000:]}") from None
    where = (
        f"the server's steps on core {a.step_cores}, its receive thread (pull_async(cpus=...)) and the trainer on "
        f"{a.other_cores}"
        if a.step_cores
        else "the OS places every thread (no cores set)"
    )
    print(f"== placement {placement}: {where}")
    return report(got, a, load0, os.getloadavg()[0])


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def report(got: dict, a: argparse.Namespace, load0: float, load1: float) -> tuple[str, float, float]:
    """Print the tables from the server's record; the summary line, and the steps/s idle and during refits of
    the transport with the lowest throughput during refits (pooled, as the line's percentage)."""
    ms, med = 1e3, statistics.median
    print(
        f"model {got['bytes'] / 2**20:.1f} MiB float32, batch {a.batch} x {a.seq} tokens, a refit every {a.every} steps"
    )
    print(
        "| transport | steps/s idle | during refit, % of idle [per refit: min-median-max] | pause ms, median [max] | "
        "blocking pause ms | wire ms | receive CPU ms | steps per refit |"
    )
    print("|---|---|---|---|---|---|---|---|")
    pauses, blocking, pcts, rates = [], [], [], []
    for name, r in got["transports"].items():
        idle = med(r["idle_rate"])
        ratios = sorted(b / i for b, i in zip(r["bg_rate"], r["idle_rate"], strict=True))  # paired: same moment
        reps = r["reports"]
        during = sum(x[4] for x in reps) / sum(x[5] for x in reps)  # every refit window pooled
        pct = 100 * during / (a.every * len(r["idle_s"]) / sum(r["idle_s"]))
        print(
            f"| {name} | {idle:.1f} | {pct:.0f}% "
            f"[{100 * ratios[0]:.0f}-{100 * med(ratios):.0f}-{100 * ratios[-1]:.0f}%] | "
            f"{ms * med(r['bg_pause']):.3f} [{ms * max(r['bg_pause']):.3f}] | {ms * med(r['block_pause']):.1f} | "
            f"{ms * med(x[1] for x in reps):.1f} | {ms * med(x[3] for x in reps):.1f} | {med(x[4] for x in reps):.0f} |"
        )
        pauses += r["bg_pause"]
        blocking += r["block_pause"]
        pcts.append(pct)
        rates.append((pct, a.every * len(r["idle_s"]) / sum(r["idle_s"]), during))
    print()
    print(
        "| transport | step ms idle | step ms during refit, median [p90] | first step on the new version ms | "
        "dispatch ms idle, median [p99] | during refit |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in got["transports"].items():
        d = r["dispatch"]
        print(
            f"| {name} | {ms / med(r['idle_rate']):.1f} | {ms * med(r['refit_step']):.1f} "
            f"[{ms * _pct(sorted(r['refit_step']), 0.9):.1f}] | {ms * med(r['first_step']):.1f} | "
            f"{ms * med(d['idle']):.3f} [{ms * _pct(d['idle'], 0.99):.3f}] | "
            f"{ms * med(d['refit']):.3f} [{ms * _pct(d['refit'], 0.99):.3f}] |"
        )
    print(
        f"load average (1 min): {load0:.2f} before, {load1:.2f} after (other programs on this machine share its cores)"
    )
    _, idle_rate, during_rate = min(rates)
    line = (
        f"serve: pause {ms * med(pauses):.3f} ms ({ms * max(pauses):.3f} max), "
        f"throughput during refit {min(pcts):.0f}% of idle, blocking pause {ms * med(blocking):.1f} ms"
    )
    return line, idle_rate, during_rate


if __name__ == "__main__":
    main()
