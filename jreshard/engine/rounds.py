"""The engine: run the ranks' parts of a :class:`~jreshard.sharding.plan.Plan` over a Communicator.

Every transport (in-process, MPI, NCCL) drives this same code; only the
:class:`~jreshard.engine.comm.Communicator` and the
:class:`~jreshard.engine.buffers.BufferBackend` differ. What runs when is decided
by the schedule (:mod:`jreshard.schedule.steps`: chunks, rounds, staging layout),
built once per plan and cached; this module interprets it.

**Buffers.** Stage-0 chunks are read from the sender's source shard; later
stages forward bytes the sender received, which it holds in its destination shard
(a forwarded piece always lies inside the forwarding rank's destination box).
Receivers write into their destination shard. A chunk that is one contiguous run
of its shard is sent or received in place; the others are packed into, or
unpacked from, the rank's staging arena with one descriptor table per round; a backend
that asks for two arenas (``BufferBackend.staging_buffers``) gets them alternated by round.
Local copies (``RankProgram.local``) run first, straight from the source shard.

**Report.** Given a :class:`~jreshard.report.ReportBuilder`, :func:`execute` adds
the time of every phase (pack, network, fan-out, unpack with the local copies),
the bytes per link, the messages and the staging it held. A message is what a
plan counts as one (:attr:`~jreshard.sharding.plan.PlanStats.messages`): all a
rank sends one peer at one stage, however many chunks carry it, so the messages
of all processes add up to the plan's whatever the chunking. An exchange group is
timed as a whole: a group that carries any network chunk counts as network time
(the fan-out chunks inside it overlap with it), a group of fast-link chunks only
as fan-out time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from jreshard.engine.buffers import BufferBackend, CpuBuffers
from jreshard.engine.comm import Communicator, RecvOp, SendOp
from jreshard.errors import TransferError
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder, ReportPhase
from jreshard.schedule import kernels
from jreshard.schedule.groups import group_rounds
from jreshard.schedule.ranksteps import RankSteps
from jreshard.schedule.steps import (
    DST,
    SRC,
    STAGING,
    TAG_CHUNK_BITS,
    Schedule,
    Step,
    Wire,
    buffer_index,
    build_schedule,
    chunk_pieces,
    tag_of,
)
from jreshard.sharding.plan import Plan
from jreshard.sharding.topology import Link

__all__ = [
    "DST",
    "SRC",
    "ExecStats",
    "Schedule",
    "Shards",
    "Step",
    "Wire",
    "buffer_index",
    "build_schedule",
    "chunk_pieces",
    "exchange_groups",
    "execute",
    "split_ops",
    "tag_of",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Shards:
    """The shard buffers of the ranks this process runs: 1-D uint8 per ``(tensor, rank)``.

    ``src`` holds source shards (read), ``dst`` destination shards (written, and
    read again when a rank forwards what it received).
    """

    src: Mapping[tuple[int, int], object]
    dst: Mapping[tuple[int, int], object]

    def of_rank(self, rank: int, ntensors: int) -> list[object]:
        out: list[object] = [None] * (2 * ntensors)
        for t in range(ntensors):
            out[2 * t] = self.src.get((t, rank))
            out[2 * t + 1] = self.dst.get((t, rank))
        return out


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExecStats:
    """What :func:`execute` did for this process's ranks.

    Attributes:
      sent_bytes: bytes sent, by link kind.
      local_bytes: bytes copied locally.
      chunks: chunk messages sent.
      rounds: exchange groups run.
      peak_staging_bytes: per local rank, the most staging it held (never over ``options.staging_bytes``).
    """

    sent_bytes: Mapping[Link, int]
    local_bytes: int
    chunks: int
    rounds: int
    peak_staging_bytes: Mapping[int, int]


def execute(
    plan: Plan | None,
    comm: Communicator,
    shards: Shards,
    *,
    options: Options | None = None,
    backend: BufferBackend | None = None,
    devices: Mapping[int, Any] | None = None,
    report: ReportBuilder | None = None,
    schedule: Schedule | None = None,
) -> ExecStats:
    """Run the parts of ``plan`` that belong to ``comm.local_ranks``.

    Args:
      plan: the whole plan (every process holds the same one); None when ``schedule`` and
        ``options`` are given.
      comm: the transport; its ``local_ranks`` are the ranks this process runs.
      shards: the local ranks' source and destination shard buffers.
      options: chunking, staging and timeout (default: the plan's).
      backend: buffer operations (default :class:`CpuBuffers`).
      devices: ``{rank: jax device}`` of the local ranks, so each staging arena is
        allocated on its rank's device (default: the backend's current device).
      report: where to add phase times, bytes per link, messages and staging.
      schedule: the rounds to run (default: ``build_schedule(plan, options)``), e.g. one
        built for this process's ranks alone by :mod:`jreshard.schedule.pairsched`.

    Returns:
      What was moved, and the peak staging of each local rank.

    Raises:
      TransferError: a shard the plan reads or writes is missing (nothing was written);
        TransferTimeoutError / PeerError from the communicator.
    """
    if plan is None:
        if schedule is None or options is None:
            raise ValueError("execute: without a plan, give both schedule and options")
        sched = schedule
    else:
        options = options or plan.options
        sched = schedule or build_schedule(plan, options)
    backend = backend or CpuBuffers()
    ranks = tuple(comm.local_ranks)
    bufs = {r: shards.of_rank(r, sched.ntensors) for r in ranks}
    _check_buffers(sched, ranks, bufs, shards)
    rep = report or ReportBuilder(Backend.LOCAL)  # a throwaway one keeps the loop free of branches
    sent = dict.fromkeys(Link, 0)
    local_bytes = chunks = 0
    with rep.timed(ReportPhase.UNPACK):
        for r in ranks:
            if r in sched.local:
                keys, st, dt = sched.local[r]
                backend.copy(st, [shards.src[k] for k in keys], dt, bufs[r])
                local_bytes += kernels.table_bytes(dt)
        backend.fence()
    rep.add_bytes(Link.LOCAL, local_bytes)
    devices = devices or {}
    arenas = {r: _arenas(backend, sched.staging.get(r, 0), devices.get(r), options.staging_bytes) for r in ranks}
    held = sum(len(a) * sched.staging.get(r, 0) for r, a in arenas.items())
    rep.staging(held)
    backend.prepare(_jobs(sched, ranks, bufs, arenas))  # e.g. the GPU's launch tables, once per schedule
    rounds_run = 0
    if sched.groups is None:  # a global schedule: rounds over max_group_ops operations run as groups
        cuts = group_rounds(sched, options.max_group_ops).group_of
    else:  # a rank-local one carries its own cut, agreed with the peers
        cuts = sched.groups
    messages: set[tuple[int, int, int]] = set()  # (rank, peer, stage) of the messages sent
    for rnd in range(sched.rounds):
        sends: list[SendOp] = []
        recvs: list[RecvOp] = []
        todo = []
        network = False
        with rep.timed(ReportPhase.PACK):
            for r in ranks:
                step = sched.steps.get(r, {}).get(rnd)
                if step is None:
                    continue
                arena = arenas[r][rnd % len(arenas[r])]
                if len(step.pack):
                    backend.pack(step.pack, bufs[r], arena)
                for w in step.sends:
                    sends.append(SendOp(r, w.peer, w.tag, _region(w, bufs[r], arena)))
                    sent[w.link] += w.nbytes
                    key = (r, w.peer, w.tag >> TAG_CHUNK_BITS)
                    first = key not in messages
                    messages.add(key)
                    rep.add_bytes(w.link, w.nbytes, messages=int(first))
                    network = network or w.link is Link.NETWORK
                recvs.extend(RecvOp(w.peer, r, w.tag, _region(w, bufs[r], arena)) for w in step.recvs)
                network = network or any(w.link is Link.NETWORK for w in step.recvs)
                chunks += len(step.sends)
                if len(step.unpack):
                    todo.append((step.unpack, arena, bufs[r]))
            if not sends and not recvs:
                continue
            backend.fence()  # ordered before the sends; no host wait where the backend can avoid one
        with rep.timed(ReportPhase.NETWORK if network else ReportPhase.FANOUT):
            exchange_groups(comm, sends, recvs, cuts.get(rnd), timeout_s=options.timeout_s)
        rounds_run += 1
        with rep.timed(ReportPhase.UNPACK):
            for table, arena, b in todo:
                backend.unpack(table, arena, b)
    with rep.timed(ReportPhase.UNPACK):
        backend.synchronize()
    rep.staging(-held)
    return ExecStats(
        sent_bytes=sent,
        local_bytes=local_bytes,
        chunks=chunks,
        rounds=rounds_run,
        peak_staging_bytes={r: len(arenas[r]) * sched.staging.get(r, 0) for r in ranks},
    )


def _arenas(backend: BufferBackend, nbytes: int, device: Any, bound: int) -> list[Any]:
    """A rank's staging arenas: ``backend.staging_buffers`` of them where they fit ``bound`` together, else one."""
    n = backend.staging_buffers if backend.staging_buffers * nbytes <= bound else 1
    return [backend.staging(nbytes, device) for _ in range(n)]


