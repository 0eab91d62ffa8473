"""One front door: each call flattens ``x`` once and ``target`` once, whatever path runs it: arrays on
every route, views in one process and across processes, ``RefitGroup``, ``ElasticTrainer.push``.

Every jax.tree_util / jax.tree flattening function is wrapped to count the calls whose tree is ``x`` or
``target`` (by identity); the target's flattening up to ``x``'s structure goes through
``jreshard.call.front._up_to``, counted the same way.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard.call import front as frontdoor
from jreshard.call import routes
from jreshard.call.routes import BackendChoice
from jreshard.engine.buffers import CpuBuffers
from jreshard.engine.record import Opened
from jreshard.engine.recording import RecordingComm
from jreshard.options import Backend
from jreshard.sharding.topology import Topology

DEVS = np.array(jax.devices())
SRC = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x"))
DST = NamedSharding(Mesh(DEVS[4:], ("y",)), P(None, "y"))
_FLATTENERS = ["tree_flatten", "tree_leaves", "tree_flatten_with_path", "tree_leaves_with_path", "tree_structure"]
_TREE = ["flatten", "leaves", "flatten_with_path", "leaves_with_path", "structure", "map", "broadcast"]


class _Seen:
    """Flattenings of the watched trees (by identity, only while they are watched: ids are reused)."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.watched: dict[int, object] = {}

    def watch(self, *trees: object) -> None:
        self.counts.clear()
        self.watched = {id(t): t for t in trees}

    def update(self, ids) -> None:
        self.counts.update(i for i in ids if i in self.watched)

    def __call__(self, tree: object) -> int:
        return self.counts[id(tree)]


@pytest.fixture
def counted(monkeypatch):
    """``counted.watch(x, target)`` before a call; ``counted(tree)`` after it: how many times a flattening
    function saw ``tree`` during the call."""
    seen = _Seen()

    def wrap(fn):
        def counting(tree, *args, **kwargs):
            seen.update([id(tree)])
            return fn(tree, *args, **kwargs)

        return counting

    for name in _FLATTENERS:
        monkeypatch.setattr(jax.tree_util, name, wrap(getattr(jax.tree_util, name)))
    monkeypatch.setattr(jax.tree_util, "tree_map", _map_counter(jax.tree_util.tree_map, seen))
    for name in _TREE:
        fn = getattr(jax.tree, name)
        monkeypatch.setattr(jax.tree, name, _map_counter(fn, seen) if name == "map" else wrap(fn))
    monkeypatch.setattr(
        frontdoor,
        "_up_to",
        lambda treedef, target, f=frontdoor._up_to: (seen.update([id(target)]), f(treedef, target))[1],
    )
    return seen


def _map_counter(fn, seen):
    def counting(f, tree, *rest, **kwargs):
        seen.update([id(t) for t in (tree, *rest)])
        return fn(f, tree, *rest, **kwargs)

    return counting


def _tree(seed=0):
    rng = np.random.default_rng(seed)
    host = {"a": rng.standard_normal((8, 8)).astype(np.float32), "b": [rng.integers(0, 9, (8, 4)).astype(np.int32)]}
    return jax.tree.map(lambda v: jax.device_put(v, SRC), host)


def test_the_counter_counts():
    seen = _Seen()
    x, y = {"a": 1}, {"a": 2}
    seen.watch(x)
    _map_counter(jax.tree_util.tree_map, seen)(lambda v, w: v, x, y)
    assert (seen(x), seen(y)) == (1, 0)


@pytest.mark.parametrize("mode", ["transfer", "transfer_into"])
def test_local_route_flattens_x_and_target_once(counted, mode):
    x = _tree()
    target = {"a": DST, "b": [DST]}
    if mode == "transfer":
        counted.watch(x, target)
        out = jreshard.transfer(x, target)
    else:
        target = jax.tree.map(lambda v: jax.device_put(jnp.zeros(v.shape, v.dtype), DST), x)
        counted.watch(x, target)
        out = jreshard.transfer_into(x, target)
    np.testing.assert_array_equal(np.asarray(out["a"]), np.asarray(x["a"]))
    assert (counted(x), counted(target)) == (1, 1)


def test_mpi_route_flattens_x_and_target_once(counted):
    pytest.importorskip("mpi4py.MPI")
    x = _tree(1)
    target = {"a": DST, "b": [DST]}
    counted.watch(x, target)
    out = jreshard.transfer(x, target, options=jreshard.Options(backend="mpi"))
    np.testing.assert_array_equal(np.asarray(out["b"][0]), np.asarray(x["b"][0]))
    assert (counted(x), counted(target)) == (1, 1)


