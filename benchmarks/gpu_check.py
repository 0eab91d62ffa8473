"""One prepared check of jreshard's GPU path, for one short run on one GPU (420 s by default, ``--budget``).

Run from a checkout (Python 3.12, jax with CUDA, CuPy 14, NCCL; no package index needed)::

    PYTHONPATH=. python benchmarks/gpu_check.py            # full sizes
    PYTHONPATH=. python benchmarks/gpu_check.py --quick    # small sizes
    python benchmarks/gpu_check.py --dry-run               # list the stages and their time limits

Every stage runs in its own subprocess under a time limit, so a hang or a crash in
one (a CUDA error, a stuck NCCL call) still leaves the others' results. The limits
share one global budget: a stage gets its own limit or what is left of the budget,
whichever is less, so the whole run never takes longer than the budget; the stages
least sure to pass (NCCL, the engine, XLA's preallocation, pytest) run last. Each
result is one JSON line, appended and flushed to ``gpu_check.jsonl`` in ``--out``
(default ``$OUT``, else ``./gpu_check_out``) the moment it is known, so a run cut short
still says everything it reached; a line a killed stage left half-written is skipped
and counted. The stages are listed in :data:`STAGES` (``docs/gpu.md`` says what each
measures and the range expected of it). A short table, one row per stage, is printed
last, ready to paste into ``docs/gpu.md``.

GPU times are CUDA-event times on the stream the work runs on; a time that spans
work on streams jreshard does not own (jax's) is host wall-clock around a call that
waits without backing off, and its record says ``"clock": "wall"``. On a machine
without a GPU it prints "no GPU", writes that line to the results file and exits 0
within seconds. Not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 420  # the default whole-run budget: a 600 s command limit less start-up and a rerun margin
MIN_STAGE_S = 5  # a stage is not started with less than this left of the budget


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One stage: its name in ``gpu_stages.py``, its time limits, and environment changes.

    ``env`` maps a variable to the value the stage runs with (``None``: unset).
    """

    name: str
    full_s: int
    quick_s: int
    env: Mapping[str, str | None] = dataclasses.field(default_factory=dict)

    def limit(self, quick: bool) -> int:
        return self.quick_s if quick else self.full_s


