"""benchmarks/gpu_check.py without a GPU: it says so (on stdout and in the results file) and exits 0;
``--dry-run`` lists the stages with limits inside the budget; a stage's results, failure, timeout and a
line torn by a kill land in (or are skipped from) the JSON-lines file; and every stage passes in one
run against the numpy stand-ins of CuPy, NCCL and NVML (``--standin``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_stages  # noqa: E402

ORDER = [
    "versions", "nvml", "kernel", "dlpack", "kernel_cases", "sweep", "small_leaves", "nccl", "transfer", "prealloc",
    "xla", "graph", "pytest",
]  # fmt: skip


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_no_gpu_says_so_writes_it_to_out_and_exits_zero_within_seconds(tmp_path):
    if gpu_check.gpu_count()[0]:
        pytest.skip("this machine has a GPU")
    t0 = time.perf_counter()
    proc = cli("--out", str(tmp_path))
    assert proc.returncode == 0 and proc.stdout.startswith("no GPU")
    assert time.perf_counter() - t0 < 30  # no wait for a GPU that is not there (a loaded host: slack)
    (rec,) = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    assert rec["check"] == "no GPU" and rec["status"] == "SKIPPED" and rec["why"]


@pytest.mark.parametrize("quick", [False, True])
def test_dry_run_lists_the_stages_in_order_within_the_budget(quick):
    proc = cli("--dry-run", *(["--quick"] if quick else []))
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    names = [line.split(". ", 1)[1].split(" ")[0] for line in lines[:-1]]
    limits = [int(line.split("(limit ")[1].split(" ")[0]) for line in lines[:-1]]
    assert names == ORDER == [st.name for st in gpu_check.STAGES] and set(names) == set(gpu_stages.STAGES)
    assert all(lim >= gpu_check.MIN_STAGE_S for lim in limits)
    assert sum(limits) <= gpu_check.BUDGET_S == 420
    assert lines[-1] == f"total {sum(limits)} s of a 420 s budget"


def test_limits_past_the_budget_are_capped_to_what_is_left():
    stages = [gpu_check.Stage(name=f"s{i}", full_s=100, quick_s=100) for i in range(5)]
    planned = [lim for _, lim in gpu_check.plan_limits(stages, False, 250)]
    assert planned == [100, 100, 50, 0, 0]  # 0: under MIN_STAGE_S left, not started


def test_a_failing_stage_and_a_timeout_are_recorded_line_by_line(tmp_path):
    if gpu_check.gpu_count()[0]:
        pytest.skip("this machine has a GPU: the stages would pass")
    path = tmp_path / "gpu_check.jsonl"
    hang = tmp_path / "hang"
    hang.mkdir()
    (hang / "sitecustomize.py").write_text("import time\ntime.sleep(60)\n")  # the stage's interpreter never starts it
    stages = [
        gpu_check.Stage(name="kernel", full_s=120, quick_s=120),
        gpu_check.Stage(name="pytest", full_s=1, quick_s=1, env={"PYTHONPATH": str(hang)}),
    ]
    failed, rows = gpu_check.run_stages(path, True, stages, min_stage_s=0.5)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    kernel = [r for r in recs if r["stage"] == "kernel"]
    assert kernel[0]["check"] == "stage body" and kernel[0]["status"] == "FAILED"  # no GPU: jax has no gpu backend
    assert kernel[-1]["check"] == "stage" and kernel[-1]["rc"] == 1
    assert recs[-1] == {**recs[-1], "stage": "pytest", "check": "stage", "status": "TIMEOUT", "rc": None, "limit": 1}
    assert failed == 2 and [(r["stage"], r["status"]) for r in rows] == [("kernel", "FAILED"), ("pytest", "TIMEOUT")]


def test_a_stage_past_the_budget_is_not_started_and_counts_as_not_passed(tmp_path):
    path = tmp_path / "gpu_check.jsonl"
    failed, rows = gpu_check.run_stages(path, True, [gpu_check.Stage(name="kernel", full_s=60, quick_s=60)], budget=3)
    (rec,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert rec["status"] == "SKIPPED" and rec["why"].startswith("budget spent")
    assert failed == 1 and rows == [{"stage": "kernel", "status": "SKIPPED", "seconds": 0.0, "limit": 0,
                                     "result": "budget spent"}]  # fmt: skip


def test_a_line_torn_by_a_kill_is_skipped_and_the_next_record_starts_a_line(tmp_path):
    path = tmp_path / "gpu_check.jsonl"
    gpu_check.append(path, {"stage": "a", "check": "x", "status": "ok"})
    with path.open("a") as f:
        f.write('{"stage": "a", "check": "cut off')  # what a SIGKILL mid-write leaves
    gpu_check.append(path, {"stage": "a", "check": "stage", "status": "TIMEOUT"})
    recs, torn = gpu_check.read_records(path)
    assert torn == 1 and [r["check"] for r in recs] == ["x", "stage"]


def test_the_table_has_one_row_per_stage():
    rows = [{"stage": "nccl", "status": "ok", "seconds": 3.25, "limit": 40, "result": "8 MiB chunks 310 GB/s | x"}]
    assert gpu_check.table(rows).splitlines() == [
        "| stage | status | seconds (limit) | result |",
        "|---|---|---|---|",
        "| nccl | ok | 3.2 (40) | 8 MiB chunks 310 GB/s / x |",
    ]


def test_the_pytest_stage_collects_test_gpu_only_without_the_project_addopts():
    cmd = gpu_stages.pytest_command("python")
    assert cmd[:3] == ["python", "-m", "pytest"]
    flags = cmd[3:]
    assert flags[: len(gpu_stages.PYTEST_ARGS)] == list(gpu_stages.PYTEST_ARGS)
    pairs = {flags[i]: flags[i + 1] for i in range(len(gpu_stages.PYTEST_ARGS) - 1)}
    assert pairs["-o"] == "addopts=" and pairs["-p"] == "no:cacheprovider" and pairs["-W"] == "default"
    assert pairs["-m"] == "gpu" and "tests/test_gpu.py" in flags and "tests" not in flags


@pytest.mark.slow
def test_every_stage_passes_in_one_run_against_the_numpy_stand_ins(tmp_path):
    proc = cli("--standin", "--quick", "--out", str(tmp_path), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    recs, torn = gpu_check.read_records(tmp_path / "gpu_check.jsonl")
    assert torn == 0
    stage_rows = [r for r in recs if r["check"] == "stage"]
    assert [r["stage"] for r in stage_rows] == ORDER and all(r["status"] == "ok" for r in stage_rows)
    bad = [r for r in recs if r["status"] not in ("ok", "info")]
    assert bad == []
    summaries = {r["stage"]: r["text"] for r in recs if r["check"] == "summary"}
    assert set(summaries) == set(ORDER)
    assert re.fullmatch(
        r"\d+ passed in [\d.]+s", summaries["pytest"]
    )  # test_gpu.py against the stand-ins, none skipped
    (mem,) = [r for r in recs if r["check"] == "memory with jax started"]
    assert mem["stage"] == "prealloc" and mem["preallocate"] == "true"  # that stage alone runs with XLA's default
    (versions,) = [r for r in recs if r["check"] == "versions"]
    assert versions["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    destroyed = [r["count"] for r in recs if r["check"] == "communicators destroyed"]
    # the nccl stage's and the engine's communicators, then the graph stage's two (eager and captured), each
    # destroyed at the end of its stage
    assert destroyed == [1, 1, 2]
    table = proc.stdout[proc.stdout.index("| stage |") :].splitlines()
    assert len(table) == 2 + len(ORDER) and all(f"| {n} | ok |" in row for n, row in zip(ORDER, table[2:], strict=True))
