"""Two MPI launches joined by ``RefitGroup.connect`` when a peer never comes, left a stale address file,
or is SIGKILLed mid-refit, with MPI's bytes on UCX over TCP (where MPICH crashes on a send to a dead
peer): every wait bounded, every survivor raises a jreshard error and exits normally (no signal), the
destination keeps its previous version, and the survivor refits again with a new peer."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi_launch import BODIES, MPIEXEC, env_for, need_mpi

pytestmark = pytest.mark.timeout(240)
TIMEOUT_S = 3.0
SLACK_S = 5.0  # past timeout_s, for a loaded host


def start(tmp_path: Path, role: str, mode: str, **extra: str) -> subprocess.Popen:
    env = env_for(tmp_path, 1, {"JRESHARD_ADDRESS": str(tmp_path / "address"), "JRESHARD_TIMEOUT": str(TIMEOUT_S)})
    env.pop("UCX_LOG_LEVEL", None)  # UCX's noise, or its absence, as a user who set nothing sees it
    env |= {"UCX_TLS": "tcp,self", "PYTHONFAULTHANDLER": "1"} | extra  # TCP, as between hosts
    cmd = [str(MPIEXEC), "-n", "1", sys.executable, str(BODIES / "connect_faults.py"), role, mode]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def finish(p: subprocess.Popen, timeout_s: float = 120) -> str:
    try:
        return p.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out = p.communicate()[0]
        pytest.fail(f"{p.args} did not finish within {timeout_s} s:\n{out[-4000:]}")


def result(tmp_path: Path, role: str, mode: str) -> dict:
    return json.loads((tmp_path / f"faults-{role}-{mode.replace(':', '')}-0.json").read_text())


@pytest.mark.parametrize("role", ["source", "destination"])
def test_connect_with_no_peer_raises_a_timeout_within_timeout_s(tmp_path, role):
    need_mpi()
    p = start(tmp_path, role, "alone")
    out = finish(p)
    assert p.returncode == 0, out
    r = result(tmp_path, role, "alone")
    assert r["raised"].startswith("TransferTimeoutError"), r
    assert TIMEOUT_S <= r["elapsed"] < TIMEOUT_S + SLACK_S, r
    assert not (tmp_path / "address").exists()  # the source's file is gone with it


def test_a_stale_address_file_is_refused_with_a_clear_error(tmp_path):
    need_mpi()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = s.getsockname()[1]
    s.close()  # nothing listens there now, as after a source was killed
    (tmp_path / "address").write_text(f"127.0.0.1:{dead}\n{'ab' * 32}")
    p = start(tmp_path, "destination", "alone")
    out = finish(p)
    assert p.returncode == 0, out  # raised, no crash
    r = result(tmp_path, "destination", "alone")
    assert r["raised"].startswith("TransferTimeoutError") and "is stale" in r["raised"], r
    assert f"127.0.0.1:{dead}, where nothing listens" in r["raised"] and r["elapsed"] < TIMEOUT_S + SLACK_S, r
    # a file in the old format (an MPI port name), as an older source left it: refused, never connected to
    (tmp_path / "address").write_text("tag#0$connentry#0200A4F07F000001$")
    os.remove(tmp_path / "faults-destination-alone-0.json")
    p = start(tmp_path, "destination", "alone")
    out = finish(p)
    assert p.returncode == 0, out
    r = result(tmp_path, "destination", "alone")
    assert "ValueError" in r["raised"] and "not an address" in r["raised"], r


@pytest.mark.parametrize("victim", ["source", "destination"])
def test_a_peer_killed_mid_refit_the_survivor_raises_exits_cleanly_and_refits_with_a_new_peer(tmp_path, victim):
    need_mpi()
    survivor = "destination" if victim == "source" else "source"
    t0 = time.monotonic()
    live = start(tmp_path, survivor, "again")
    dying = start(tmp_path, victim, "die:3")
    out = finish(dying)
    assert dying.returncode != 0, out  # it killed itself (mpiexec reports the signal)
    fresh = start(tmp_path, victim, "ok", JRESHARD_FIRST="3")
    outs = {"survivor": finish(live), "fresh": finish(fresh)}
    assert live.returncode == 0 and fresh.returncode == 0, outs  # no signal, no MPICH crash at exit
    for text in outs.values():
        assert "Segmentation fault" not in text and "BAD TERMINATION" not in text, text
        assert "UCX  WARN" not in text, text  # no UCX noise by default (its warnings at MPI_Finalize, below)
    r = result(tmp_path, survivor, "again")
    (failed,) = r["failures"]
    assert failed["version"] == 3 and failed["seconds"] < TIMEOUT_S + SLACK_S, failed
    assert failed["error"].startswith(("PeerError", "TransferTimeoutError")) and failed["intact"] is True, failed
    if survivor == "destination":
        assert failed["previous_exact"] is True, failed  # still version 2, byte for byte
    assert r["versions"] == [1, 2, 3, 4], r  # 3 and 4 from the new peer (checked byte for byte there)
    assert result(tmp_path, victim, "ok")["versions"] == [3, 4]
    assert time.monotonic() - t0 < 120


def test_a_peer_that_dies_inside_the_mpi_join_makes_the_survivor_exit_saying_why_not_hang(tmp_path):
    """MPI cannot time out or cancel MPI_Comm_accept: a destination killed between the port exchange and its
    MPI_Comm_connect leaves the source's accept pending for good; the source says so and exits (status 75)."""
    need_mpi()
    src = start(tmp_path, "source", "ok")
    victim = start(tmp_path, "destination", "vanish")
    finish(victim)
    t0 = time.monotonic()
    out = finish(src)
    assert src.returncode == 75, out
    assert "jreshard: RefitGroup.connect: process 1 (destination) died while the two launches were joining" in out
    assert "MPI_Comm_accept" in out and "exits with status 75" in out and "Segmentation fault" not in out, out
    assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S  # once the victim is gone: at once, never a hang


