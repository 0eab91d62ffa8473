"""Prepared refits captured as one CUDA graph (``jreshard.nccl.graph``), against the numpy stand-ins of CuPy and
NCCL that move real bytes (``tests/cupy_numpy.py``: what a stream under capture is given is kept and run at each
launch). None of it has run on a GPU: these check what is captured, when it is captured again, that each step's
bytes land where this step's buffers are, and that the wait on a launch is bounded."""

from __future__ import annotations

import numpy as np
import pytest
from cupy_numpy import make_cupy
from schedule_oracle import build_schedule

from jreshard.engine import replay
from jreshard.engine.replay import ops_of
from jreshard.engine.rounds import Shards, execute
from jreshard.errors import TransferTimeoutError
from jreshard.nccl.cupy_nccl import NcclComm, destroy_cached_communicators
from jreshard.nccl.graph import GraphRefit, why_eager
from jreshard.nccl.rendezvous import KeyValueRendezvous
from jreshard.options import Options
from jreshard.schedule import kernels as K
from jreshard.sharding.box import Box
from jreshard.sharding.layout import Layout
from jreshard.sharding.planner import plan_layouts
from jreshard.sharding.topology import Topology

SHAPE = (32, 128)  # float32, 16 KiB; 1 KiB chunks through 2 KiB arenas: many rounds
SRC_BOXES = {0: Box((0, 0), (32, 32)), 3: Box((0, 32), (32, 128))}
DST_BOXES = {1: Box((0, 0), (16, 64)), 2: Box((0, 64), (16, 128)), 4: Box((16, 0), (32, 64)),
             5: Box((16, 64), (32, 128))}  # fmt: skip
RANKS = sorted([*SRC_BOXES, *DST_BOXES])


@pytest.fixture
def cp():
    cp = make_cupy()
    yield cp
    destroy_cached_communicators()
    assert cp.cuda.standin.order.races == []  # every access ordered after those it conflicts with


def _part(host, box):
    return host[tuple(slice(a, b) for a, b in zip(box.lo, box.hi, strict=True))]


class _Split:
    """Column stripes on ranks 0 and 3 to 2 x 2 tiles on ranks 1, 2, 4, 5, all on one GPU (NCCL rank 0 to itself)."""

    def __init__(self, cp, namespace: str, *, graphs: bool = True, timeout_s: float = 10.0):
        self.cp = cp
        self.opts = Options(backend="nccl", chunk_bytes=1 << 10, staging_bytes=4 << 10, timeout_s=timeout_s)
        half = Options(backend="nccl", chunk_bytes=1 << 10, staging_bytes=2 << 10, timeout_s=timeout_s)
        src = Layout.from_boxes(SHAPE, "float32", SRC_BOXES)
        dst = Layout.from_boxes(SHAPE, "float32", DST_BOXES)
        topo = Topology.from_domains(dict.fromkeys(RANKS, 0), devices={r: r for r in RANKS})
        self.sched = build_schedule(plan_layouts([(src, dst)], topo, self.opts), half)
        self.comm = NcclComm(
            devices=dict.fromkeys(RANKS, 0),
            local_devices=dict.fromkeys(RANKS, 0),
            rendezvous=KeyValueRendezvous.in_process(),
            namespace=namespace,
            nccl=cp.cuda.nccl,
            cuda=cp.cuda,
            graphs=graphs,
        )
        self.bufs = self.comm.buffers(timeout_s=timeout_s, cupy=cp)
        self.dsts = self.fresh_destinations()

    def fresh_destinations(self) -> dict:
        return {(0, r): self.cp.zeros(_part(np.zeros(SHAPE, np.float32), b).nbytes, self.cp.uint8)
                for r, b in DST_BOXES.items()}  # fmt: skip

    def step(self, k: int) -> np.ndarray:
        """One refit of a tensor whose values differ from step to step; checks every destination shard."""
        cp = self.cp
        host = np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE) * (k + 1)
        srcs = {(0, r): cp.asarray(np.ascontiguousarray(_part(host, b)).reshape(-1).view(np.uint8))
                for r, b in SRC_BOXES.items()}  # fmt: skip
        cp.cuda.Device(0).synchronize()  # the set-up ran on the legacy default stream
        execute(self.sched, self.comm, Shards(src=srcs, dst=self.dsts), options=self.opts, buffers=self.bufs)
        for (_, r), d in self.dsts.items():
            got = cp.asnumpy(d).view(np.float32).reshape(_part(host, DST_BOXES[r]).shape)
            np.testing.assert_array_equal(got, _part(host, DST_BOXES[r]))
        return host

    def graph(self) -> GraphRefit:
        (rep,) = replay._by_comm[self.comm].values()
        assert isinstance(rep.graph, GraphRefit)
        return rep.graph


