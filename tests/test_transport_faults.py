"""Every call into a transport library, made to fail: what the caller sees.

NIXL: each call NixlComm makes into the ``nixl_agent`` (register, post, poll, release, notify, read
notifications, introduce) raises NIXL's own ``nixlRemoteDisconnectError`` or reports ``ERR``; the
caller sees :class:`PeerError` naming the peer and the phase, the communicator is broken, and the
peer hears of it at once (no wait for its timeout). Above it, ``RefitGroup.push`` marks the group
broken and still runs the commit vote (the destination raises at once and keeps its version), and
an elastic trainer drops only the replica whose WRITE failed. MPI, the NCCL stand-in and the
in-process path are in :mod:`test_transport_faults_mpi`.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import jax
import numpy as np
import pytest

pytest.importorskip("nixl_cu12", reason="the NIXL tests need nixl-cu12 (pip install --no-deps nixl-cu12)")

from _faulty_nixl import failing
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jreshard import Options, PeerError, RefitGroup, TransferError
from jreshard.engine.comm import RecvOp, SendOp
from jreshard.net.channel import Channel, listen
from jreshard.nixl import NixlAgent, NixlComm

pytestmark = pytest.mark.timeout(90)
KEY = b"transport-faults-key-0123456789"
SLACK_S = 4.0  # "at once" on a loaded host; every timeout below is 10 s or more

# (method, failing side, the phase the error names, nbytes sent)
CALLS = [
    ("get_agent_metadata", "sender", "introduction of the agents", 8),
    ("register_memory", "sender", "registration of the WRITE 0->1 tag 3", 8),
    ("register_memory", "receiver", "registration of the receive 0->1 tag 3", 8),
    ("get_xfer_descs", "sender", "post of the WRITE 0->1 tag 3", 8),
    ("initialize_xfer", "sender", "post of the WRITE 0->1 tag 3", 8),
    ("transfer", "sender", "post of the WRITE 0->1 tag 3", 8),
    ("check_xfer_state", "sender", "poll of the WRITE 0->1 tag 3", 8),
    ("release", "sender", "release of the WRITE 0->1 tag 3", 8),
    ("send_notif", "sender", "notification of the empty WRITE 0->1 tag 3", 0),
    ("get_new_notifs", "receiver", "reading of notifications", 8),
]


def _pair() -> tuple[Channel, Channel]:
    a, b = socket.socketpair()
    return Channel(a, "peer 'receiver'"), Channel(b, "peer 'sender'")


def _run(side: str, method: str, nbytes: int, **fault) -> tuple[BaseException | None, object, float]:
    """One exchange of ``nbytes`` from rank 0 (sender) to rank 1 (receiver); ``method`` fails on the
    ``side`` that runs in this thread. Returns (what this side raised, what the other side did, seconds)."""
    to_rx, to_tx = _pair()
    agent = NixlAgent.shared()
    data = np.arange(max(nbytes, 1), dtype=np.uint8)[:nbytes] + 1
    got = np.zeros(nbytes, np.uint8)
    other: dict = {}

    def run(role: str) -> None:
        if role == "sender":
            comm = NixlComm(agent, [0], {1: to_rx}, timeout_s=10.0)
            comm.exchange([SendOp(0, 1, 3, data)], [], timeout_s=10.0)
        else:
            comm = NixlComm(agent, [1], {0: to_tx}, timeout_s=10.0)
            comm.exchange([], [RecvOp(0, 1, 3, got)], timeout_s=10.0)
        return comm

    def elsewhere(role: str) -> None:
        try:
            other["comm"] = run(role)
            other["result"] = "ok"
        except BaseException as err:
            other["result"] = err

    t = threading.Thread(target=elsewhere, args=("receiver" if side == "sender" else "sender",), daemon=True)
    t.start()
    mine: BaseException | None = None
    t0 = time.monotonic()
    with failing(method, thread=threading.get_ident(), **fault) as proxy:
        try:
            run(side)
        except BaseException as err:
            mine = err
            (to_rx if side == "sender" else to_tx).close()  # as a caller does: it drops the failed group
        seconds = time.monotonic() - t0
        t.join(30.0)
    assert proxy.failed >= 1, f"{method} was never called on the {side}'s side"
    to_rx.close()
    to_tx.close()
    return mine, other.get("result", "still running"), seconds


@pytest.mark.parametrize(("method", "side", "phase", "nbytes"), CALLS, ids=[f"{c[0]}-{c[1]}" for c in CALLS])
def test_every_nixl_call_that_raises_becomes_a_peer_error_naming_peer_and_phase(method, side, phase, nbytes):
    mine, other, seconds = _run(side, method, nbytes)
    peer = "peer 'receiver'" if side == "sender" else "peer 'sender'"
    assert isinstance(mine, PeerError), repr(mine)
    assert f"NIXL failed during the {phase}" in str(mine) and peer in str(mine), str(mine)
    assert "nixlRemoteDisconnectError" in str(mine) and seconds < SLACK_S, (str(mine), seconds)
    # the other side either finished its part first or hears of the failure at once (never its timeout)
    told = ("failed the exchange", "closed the connection", "the connection broke")
    assert other == "ok" or (isinstance(other, PeerError) and any(w in str(other) for w in told)), repr(other)
    if side == "sender" and method not in ("check_xfer_state", "release"):  # (those fail after the WRITE landed)
        assert isinstance(other, PeerError), repr(other)  # no bytes were delivered: the receiver must fail


@pytest.mark.parametrize("method", ["transfer", "check_xfer_state"])
def test_a_write_nixl_reports_err_is_a_peer_error_and_the_receiver_is_told(method):
    mine, other, seconds = _run("sender", method, 8, state="ERR")
    assert isinstance(mine, PeerError) and "WRITE 0->1 tag 3" in str(mine), repr(mine)
    if method == "transfer":  # never started: the receiver must be told
        assert isinstance(other, PeerError) and "failed the exchange" in str(other), repr(other)
    else:  # the WRITE had landed (the planted ERR came after): the receiver may have finished first
        assert other == "ok" or isinstance(other, PeerError), repr(other)
    assert seconds < SLACK_S


def test_a_failed_communicator_is_broken_and_says_why():
    to_rx, to_tx = _pair()
    agent = NixlAgent.shared()
    t = threading.Thread(target=lambda: NixlComm(agent, [1], {0: to_tx}, timeout_s=10.0), daemon=True)
    t.start()
    comm = NixlComm(agent, [0], {1: to_rx}, timeout_s=10.0)
    t.join()
    with failing("initialize_xfer", thread=threading.get_ident()):
        rx = threading.Thread(target=lambda: _quiet(to_tx), daemon=True)
        rx.start()
        with pytest.raises(PeerError, match="post of the WRITE"):
            comm.exchange([SendOp(0, 1, 3, np.ones(8, np.uint8))], [], timeout_s=10.0)
    with pytest.raises(PeerError, match=r"broken since an earlier failure \(PeerError: .*post of the WRITE"):
        comm.exchange([], [], timeout_s=1.0)
    rx.join(15.0)
    to_rx.close()
    to_tx.close()


def _quiet(ch: Channel) -> None:
    comm = NixlComm(NixlAgent.shared(), [1], {0: ch}, timeout_s=10.0)
    try:
        comm.exchange([], [RecvOp(0, 1, 3, np.zeros(8, np.uint8))], timeout_s=10.0)
    except PeerError:
        pass


# ---- RefitGroup over NIXL: the group breaks, the vote still runs ------------------------------------
D = jax.devices()
OPTS = Options(timeout_s=20.0, chunk_bytes=64, staging_bytes=1024, secret=KEY)


def _params(v: int, devices) -> dict:
    mesh = Mesh(np.array(devices), ("x",))
    return {"w": jax.device_put(np.arange(64, dtype=np.float32).reshape(16, 4) + v, NamedSharding(mesh, P("x")))}


def _groups(options: Options = OPTS) -> tuple[RefitGroup, RefitGroup, dict]:
    from jreshard.nixl.group import ProcessGroup

    port = listen("127.0.0.1", 0)
    where = port.getsockname()[:2]
    port.close()
    address = f"{where[0]}:{where[1]}"
    made: dict = {}

    def join(role: str, devices) -> None:
        group = ProcessGroup.join(role, address, index=0, count=1, key=KEY, timeout_s=20.0)
        like = _params(0, devices)
        made[role] = RefitGroup(role, like, _group=group, devices=devices, options=options)

    t = threading.Thread(target=join, args=("source", D[:2]))
    t.start()
    time.sleep(0.1)
    join("destination", D[2:4])
    t.join()
    return made["source"], made["destination"], {"src": D[:2], "dst": D[2:4]}


# per operation, the poll of a WRITE raises (what NIXL does when its peer was killed with the bytes in flight);
# with prepared groups (a WRITE that can finish within its post is never polled), the post raises
PATHS = [(False, "check_xfer_state", "poll of the WRITE"), (True, "transfer", "refused the WRITEs")]


@pytest.mark.parametrize(("prepares", "call", "says"), PATHS, ids=["per-op", "prepared"])
def test_refit_group_push_with_a_failing_nixl_call_breaks_the_group_and_votes(monkeypatch, prepares, call, says):
    monkeypatch.setattr(NixlComm, "prepares", prepares)
    # prepared groups run where a refit is not a delta (a delta refit's rounds post each group afresh)
    src, dst, devs = _groups(dataclasses.replace(OPTS, delta="off") if prepares else OPTS)
    current = _params(1, devs["dst"])
    pulled: dict = {}

    def pull() -> None:
        try:
            pulled["tree"] = dst.pull(into=current)
        except BaseException as err:
            pulled["error"] = err
            pulled["at"] = time.monotonic()

    # version 1 moves; version 2's WRITE fails on the source (a destination killed mid-WRITE)
    t = threading.Thread(target=pull)
    t.start()
    src.push(_params(1, devs["src"]), version=1)
    t.join(30)
    tree, v = pulled.pop("tree")
    assert v == 1 and np.array_equal(np.asarray(tree["w"]), np.asarray(_params(1, devs["src"])["w"]))
    t = threading.Thread(target=pull)
    t.start()
    with failing(call, thread=threading.get_ident()):
        t0 = time.monotonic()
        with pytest.raises(PeerError, match=says) as err:
            src.push(_params(2, devs["src"]), version=2)
    t.join(30)
    assert "refit failed; the destination keeps its previous version" in str(err.value)
    assert err.value.destination_intact is True
    assert src.version == 1 and src._broken is not None
    got = pulled["error"]
    assert isinstance(got, TransferError) and pulled["at"] - t0 < OPTS.timeout_s / 2, (repr(got), pulled["at"] - t0)
    assert dst.version == 1 and got.destination_intact is True
    assert np.array_equal(np.asarray(tree["w"]), np.asarray(_params(1, devs["src"])["w"]))  # still version 1
    with pytest.raises(PeerError, match="broken since an earlier failure"):
        src.push(_params(3, devs["src"]), version=3)
    for g in (src, dst):
        g.close()


# ---- elastic: a replica whose WRITE fails is dropped, every other one completes the version --------
@pytest.mark.parametrize(("prepares", "call", "says"), PATHS, ids=["per-op", "prepared"])
def test_elastic_the_middle_of_three_replicas_failing_mid_write_is_lost_and_the_others_commit(
    monkeypatch, prepares, call, says
):
    from jreshard.elastic import ElasticReplica, ElasticTrainer
    from jreshard.elastic import membership as membership_module

    monkeypatch.setattr(NixlComm, "prepares", prepares)
    opts = Options(timeout_s=10.0, chunk_bytes=64, staging_bytes=1024, secret=KEY)
    tr = ElasticTrainer(_params(0, D[:2]), devices=list(D[:2]), options=opts)

    def like(i: int) -> dict:
        return {
            "w": jax.ShapeDtypeStruct(
                (16, 4), np.float32, sharding=NamedSharding(Mesh(np.array(D[i : i + 2]), ("x",)), P("x"))
            )
        }

    reps = {
        n: ElasticReplica(like(i), tr.address, name=n, devices=list(D[i : i + 2]), options=opts)
        for n, i in (("r1", 2), ("r2", 4), ("r3", 6))
    }
    assert tr.wait(count=3) == ("r1", "r2", "r3")
    assert tr.push(_params(1, D[:2]), version=1).committed == ("r1", "r2", "r3")
    real = membership_module.Membership._send

    def send(self, m, leaves, use):  # r2's node dies with its bytes in flight: NIXL's poll raises (what it raised)
        if m.name != "r2":
            return real(self, m, leaves, use)
        with failing(call, thread=threading.get_ident()):
            return real(self, m, leaves, use)

    monkeypatch.setattr(membership_module.Membership, "_send", send)
    t0 = time.monotonic()
    report = tr.push(_params(2, D[:2]), version=2)
    assert time.monotonic() - t0 < opts.timeout_s  # dropped at once, not after a timeout
    assert report.committed == ("r1", "r3") and list(report.lost) == ["r2"], report
    # (whichever of its exchanges met the failure first: the rounds' agreement, or the WRITEs)
    assert "during version 2" in report.lost["r2"] and "NIXL_ERR_REMOTE_DISCONNECT" in report.lost["r2"], report.lost
    assert tr.version == 2 and tr.wait(version=2) == ("r1", "r3")
    want = np.asarray(_params(2, D[:2])["w"])
    for n in ("r1", "r3"):
        tree, v = reps[n].pull()
        assert v == 2 and np.array_equal(np.asarray(tree["w"]), want)
    assert reps["r2"].pull(allow_stale=True)[1] == 1  # it keeps the version it held (stale: it was dropped)
    monkeypatch.setattr(membership_module.Membership, "_send", real)
    assert tr.push(_params(3, D[:2]), version=3).committed == ("r1", "r3")  # the trainer goes on
    tr.close()
    for r in reps.values():
        r.leave()


def test_elastic_a_replica_lost_between_pushes_is_in_the_next_report_and_its_history_survives_a_rejoin():
    from jreshard.elastic import ElasticReplica, ElasticTrainer, ReplicaState

    opts = Options(timeout_s=10.0, chunk_bytes=64, staging_bytes=1024, secret=KEY)
    tr = ElasticTrainer(_params(0, D[:2]), devices=list(D[:2]), options=opts)

    def like(i: int) -> dict:
        return {
            "w": jax.ShapeDtypeStruct(
                (16, 4), np.float32, sharding=NamedSharding(Mesh(np.array(D[i : i + 2]), ("x",)), P("x"))
            )
        }

    def join(name: str, i: int) -> ElasticReplica:
        return ElasticReplica(like(i), tr.address, name=name, devices=list(D[i : i + 2]), options=opts)

    r1, r2 = join("r1", 2), join("r2", 4)
    tr.wait(count=2)
    assert tr.push(_params(1, D[:2]), version=1).lost == {}
    first = r2.id
    r2._trainer.sock.shutdown(socket.SHUT_RDWR)  # r2's node dies between two pushes
    deadline = time.monotonic() + 10
    while "r2" in tr.replicas() and time.monotonic() < deadline:
        time.sleep(0.01)
    again = join("r2", 6)  # a new r2 joins under the same name before the next push
    tr.wait(version=1)
    report = tr.push(_params(2, D[:2]), version=2)
    assert report.committed == ("r1", "r2") and list(report.lost) == ["r2"], report
    assert "closed the connection" in report.lost["r2"] or "connection broke" in report.lost["r2"], report.lost
    assert tr.push(_params(3, D[:2]), version=3).lost == {}  # reported once
    history = tr.history("r2")
    assert [(i.id, i.state) for i in history] == [(first, ReplicaState.GONE), (again.id, ReplicaState.READY)]
    assert history[0].error == report.lost["r2"] and history[0].version == 1 and history[1].version == 3
    assert tr.replicas(include_gone=True)["r2"].id == again.id  # one entry per name: the live one
    assert [i.name for i in tr.history()] == ["r1", "r2", "r2"]
    r1.leave()
    deadline = time.monotonic() + 10
    while "r1" in tr.replicas() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tr.push(_params(4, D[:2]), version=4).lost == {"r1": "left"}  # a clean leave, with its reason
    tr.close()
    for r in (r2, again):
        r.leave()
