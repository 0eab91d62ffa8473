"""Publication gating of elastic replicas, in one process (a trainer on two CPU devices, replicas on
others, every byte a NIXL WRITE of this process's agent to itself): a replica that joins, re-joins with
the weights it held, is dropped, or loses its trainer reports ``syncing`` / ``current`` / ``stale`` and
hands out only a current version unless asked."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jreshard import Options, PeerError, TransferTimeoutError
from jreshard.elastic import ElasticReplica, ElasticTrainer, Publication
from jreshard.elastic import membership as membership_module
from jreshard.elastic import replica as replica_module

pytest.importorskip("nixl_cu12", reason="the elastic tests need nixl-cu12")
pytestmark = pytest.mark.timeout(60)
D = jax.devices()
OPTS = Options(timeout_s=5.0, chunk_bytes=256, staging_bytes=4096, secret=b"serve-elastic-key-0123456789")


def params(v: int) -> dict:
    return {"w": jax.device_put(np.arange(128, dtype=np.float32).reshape(16, 8) + 100 * v, _src())}


def _src() -> NamedSharding:
    return NamedSharding(Mesh(np.array(D[:2]), ("fsdp",)), P("fsdp"))


def like(i: int) -> dict:
    mesh = Mesh(np.array(D[2 * i : 2 * i + 2]).reshape(1, 2), ("dp", "tp"))
    return {"w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=NamedSharding(mesh, P(None, "tp")))}


def replica(trainer: ElasticTrainer, i: int, name: str, **kw) -> ElasticReplica:
    return ElasticReplica(like(i), trainer.address, name=name, devices=list(D[2 * i : 2 * i + 2]), options=OPTS, **kw)


def exact(tree: dict, v: int) -> bool:
    return np.array_equal(np.asarray(tree["w"]), np.asarray(params(v)["w"]))


def hold_receives(monkeypatch) -> threading.Event:
    """Every replica's receive waits for the returned event: a catch-up stays in flight."""
    gate, real = threading.Event(), replica_module.ElasticReplica._receive

    def held(self, *args, **kw):
        assert gate.wait(20)
        return real(self, *args, **kw)

    monkeypatch.setattr(replica_module.ElasticReplica, "_receive", held)
    return gate


def test_a_replica_rejoining_with_stale_weights_hands_out_none_until_current(monkeypatch):
    tr = ElasticTrainer(params(0), devices=list(D[:2]), options=OPTS)
    try:
        r1, r2 = replica(tr, 1, "r1"), replica(tr, 2, "r2")
        assert r1.publication is Publication.SYNCING and not r1.ready()  # joined, nothing held yet
        tr.wait(count=2)
        tr.push(params(1), version=1)
        tree1, v = r1.pull()
        assert v == 1 and exact(tree1, 1) and r1.publication is Publication.CURRENT and r1.ready()
        r1.leave()  # it goes away; the trainer moves on without it
        assert r1.publication is Publication.STALE and not r1.ready()
        with pytest.raises(PeerError, match=r"it left; it holds version 1 \(stale"):
            r1.pull()
        assert r1.pull(allow_stale=True)[1] == 1
        tr.push(params(2), version=2)
        tr.push(params(3), version=3)
        gate = hold_receives(monkeypatch)
        back = replica(tr, 1, "r1", held=(tree1, 1))  # it re-joins with the weights it held
        assert back.publication is Publication.SYNCING and not back.ready()
        with pytest.raises(TransferTimeoutError, match=r"it holds 1, syncing; the trainer's latest is 3"):
            back.pull(timeout_s=0.2)  # no weights handed out while it catches up
        assert back.pull(timeout_s=0.2, allow_stale=True) == (tree1, 1)  # only when asked
        gate.set()
        tree, v = back.pull(timeout_s=5.0)
        assert v == 3 and exact(tree, 3) and back.publication is Publication.CURRENT
        arrival = back.arrivals[-1]
        assert arrival.version == 3 and arrival.nbytes == 4 * 16 * 8 and 0 < arrival.cpu_s
        assert tr.wait(version=3) == ("r1", "r2")
        assert exact(r2.pull()[0], 3)
    finally:
        tr.close()
    assert back.publication is Publication.CURRENT  # the trainer closed cleanly after version 3: final
    assert back.pull()[1] == 3
    back.leave()
    r2.leave()


def test_a_replica_whose_trainer_vanishes_is_stale(monkeypatch):
    tr = ElasticTrainer(params(0), devices=list(D[:2]), options=OPTS)
    r1 = replica(tr, 1, "r1")
    tr.wait(count=1)
    tr.push(params(1), version=1)
    assert r1.pull()[1] == 1
    real = membership_module.Membership._drop

    def vanish(self, m, why):  # the trainer's connections close with no goodbye, as a killed trainer's
        for ch in m.channels:
            ch.close()
        real(self, m, why)

    monkeypatch.setattr(
        membership_module.Membership,
        "goodbye",
        lambda self: [vanish(self, m, "killed") for m in list(self.members.values())],
    )
    tr.close()
    with pytest.raises(PeerError, match="connection closed"):
        r1.pull(newer_than=1, timeout_s=5.0)  # returns once the replica has seen its trainer go
    with pytest.raises(PeerError, match=r"holds version 1 \(stale, pull\(allow_stale=True\) hands it out\)"):
        r1.pull()
    assert r1.publication is Publication.STALE
    tree, v = r1.pull(allow_stale=True)
    assert v == 1 and exact(tree, 1)
    r1.leave()


def test_held_weights_that_do_not_match_the_declaration_are_refused_before_connecting():
    bad = {
        "w": jax.device_put(
            np.zeros((8, 8), np.float32),
            NamedSharding(Mesh(np.array(D[2:4]).reshape(1, 2), ("dp", "tp")), P(None, "tp")),
        )
    }
    with pytest.raises(ValueError, match="ElasticReplica: held"):
        ElasticReplica(like(1), "127.0.0.1:1", name="r", devices=list(D[2:4]), options=OPTS, held=(bad, 1))
    with pytest.raises(ValueError, match=r"held must be \(tree, version: int\), not a tuple with version '1'"):
        ElasticReplica(like(1), "127.0.0.1:1", name="r", devices=list(D[2:4]), options=OPTS, held=(bad, "1"))