def _log(cp, what: str) -> list[tuple]:
    return [e for e in cp.cuda.standin.log if e[0] == what]


def test_steps_after_the_first_are_one_graph_launch_each_and_move_each_steps_bytes(cp):
    split = _Split(cp, "graph-steps")
    for k in range(4):
        split.step(k)
    g = split.graph()
    assert (g.steps, g.captures, g.launches, g.eager_because) == (4, 1, 3, None)
    assert len(_log(cp, "begin_capture")) == 1 and len(_log(cp, "graph_launch")) == 3
    launches = _log(cp, "graph_launch")
    nccl_stream = split.comm.stream(RANKS[0]).ptr
    assert all(e[1] == nccl_stream and e[2] > 0 for e in launches)  # on the NCCL stream, not the legacy one


def test_the_graph_holds_every_pack_group_and_unpack_of_the_schedule(cp):
    split = _Split(cp, "graph-contents")
    split.step(0)
    cp.cuda.standin.log.clear()
    split.step(1)  # captured now: what the stream was given is in the graph, nothing ran outside it
    g = split.graph()
    packs = sum(1 for op in g.ops.ops if op[0] in (replay.PACK, replay.UNPACK) and len(op[1]))
    messages = sum(len(s) + len(r) for s, r in g.ops.groups)
    (launch,) = _log(cp, "graph_launch")
    assert launch[2] == g.kernels + messages  # kernels, and one send or receive per message
    bounced = sum(bool(s) + bool(r) for s, r in zip(g._bounce_sends, g._bounce_recvs, strict=True))
    assert g.kernels == packs + bounced > packs  # the schedule sends straight from its source shards
    assert len(_log(cp, "groupStart")) == len(g.ops.groups)  # each group issued once, at capture
    assert not [e for e in cp.cuda.standin.log if e[0] in ("launch", "send", "recv") and e[1] == 0]


def test_moved_destination_shards_are_written_where_they_are_now_never_where_they_were(cp):
    split = _Split(cp, "graph-moved")
    split.step(0)
    split.step(1)
    old = split.dsts
    split.dsts = split.fresh_destinations()  # new addresses for the next step
    for d in old.values():
        d._a[...] = 0xAB
    split.step(2)
    assert all((cp.asnumpy(d) == 0xAB).all() for d in old.values())  # nothing written through a stale pointer
    g = split.graph()
    assert g.launches == 2 and g.captures in (1, 2)  # recaptured only where a message named a moved shard


def test_a_launch_that_does_not_finish_aborts_the_communicators_within_the_timeout(cp, monkeypatch):
    split = _Split(cp, "graph-timeout", timeout_s=0.3)
    split.step(0)
    runtime = cp.cuda.runtime
    monkeypatch.setattr(runtime, "eventQuery", lambda event: 600)  # cudaErrorNotReady, for ever
    with pytest.raises(TransferTimeoutError, match=r"did not finish within timeout_s=0\.3"):
        split.step(1)
    assert _log(cp, "nccl_abort")


def test_without_graphs_every_step_runs_eagerly(cp):
    split = _Split(cp, "graph-off", graphs=False)
    for k in range(2):
        split.step(k)
    (rep,) = replay._by_comm[split.comm].values()
    assert rep.graph is None and not _log(cp, "begin_capture")


def test_schedules_with_cast_rows_or_on_several_gpus_run_eagerly_with_the_reason():
    table = K.build_table([(0, (4, 64), Box((0, 0), (4, 16)))])
    plain = ops_of(((((table, 0, 1),), (), (), True),), (False,), {0: 0}, 1)
    assert why_eager(plain, [0]) is None
    cast = table.copy()
    cast[:, K.CAST] = 1
    casting = ops_of(((((cast, 0, 1),), (), (), True),), (False,), {0: 0}, 1)
    assert why_eager(casting, [0]) == "rows that cast dtypes"
    assert "2 GPUs" in why_eager(plain, [0, 1])