def test_ucx_warnings_after_a_killed_peer_print_where_the_user_asks_for_them(tmp_path):
    """The survivor of a killed source, as above, with ``UCX_LOG_LEVEL=warn`` set by the user: UCX's warnings
    about the requests the dead peer left behind print at MPI_Finalize (jreshard keeps a level the user set;
    unset, it loads UCX at level error, and the test above finds no warning)."""
    need_mpi()
    live = start(tmp_path, "destination", "again", UCX_LOG_LEVEL="warn")
    dying = start(tmp_path, "source", "die:3", UCX_LOG_LEVEL="warn")
    finish(dying)
    fresh = start(tmp_path, "source", "ok", JRESHARD_FIRST="3")
    out, _ = finish(live), finish(fresh)
    assert live.returncode == 0, out
    assert "UCX  WARN" in out and "was not returned to mpool ucp_requests" in out, out


@pytest.mark.parametrize(
    ("joins", "stays_out", "what"),
    [
        ("source", "destination", "forming the refit group"),
        ("initialize", "absent", "jreshard.mpi.cluster.initialize"),
        ("transfer", "idle", "the first transfer across processes"),
        ("mpicomm", "duplicates", "MpiComm"),
    ],
)
def test_a_process_that_never_joins_makes_the_other_raise_within_its_timeout(tmp_path, joins, stays_out, what):
    """One launch of two processes, one of which never makes its side of what they form together: a RefitGroup (the
    destination, a PyTorch receiver, refuses its tensor's dtype first), jreshard.mpi.cluster.initialize (the
    process exits first), the multi-controller cluster's first transfer across processes (the process idles), an
    MpiComm past its duplicate (the process only duplicates).
    The other raises TransferTimeoutError within its timeout_s, naming what did not form; each used to wait in
    MPI (MPI_Comm_dup, allgather) for good."""
    from mpi_launch import launch, program, results

    need_mpi()
    t0 = time.monotonic()
    launch(
        [program(1, "join_refused_body.py", joins), program(1, "join_refused_body.py", stays_out)],
        tmp_path,
        devices=1,
        timeout_s=120,
    )
    ((_, r),) = results(tmp_path, f"join-{joins}").items()
    assert r["raised"].startswith(f"{what}: not every one of the communicator's 2 processes joined within 4 s"), r
    assert 4.0 <= r["after_s"] < 4.0 + SLACK_S, r
    if stays_out == "destination":
        ((_, d),) = results(tmp_path, "join-destination").items()
        assert "int4 has no jreshard counterpart" in d["refused"], d
    assert time.monotonic() - t0 < 90
