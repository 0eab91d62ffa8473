"""RefitGroup between two separately launched programs over NIXL (no MPI): versioned refits bit-exact,
and a destination killed mid-pull leaves the source able to go on with a new destination."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu12", reason="the NIXL tests need nixl-cu12 (pip install --no-deps nixl-cu12)")

ROOT = Path(__file__).parent.parent
BODY = ROOT / "tests" / "nixl_bodies" / "refit_pair.py"
pytestmark = pytest.mark.timeout(120)


def start(role: str, address: str, mode: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_FLAGS"))}
    env |= {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2", "OMP_NUM_THREADS": "1"}
    env["JRESHARD_SECRET"] = "refit-over-nixl-test-key-0123"
    return subprocess.Popen(
        [sys.executable, str(BODY), role, address, mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def events(proc: subprocess.Popen) -> list[dict]:
    out = proc.communicate(timeout=90)[0]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")] or [{"output": out}]


def test_five_versioned_refits_between_two_launches_are_bit_exact(tmp_path):
    address = str(tmp_path / "address")
    src, dst = start("source", address, "five"), start("destination", address, "ok")
    got, sent = events(dst), events(src)
    assert src.returncode == 0 and dst.returncode == 0, (sent, got)
    assert [e["version"] for e in sent if e.get("event") == "pushed"] == [1, 2, 3, 4, 5]
    deltas = [e["delta"] for e in sent if e.get("event") == "pushed"]
    assert [d[0] for d in deltas] == ["full", "delta", "delta", "delta", "delta"], deltas  # on between programs
    assert all(d[1] < d[2] for d in deltas[1:]) and deltas[0][1] > deltas[0][2], deltas
    assert [e["delta"][0] for e in got if e.get("event") == "pulled"] == ["full"] + ["delta"] * 4
    result = got[-1]
    assert result["checked"] == [1, 2, 3, 4, 5] and result["bad"] == [], result
    assert "closed the group" in result["end"]  # the source's close is seen at once
    # destination shards and staging come back from the pools: after two versions (the tree
    # of the last one is alive while the next lands) every buffer is registered
    made = [e["registrations"] for e in got if e.get("event") == "pulled"]
    assert made[2:] == [made[1]] * 3, made


def test_a_destination_killed_mid_pull_leaves_the_source_going_on_with_a_new_one(tmp_path):
    address = str(tmp_path / "address")
    src, victim = start("source", address, "replace"), start("destination", address, "die:2")
    victim.communicate(timeout=90)
    assert victim.returncode == -signal.SIGKILL
    fresh = start("destination", address, "ok")
    got, sent = events(fresh), events(src)
    assert src.returncode == 0, sent
    failed = next(e for e in sent if e.get("event") == "failed")
    assert failed["version"] == 2 and "closed the connection" in failed["error"] and failed["seconds"] < 20.0
    assert [e["version"] for e in sent if e.get("event") == "pushed"] == [1, 3, 4, 5]
    assert got[-1]["checked"] == [3, 4, 5] and got[-1]["bad"] == [], got
    # the rejoined destination holds no base: its first refit is full and says why, the next ones are deltas
    deltas = [e["delta"] for e in sent if e.get("event") == "pushed"]
    assert [d[0] for d in deltas] == ["full", "full", "delta", "delta"], deltas
    assert "no base" in deltas[1][3][0], deltas
