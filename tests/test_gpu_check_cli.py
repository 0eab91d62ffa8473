"""benchmarks/gpu_check.py on a machine without a GPU: it says so and exits 0; its stages
are listed in order; a stage's results, failure and timeout land in the JSON-lines file."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

ORDER = ["versions", "kernel", "dlpack", "kernel_cases", "nccl", "transfer", "sweep", "pytest"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args], capture_output=True, text=True, timeout=60
    )


def test_no_gpu_says_so_and_exits_zero_within_seconds():
    if gpu_check.gpu_count()[0]:
        pytest.skip("this machine has a GPU")
    t0 = time.perf_counter()
    proc = cli()
    assert proc.returncode == 0 and proc.stdout.startswith("no GPU")
    assert time.perf_counter() - t0 < 10


def test_dry_run_lists_the_stages_in_order():
    proc = cli("--quick", "--dry-run")
    assert proc.returncode == 0
    names = [line.split(". ", 1)[1].split(" ")[0] for line in proc.stdout.splitlines()]
    assert names == ORDER == [n for n, *_ in gpu_check.STAGES]


def test_a_failing_stage_and_a_timeout_are_recorded_line_by_line(tmp_path):
    if gpu_check.gpu_count()[0]:
        pytest.skip("this machine has a GPU: the stages would pass")
    path = tmp_path / "gpu_check.jsonl"
    failed = gpu_check.run_stages(path, True, (("kernel", 120, 120), ("pytest", 1, 1)))
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert failed == 2
    kernel = [r for r in recs if r["stage"] == "kernel"]
    assert kernel[0]["check"] == "stage body" and kernel[0]["status"] == "FAILED"  # no GPU: jax has no gpu backend
    assert kernel[-1]["check"] == "stage" and kernel[-1]["rc"] == 1
    assert recs[-1] == {**recs[-1], "stage": "pytest", "check": "stage", "status": "TIMEOUT", "rc": None}
