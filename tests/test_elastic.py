"""Elastic refit between separate programs: a trainer and replicas, each its own process (no mpiexec).

Each test starts ``tests/elastic_bodies/trainer.py`` and ``replica.py`` programs with 2 CPU devices
each, starts more replicas when the trainer says so, and checks what every program reports: the
versions each replica held (every element compared), where each version came from, what the
trainer saw.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

BODIES = Path(__file__).parent / "elastic_bodies"
ROOT = Path(__file__).parent.parent
TIMEOUT_S = 10.0  # the bodies' Options(timeout_s=...)
SECRET = "elastic-tests-shared-key-0123456789"  # every program's $JRESHARD_SECRET

pytestmark = pytest.mark.timeout(120)


class Program:
    """One body in its own process group; its stdout is read line by line on a thread."""

    def __init__(
        self, *args: str, folder: Path = BODIES, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
    ):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_FLAGS"))} | (env or {})
        env = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2", "OMP_NUM_THREADS": "1"} | env
        env.setdefault("JRESHARD_SECRET", SECRET)
        env["PYTHONPATH"] = os.pathsep.join([str(BODIES), str(ROOT)])
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(folder / args[0]), *args[1:]],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def events(self) -> list[dict]:
        out = []
        for line in list(self.lines):
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    def wait_event(self, name: str, timeout_s: float = 90.0) -> dict:  # name "": a result line
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for e in self.events():
                if e.get("event", "") == name:
                    return e
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        pytest.fail(f"no {name!r} event from {self.proc.args!r}:\n" + "\n".join(self.lines[-60:]))

    def finish(self, timeout_s: float = 90.0) -> int:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.proc.args!r} did not finish:\n" + "\n".join(self.lines[-60:]))
        self._reader.join(5)
        return self.proc.returncode

    def result(self) -> dict:
        assert self.finish() == 0, "\n".join(self.lines[-60:])
        return self.events()[-1]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._reader.join(5)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def programs():
    started: list[Program] = []

    def start(
        *args: str, folder: Path = BODIES, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
    ) -> Program:
        p = Program(*args, folder=folder, env=env, prefix=prefix)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


def _exact(rep: dict, versions: list[int]) -> None:
    assert rep["bad"] == [], f"{rep['name']} held wrong values at (version, leaf) {rep['bad']}"
    assert rep["checked"] and set(rep["checked"]) <= set(versions)
    assert [v for v, _ in rep["arrivals"]] == sorted(v for v, _ in rep["arrivals"])


@pytest.mark.parametrize("catch_up", ["trainer", "peer"])
def test_join_at_version_3_catches_up_before_version_4(tmp_path, programs, catch_up):
    address = str(tmp_path / "address")
    trainer = programs("trainer.py", address, "join", catch_up)
    r1, r2 = programs("replica.py", address, "r1", "ok"), programs("replica.py", address, "r2", "ok")
    trainer.wait_event("join-now")
    r3 = programs("replica.py", address, "r3", "ok")
    out = trainer.result()
    reps = {r["name"]: r for r in (r1.result(), r2.result(), r3.result())}
    assert out["at3"] == ["r1", "r2", "r3"]
    first_version, source = reps["r3"]["arrivals"][0]
    assert first_version == 3  # reached version 3 before version 4 was pushed (the trainer waited for it)
    if catch_up == "trainer":
        assert source == out["joined"]["r3"] == "trainer"
    else:
        assert source == out["joined"]["r3"] in ("replica 'r1'", "replica 'r2'")
    assert [v for v, _ in reps["r3"]["arrivals"][1:]] == [4, 5]
    assert all(s == "trainer" for _, s in reps["r3"]["arrivals"][1:])
    for name, rep in reps.items():
        _exact(rep, [1, 2, 3, 4, 5])
        assert rep["checked"][-1] == 5 and "trainer closed" in rep["end"], (name, rep)
    for v in (4, 5):
        assert sorted(out["pushes"][str(v)]["committed"]) == ["r1", "r2", "r3"]


def test_replica_killed_mid_version_5(tmp_path, programs):
    address = str(tmp_path / "address")
    trainer = programs("trainer.py", address, "kill")
    r1, victim = programs("replica.py", address, "r1", "ok"), programs("replica.py", address, "r2", "kill:5")
    trainer.wait_event("join-now")
    assert victim.finish() == -signal.SIGKILL
    r3 = programs("replica.py", address, "r3", "ok")
    out = trainer.result()
    push5 = out["pushes"]["5"]
    assert push5["committed"] == ["r1"] and list(push5["lost"]) == ["r2"], push5
    assert "r2" in push5["lost"] and "closed the connection" in push5["lost"]["r2"], push5
    assert push5["seconds"] < TIMEOUT_S  # noticed within timeout_s (at once: its connection closed)
    assert out["after5"] == {"r1": 5}  # the dead replica's slot is released
    assert out["at5"] == ["r1", "r3"] and out["joined"]["r3"] in ("trainer", "replica 'r1'")
    reps = {r["name"]: r for r in (r1.result(), r3.result())}
    _exact(reps["r1"], [1, 2, 3, 4, 5, 6])
    assert [v for v, _ in reps["r1"]["arrivals"]] == [1, 2, 3, 4, 5, 6]
    _exact(reps["r3"], [5, 6])
    assert [v for v, _ in reps["r3"]["arrivals"]] == [5, 6]
    assert sorted(out["pushes"]["6"]["committed"]) == ["r1", "r3"]
    # deltas (on by default): r1 takes every version after its first as a delta, the killed one included;
    # the replacement's first push is a delta when it caught up from the trainer, else full ("no base")
    modes = {v: p["delta"] for v, p in out["pushes"].items()}
    assert [modes[str(v)]["r1"][0] for v in range(1, 7)] == ["full"] + ["delta"] * 5, modes
    assert all(m[1] < m[2] for v in range(2, 7) for m in [modes[str(v)]["r1"]]), modes
    r3 = modes["6"]["r3"]
    if out["joined"]["r3"] == "trainer":
        assert r3[0] == "delta" and r3[1] < r3[2], r3
    else:
        assert r3[0] == "full" and any("process 0 holds no base" in why for why in r3[3]), r3


def test_clean_leave_and_rejoin_waits_all_and_any(tmp_path, programs):
    address = str(tmp_path / "address")
    trainer = programs("trainer.py", address, "leave", "trainer")
    r1, r2 = programs("replica.py", address, "r1", "ok"), programs("replica.py", address, "r2", "leave:2")
    trainer.wait_event("join-now")
    left = r2.result()
    assert left["end"] == "left" and left["checked"][-1] == 2 and left["bad"] == []
    r2b = programs("replica.py", address, "r2", "ok")  # the same name again: its slot was released
    out = trainer.result()
    assert out["gone"] == {"r2": "left"}
    assert out["any1"] == ["r1"] and out["all3"] == ["r1"] and out["members3"] == ["r1"]
    assert out["rejoined"] == ["r1", "r2"] and out["all4"] == ["r1", "r2"]
    assert out["any1_4"] and set(out["any1_4"]) <= {"r1", "r2"}
    reps = {r["name"]: r for r in (r1.result(), r2b.result())}
    _exact(reps["r1"], [1, 2, 3, 4])
    assert [v for v, _ in reps["r2"]["arrivals"]] == [3, 4] and reps["r2"]["arrivals"][0][1] == "trainer"
    _exact(reps["r2"], [3, 4])


def test_auto_deltas_step_aside_while_every_element_changes(tmp_path, programs):
    """delta="auto" (the default) with every element changing every version: a delta refit, then the
    trainer sends whole (1, then 2 refits: the reports say why), lays the bases again and looks again;
    every version exact."""
    address, dense = str(tmp_path / "address"), {"JRESHARD_DENSE": "1"}
    trainer = programs("trainer.py", address, "dense", "trainer", env=dense)
    r1 = programs("replica.py", address, "r1", "ok", env=dense)
    out = trainer.result()
    modes = [out["pushes"][str(v)]["delta"]["r1"] for v in range(1, 9)]
    assert [m[0] for m in modes] == ["full", "delta", "off", "full", "delta", "off", "off", "full"], modes
    assert "the trainer sends whole for now (delta='auto': 100% of the elements" in modes[2][3][0], modes[2]
    assert modes[1][1] > modes[1][2] * 7 // 8 and modes[2][1] == modes[2][2], modes  # dense: no bytes saved
    rep = r1.result()
    _exact(rep, list(range(1, 9)))
    assert [v for v, _ in rep["arrivals"]] == list(range(1, 9))


def test_the_example_pair_runs(tmp_path, programs):
    address, examples = str(tmp_path / "address"), ROOT / "examples"
    trainer = programs("elastic_trainer.py", address, "--steps", "3", "--step-seconds", "0", folder=examples)
    replica = programs("elastic_replica.py", address, "r1", folder=examples)
    assert trainer.finish() == 0 and replica.finish() == 0, "\n".join(trainer.lines + replica.lines)
    assert "trainer: version 3: committed by r1" in "\n".join(trainer.lines)
    seen = [line for line in replica.lines if " from trainer, " in line]
    versions = [int(line.split()[2]) for line in seen]  # "r1: version V from trainer, wq[0, 0] = V.0"
    assert versions[-1] == 3 and versions == sorted(set(versions)), seen  # a pull may skip a version, never go back
    assert all(line.endswith(f"= {float(v)}") for v, line in zip(versions, seen, strict=True)), seen


def test_a_replica_of_two_processes_serves_a_joiner(tmp_path, programs, held_port):
    port = held_port()  # the jax coordinator's, held until the test ends
    address = str(tmp_path / "address")
    trainer = programs("trainer.py", address, "multi", "peer")
    cluster = {"JAX_NUM_CPU_DEVICES": "1", "JRESHARD_COORDINATOR": f"127.0.0.1:{port}", "JRESHARD_PROCESSES": "2"}
    r2 = [programs("replica.py", address, "r2", "ok", env=cluster | {"JRESHARD_PROCESS": str(i)}) for i in (0, 1)]
    trainer.wait_event("join-now")
    r3 = programs("replica.py", address, "r3", "ok")
    trainer.wait_event("kill-now")
    r2[1].kill()  # SIGKILL one process of the two-process replica
    out = trainer.result()
    assert out["at2"] == ["r2", "r3"] and out["joined"] == {"r2": "trainer", "r3": "replica 'r2'"}
    assert out["pushes"]["3"]["committed"] == ["r2", "r3"]
    assert out["noticed_s"] < TIMEOUT_S and "replica 'r2' (process 1) closed the connection" in out["gone"]["r2"]
    push4 = out["pushes"]["4"]  # r2, lost between pushes 3 and 4, is reported in push 4 with its reason
    assert push4["committed"] == ["r3"] and push4["lost"] == {"r2": out["gone"]["r2"]}, push4
    rep3 = r3.result()
    _exact(rep3, [2, 3, 4])
    assert rep3["arrivals"] == [[2, "replica 'r2'"], [3, "trainer"], [4, "trainer"]]
    # The survivor of r2 sees its replica dropped, reports, then waits in jax.distributed's shutdown
    # for its dead sibling (jax's behaviour, not jreshard's): read its report, then stop it.
    rep2 = r2[0].wait_event("", timeout_s=30.0)
    assert "connection closed" in rep2["end"] and [v for v, _ in rep2["arrivals"]] == [1, 2, 3], rep2
    _exact(rep2, [1, 2, 3])


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)


@pytest.fixture
def namespaces():
    """Two network namespaces joined by a veth pair: the trainer's (10.77.N.1) and the replicas' (10.77.N.2)."""
    n = os.getpid() % 200 + 10
    trainer_ns, replica_ns = f"jrt{os.getpid()}", f"jrr{os.getpid()}"
    if _ip("netns", "add", trainer_ns).returncode != 0:
        pytest.skip("ip netns cannot run here (needs root and network namespaces)")
    try:
        steps = [
            ("netns", "add", replica_ns),
            ("link", "add", f"jrva{n}", "type", "veth", "peer", "name", f"jrvb{n}"),
            ("link", "set", f"jrva{n}", "netns", trainer_ns),
            ("link", "set", f"jrvb{n}", "netns", replica_ns),
            ("-n", trainer_ns, "addr", "add", f"10.77.{n}.1/24", "dev", f"jrva{n}"),
            ("-n", replica_ns, "addr", "add", f"10.77.{n}.2/24", "dev", f"jrvb{n}"),
            ("-n", trainer_ns, "link", "set", f"jrva{n}", "up"),
            ("-n", replica_ns, "link", "set", f"jrvb{n}", "up"),
            ("-n", trainer_ns, "link", "set", "lo", "up"),
            ("-n", replica_ns, "link", "set", "lo", "up"),
        ]
        for step in steps:
            done = _ip(*step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr}"
        yield trainer_ns, replica_ns, f"10.77.{n}.1"
    finally:
        _ip("netns", "del", trainer_ns)  # deleting a namespace deletes its end of the veth pair
        _ip("netns", "del", replica_ns)


def test_trainer_and_replicas_in_two_network_namespaces(tmp_path, programs, namespaces, held_port):
    """The 2-process trainer scenario below with the trainer's processes in one network namespace and
    the replicas in another, joined by a veth pair: real non-loopback addresses, UCX limited to TCP
    so the weights cross the pair too (and the peer catch-up stays among the replicas)."""
    trainer_ns, replica_ns, trainer_ip = namespaces
    port = held_port()  # the trainer's jax coordinator (its fresh namespace holds no port at all)
    address = str(tmp_path / "address")
    net = {"UCX_TLS": "tcp,self"}
    in_trainer, in_replicas = ("ip", "netns", "exec", trainer_ns), ("ip", "netns", "exec", replica_ns)
    cluster = net | {"JAX_NUM_CPU_DEVICES": "1", "JRESHARD_COORDINATOR": f"127.0.0.1:{port}", "JRESHARD_PROCESSES": "2"}
    cluster["JRESHARD_HOST"] = trainer_ip
    trainer = [
        programs("trainer.py", address, "big", "peer", env=cluster | {"JRESHARD_PROCESS": str(i)}, prefix=in_trainer)
        for i in (0, 1)
    ]
    r1 = programs("replica.py", address, "r1", "ok", env=net, prefix=in_replicas)
    r2 = programs("replica.py", address, "r2", "leave:2", env=net, prefix=in_replicas)
    trainer[0].wait_event("join-now")
    r3 = programs("replica.py", address, "r3", "kill:4", env=net, prefix=in_replicas)
    out, follower = trainer[0].result(), trainer[1].result()
    assert Path(address).read_text().startswith(trainer_ip + ":")  # the replicas reached a non-loopback address
    _check_big(out, follower, r1, r2, r3)


def test_a_trainer_of_two_processes_and_three_replicas(tmp_path, programs, held_port):
    """Each trainer process serves its own shards: joins at versions 0 and 2, a catch-up from a peer,
    a clean leave, a replica SIGKILLed in the middle of version 4; every committed version exact."""
    port = held_port()  # the jax coordinator's, held until the test ends
    address = str(tmp_path / "address")
    cluster = {"JAX_NUM_CPU_DEVICES": "1", "JRESHARD_COORDINATOR": f"127.0.0.1:{port}", "JRESHARD_PROCESSES": "2"}
    trainer = [
        programs("trainer.py", address, "big", "peer", env=cluster | {"JRESHARD_PROCESS": str(i)}) for i in (0, 1)
    ]
    r1, r2 = programs("replica.py", address, "r1", "ok"), programs("replica.py", address, "r2", "leave:2")
    trainer[0].wait_event("join-now")
    r3 = programs("replica.py", address, "r3", "kill:4")
    out, follower = trainer[0].result(), trainer[1].result()
    _check_big(out, follower, r1, r2, r3)


def _check_big(out: dict, follower: dict, r1: Program, r2: Program, r3: Program) -> None:
    assert r3.finish() == -signal.SIGKILL
    assert out["gone"] == {"r2": "left"}
    assert out["at2"] == ["r1", "r3"] and out["joined"]["r3"] == "replica 'r1'"  # caught up from a peer
    assert sorted(out["pushes"]["3"]["committed"]) == ["r1", "r3"]
    push4 = out["pushes"]["4"]
    assert push4["committed"] == ["r1"] and "r3" in push4["lost"], push4
    assert out["pushes"]["5"]["committed"] == ["r1"]
    assert follower["reports"]["4"] == {"committed": ["r1"], "lost": ["r3"]}  # process 1 got every report
    reps = {r["name"]: r for r in (r1.result(), r2.result())}
    _exact(reps["r1"], [1, 2, 3, 4, 5])
    assert [v for v, _ in reps["r1"]["arrivals"]] == [1, 2, 3, 4, 5]
    assert reps["r2"]["end"] == "left" and reps["r2"]["checked"][-1] == 2 and reps["r2"]["bad"] == []


@pytest.mark.parametrize(("seed", "catch_up"), [(1, "peer"), (2, "trainer")])
def test_random_trees_between_programs_with_a_joiner(tmp_path, programs, seed, catch_up):
    """A trainer and three replicas, each its own program of 4 devices, over a random tree (every dtype a refit
    moves, sizes of 0, each side's random shardings, casts, weak types, deltas): the third replica joins at
    version 2 and catches up from a replica or the trainer; every version each replica holds is checked."""
    address, four = str(tmp_path / "address"), {"JAX_NUM_CPU_DEVICES": "4"}
    trainer = programs("random_elastic.py", "trainer", address, str(seed), catch_up, env=four)
    r1 = programs("random_elastic.py", "replica", address, str(seed), "r1", env=four)
    r2 = programs("random_elastic.py", "replica", address, str(seed), "r2", env=four)
    trainer.wait_event("join-now")
    r3 = programs("random_elastic.py", "replica", address, str(seed), "r3", env=four)
    out = trainer.result()
    reps = {r["name"]: r for r in (r1.result(), r2.result(), r3.result())}
    for v in ("3", "4"):
        assert out["pushes"][v]["committed"] == ["r1", "r2", "r3"], out
    for name, rep in reps.items():
        assert rep["bad"] == [], (name, rep)
        assert rep["checked"] and rep["checked"][-1] == 4 and "trainer closed" in rep["end"], (name, rep)
    first_version, source = reps["r3"]["arrivals"][0]
    assert first_version == 2, reps["r3"]
    assert source == ("trainer" if catch_up == "trainer" else out["joined"]["r3"]), (source, out["joined"])
    if catch_up == "peer":
        assert source in ("replica 'r1'", "replica 'r2'"), source
