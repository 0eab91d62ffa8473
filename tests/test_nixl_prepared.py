"""NIXL prepared groups (jreshard/nixl/prepared.py) between two processes: bit-identical to the per-operation path
step after step, receive buffers that move are posted again, and a peer SIGKILLed mid-replay is reported within
the timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu12", reason="the NIXL tests need nixl-cu12 (pip install --no-deps nixl-cu12)")

ROOT = Path(__file__).parent.parent
BODY = ROOT / "tests" / "nixl_bodies" / "prepared_pair.py"
KEY = "prepared-nixl-test-key-0123456789"
pytestmark = pytest.mark.timeout(120)


def run_pair(tmp_path, mode: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env |= {"PYTHONPATH": str(ROOT), "JRESHARD_SECRET": KEY, "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
    address = str(tmp_path / "address")
    procs = [
        subprocess.Popen(
            [sys.executable, str(BODY), str(p), address, mode],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for p in (0, 1)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90)[0])
        finally:
            if p.poll() is None:
                p.kill()
    return [
        {"rc": p.returncode, **json.loads(next((ln for ln in out.splitlines() if ln.startswith("{")), '{"out": 0}'))}
        | {"output": out[-3000:]}
        for p, out in zip(procs, outs, strict=True)
    ]


def test_prepared_and_per_op_refits_are_bit_identical_step_after_step_and_moved_buffers_are_posted_again(tmp_path):
    got = run_pair(tmp_path, "steps")
    assert [g["rc"] for g in got] == [0, 0], [g["output"] for g in got]
    for g in got:
        prepared, per_op = g["prepared"], g["per_op"]
        assert [r["digest"] for r in prepared] == [r["digest"] for r in per_op]  # bit-identical, every step
        assert len({r["digest"] for r in prepared}) == len(prepared) == 6  # new bytes every step (no stale data)
        assert all(r["checked"] == prepared[0]["checked"] > 0 for r in prepared + per_op)
        assert all(r["counters"] == [] for r in per_op)  # per operation: nothing prepared
        counters = [r["counters"][0][:2] for r in prepared]  # (descriptor lists posted, WRITE handles made)
        assert counters[0][0] > 0 and counters[0][1] > 0  # the first step posted the descriptors, made the handles
        # steps 2 and 3 keep the destination arrays; the staging arenas of two ranks of the same size trade places
        # (the pool's last-in-first-out blocks), so step 3 is back at step 1's addresses: no handle made again
        assert counters[2][1] == counters[1][1]
        posts = [c[0] for c in counters[3:]]  # steps 4-6: fresh destination arrays, each step posted again
        assert posts[0] > counters[2][0] and posts[1] > posts[0] and posts[2] > posts[1]


def test_a_peer_sigkilled_mid_replay_is_reported_within_the_timeout(tmp_path):
    survivor, victim = run_pair(tmp_path, "kill")
    assert victim["rc"] == -9, victim["output"]
    assert survivor["rc"] == 0, survivor["output"]
    assert survivor["checked"] > 0  # the first step went through
    assert survivor["error"] is not None and survivor["error"].startswith("PeerError"), survivor
    assert "process 1" in survivor["error"], survivor
    assert survivor["seconds"] < 10.0  # the 20 s timeout: seen from the closed connection (1 s grace), with slack
    assert survivor["broken"] and "broken since an earlier failure" in survivor["after"]
