"""The fault suite: refits between programs in separate network namespaces (a bridge between them, each
link held to 60 Mbit/s, NIXL's and MPI's bytes on UCX over TCP as between hosts), with a fault injected
at a random moment of a refit:

- ``kill``: the source or the destination SIGKILLed (a new one is started in its place);
- ``stop``: one SIGSTOPped past ``timeout_s``, then continued;
- ``link``: one's link taken down for 2 s, then up;

on ``RefitGroup`` over NIXL and over MPI, and on elastic refit (three replicas, the middle one in
push order killed mid-WRITE). Every destination hashes what it holds after every refit and every
failure, against every version. Checked: no program hangs past ``timeout_s`` + 10 s; no program dies
of a signal other than the one injected; every failure a survivor sees is a jreshard error; no
destination ever holds a mix of versions or loses the one it held; the survivors refit again to the
last version (a new group, or a re-join).

``make test`` runs a bounded form (three runs, well under 90 s); ``JRESHARD_FAULTS=full`` runs every
fault on every transport and victim, ``JRESHARD_FAULT_RUNS`` times each (default 5), at random moments
(seeded by ``JRESHARD_FAULT_SEED``, printed on failure).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
from _netns import Network, Program, available

ROOT = Path(__file__).parent.parent
FULL = os.environ.get("JRESHARD_FAULTS", "") == "full"
RUNS = int(os.environ.get("JRESHARD_FAULT_RUNS", "5")) if FULL else 1
SEED = int(os.environ.get("JRESHARD_FAULT_SEED", str(int(time.time()) % 100000)))
TIMEOUT_S = 5.0
STEPS = 5
HANG_S = TIMEOUT_S + 10.0
LOSS = 0.05  # the fraction of packets the lossy relay drops (fault "loss")
JRESHARD_ERRORS = ("PeerError", "TransferTimeoutError", "AuthenticationError")

pytestmark = [pytest.mark.timeout(300 if not FULL else 3600)]

why = available()
if why:
    pytestmark.append(pytest.mark.skip(reason=f"the fault suite needs network namespaces: {why}"))
pytest.importorskip("nixl_cu12", reason="the fault suite needs nixl-cu12")


def _env(tmp_path: Path, net: Network, host: str, transport: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_FLAGS", "UCX_"))}
    env |= {
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "mpi_bodies"), str(ROOT)]),
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": "2",
        "OMP_NUM_THREADS": "1",
        "JRESHARD_ADDRESS": str(tmp_path / "address"),
        "JRESHARD_GO": str(tmp_path / "go"),
        "JRESHARD_HOST": net.addr[host],
        "JRESHARD_TIMEOUT": str(TIMEOUT_S),
        "JRESHARD_STEPS": str(STEPS),
        "JRESHARD_MIB": "2",
        "UCX_TLS": "tcp,self",  # as between hosts: no shared memory between the "hosts"
        "UCX_TCP_BRIDGE_ENABLE": "y",
    }
    if transport == "nixl":
        env["JRESHARD_SECRET"] = "fault-suite-secret-0123456789"
    return env | extra


def _side(tmp_path: Path, net: Network, host: str, role: str, transport: str, name: str, **extra: str) -> Program:
    body = [sys.executable, str(ROOT / "tests" / "nixl_bodies" / "fault_side.py"), role, transport, "again"]
    if transport == "mpi":
        body = [str(Path(sys.executable).parent / "mpiexec"), "-n", "1", *body]
    return Program(name, net.ns[host], body, _env(tmp_path, net, host, transport, **extra))


def _check_side(p: Program, role: str, log: list[str]) -> None:
    for e in p.of("failed"):
        assert e["type"] in JRESHARD_ERRORS, (p.name, e, log)
        assert e["seconds"] < HANG_S, (p.name, e, log)
        if role == "destination":  # it still holds exactly the version it held before
            assert e["held"] == [e["held_version"] or 0], (p.name, e, log)
            assert e["intact"] in (True, None), (p.name, e, log)
    for e in p.of("pulled"):
        assert e["held"] == [e["version"]], (p.name, "a mix, or not the version pulled", e, log)


def _refit_run(
    tmp_path: Path, transport: str, fault: str, victim: str, rng: random.Random, background: bool = False
) -> None:
    log = [f"seed={SEED} transport={transport} fault={fault} victim={victim} background={background}"]
    bg = {"JRESHARD_BACKGROUND": "1"} if background else {}
    net = Network(["s", "d"], loss=LOSS if fault == "loss" else 0.0, seed=rng.randrange(1 << 30))
    hosts = {"source": "s", "destination": "d"}
    progs: list[Program] = []
    try:
        for f in ("address", "go"):
            (tmp_path / f).unlink(missing_ok=True)
        sides = {r: _side(tmp_path, net, hosts[r], r, transport, r, **bg) for r in ("source", "destination")}
        progs += sides.values()
        for p in sides.values():
            p.wait_event("ready", 180)
        (tmp_path / "go").touch()
        at = rng.choice([2, 3])
        sides["source"].wait_event("start", 120, version=at)
        delay = rng.uniform(0.0, 0.6)
        time.sleep(delay)
        log.append(f"fault at version {at} + {delay:.2f} s")
        hit = sides[victim]
        survivor = sides["destination" if victim == "source" else "source"]
        if fault == "kill":
            hit.signal(signal.SIGKILL)
            code = hit.finish(HANG_S)
            assert code in (-signal.SIGKILL, signal.SIGKILL), (code, hit.tail())  # (mpiexec reports 9)
            first = "1"
            if victim == "source":  # the new source goes on from the version the destination lacks
                failed = survivor.wait_event("failed", HANG_S)
                first = str((failed["held_version"] or 0) + 1)
            fresh = _side(tmp_path, net, hosts[victim], victim, transport, f"new {victim}", JRESHARD_FIRST=first, **bg)
            progs.append(fresh)
            rest = [survivor, fresh]
        elif fault == "stop":
            hit.signal(signal.SIGSTOP)
            time.sleep(TIMEOUT_S + 1.5)
            hit.signal(signal.SIGCONT)
            rest = [survivor, hit]
        elif fault == "link":
            net.link(hosts[victim], up=False)
            time.sleep(2.0)
            net.link(hosts[victim], up=True)
            rest = [survivor, hit]
        else:  # loss: every packet of the whole run, both ways, dropped with probability LOSS
            rest = [survivor, hit]
        for p in rest:
            code = p.finish(120)
            assert code == 0, (p.name, code, p.tail(), log)  # no signal, no crash
        for p in progs:
            role = "source" if "source" in p.name else "destination"
            _check_side(p, role, log)
        for p in rest:  # the survivors refit again, to the last version
            assert p.of("end") and p.of("end")[-1]["versions_done"] == STEPS, (p.name, p.tail(), log)
        if fault == "kill":
            assert survivor.of("failed"), (survivor.tail(), log)  # it saw its peer die, and said so
        pulled = [e["version"] for p in progs if "destination" in p.name for e in p.of("pulled")]
        assert pulled == sorted(pulled) and pulled[-1] == STEPS, (pulled, log)  # never back to an older one
        if background:  # the destination served on its version while the next one arrived
            served = [e["served"] for p in progs if "destination" in p.name for e in p.of("pulled")]
            assert sum(served) > 0, (served, log)
        if net.relay is not None:
            assert net.relay.dropped > 0, log
    finally:
        for p in progs:
            p.kill()
        net.close()


CASES = [
    (t, f, v, b)
    for t in ("nixl", "mpi")
    for f in ("kill", "stop", "link")
    for v in ("source", "destination")
    for b in (False, True)
] + [(t, "loss", "destination", b) for t in ("nixl", "mpi") for b in (False, True)]
BOUNDED = [
    ("nixl", "kill", "destination", False),
    ("mpi", "kill", "source", False),
    ("mpi", "kill", "destination", True),
    ("nixl", "loss", "destination", True),
]


@pytest.mark.parametrize(("transport", "fault", "victim", "background"), CASES if FULL else BOUNDED)
def test_refit_group_survives_a_fault_at_a_random_moment(tmp_path, transport, fault, victim, background):
    """``background``: the destination receives with ``pull_async`` while it keeps serving, and flips."""
    rng = random.Random(f"{SEED}-{transport}-{fault}-{victim}-{background}")
    for run in range(RUNS):
        (tmp_path / f"run{run}").mkdir()
        _refit_run(tmp_path / f"run{run}", transport, fault, victim, rng, background)


# ---- elastic ------------------------------------------------------------------------------------
def _elastic_run(tmp_path: Path, fault: str, rng: random.Random) -> None:
    log = [f"seed={SEED} elastic fault={fault}"]
    net = Network(["t", "a", "b", "c"], loss=LOSS if fault == "loss" else 0.0, seed=rng.randrange(1 << 30))
    progs: list[Program] = []
    body = ROOT / "tests" / "elastic_bodies"
    try:

        def start(name: str, host: str, *args: str, env: dict[str, str] | None = None) -> Program:
            env = _env(tmp_path, net, host, "nixl", **(env or {}))
            p = Program(name, net.ns[host], [sys.executable, str(body / f"fault_{name[:7]}.py"), *args], env)
            progs.append(p)
            return p

        trainer = start("trainer", "t")
        trainer.wait_event("listening", 180)
        at = rng.choice([2, 3])
        reps = {}
        for name, host in (("r1", "a"), ("r2", "b"), ("r3", "c")):  # admitted in this order: the push order
            mode = f"die:{at}:{rng.choice([1, 2, 3])}" if name == "r2" and fault == "kill-mid-write" else "ok"
            mode = "rejoin" if fault == "kill-trainer" else mode
            reps[name] = start("replica", host, name, mode)
            trainer.wait_event("joined", 180, name=name)
        (tmp_path / "go").touch()  # the trainer pushes
        if fault != "kill-mid-write":  # at a random moment of version `at`'s push
            trainer.wait_event("start", 120, version=at)
            time.sleep(rng.uniform(0.0, 0.5))
        if fault == "kill-trainer":
            _trainer_killed(tmp_path, trainer, reps, start, log)
            return
        if fault == "kill-random":
            reps["r2"].signal(signal.SIGKILL)
        elif fault == "stop":  # past timeout_s: dropped; continued, it finds itself dropped and ends
            reps["r2"].signal(signal.SIGSTOP)
            time.sleep(TIMEOUT_S + 1.5)
            reps["r2"].signal(signal.SIGCONT)
        elif fault == "link":
            net.link("b", up=False)
            time.sleep(2.0)
            net.link("b", up=True)
        lost = None
        if fault.startswith("kill"):
            code = reps["r2"].finish(120)
            assert code == -signal.SIGKILL, ("r2 was to be killed", code, reps["r2"].tail())
            lost = trainer.wait_event("lost", 120, name="r2")
        elif fault == "stop":
            lost = trainer.wait_event("lost", 120, name="r2")
            assert reps["r2"].finish(120) == 0, reps["r2"].tail()
        else:  # link: a 2 s outage is shorter than timeout_s: TCP carries on, or r2 is dropped and joins again
            # (loss: 5% of every packet of the run; as a short outage, for r2)
            trainer.wait_event("pushed", 120, version=at)
            if any(e["name"] == "r2" for e in trainer.of("lost")):
                lost = trainer.of("lost")[0]
                assert reps["r2"].finish(120) == 0, reps["r2"].tail()
        back = reps["r2"]
        if lost is not None:
            log.append(f"r2 lost at version {lost['version']}: {lost['why']}")
            back = start("replica", "b", "r2", "ok")  # it comes back under the same name, and catches up
        for p in (trainer, reps["r1"], reps["r3"], back):
            code = p.finish(120)
            assert code == 0, (p.name, code, p.tail(), log)
        pushes = {e["version"]: e for e in trainer.of("pushed")}
        assert sorted(pushes) == list(range(1, STEPS + 1)), (pushes, log)
        assert all(set(pushes[u]["committed"]) >= {"r1", "r3"} for u in pushes), (pushes, log)
        assert "r2" in pushes[STEPS]["committed"], (pushes[STEPS], log)  # r2 (re-joined if lost) has the last
        history = trainer.of("end")[-1]["history"]
        if lost is not None:
            v = lost["version"]
            assert set(pushes[v]["committed"]) == {"r1", "r3"} and "r2" in pushes[v]["lost"], (pushes[v], log)
            assert [h[0] for h in history].count("r2") == 2, (history, log)  # both r2s, the lost one with its reason
            assert next(h for h in history if h[0] == "r2")[4] == lost["why"], (history, log)
        for p in (reps["r1"], reps["r3"], back):
            for e in p.of("pulled"):
                assert e["held"] == [e["version"]], (p.name, "a mix", e, log)
            assert p.of("pulled")[-1]["version"] == STEPS, (p.name, p.tail(), log)
    finally:
        for p in progs:
            p.kill()
        net.close()


def _trainer_killed(tmp_path: Path, trainer: Program, reps: dict, start, log: list[str]) -> None:
    """The trainer SIGKILLed mid-push: every replica keeps a whole version, and all of them join the trainer
    started in its place, which goes on from the next version."""
    trainer.signal(signal.SIGKILL)
    assert trainer.finish(HANG_S) == -signal.SIGKILL, trainer.tail()
    lost = {n: r.wait_event("trainer-lost", HANG_S) for n, r in reps.items()}
    for n, e in lost.items():  # seen within the bound, each holding exactly the version it committed
        assert e["t"] - trainer.proc_end < HANG_S and e["held"] == [e["version"]], (n, e, log)
    first = max(e["version"] for e in lost.values()) + 1
    log.append(f"trainer killed; replicas hold {[e['version'] for e in lost.values()]}")
    again = start("trainer", "t", env={"JRESHARD_FIRST": str(first)})
    for p in (again, *reps.values()):
        assert p.finish(180) == 0, (p.name, p.tail(), log)
    pushes = {e["version"]: e for e in again.of("pushed")}
    assert sorted(pushes) == list(range(first, STEPS + 1)), (pushes, log)
    assert all(sorted(e["committed"]) == ["r1", "r2", "r3"] for e in pushes.values()), (pushes, log)
    for n, r in reps.items():
        for e in r.of("pulled"):
            assert e["held"] == [e["version"]], (n, "a mix", e, log)
        assert r.of("pulled")[-1]["version"] == STEPS, (n, r.tail(), log)
        back = r.of("rejoined")  # it came back with the version it held: syncing, and handed out nothing older
        assert back and back[0]["publication"] == "syncing", (n, back, log)
        assert all(e["version"] >= first for e in r.of("pulled") if e["t"] > back[0]["t"]), (n, r.tail(), log)


@pytest.mark.parametrize(
    "fault", ["kill-mid-write", "kill-random", "stop", "link", "loss", "kill-trainer"] if FULL else ["kill-mid-write"]
)
def test_elastic_survives_a_fault_mid_push(tmp_path, fault):
    rng = random.Random(f"{SEED}-elastic-{fault}")
    for run in range(RUNS):
        (tmp_path / f"run{run}").mkdir()
        _elastic_run(tmp_path / f"run{run}", fault, rng)
