"""One prepared check of jreshard's GPU path, for one short run on one GPU (about 8 minutes).

Run from a checkout (Python 3.12, jax with CUDA, CuPy 14, NCCL; no package index needed)::

    PYTHONPATH=. python benchmarks/gpu_check.py            # full sizes
    PYTHONPATH=. python benchmarks/gpu_check.py --quick    # small sizes, under a minute
    python benchmarks/gpu_check.py --quick --dry-run       # list the stages and their time limits

Every stage runs in its own subprocess under a time limit, so a hang or a crash in
one (a CUDA error, a stuck NCCL call) still leaves the others' results. Each result
is one JSON line, appended and flushed to ``gpu_check.jsonl`` in ``--out`` (default
``$OUT``, else ``./gpu_check_out``) the moment it is known, so a run cut short still
says everything it reached. Stages, in order:

1. ``versions``: python, jax, CuPy, CUDA, NCCL, the GPU, and the NCCL unique id's type;
2. ``kernel``: compile and launch the pack kernel once, against numpy;
3. ``dlpack``: zero-copy export and import, and ordering: a CuPy write on a
   non-default stream, then a jax reduction, no host sync in between, 20 times;
4. ``kernel_cases``: the random pack/unpack cases of ``test_cuda_kernels_math`` on the GPU, against numpy;
5. ``nccl``: ``NcclComm`` on one rank sending to itself, 1 GiB in 8 and 64 MiB chunks (GB/s);
6. ``transfer``: ``jreshard.transfer_into`` of 4 GiB (checked to move every byte)
   against ``jax.device_put(..., may_alias=False)`` and a device-to-device memcpy, and
   the engine moving 4 GiB between different boxes (a column split) through NCCL;
7. ``sweep``: pack/unpack bandwidth over unit widths 1, 2, 4, 16 bytes and 2-D and
   3-D pieces, against ``cudaMemcpyAsync`` (and ``cudaMemcpy2DAsync`` for 2-D pieces);
8. ``pytest``: ``pytest -m gpu -x`` (the GPU tests).

Times are CUDA-event or wall-clock medians over repeats, printed with min and max;
every ratio is against a baseline measured in the same stage. On a machine without a
GPU it prints "no GPU" and exits 0 within seconds. Not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (name, seconds allowed at full size, at --quick); the full run adds up to under 10 minutes.
STAGES: tuple[tuple[str, int, int], ...] = (
    ("versions", 60, 60),
    ("kernel", 90, 60),
    ("dlpack", 90, 60),
    ("kernel_cases", 90, 60),
    ("nccl", 90, 60),
    ("transfer", 150, 60),
    ("sweep", 120, 60),
    ("pytest", 240, 180),
)


def gpu_count() -> tuple[int, str]:
    """CUDA devices the driver sees, through libcuda (no CuPy or jax import): ``(count, why not)``."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        return 0, f"libcuda.so.1 does not load ({err})"
    rc = cuda.cuInit(0)
    if rc != 0:
        return 0, f"cuInit returned CUresult {rc}"
    n = ctypes.c_int(0)
    rc = cuda.cuDeviceGetCount(ctypes.byref(n))
    return (n.value, "") if rc == 0 else (0, f"cuDeviceGetCount returned CUresult {rc}")


def out_file(out: str | None) -> Path:
    base = Path(out or os.environ.get("OUT") or ROOT / "gpu_check_out")
    base.mkdir(parents=True, exist_ok=True)
    return base / "gpu_check.jsonl"


def append(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("JAX_PLATFORMS", "cuda,cpu")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for CuPy's buffers
    return env


def summarize(record: dict) -> str:
    keep = {k: v for k, v in record.items() if k not in ("stage", "check", "status", "time")}
    return f"  {record.get('status', '?'):8} {record.get('check', '')}: {json.dumps(keep, default=str)[:300]}"


def run_stage(cmd: list[str], limit: float) -> tuple[str, int | None, str]:
    """Run one stage in its own session; past ``limit`` kill it and everything it started."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the stage and its children (pytest, NCCL threads)
        out, err = proc.communicate()
        return "TIMEOUT", None, (err or out)[-1500:]
    if proc.returncode:
        return "FAILED", proc.returncode, (err or out)[-1500:]
    return "ok", 0, ""


def run_stages(path: Path, quick: bool, stages: tuple[tuple[str, int, int], ...] = STAGES) -> int:
    """Run every stage in order; returns how many failed or timed out."""
    failed = 0
    for name, full_s, quick_s in stages:
        limit = quick_s if quick else full_s
        seen = path.stat().st_size if path.exists() else 0
        cmd = [sys.executable, str(Path(__file__).with_name("gpu_stages.py")), name, str(path)]
        if quick:
            cmd.append("--quick")
        t0 = time.perf_counter()
        print(f"[{name}] limit {limit} s", flush=True)
        status, rc, tail = run_stage(cmd, limit)
        append(
            path,
            {"stage": name, "check": "stage", "status": status, "rc": rc, "seconds": time.perf_counter() - t0,
             "stderr_tail": tail},
        )  # fmt: skip
        bad = False
        with path.open() as f:
            f.seek(seen)
            for line in f:
                rec = json.loads(line)
                print(summarize(rec), flush=True)
                bad = bad or rec.get("status") in ("FAILED", "TIMEOUT")
        failed += bad
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: the whole run in about a minute")
    ap.add_argument("--dry-run", action="store_true", help="list the stages and their time limits, run nothing")
    ap.add_argument("--out", help="folder for gpu_check.jsonl (default $OUT, else ./gpu_check_out)")
    args = ap.parse_args(argv)
    if args.dry_run:
        for i, (name, full_s, quick_s) in enumerate(STAGES, 1):
            print(f"{i}. {name} (limit {quick_s if args.quick else full_s} s)")
        return 0
    n, why = gpu_count()
    if n == 0:
        print(f"no GPU ({why}); nothing to check")
        return 0
    path = out_file(args.out)
    append(path, {"stage": "start", "check": "run", "status": "info", "quick": args.quick, "gpus": n,
                  "argv": sys.argv, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")})  # fmt: skip
    print(f"{n} GPU(s); results appended to {path}", flush=True)
    failed = run_stages(path, args.quick)
    print(f"\n{failed} failed or timed out; every result is in {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