def test_nccl_route_flattens_x_and_target_once(counted, monkeypatch):
    """The NCCL route with its transport twinned by a recording one over host buffers (no GPU here)."""
    comms = []

    class Twin(RecordingComm):
        def buffers(self, *, timeout_s: float) -> CpuBuffers:
            return _Buffers()

    class _Buffers(CpuBuffers):
        def release(self) -> None:
            pass

    def twin(devs, single_process, options, topology):
        comms.append(Twin(ranks=sorted(devs), topology=Topology.uniform(range(8), domain_size=4)))
        return Opened(comm=comms[-1], buffers=comms[-1].buffers(timeout_s=options.timeout_s))

    registered = routes.transport
    nccl = dataclasses.replace(registered("nccl"), open=twin)  # the NCCL record, its communicator twinned
    monkeypatch.setattr(routes, "transport", lambda name: nccl if name == "nccl" else registered(name))
    monkeypatch.setattr(
        routes, "route", lambda leaves, targets, options: (BackendChoice(backend=Backend.NCCL, reason="test"), True)
    )
    monkeypatch.setattr(jreshard.api, "route", routes.route)
    monkeypatch.setattr(jreshard.api, "_plain_route", lambda key: None)  # routed to NCCL: not a local call
    x = _tree(2)
    target = {"a": DST, "b": [DST]}
    counted.watch(x, target)
    out = jreshard.transfer(x, target)
    np.testing.assert_array_equal(np.asarray(out["a"]), np.asarray(x["a"]))
    assert comms and comms[0].records  # the engine ran over the twin
    assert (counted(x), counted(target)) == (1, 1)


def test_xla_route_flattens_x_and_target_once(counted):
    x = _tree(3)
    target = {"a": DST, "b": [DST]}
    counted.watch(x, target)
    out = jreshard.transfer(x, target, options=jreshard.Options(backend="xla"))
    np.testing.assert_array_equal(np.asarray(out["b"][0]), np.asarray(x["b"][0]))
    assert (counted(x), counted(target)) == (1, 1)


def test_refit_group_push_and_pull_flatten_their_tree_once(tmp_path):
    """Two programs under one MPMD mpiexec; each process counts the flattenings of the tree it hands
    ``push`` or ``pull`` (``tests/mpi_bodies/refit_flatten_body.py``)."""
    from mpi_launch import launch, need_mpi, program, results

    need_mpi()
    launch(
        [program(1, "refit_flatten_body.py", "source"), program(1, "refit_flatten_body.py", "destination")],
        tmp_path,
        devices=2,
        timeout_s=120,
    )
    got = results(tmp_path, "flatten-source") | results(tmp_path, "flatten-destination")
    assert len(got) == 2 and all("error" not in r for r in got.values()), got
    assert sorted(r["flattenings"] for r in got.values()) == [1, 1]
    assert [r["value"] for r in got.values() if r["value"] is not None] == [3.0]


def _fused(seed=4):
    from jreshard import views

    x = _tree(seed)
    return x, {"f": views.astype(views.concat([x["a"], x["b"][0].astype(jnp.float32)], axis=1), jnp.bfloat16)}


@pytest.mark.parametrize("mode", ["transfer", "transfer_into"])
def test_views_flatten_x_and_target_once(counted, mode):
    """A tree with views among its leaves, in one process: the front door's flattening is the only one."""
    _, tree = _fused()
    dst = NamedSharding(Mesh(DEVS[4:], ("y",)), P("y"))
    if mode == "transfer":
        target = {"f": dst}
        counted.watch(tree, target)
        out = jreshard.transfer(tree, target)
    else:
        target = {"f": jax.device_put(jnp.zeros((8, 12), jnp.bfloat16), dst)}
        counted.watch(tree, target)
        out = jreshard.transfer_into(tree, target)
    assert out["f"].dtype == jnp.bfloat16 and out["f"].sharding == dst
    assert (counted(tree), counted(target)) == (1, 1)


def test_views_across_processes_flatten_once(counted):
    """The views' cluster path (every rank here, over a recording transport) flattens once too."""
    from jreshard.call.views import transfer_cluster

    _, tree = _fused(5)
    target = {"f": DST}
    topo = Topology.uniform(range(8), domain_size=4)
    counted.watch(tree, target)
    out = transfer_cluster(tree, target, topology=topo, transport=RecordingComm(range(8), topo))
    assert out["f"].dtype == jnp.bfloat16
    assert (counted(tree), counted(target)) == (1, 1)


def test_elastic_push_flattens_the_parameters_once(counted):
    """ElasticTrainer.push checks the tree against its declaration and sends its leaves: one flattening."""
    from jreshard.elastic import ElasticReplica, ElasticTrainer

    devs = list(DEVS)
    src = NamedSharding(Mesh(DEVS[:2], ("fsdp",)), P("fsdp"))
    dst = NamedSharding(Mesh(DEVS[2:4], ("tp",)), P(None, "tp"))

    def params(v):
        return {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8) + v, src)}

    opts = jreshard.Options(timeout_s=5.0, chunk_bytes=64, staging_bytes=1024, secret=b"flatten-once-key-0123456789")
    like = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=dst)}
    with ElasticTrainer(params(0), devices=devs[:2], options=opts) as trainer:
        replica = ElasticReplica(like, trainer.address, name="r", devices=devs[2:4], options=opts)
        trainer.wait(count=1)
        tree = params(1)
        counted.watch(tree)
        trainer.push(tree, version=1)
        assert counted(tree) == 1
        got, version = replica.pull()
        assert version == 1
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(tree["w"]))
        replica.leave()
