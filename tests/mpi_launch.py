"""Launch rank-agnostic bodies (``tests/mpi_bodies``) under ``mpiexec`` from plain pytest.

Each launch has a hard timeout and runs in its own process group, killed whole on timeout.
Subprocesses set their own CPU device count (the root conftest's 8 devices are for pytest's
own process only).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

BODIES = Path(__file__).parent / "mpi_bodies"
ROOT = Path(__file__).parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def need_mpi() -> None:
    pytest.importorskip("mpi4py")
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec next to {sys.executable} (pip install mpich)")


def env_for(out: Path, devices: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_FLAGS"))}
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_NUM_CPU_DEVICES=str(devices),
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JRESHARD_MPI_OUT=str(out),
        PYTHONPATH=os.pathsep.join([str(BODIES), str(BODIES.parent), str(ROOT)]),  # tests/: its oracles
        OMP_NUM_THREADS="1",
    )
    env.update(extra or {})
    return env


def program(n: int, body: str, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """One ``-n N python body args`` segment of an mpiexec line (``env``: per-program variables)."""
    seg = ["-n", str(n)]
    for k, v in (env or {}).items():
        seg += ["-env", k, v]
    return [*seg, sys.executable, str(BODIES / body), *args]


def launch(
    segments: Sequence[Sequence[str]],
    out: Path,
    *,
    devices: int = 1,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``mpiexec seg1 : seg2 ...``; kill the whole process group after ``timeout_s``."""
    cmd = [str(MPIEXEC)]
    for i, seg in enumerate(segments):
        cmd += ([":"] if i else []) + list(seg)
    return start_and_wait([cmd], out, devices=devices, timeout_s=timeout_s, env=env, check=check)[0]


def start_and_wait(
    cmds: Sequence[Sequence[str]],
    out: Path,
    *,
    devices: int,
    timeout_s: float,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> list[subprocess.CompletedProcess]:
    """Start several commands at once (e.g. two separate mpiexec launches) and wait for all."""
    procs = [
        subprocess.Popen(
            list(c),
            env=env_for(out, devices, env),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for c in cmds
    ]
    results = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            stdout, _ = p.communicate()
            pytest.fail(f"{' '.join(p.args)} did not finish within {timeout_s} s:\n{stdout[-4000:]}")
        results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
        if check and p.returncode != 0:
            pytest.fail(f"{' '.join(p.args)} exited with {p.returncode}:\n{stdout[-6000:]}\n{errors(out)}")
    return results


def results(out: Path, tag: str) -> dict[int, dict]:
    """``{world rank: result}`` of the files a body wrote under ``tag``."""
    got = {}
    for f in sorted(out.glob(f"{tag}-*.json")):
        got[int(f.stem.rsplit("-", 1)[1])] = json.loads(f.read_text())
    return got


def errors(out: Path) -> str:
    msgs = []
    for f in sorted(out.glob("*.json")):
        r = json.loads(f.read_text())
        if "error" in r:
            msgs.append(f"{f.name}: {r['error']}")
    return "\n".join(msgs)
