"""The engine's round loop: run a schedule's rounds for this process's ranks over a Communicator.

Every transport (in-process, MPI, NCCL) drives this same code; only the
:class:`~jreshard.engine.comm.Communicator` and the
:class:`~jreshard.engine.buffers.Buffers` differ. What runs when is decided
by the schedule (:mod:`jreshard.schedule`: chunks, rounds, staging layout), built
once per plan, or per rank by the pair-paced scheduler, and cached. This module
compiles it once for the ranks of one process (:func:`compile_rounds`: per round, the
descriptor tables and the exchange groups as rows of plain integers, with every
count the report needs summed ahead) and runs it: per round, the packs, the exchange
groups, the unpacks. It runs them as a prepared schedule (:mod:`jreshard.engine.replay`):
flattened into operations, with the transport's requests made, on the schedule's first step,
and replayed on every later one (in one compiled call over MPI on CPU buffers).

**Buffers.** Stage-0 chunks are read from the sender's source shard; later
stages forward bytes the sender received, which it holds in its destination shard
(a forwarded piece always lies inside the forwarding rank's destination box). Where
a rank alternates two arenas on host-ordered buffers and a forwarded chunk is a chunk
it landed the round before, byte for byte, it is sent from that landed staging
instead, with no pack (:func:`forwards_from_landing`).
Receivers write into their destination shard. A chunk that is one contiguous run
of its shard is sent or received in place; the others are packed into, or
unpacked from, the rank's staging arena with one descriptor table per round; buffers
that ask for two arenas (``Buffers.staging_buffers``) get them alternated by round.
Same-device copies (``RankPlan.copies``) run first, straight from the source shard.

**Packing ahead.** Over a transport whose messages move while the host works
(``Communicator.posts_ahead``: MPI), each rank gets two arenas where they fit the
staging bound together, and a round whose packs read source shards only (a sender's
casts, its strided boxes) is packed while the round before is on the wire: the loop
posts that round's last group (``start_rows``), packs the next round into the other
arena, then waits. Packs that read forwarded bytes, or that would write an arena the
posted round still uses, run in their own round as before. A pack that fails while a
group is posted gives the group up (the communicator is then broken) and raises.

**Report.** Given a :class:`~jreshard.report.ReportBuilder`, :func:`execute` adds
the time of every phase (pack, network, fan-out, unpack with the same-device copies),
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
import functools
import itertools
import operator
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jreshard.engine.buffers import Buffers, CpuBuffers
from jreshard.engine.comm import Communicator, Row
from jreshard.engine.deltarounds import DeltaRefit, run_delta_rounds
from jreshard.engine.replay import ops_cached, ops_of, replay_of
from jreshard.errors import TransferError
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder, ReportPhase
from jreshard.schedule import kernels
from jreshard.schedule.groups import group_rounds
from jreshard.schedule.ranksteps import RankColumns, RankSteps, WireColumns
from jreshard.schedule.steps import SRC, STAGING, TAG_CHUNK_BITS, Schedule, Step, Wire
from jreshard.sharding.topology import Link
from jreshard.types import Device, ShardKey

__all__ = ["ExecStats", "CompiledRounds", "Shards", "compile_rounds", "execute", "forwards_from_landing"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Shards:
    """The shard buffers of the ranks this process runs: 1-D uint8 per ``(tensor, rank)``.

    ``src`` holds source shards (read), ``dst`` destination shards (written, and
    read again when a rank forwards what it received).
    """

    src: Mapping[ShardKey, Any]
    dst: Mapping[ShardKey, Any]

    def of_rank(self, rank: int, ntensors: int) -> list[Any]:
        """``[src(t0), dst(t0), src(t1), dst(t1), ...]`` of ``rank`` (``None`` where it holds no such shard)."""
        keys = _keys(rank, ntensors)
        out: list[Any] = [None] * (2 * ntensors)
        if self.src:  # (a destination rank's step looks up no source)
            out[0::2] = map(self.src.get, keys)
        if self.dst:
            out[1::2] = map(self.dst.get, keys)
        return out


@functools.lru_cache(maxsize=64)
def _keys(rank: int, ntensors: int) -> tuple[ShardKey, ...]:
    return tuple((t, rank) for t in range(ntensors))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExecStats:
    """What :func:`execute` did for this process's ranks.

    Attributes:
      sent_bytes: bytes sent, by link kind.
      same_device_bytes: bytes copied on one device.
      chunks: chunk messages sent.
      rounds: exchange groups run.
      peak_staging_bytes: per local rank, the most staging it held (never over ``options.staging_bytes``).
    """

    sent_bytes: Mapping[Link, int]
    same_device_bytes: int
    chunks: int
    rounds: int
    peak_staging_bytes: Mapping[int, int]


def execute(
    schedule: Schedule,
    comm: Communicator,
    shards: Shards,
    *,
    options: Options,
    buffers: Buffers[Any] | None = None,
    devices: Mapping[int, Device] | None = None,
    report: ReportBuilder | None = None,
    delta: DeltaRefit | None = None,
) -> ExecStats:
    """Run the rounds of ``schedule`` that belong to ``comm.local_ranks``.

    Args:
      schedule: the rounds, from :func:`~jreshard.schedule.steps.build_schedule` (a whole plan's) or
        :mod:`jreshard.schedule.pairsched` (this process's ranks alone).
      comm: the transport; its ``local_ranks`` are the ranks this process runs.
      shards: the local ranks' source and destination shard buffers.
      options: staging bound, ``max_group_ops`` and ``timeout_s``.
      buffers: buffer operations (default :class:`CpuBuffers`).
      devices: ``{rank: jax device}`` of the local ranks, so each staging arena is
        allocated on its rank's device (default: the buffers' current device).
      report: where to add phase times, bytes per link, messages and staging.
      delta: send each chunk as what changed since the base its receiver holds
        (:mod:`jreshard.engine.deltarounds`; CPU buffers), instead of replaying the prepared schedule.

    Returns:
      What was moved, and the peak staging of each local rank.

    Raises:
      TransferError: a shard the schedule reads or writes is missing (nothing was written);
        TransferTimeoutError / PeerError from the communicator.
    """
    if buffers is None:
        buffers = CpuBuffers()
    ranks = tuple(comm.local_ranks)
    devices = devices or {}
    want = max(buffers.staging_buffers, 2 if comm.posts_ahead else 1)
    arenas = {
        r: _arenas(buffers, schedule.staging.get(r, 0), devices.get(r), options.staging_bytes, want) for r in ranks
    }
    compiled = compile_rounds(
        schedule, ranks, tuple(len(arenas[r]) for r in ranks), options.max_group_ops, from_landing=buffers.host_ordered
    )
    bufs = {r: shards.of_rank(r, schedule.ntensors) for r in ranks}
    _check_buffers(schedule, compiled, ranks, bufs, shards)
    rep = report or ReportBuilder(Backend.LOCAL)  # a throwaway one keeps the loop free of branches
    clock = rep.clock
    t0 = clock()
    same_device_bytes = 0
    for r in ranks:
        if r in schedule.copies:
            keys, st, dt = schedule.copies[r]
            buffers.copy(st, [shards.src[k] for k in keys], dt, bufs[r])
            same_device_bytes += kernels.table_bytes(dt)
    buffers.fence()
    unpack_s = clock() - t0
    held = sum(len(a) * schedule.staging.get(r, 0) for r, a in arenas.items())
    rep.staging(held)
    # One list of every buffer an operation can name: each local rank's shard buffers, then its arenas.
    bases: list[Any] = []
    segments: dict[int, int] = {}
    for r in ranks:
        segments[r] = len(bases)
        bases += bufs[r]
        bases += arenas[r]
    t3 = clock()
    if delta is not None:
        fresh, idle_s = True, 0.0
        pack_s, network_s, fanout_s, unpack_rounds_s = run_delta_rounds(
            compiled.rounds, comm, buffers, bufs, bases, options.timeout_s, delta, clock
        )
    else:
        ahead = compiled.ahead if comm.posts_ahead else (False,) * len(compiled.rounds)
        nbuf = 2 * schedule.ntensors
        shape = (tuple(segments.items()), nbuf, tuple(ahead))
        replay, fresh = replay_of(
            comm,
            compiled,
            lambda: ops_cached(compiled, shape, lambda: ops_of(compiled.rounds, ahead, segments, nbuf)),
            posts_ahead=comm.posts_ahead,
        )
        replay.intact = same_device_bytes == 0  # a step that fails before its rounds has written no destination byte
        if not buffers.native_rows:
            buffers.prepare(_jobs(compiled, bufs, bases))  # e.g. the GPU's launch tables, once per schedule
        t3 = clock()
        pack_s, network_s, fanout_s, unpack_rounds_s, idle_s = replay.run(
            comm, buffers, bufs, bases, options.timeout_s, clock
        ).tolist()
    t4 = clock()
    buffers.synchronize()
    unpack_s += unpack_rounds_s + clock() - t4
    pack_s += max(t4 - t3 - (pack_s + network_s + fanout_s + unpack_rounds_s), 0.0)  # binding the step's buffers
    rep.add_seconds(ReportPhase.PACK, pack_s)
    rep.add_seconds(ReportPhase.NETWORK, network_s)
    rep.add_seconds(ReportPhase.FANOUT, fanout_s)
    rep.add_seconds(ReportPhase.UNPACK, unpack_s)
    rep.add_rounds(len(compiled.rounds), replayed=not fresh, idle_s=idle_s)
    rep.add_bytes(Link.SAME_DEVICE, same_device_bytes)
    for link in Link:
        rep.add_bytes(link, compiled.sent_bytes[link], messages=compiled.messages[link])
    rep.staging(-held)
    return ExecStats(
        sent_bytes=dict(compiled.sent_bytes),
        same_device_bytes=same_device_bytes,
        chunks=compiled.chunks,
        rounds=len(compiled.rounds),
        peak_staging_bytes={r: len(arenas[r]) * schedule.staging.get(r, 0) for r in ranks},
    )


@dataclasses.dataclass(frozen=True, slots=True)
class CompiledRounds:
    """A schedule's rounds for the ranks of one process, as the round loop reads them (final).

    Built once per schedule, ranks and arena count (:func:`compile_rounds`, cached), so a refit's
    rounds cost the engine a loop over prepared tuples: no step, wire or operation object is made,
    and no report bookkeeping runs per chunk.

    Attributes:
      rounds: per round this process takes part in, in order, ``(packs, groups, unpacks, network)``:
        ``packs`` and ``unpacks`` are ``(table, rank, arena)`` (``arena`` an index into the loop's list of
        buffers), ``groups`` the round's exchange groups as ``(sends, recvs)`` rows, ``network`` whether
        any of its chunks crosses the network (its exchange is then network time, else fan-out time).
      ahead: per round, whether its packs may run while the round before is on the wire: it has packs,
        they read source shards only (which no round writes), and write arenas that the round before
        neither sends from, receives into nor unpacks.
      sent_bytes: bytes sent by link kind, over all rounds.
      messages: messages sent by link kind, as a plan counts them (all a rank sends one peer at one stage).
      chunks: chunk messages sent.
      needs: per local rank, the shard buffer indices the rounds and same-device copies read or write.
    """

    rounds: tuple[tuple[tuple, tuple, tuple, bool], ...]
    ahead: tuple[bool, ...]
    sent_bytes: Mapping[Link, int]
    messages: Mapping[Link, int]
    chunks: int
    needs: Mapping[int, frozenset[int]]


def compile_rounds(
    schedule: Schedule,
    ranks: tuple[int, ...],
    arenas: tuple[int, ...],
    max_group_ops: int,
    *,
    from_landing: bool = True,
) -> CompiledRounds:
    """The rounds of ``ranks`` (each with ``arenas[i]`` staging arenas, alternated by round), cut into
    exchange groups (by the schedule's own cut, else of at most ``max_group_ops`` operations per rank);
    with ``from_landing`` (host-ordered buffers), forwards leave from landed staging where they can
    (:func:`forwards_from_landing`)."""
    by_schedule = _compiled.setdefault(schedule, {})
    key = (ranks, arenas, max_group_ops if schedule.groups is None else 0, from_landing)
    compiled = by_schedule.get(key)
    if compiled is None:
        compiled = by_schedule[key] = _compile(schedule, ranks, arenas, max_group_ops, from_landing)
    return compiled


_compiled: weakref.WeakKeyDictionary[Schedule, dict[tuple, CompiledRounds]] = weakref.WeakKeyDictionary()


def _compile(
    schedule: Schedule, ranks: tuple[int, ...], arenas: tuple[int, ...], max_group_ops: int, from_landing: bool
) -> CompiledRounds:
    cuts = group_rounds(schedule, max_group_ops).group_of if schedule.groups is None else schedule.groups
    nbuf = 2 * schedule.ntensors
    per_round: dict[int, list] = {}
    sent = dict.fromkeys(Link, 0)
    messages = dict.fromkeys(Link, 0)
    chunks = 0
    needs: dict[int, frozenset[int]] = {}
    at = 0
    for i, r in enumerate(ranks):
        steps = schedule.steps.get(r, {})
        cols = steps.columns if isinstance(steps, RankSteps) else _columns(steps)
        cols, send_round = forwards_from_landing(cols, arenas[i]) if from_landing else (cols, None)
        rank = _RankRows(cols, r, at, nbuf, arenas[i], send_round)
        at += nbuf + arenas[i]
        for link in Link:
            sent[link] += rank.sent[link]
            messages[link] += rank.messages[link]
        chunks += len(cols.sends[0])
        need = rank.needs
        if r in schedule.copies:
            need |= set(np.unique(schedule.copies[r][2][:, kernels.BUF]).tolist())
        needs[r] = frozenset(need)
        pack_at, unpack_at = cols.pack_at.tolist(), cols.unpack_at.tolist()
        send_at, recv_at, send_rows, recv_rows = rank.send_at, rank.recv_at, rank.send_rows, rank.recv_rows
        for j, rnd in enumerate(cols.rounds.tolist()):
            slot = per_round.get(rnd)
            if slot is None:
                slot = per_round[rnd] = [[], [], [], [], False]
            arena = rank.arena(rnd)
            if pack_at[j + 1] > pack_at[j]:
                slot[0].append((cols.pack[pack_at[j] : pack_at[j + 1]], r, arena))
            if unpack_at[j + 1] > unpack_at[j]:
                slot[3].append((cols.unpack[unpack_at[j] : unpack_at[j + 1]], r, arena))
            slot[1] += send_rows[send_at[j] : send_at[j + 1]]
            slot[2] += recv_rows[recv_at[j] : recv_at[j + 1]]
            slot[4] = slot[4] or rank.network[j]
    rounds = []
    for rnd in sorted(per_round):
        packs, sends, recvs, unpacks, network = per_round[rnd]
        if not sends and not recvs:
            continue
        groups = tuple((tuple(s), tuple(v)) for s, v in _cut(sends, recvs, cuts.get(rnd)))
        rounds.append((tuple(packs), groups, tuple(unpacks), network))
    ahead = tuple(i > 0 and _packs_ahead(rounds[i - 1], rounds[i]) for i in range(len(rounds)))
    return CompiledRounds(
        rounds=tuple(rounds), ahead=ahead, sent_bytes=sent, messages=messages, chunks=chunks, needs=needs
    )


def _packs_ahead(before: tuple, this: tuple) -> bool:
    """Whether round ``this``'s packs can run while round ``before``'s groups are posted (see
    :attr:`CompiledRounds.ahead`)."""
    packs = this[0]
    if not packs or any((t[:, kernels.BUF] % 2 != SRC).any() for t, _, _ in packs):
        return False
    busy = {row[3] for sends, recvs in before[1] for row in (*sends, *recvs)}
    busy |= {arena for _, _, arena in before[2]}
    return not any(arena in busy for _, _, arena in packs)


def forwards_from_landing(cols: RankColumns, arenas: int) -> tuple[RankColumns, np.ndarray | None]:
    """Send a forwarded chunk straight from the staging it landed in, with no pack, where it can be.

    A rank that forwards what it received (the fan-out) would pack the chunk out of its destination shard,
    where the round before unpacked it. Where the chunk's pack rows are the rows that round unpacked from a
    landed chunk (the same buffer regions in the same staging order, and no casts, so the two staging images
    hold the same bytes), the send reads the landed chunk's staging instead, and its pack rows go; a chunk
    forwarded to several replicas is read by each of its sends. That arena is still intact: the rank's
    rounds alternate ``arenas`` (at least 2) arenas, the landing round's arena is not this round's, and the
    next writes to it come in a later round (the round loop packs ahead into an arena only when no posted
    row reads it).

    Returns:
      ``cols`` with those sends' offsets moved and their pack rows dropped, and per send row the round whose
      arena it reads (``None`` where nothing changed).
    """
    if arenas < 2 or not len(cols.pack) or not len(cols.unpack):
        return cols, None
    rounds = cols.rounds.tolist()
    send_at, recv_at = cols.send_at.tolist(), cols.recv_at.tolist()
    pack_at, unpack_at = cols.pack_at.tolist(), cols.unpack_at.tolist()
    _, _, _, nbytes, buf, offset = cols.sends
    _, _, _, r_nbytes, r_buf, r_offset = cols.recvs
    new_offset = offset.copy()
    send_round = np.repeat(cols.rounds, np.diff(cols.send_at))
    keep = np.ones(len(cols.pack), bool)
    for j in range(1, len(rounds)):
        if rounds[j - 1] % arenas == rounds[j] % arenas or pack_at[j] == pack_at[j + 1]:
            continue
        landed: dict[bytes, int] = {}
        rows, by, _ = _by_stage(cols.unpack[unpack_at[j - 1] : unpack_at[j]])
        for k in range(recv_at[j - 1], recv_at[j]):
            if r_buf[k] == STAGING:
                key = _chunk_key(rows, by, int(r_offset[k]), int(r_nbytes[k]))
                if key is not None:
                    landed.setdefault(key, int(r_offset[k]))
        if not landed:
            continue
        rows, by, order = _by_stage(cols.pack[pack_at[j] : pack_at[j + 1]])
        for k in range(send_at[j], send_at[j + 1]):
            if buf[k] != STAGING:
                continue
            key = _chunk_key(rows, by, int(offset[k]), int(nbytes[k]))
            if key is None or key not in landed:
                continue
            lo, hi = np.searchsorted(by, [offset[k], offset[k] + nbytes[k]])
            keep[pack_at[j] + order[lo:hi]] = False
            # A chunk forwarded to several replicas: each send reads the one landed copy.
            new_offset[k], send_round[k] = landed[key], rounds[j - 1]
    if keep.all():
        return cols, None
    pack = cols.pack[keep]
    pack.setflags(write=False)  # the kernels keep the analysis of a table nobody can change
    pack_at = np.concatenate([[0], np.cumsum(keep)])[cols.pack_at]
    sends = (*cols.sends[:5], new_offset)
    return cols._replace(sends=sends, pack=pack, pack_at=pack_at), send_round


def _by_stage(table: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``table``'s rows sorted by their staging offset, those offsets, and the order that sorts them."""
    order = np.argsort(table[:, kernels.STAGE], kind="stable")
    rows = table[order]
    return rows, rows[:, kernels.STAGE], order


def _chunk_key(rows: np.ndarray, by: np.ndarray, offset: int, nbytes: int) -> bytes | None:
    """The rows of the chunk at ``offset`` of ``nbytes`` bytes, staging offsets taken from the chunk's start,
    as bytes (``None`` where a row casts or leaves the chunk): two chunks with one key hold the same bytes."""
    lo, hi = np.searchsorted(by, [offset, offset + nbytes])
    if lo == hi:
        return None
    mine = rows[lo:hi].copy()
    if mine[:, kernels.CAST].any() or (mine[:, kernels.STAGE] + mine[:, kernels.NBYTES] > offset + nbytes).any():
        return None
    mine[:, kernels.STAGE] -= offset
    return nbytes.to_bytes(8, "little") + mine.tobytes()


class _RankRows:
    """One rank's wires as rows of the round loop, with the counts the report needs (all rounds at once)."""

    def __init__(
        self, cols: RankColumns, rank: int, base: int, nbuf: int, arenas: int, send_round: np.ndarray | None = None
    ):
        self._staging, self._arenas = base + nbuf, arenas
        self.send_at, self.recv_at = cols.send_at.tolist(), cols.recv_at.tolist()
        self.send_rows = self._rows(cols, cols.sends, cols.send_at, rank, base, True, send_round)
        self.recv_rows = self._rows(cols, cols.recvs, cols.recv_at, rank, base, False)
        peer, tag, link, nbytes, _, _ = cols.sends
        self.sent = {k: int(nbytes[link == k].sum()) for k in Link}
        # A message is all the rank sends one peer at one stage: count each (peer, stage) once, at its first chunk.
        _, first = np.unique(peer * (1 << 32) + (tag >> TAG_CHUNK_BITS), return_index=True)
        self.messages = {k: int((link[first] == k).sum()) for k in Link}
        network = np.zeros(len(cols.rounds), bool)
        for (_, _, lk, _, _, _), where in ((cols.sends, cols.send_at), (cols.recvs, cols.recv_at)):
            ahead = np.concatenate([[0], np.cumsum(lk == Link.NETWORK)])
            network |= ahead[where[1:]] > ahead[where[:-1]]
        self.network = network.tolist()
        need = set(np.unique(cols.pack[:, kernels.BUF]).tolist()) | set(np.unique(cols.unpack[:, kernels.BUF]).tolist())
        for c in (cols.sends, cols.recvs):
            need.update(np.unique(c[4][c[4] != STAGING]).tolist())
        self.needs = need

    def arena(self, rnd: int) -> int:
        return self._staging + rnd % self._arenas

    def _rows(
        self, cols: RankColumns, wires, at: np.ndarray, rank: int, base: int, send: bool, rnd: np.ndarray | None = None
    ) -> list[Row]:
        peer, tag, _, nbytes, buf, offset = wires
        if rnd is None:  # the round whose arena a staging row uses: its own, unless it reads a landed chunk
            rnd = np.repeat(cols.rounds, np.diff(at))
        slot = np.where(buf == STAGING, self._staging + rnd % self._arenas, base + buf)
        me = itertools.repeat(rank, len(peer))
        ends = (me, peer.tolist()) if send else (peer.tolist(), me)
        return list(zip(*ends, tag.tolist(), slot.tolist(), offset.tolist(), nbytes.tolist(), strict=True))


def _columns(steps: Mapping[int, Step]) -> RankColumns:
    """:class:`RankColumns` of steps held as :class:`Step` values (a whole plan's schedule)."""
    rounds = sorted(steps)
    by = [steps[r] for r in rounds]

    def wires(pick: Callable[[Step], Sequence[Wire]]) -> tuple[WireColumns, np.ndarray]:
        ws = [w for st in by for w in pick(st)]
        cols = tuple(np.array([getattr(w, f) for w in ws], np.int64) for f in _WIRE_FIELDS)
        return cols, np.concatenate([[0], np.cumsum([len(pick(st)) for st in by])]).astype(np.int64)  # type: ignore[return-value]

    def tables(pick: Callable[[Step], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        ts = [pick(st) for st in by]
        at = np.concatenate([[0], np.cumsum([len(t) for t in ts])]).astype(np.int64)
        width = next((t.shape[1] for t in ts if t.ndim == 2), kernels.COLUMNS)
        table = np.concatenate(ts) if ts else np.zeros((0, width), np.int64)
        table.setflags(write=False)  # the kernels keep the analysis of a table nobody can change
        return table, at

    (sends, send_at), (recvs, recv_at) = wires(lambda st: st.sends), wires(lambda st: st.recvs)
    (pack, pack_at), (unpack, unpack_at) = tables(lambda st: st.pack), tables(lambda st: st.unpack)
    return RankColumns(np.array(rounds, np.int64), sends, recvs, send_at, recv_at, pack, unpack, pack_at, unpack_at)


_WIRE_FIELDS = ("peer", "tag", "link", "nbytes", "buf", "offset")


def _cut(sends: list[Row], recvs: list[Row], cut: Mapping[tuple[int, int, int], int] | None) -> list[tuple[list, list]]:
    """One round's rows, group by group in order (groups this process has no part in are skipped)."""
    if cut is None:
        return [(sends, recvs)]
    by: dict[int, tuple[list[Row], list[Row]]] = {}
    for row in sends:
        by.setdefault(cut[row[:3]], ([], []))[0].append(row)
    for row in recvs:
        by.setdefault(cut[row[:3]], ([], []))[1].append(row)
    return [by[g] for g in sorted(by)]


def _arenas(buffers: Buffers[Any], nbytes: int, device: Device | None, bound: int, want: int) -> list[Any]:
    """A rank's staging arenas: ``want`` of them where they fit ``bound`` together, else one."""
    n = want if want * nbytes <= bound else 1
    return [buffers.staging(nbytes, device) for _ in range(n)]


def _jobs(compiled: CompiledRounds, bufs: dict[int, list], bases: list[Any]):
    """Every pack and unpack of the compiled rounds, with the buffers and arena each will use (lazily)."""
    for packs, _, unpacks, _ in compiled.rounds:
        yield from (("pack", table, bufs[r], bases[arena]) for table, r, arena in packs)
        yield from (("unpack", table, bufs[r], bases[arena]) for table, r, arena in unpacks)


def _check_buffers(
    schedule: Schedule, compiled: CompiledRounds, ranks: tuple[int, ...], bufs: dict[int, list], shards: Shards
) -> None:
    missing: list[str] = []
    for r in ranks:
        if not any(map(operator.is_, map(bufs[r].__getitem__, compiled.needs[r]), itertools.repeat(None))):
            continue  # (the common case, checked without a Python loop; ``in`` would compare arrays with ==)
        for b in sorted(compiled.needs[r]):
            if bufs[r][b] is None:
                missing.append(f"{'source' if b % 2 == SRC else 'destination'} shard of tensor {b // 2} on rank {r}")
    missing += [
        f"source shard of tensor {t} on rank {h}"
        for r in ranks
        if r in schedule.copies
        for t, h in schedule.copies[r][0]
        if (t, h) not in shards.src
    ]
    if missing:
        raise TransferError(
            f"execute: the schedule needs buffers this process was not given: {missing[:8]}"
            + (f" ... {len(missing)} in all" if len(missing) > 8 else ""),
            destination_intact=True,
        )