def _jobs(sched: Schedule, ranks: tuple[int, ...], bufs: dict[int, list], arenas: dict[int, list]):
    """Every pack and unpack of the ranks' rounds, with the buffers and arena each will use (lazily)."""
    for r in ranks:
        for rnd, step in sched.steps.get(r, {}).items():
            arena = arenas[r][rnd % len(arenas[r])]
            yield from (("pack", step.pack, bufs[r], arena), ("unpack", step.unpack, bufs[r], arena))


def _region(w: Wire, bufs: list, arena) -> object:
    base = arena if w.buf == STAGING else bufs[w.buf]
    return base[w.offset : w.offset + w.nbytes]


def _check_buffers(sched: Schedule, ranks: tuple[int, ...], bufs: dict[int, list], shards: Shards) -> None:
    missing: list[str] = []
    for r in ranks:
        by_round = sched.steps.get(r, {})
        if isinstance(by_round, RankSteps):  # steps held as tables: read them, make no Step
            need = set(by_round.buffers())
        else:
            need = set()
            for step in by_round.values():
                need.update(int(b) for b in step.pack[:, kernels.BUF])
                need.update(int(b) for b in step.unpack[:, kernels.BUF])
                need.update(w.buf for w in (*step.sends, *step.recvs) if w.buf != STAGING)
        if r in sched.local:
            keys, _, dt = sched.local[r]
            need.update(int(b) for b in dt[:, kernels.BUF])
            missing += [f"source shard of tensor {t} on rank {h}" for t, h in keys if (t, h) not in shards.src]
        for b in sorted(need):
            if bufs[r][b] is None:
                missing.append(f"{'source' if b % 2 == SRC else 'destination'} shard of tensor {b // 2} on rank {r}")
    if missing:
        raise TransferError(
            f"execute: the plan needs buffers this process was not given: {missing[:8]}"
            + (f" ... {len(missing)} in all" if len(missing) > 8 else ""),
            destination_intact=True,
        )


def split_ops(
    sends: Sequence[SendOp], recvs: Sequence[RecvOp], cut: Mapping[tuple[int, int, int], int] | None
) -> Iterator[tuple[list[SendOp], list[RecvOp]]]:
    """This process's operations of one round, group by group in order (groups it has no part in are skipped)."""
    if cut is None:
        if sends or recvs:
            yield list(sends), list(recvs)
        return
    by: dict[int, tuple[list[SendOp], list[RecvOp]]] = {}
    for s in sends:
        by.setdefault(cut[(s.src, s.dst, s.tag)], ([], []))[0].append(s)
    for r in recvs:
        by.setdefault(cut[(r.src, r.dst, r.tag)], ([], []))[1].append(r)
    for g in sorted(by):
        yield by[g]


def exchange_groups(
    comm: Communicator,
    sends: Sequence[SendOp],
    recvs: Sequence[RecvOp],
    cut: Mapping[tuple[int, int, int], int] | None,
    *,
    timeout_s: float,
) -> None:
    """Run one round's operations as its groups, one :meth:`Communicator.exchange` each."""
    for s, r in split_ops(sends, recvs, cut):
        comm.exchange(s, r, timeout_s=timeout_s)