# In run order: the most certain first, the least certain (NCCL, the engine, XLA's default
# preallocation, pytest) last. One more stage is registered by adding a Stage here and its
# function to gpu_stages.STAGES; a stage past the budget is capped to what is left of it.
STAGES: tuple[Stage, ...] = (
    Stage(name="versions", full_s=25, quick_s=25),
    Stage(name="nvml", full_s=15, quick_s=15),
    Stage(name="kernel", full_s=30, quick_s=30),
    Stage(name="dlpack", full_s=25, quick_s=20),
    Stage(name="kernel_cases", full_s=25, quick_s=20),
    Stage(name="sweep", full_s=25, quick_s=20),
    Stage(name="small_leaves", full_s=25, quick_s=25),
    Stage(name="nccl", full_s=40, quick_s=30),
    Stage(name="transfer", full_s=50, quick_s=30),
    Stage(name="prealloc", full_s=25, quick_s=25, env={"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}),
    Stage(name="xla", full_s=35, quick_s=30),  # backend xla's computation on the GPU (benchmarks/gpu_xla_stage.py)
    Stage(name="graph", full_s=30, quick_s=25),  # a prepared refit as one CUDA graph against the eager engine
    Stage(name="pytest", full_s=70, quick_s=60),
)


def plan_limits(stages: Sequence[Stage], quick: bool, budget: float) -> list[tuple[Stage, int]]:
    """Each stage's limit if every stage before it used all of its own: capped to what is left of ``budget``.

    The limits add up to at most ``budget``; a stage left with under ``MIN_STAGE_S`` gets 0 (not run).
    """
    out, left = [], float(budget)
    for st in stages:
        lim = int(min(st.limit(quick), left))
        lim = lim if lim >= MIN_STAGE_S else 0
        out.append((st, lim))
        left -= lim
    return out


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
    """Append one JSON line, on a line of its own even after a line a killed stage left unfinished."""
    torn = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    with path.open("a") as f:
        f.write(("\n" if torn else "") + json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_records(path: Path, start: int = 0) -> tuple[list[dict], int]:
    """The JSON records from byte ``start`` on, and how many lines were not JSON (torn by a kill)."""
    recs, torn = [], 0
    with path.open("rb") as f:
        f.seek(start)
        for raw in f:
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                torn += 1
                continue
            if isinstance(rec, dict):
                recs.append(rec)
            else:
                torn += 1
    return recs, torn


def child_env(extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("JAX_PLATFORMS", "cuda,cpu")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for CuPy's buffers
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def summarize(record: dict) -> str:
    keep = {k: v for k, v in record.items() if k not in ("stage", "check", "status", "time")}
    return f"  {record.get('status', '?'):8} {record.get('check', '')}: {json.dumps(keep, default=str)[:300]}"


def run_stage(cmd: list[str], limit: float, env: Mapping[str, str | None] | None = None) -> tuple[str, int | None, str]:
    """Run one stage in its own session; past ``limit`` kill it and everything it started."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=child_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
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


def stage_command(name: str, path: Path, quick: bool, extra: Sequence[str] = ()) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).with_name("gpu_stages.py")), name, str(path), *extra]
    return [*cmd, "--quick"] if quick else cmd


def run_stages(
    path: Path,
    quick: bool,
    stages: Sequence[Stage] = STAGES,
    *,
    budget: float = BUDGET_S,
    extra: Sequence[str] = (),
    min_stage_s: float = MIN_STAGE_S,
) -> tuple[int, list[dict]]:
    """Run every stage in order within ``budget`` seconds; returns how many failed, timed out or skipped, and
    one row per stage for the table (``stage``, ``status``, ``seconds``, ``limit``, ``result``)."""
    failed, rows = 0, []
    t_start = time.perf_counter()
    for st in stages:
        left = budget - (time.perf_counter() - t_start)
        limit = int(min(st.limit(quick), left))
        if limit < min_stage_s:
            failed += 1
            append(
                path,
                {"stage": st.name, "check": "stage", "status": "SKIPPED", "why": f"budget spent ({left:.0f} s left)"},
            )
            rows.append({"stage": st.name, "status": "SKIPPED", "seconds": 0.0, "limit": 0, "result": "budget spent"})
            print(f"[{st.name}] skipped: {left:.0f} s of the {budget:.0f} s budget left", flush=True)
            continue
        seen = path.stat().st_size if path.exists() else 0
        t0 = time.perf_counter()
        print(f"[{st.name}] limit {limit} s", flush=True)
        cmd = stage_command(st.name, path, quick, [*extra, "--limit", str(limit)])
        status, rc, tail = run_stage(cmd, limit, st.env)
        seconds = time.perf_counter() - t0
        append(path, {"stage": st.name, "check": "stage", "status": status, "rc": rc, "seconds": seconds,
                      "limit": limit, "stderr_tail": tail})  # fmt: skip
        recs, torn = read_records(path, seen)
        for rec in recs:
            print(summarize(rec), flush=True)
        if torn:
            print(f"  {torn} torn line(s) skipped", flush=True)
        bad = [r for r in recs if r.get("status") in ("FAILED", "TIMEOUT")]
        skipped = any(r.get("status") == "SKIPPED" for r in recs)
        failed += bool(bad) or skipped  # a stage that skips did not check what it is for
        heads = [str(r.get("text", "")) for r in recs if r.get("check") == "summary" and r.get("stage") == st.name]
        result = "; ".join(heads) or (f"{len(bad)} failed: {bad[0].get('check')}" if bad else "")
        row_status = status if status != "ok" else "FAILED" if bad else "SKIPPED" if skipped else "ok"
        rows.append({"stage": st.name, "status": row_status, "seconds": seconds, "limit": limit, "result": result})
    return failed, rows


def table(rows: Sequence[dict]) -> str:
    """The markdown table of a run: one row per stage."""
    out = ["| stage | status | seconds (limit) | result |", "|---|---|---|---|"]
    for r in rows:
        text = str(r["result"]).replace("|", "/")
        out.append(f"| {r['stage']} | {r['status']} | {r['seconds']:.1f} ({r['limit']}) | {text} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="small sizes")
    ap.add_argument("--dry-run", action="store_true", help="list the stages and their time limits, run nothing")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for the whole run (default {BUDGET_S})")
    ap.add_argument("--out", help="folder for gpu_check.jsonl (default $OUT, else ./gpu_check_out)")
    ap.add_argument(
        "--standin",
        action="store_true",
        help="run every stage against the numpy stand-ins of CuPy, NCCL and NVML on CPU devices (CI)",
    )
    args = ap.parse_args(argv)
    if args.dry_run:
        planned = plan_limits(STAGES, args.quick, args.budget)
        for i, (st, lim) in enumerate(planned, 1):
            print(f"{i}. {st.name} (limit {lim} s)")
        print(f"total {sum(lim for _, lim in planned)} s of a {args.budget:.0f} s budget")
        return 0
    path = out_file(args.out)
    n, why = (1, "") if args.standin else gpu_count()
    if n == 0:
        print(f"no GPU ({why}); nothing to check")
        append(path, {"stage": "start", "check": "no GPU", "status": "SKIPPED", "why": why,
                      "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")})  # fmt: skip
        return 0
    append(path, {"stage": "start", "check": "run", "status": "info", "quick": args.quick, "gpus": n,
                  "standin": args.standin,
                  "budget_s": args.budget, "argv": sys.argv, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")})  # fmt: skip
    print(f"{n} GPU(s); results appended to {path}", flush=True)
    failed, rows = run_stages(path, args.quick, budget=args.budget, extra=["--standin"] if args.standin else [])
    print(f"\n{failed} stage(s) failed, timed out or skipped; every result is in {path}\n")
    print(table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
