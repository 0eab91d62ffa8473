"""Backend xla across the processes of a jax.distributed CPU cluster (gloo), launched here as subprocesses.

Each process (``tests/xla_bodies/distributed_transfer.py``) checks its result shards bit for bit;
the launch has a hard timeout and every process runs in its own process group, killed on timeout.
Only loopback addresses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
BODY = Path(__file__).parent / "xla_bodies" / "distributed_transfer.py"
TIMEOUT_S = 150


def _launch(nproc: int, devices: int, out: Path, port: int) -> dict[int, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_FLAGS", "JAX_"))}
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_NUM_CPU_DEVICES=str(devices),
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(ROOT)]),
        OMP_NUM_THREADS="1",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(BODY), str(i), str(nproc), str(port), str(out)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for i in range(nproc)
    ]
    logs = []
    try:
        for p in procs:
            try:
                logs.append(p.communicate(timeout=TIMEOUT_S)[0])
            except subprocess.TimeoutExpired:
                pytest.fail(f"a process of the {nproc}-process cluster did not finish within {TIMEOUT_S} s")
    finally:
        for p in procs:  # stragglers (after a failure or a timeout): their whole process groups
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    got = {}
    for i in range(nproc):
        f = out / f"{i}.json"
        assert f.exists(), f"process {i} wrote no result:\n{logs[i][-4000:] if i < len(logs) else ''}"
        got[i] = json.loads(f.read_text())
        assert "error" not in got[i], f"process {i}:\n{got[i]['error']}"
    return got


@pytest.mark.parametrize("nproc", [2, 4])
def test_transfer_across_processes_bit_for_bit(nproc, tmp_path, held_port):
    devices = 2  # per process
    got = _launch(nproc, devices, tmp_path, held_port())
    assert all(r["backend"] == "xla" for r in got.values())
    # Every result shard of the cluster was checked by its process: 8 + 2n + n + n/2 ... summed per case.
    n = nproc * devices
    assert sum(r["checked"] for r in got.values()) == n // 2 + n + n + n // 2
    assert sum(r["network_bytes"] for r in got.values()) > 0  # one domain per process: the processes' links
    assert sum(r["into_in_place"] for r in got.values()) == n // 2  # every destination shard, in place
    assert all(r["into_deleted"] in (True, None) for r in got.values())
    if nproc >= 4:  # a transfer among the first two processes' devices: the others take no part
        assert [got[i]["subset_shards"] for i in range(nproc)] == [0, 2] + [0] * (nproc - 2)
