"""What a neighbour costs the serve benchmark's server: its decode step alone, and beside another program.

Run: ``.venv/bin/python benchmarks/serve_contention.py [--mib 32] [--steps 200] [--pinned]``.

One process runs ``serve_bench.py``'s jitted decode step (the same transformer, XLA on one thread) and
times ``--steps`` steps, first alone, then while a second program runs on the machine, then alone again:

- ``spin``: a Python loop that only counts (CPU, no memory traffic), at nice 0 and at nice 19;
- ``copy``: ``np.copyto`` of 32 MiB over and over (what a refit's pack, transport and unpack do to the
  memory system), at nice 0 and at nice 19.

A refit received beside the server is both: CPU time on the cores, and copies through the caches and
memory the step reads its weights from. At nice 19 the neighbour only gets a core the server does not
want, so what it still costs is the memory system's share. Printed: steps/s of each phase and its ratio
to the mean of the two alone phases.

``--pinned``: the step's process (every thread XLA starts) on the first core, the neighbour on the others, as
``serve_bench.py``'s pinned placement; without it the OS places both. XLA with its Eigen pool off still runs
independent operations of a step side by side, so a step placed by the OS uses a second core when it is free:
what a neighbour then takes is that core, which a pinned step never had.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

NEIGHBOURS = {
    "spin": "x = 0\nwhile True:\n    x += 1\n",
    "copy": "import numpy as np\na = np.ones(8 << 20, np.float32)\nb = np.empty_like(a)\nwhile True:\n"
    "    np.copyto(b, a)\n",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--pinned", action="store_true", help="the step on the first core, the neighbour on the others")
    a = ap.parse_args()
    have = sorted(os.sched_getaffinity(0))
    if a.pinned and len(have) < 2:
        raise SystemExit(f"--pinned needs 2 cores; this process has {have}")
    step_cores, other_cores = ({have[0]}, set(have[1:])) if a.pinned else (None, None)
    if step_cores:
        os.sched_setaffinity(0, step_cores)  # before jax starts XLA's threads: they inherit it
    import jax
    import numpy as np
    import serve_bench

    shapes = serve_bench.model_shapes(a.mib)
    step = serve_bench.make_step(shapes)
    rng = np.random.default_rng(0)
    params = {k: jax.device_put(rng.standard_normal(s).astype(np.float32) * 0.05) for k, s in shapes.items()}
    state = {"tokens": jax.device_put(np.arange(64, dtype=np.int32).reshape(8, 8))}

    def rate() -> float:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            state["tokens"] = step(params, state["tokens"]).block_until_ready()
        return a.steps / (time.perf_counter() - t0)

    rate()  # compile and warm
    alone = [rate()]
    rows = []
    for name, code in NEIGHBOURS.items():
        for nice in (0, 19):
            pin = f"os.sched_setaffinity(0, {other_cores})\n" if other_cores else ""
            p = subprocess.Popen([sys.executable, "-c", f"import os\n{pin}os.nice({nice})\n{code}"])
            try:
                time.sleep(1.0)
                rows.append((f"{name}, nice {nice}", rate()))
            finally:
                p.kill()
                p.wait()
    alone.append(rate())
    base = sum(alone) / 2
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    where = (
        f"the step on core {sorted(step_cores)}, the neighbour on {sorted(other_cores)}"
        if a.pinned
        else "placed by the OS"
    )
    print(f"model {4 * n_params / 2**20:.1f} MiB float32, {a.steps} steps per phase, {os.cpu_count()} cores, {where}")
    print("| neighbour | steps/s | of alone |")
    print("|---|---|---|")
    print(f"| none (before, after) | {alone[0]:.1f}, {alone[1]:.1f} | 100% |")
    for name, r in rows:
        print(f"| {name} | {r:.1f} | {100 * r / base:.0f}% |")


if __name__ == "__main__":
    main()
