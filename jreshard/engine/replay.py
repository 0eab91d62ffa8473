"""Prepared refits: a schedule's compiled rounds turned once into a list of operations, bound to the
transport's prepared requests, and replayed every step.

A refit runs the same rounds every step: the same packs from the same tables, the same messages between
the same peers, into staging arenas that come back at the same addresses (the staging pool hands the last
refit's arena out again). So, the way ``jax.jit`` prepares a computation, the engine prepares a refit:

- **Once per compiled schedule** (a :class:`~jreshard.engine.rounds.CompiledRounds` and a communicator):
  the round loop's order is flattened into operations (:class:`Ops`: pack, start, wait, exchange, unpack,
  with the packs that run while a group is posted placed between its start and its wait), and the
  transport makes its requests for every group (:meth:`Communicator.prepare`: MPI persistent requests).
- **Every step**: the addresses and sizes of the step's shard and staging buffers are read in one pass
  (:func:`addresses`); requests whose buffer moved are re-made (:meth:`PreparedGroups.bind`), and every
  descriptor row is checked again against the buffer sizes whenever one changed, so nothing ever writes
  through a stale pointer or past a buffer's end. Then the operations run: in one compiled call with the
  GIL released (``_replay.c``) where the buffers are host memory moved by the compiled rows (bytes, and the
  float32 <-> bfloat16 casts) and the transport gave the C functions that start and poll its requests, else in
  a Python loop over the same operations (tables of other casts, GPU buffers, transports that post each group
  afresh). Prepared groups that observe the step (:attr:`PreparedGroups.observes`: a refit's digests) have
  their hooks called before each start, before each wait and after it; the compiled replay then runs in parts
  cut there, and each hook is told how long the bytes it may read stay as they are (:attr:`Ops.kept`).

Every wait stays bounded by ``timeout_s`` from its group's start, as in the Python loop; a failure gives the
posted group up (the communicator is then broken) and raises what the transport raises.

Replays are cached per communicator (at most :data:`PER_COMM`, the oldest released first) and keyed by the
compiled schedule, so a new schedule, layout, dtype, view, option or arena count (each compiles anew)
prepares anew; a moved buffer re-makes only the requests that name it.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from jreshard.engine.buffers import Buffers
from jreshard.engine.comm import (
    LANDED,
    STARTING,
    Communicator,
    Group,
    Posted,
    PreparedGroups,
    StepGraph,
    hook_point,
)
from jreshard.engine.strided import checking_bounds
from jreshard.errors import TransferError
from jreshard.schedule import kernels
from jreshard.sharding.caches import register_clear

__all__ = [
    "EXCHANGE",
    "FENCE",
    "PACK",
    "PER_COMM",
    "START",
    "UNPACK",
    "WAIT",
    "Ops",
    "Replay",
    "addresses",
    "compiled_replay",
    "ops_cached",
    "ops_of",
    "replay_of",
]

PACK, UNPACK, START, WAIT, EXCHANGE, FENCE = 1, 2, 3, 4, 5, 6
"""Operation codes (the first four are ``_replay.c``'s; an exchange is a start and its wait, a fence orders
packs before the next start and is nothing on host-ordered buffers)."""

PHASE_PACK, PHASE_NETWORK, PHASE_FANOUT, PHASE_UNPACK = 0, 1, 2, 3
PER_COMM = 8
OPS_KEPT = 16  # compiled schedules whose operations are kept apart from any communicator (ops_cached)

_native: ModuleType | None
try:
    from jreshard.engine import _replay as _native
except ImportError:  # not built (no compiler, or a checkout run in place)
    _native = None
if _native is not None and (_native.OP_PACK, _native.OP_UNPACK, _native.OP_START, _native.OP_WAIT) != (
    PACK,
    UNPACK,
    START,
    WAIT,
):  # pragma: no cover - a stale build
    _native = None


def compiled_replay() -> bool:
    """Whether the compiled replay (``jreshard/engine/_replay.c``) was built and loads."""
    return _native is not None


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Ops:
    """A compiled schedule's rounds as one list of operations (final).

    Attributes:
      ops: per operation, ``(code, ...)``: ``(PACK | UNPACK, table, rank, arena, phase)``, ``(FENCE, phase)``,
        ``(START | WAIT | EXCHANGE, group, phase)``; ``arena`` indexes the step's buffer list, ``rank`` the
        process's ranks, ``phase`` the report phase its time counts to.
      groups: the exchange groups, ``(sends, recvs)`` rows, in the order they run.
      native: the operations as ``_replay.c`` reads them (``(n, 8)`` int64: exchanges split, fences dropped),
        or ``None`` where a table holds rows it cannot run (cast rows other than a pack's float32 -> bfloat16 and
        an unpack's bfloat16 -> float32).
      tables: the C-ordered tables, and their compacted rows, that the native operations point into (kept alive
        here).
      written: the indices of the step's buffer list that receives and unpacks write.
      rounds: the rounds the schedule runs.
      kept: per group, the last hook points (:func:`~jreshard.engine.comm.hook_point`) through which its sends stay
        as packed and its receives as they landed: :meth:`PreparedGroups.starting`'s ``sends_kept`` and
        :meth:`PreparedGroups.landed`'s ``recvs_kept``.
    """

    ops: tuple[tuple, ...]
    groups: tuple[Group, ...]
    native: np.ndarray | None
    tables: tuple[np.ndarray, ...]
    written: np.ndarray
    rounds: int
    kept: tuple[tuple[int, int], ...] = ()
    cut: list[ByMessage] = dataclasses.field(default_factory=list)
    """The operations cut at messages (:func:`by_message`), once a step asked for them (``[]`` before): kept with
    the operations, so every communicator that replays them shares the one cut."""


def ops_of(
    rounds: Sequence[tuple[tuple, tuple, tuple, bool]],
    ahead: Sequence[bool],
    segments: Mapping[int, int],
    nbuf: int,
) -> Ops:
    """The operations of compiled ``rounds`` (:attr:`CompiledRounds.rounds`), in the round loop's order.

    Args:
      rounds: per round ``(packs, groups, unpacks, network)``.
      ahead: per round, whether its packs run while the round before is posted (all false: each in its turn).
      segments: per rank, where its shard buffers start in the step's buffer list.
      nbuf: shard buffers per rank (two per tensor).
    """
    ops: list[tuple] = []
    groups: list[Group] = []
    written: set[int] = set()

    def packs_of(packs: tuple) -> None:
        for table, r, arena in packs:
            ops.append((PACK, table, r, arena, PHASE_PACK))
        ops.append((FENCE, PHASE_PACK))

    n = len(rounds)
    for i, (packs, round_groups, unpacks, network) in enumerate(rounds):
        phase = PHASE_NETWORK if network else PHASE_FANOUT
        if packs and not ahead[i]:
            packs_of(packs)
        for k, (sends, recvs) in enumerate(round_groups):
            g = len(groups)
            groups.append((sends, recvs))
            written.update(row[3] for row in recvs)
            last = k == len(round_groups) - 1
            if last and i + 1 < n and ahead[i + 1] and rounds[i + 1][0]:
                ops.append((START, g, phase))
                packs_of(rounds[i + 1][0])  # the next round's packs, while this group is on the wire
                ops.append((WAIT, g, phase))
            else:
                ops.append((EXCHANGE, g, phase))
        for table, r, arena in unpacks:
            ops.append((UNPACK, table, r, arena, PHASE_UNPACK))
            written.update(segments[r] + b for b in np.unique(table[:, kernels.BUF]).tolist())
    native, tables = _native_ops(ops, segments, nbuf)
    return Ops(
        ops=tuple(ops),
        groups=tuple(groups),
        native=native,
        tables=tables,
        written=np.array(sorted(written), np.int64),
        rounds=n,
        kept=_kept(ops, groups, segments),
    )


def _kept(ops: Sequence[tuple], groups: Sequence[Group], segments: Mapping[int, int]) -> tuple[tuple[int, int], ...]:
    """:attr:`Ops.kept` of ``ops``: follows the buffers each group sends from (from its start) and receives into
    (from its wait), whole buffers (a conservative account), until an operation writes one of them; they stay
    through the last hook point before that operation, or through the last group's :data:`LANDED` at most."""
    kept = [[-1, -1] for _ in groups]
    watched: dict[tuple[int, int], set[int]] = {}  # (group, 0: sends | 1: receives) -> its buffers, still intact
    point = -1  # the last hook point passed

    def written(bufs: set[int]) -> None:
        for key in [k for k, into in watched.items() if into & bufs]:
            kept[key[0]][key[1]] = point
            del watched[key]

    for op in ops:
        code = op[0]
        if code == PACK:
            written({op[3]})
        elif code == UNPACK:
            written({segments[op[2]] + b for b in np.unique(op[1][:, kernels.BUF]).tolist()})
        if code in (START, EXCHANGE):
            point = hook_point(op[1], STARTING)
            written({row[3] for row in groups[op[1]][1]})  # its receives land, its in-process copies are made
            watched[op[1], 0] = {row[3] for row in groups[op[1]][0]}
        if code in (WAIT, EXCHANGE):
            point = hook_point(op[1], LANDED)
            watched[op[1], 1] = {row[3] for row in groups[op[1]][1]}
    for g, what in watched:
        kept[g][what] = point
    return tuple((s, r) for s, r in kept)


def _native_ops(ops: list[tuple], segments: Mapping[int, int], nbuf: int) -> tuple[np.ndarray | None, tuple]:
    if _native is None:
        return None, ()
    out: list[tuple[int, ...]] = []
    tables: list[np.ndarray] = []
    for op in ops:
        code = op[0]
        if code in (PACK, UNPACK):
            table = np.ascontiguousarray(op[1], np.int64)
            if table.ndim != 2 or table.shape[1] != _native.COLUMNS:
                return None, ()
            if not _compiled_casts(table, code):  # other cast rows: the Python loop runs them (the compiled casts)
                return None, ()
            rows = _compact(table)
            tables += [table, rows]
            total = int(table[:, kernels.NBYTES].sum())
            out.append((code, rows.ctypes.data, len(table), segments[op[2]], nbuf, op[3], total, table.ctypes.data))
        elif code == EXCHANGE:
            out.append((START, op[1], 0, 0, 0, op[2], 0, 0))
            out.append((WAIT, op[1], 0, 0, 0, op[2], 0, 0))
        elif code in (START, WAIT):
            out.append((code, op[1], 0, 0, 0, op[2], 0, 0))
    native = np.array(out, np.int64).reshape(-1, _native.OP_WORDS)
    native.setflags(write=False)
    return native, tuple(tables)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ByMessage:
    """A compiled schedule's native operations cut at its messages, for prepared groups that read every message
    while it is in the cache (:attr:`PreparedGroups.by_message`; final). Each message is handed to
    :meth:`~PreparedGroups.packed` (a send) or :meth:`~PreparedGroups.unpacked` (a receive) exactly once:

    - a send right after the last pack that writes it before its group starts (that pack's rows cut there, and
      written with plain stores, not streamed past the cache), else as its group starts (its bytes come from
      elsewhere: a forward from landed staging);
    - a receive right after the last unpack that reads it before anything writes it again (the unpack's rows cut
      there: the unpack read it into the cache, where the hook reads it again), else as its group landed.

    Attributes:
      native: the operations as ``_replay.c`` reads them: :attr:`Ops.native`, each pack and unpack cut into runs of
        rows at those places (each run its own table and compacted rows, checked as the whole ones are).
      after: native operation index -> ``[(group, sends)]`` packed whole by it.
      unpacked: native operation index -> ``[(group, recvs)]`` it reads last.
      sends: per group, the sends handed over as it starts (not packed in this step's operations).
      recvs: per group, the receives handed over as it landed (no unpack reads them).
      tables: the cut tables and their compacted rows (kept alive here).
    """

    native: np.ndarray
    after: dict[int, list[tuple[int, tuple[int, ...]]]]
    unpacked: dict[int, list[tuple[int, tuple[int, ...]]]]
    sends: tuple[tuple[int, ...], ...]
    recvs: tuple[tuple[int, ...], ...]
    tables: tuple[np.ndarray, ...]


_NO_ROWS = np.zeros(0, np.int64)


class _Spans:
    """Byte spans ``[start, start + nbytes)`` (a table's rows in staging, a group's receives in an arena), for
    :func:`by_message`'s lookups: which of them touch a byte range, in their order (spans in ascending order that do
    not overlap, as the schedule writes them, answer by bisection; any others by a scan)."""

    __slots__ = ("_end", "_ends", "_hi", "_lo", "_rows", "_sorted", "_stage", "_starts")

    def __init__(self, start: np.ndarray, nbytes: np.ndarray):
        rows = np.nonzero(nbytes > 0)[0]
        self._rows, self._stage = rows, start[rows]
        self._end = self._stage + nbytes[rows]
        self._sorted = bool((self._end[:-1] <= self._stage[1:]).all())
        self._starts, self._ends = self._stage.tolist(), self._end.tolist()
        self._lo = int(self._stage.min()) if len(rows) else 0
        self._hi = int(self._end.max()) if len(rows) else 0

    def overlapping(self, lo: int, hi: int) -> np.ndarray:
        """The indices of the spans that touch ``[lo, hi)``, ascending."""
        if hi <= self._lo or lo >= self._hi:
            return _NO_ROWS
        if self._sorted:
            return self._rows[bisect.bisect_right(self._ends, lo) : bisect.bisect_left(self._starts, hi)]
        return self._rows[(self._stage < hi) & (self._end > lo)]


def by_message(ops: Ops) -> ByMessage | None:
    """:class:`ByMessage` of ``ops`` (``None`` where it has no native operations)."""
    if ops.native is None or _native is None:
        return None
    k = kernels
    tables = {j: np.ascontiguousarray(op[1], np.int64) for j, op in enumerate(ops.ops) if op[0] in (PACK, UNPACK)}
    # Per arena (an index of the step's buffer list), the operations that touch it in order: (python op index,
    # "pack" | "unpack" | "lands", the spans they touch); a group's receives land from its start (or exchange) on.
    touches: dict[int, list[tuple[int, str, _Spans]]] = collections.defaultdict(list)
    start_at: dict[int, int] = {}
    wait_at: dict[int, int] = {}
    for j, op in enumerate(ops.ops):
        if op[0] in (PACK, UNPACK):
            t = tables[j]
            touches[op[3]].append((j, "pack" if op[0] == PACK else "unpack", _Spans(t[:, k.STAGE], t[:, k.NBYTES])))
        elif op[0] in (START, EXCHANGE):
            start_at[op[1]] = j
            landing = np.array(ops.groups[op[1]][1], np.int64).reshape(-1, 6)
            for b in np.unique(landing[:, 3]).tolist():
                into = landing[landing[:, 3] == b]
                touches[b].append((j, "lands", _Spans(into[:, 4], into[:, 5])))
        if op[0] in (WAIT, EXCHANGE):
            wait_at[op[1]] = j
    index = {b: [j for j, _, _ in ts] for b, ts in touches.items()}
    cut_after: dict[int, dict[int, list[tuple[int, int]]]] = collections.defaultdict(dict)  # op -> row -> units
    cut_unpacked: dict[int, dict[int, list[tuple[int, int]]]] = collections.defaultdict(dict)
    rest_sends: list[list[int]] = [[] for _ in ops.groups]
    rest_recvs: list[list[int]] = [[] for _ in ops.groups]

    for g, (sends, recvs) in enumerate(ops.groups):
        for m, (_, _, _, b, o, n) in enumerate(sends):  # the last write into it before its group starts
            at, ts = bisect.bisect_left(index.get(b, []), start_at[g]), touches.get(b, [])
            row = last = -1
            for i in range(at - 1, -1, -1):
                j, what, spans = ts[i]
                if what == "unpack":
                    continue
                hit = spans.overlapping(o, o + n)
                if len(hit):
                    if what == "pack":  # the pack that wrote it last (else landed bytes)
                        row, last = int(hit[-1]), j
                    break
            if row < 0 or n == 0:
                rest_sends[g].append(m)
            else:
                cut_after[last].setdefault(row, []).append((g, m))
        for m, (_, _, _, b, o, n) in enumerate(recvs):  # the last unpack of it before anything writes it again
            at, ts = bisect.bisect_right(index.get(b, []), wait_at[g]), touches.get(b, [])
            row = last = -1
            for j, what, spans in itertools.islice(ts, at, None):
                hit = spans.overlapping(o, o + n)
                if len(hit) and what != "unpack":
                    break  # written over: landed or packed
                if len(hit):
                    row, last = int(hit[-1]), j
            if row < 0 or n == 0:
                rest_recvs[g].append(m)
            else:
                cut_unpacked[last].setdefault(row, []).append((g, m))

    def units(us: list[tuple[int, int]]) -> list[tuple[int, tuple[int, ...]]]:
        by: dict[int, list[int]] = {}
        for g, m in us:
            by.setdefault(g, []).append(m)
        return [(g, tuple(ms)) for g, ms in sorted(by.items())]

    out: list[np.ndarray] = []
    kept: list[np.ndarray] = []
    after: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    unpacked: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    native = iter(ops.native)
    for j, op in enumerate(ops.ops):
        if op[0] == FENCE:
            continue
        nat = next(native)
        cuts = cut_after.get(j) if op[0] == PACK else cut_unpacked.get(j) if op[0] == UNPACK else None
        if op[0] == EXCHANGE:
            out += [nat, next(native)]
            continue
        if not cuts:
            out.append(nat)
            continue
        table = tables[j]
        rows, rec = _compact(table), _records(table)
        if (
            rec[-1] != len(rows)
            or (rows[rec[:-1]] != table[:, k.BUF]).any()
            or (rows[rec[:-1] + 3] != table[:, k.NBYTES]).any()
        ):
            raise RuntimeError(f"by_message: operation {j}'s compacted rows are not where _records puts them")
        kept += [table, rows]
        bounds = np.array(sorted({0, len(table)} | {r + 1 for r in cuts}), np.int64)
        lo, hi = bounds[:-1], bounds[1:]
        part = np.empty((len(lo), _native.OP_WORDS), np.int64)
        part[:] = nat
        part[:, 1] = rows.ctypes.data + 8 * rec[lo]  # each run its rows: a slice of the table and of its compacted rows
        part[:, 2] = hi - lo
        part[:, 7] = table.ctypes.data + table.strides[0] * lo
        if op[0] == PACK:
            part[:, 6] = 0  # packed to be read again at once: plain stores, no streaming past the cache
        else:
            total = np.concatenate([[0], np.cumsum(table[:, k.NBYTES])])
            part[:, 6] = total[hi] - total[lo]
        first = len(out)
        out += list(part)
        for i, h in enumerate(hi.tolist()):
            if h - 1 in cuts:
                (after if op[0] == PACK else unpacked)[first + i] = units(cuts[h - 1])
    arr = np.array(out, np.int64).reshape(-1, _native.OP_WORDS)
    arr.setflags(write=False)
    return ByMessage(
        native=arr,
        after=after,
        unpacked=unpacked,
        sends=tuple(tuple(r) for r in rest_sends),
        recvs=tuple(tuple(r) for r in rest_recvs),
        tables=tuple(kept),
    )


def _records(table: np.ndarray) -> np.ndarray:
    """Where each row of ``table`` starts in :func:`_compact`'s rows, in words, and (last) their length: a row takes
    five words, and two more a dimension where it has more than one or is a cast row.

    >>> t = np.zeros((3, kernels.COLUMNS), np.int64); t[:, kernels.NDIM] = [1, 3, 1]; t[:, kernels.NBYTES] = 8
    >>> _records(t).tolist(), len(_compact(t))
    ([0, 5, 16, 21], 21)
    """
    k = kernels
    nd = table[:, k.NDIM]
    words = 5 + np.where((nd > 1) | (table[:, k.CAST] != 0), 2 * np.abs(nd), 0)
    if (nd == 1).all() and not table[:, k.CAST].any():
        words = np.full(len(table), 5, np.int64)
    out = np.zeros(len(table) + 1, np.int64)
    np.cumsum(words, out=out[1:])
    return out


def _compiled_casts(table: np.ndarray, code: int) -> bool:
    """Whether the compiled replay runs every cast row of a pack (``code`` :data:`PACK`) or unpack table: none, or
    only a pack's float32 -> bfloat16 or an unpack's bfloat16 -> float32 rows, with a build whose codes agree."""
    casts = table[:, kernels.CAST]
    if not casts.any():
        return True
    if not kernels.compiled_cast_codes(_native):  # pragma: no cover - a stale build
        return False
    return bool(((casts == 0) | (casts == (kernels.PACK_CAST if code == PACK else kernels.UNPACK_CAST))).all())


def _compact(table: np.ndarray) -> np.ndarray:
    """``table``'s rows as ``_replay.c`` copies them: ``(buffer, offset, staging offset, nbytes, ndim)``, then for a
    row of more than one dimension its ``(extent, stride)`` pairs; a cast row has ``-ndim`` and all its pairs."""
    k = kernels
    head = table[:, [k.BUF, k.OFF, k.STAGE, k.NBYTES, k.NDIM]]
    if (table[:, k.NDIM] == 1).all() and not table[:, k.CAST].any():  # runs of bytes (every row of a plain refit)
        return np.ascontiguousarray(head).reshape(-1)
    parts = []
    for row, h in zip(table, head, strict=True):
        nd = int(row[k.NDIM])
        if row[k.CAST]:
            h = h.copy()
            h[4] = -nd
        parts.append(h)
        if nd > 1 or row[k.CAST]:
            pairs = np.stack([row[k.SHAPE0 : k.SHAPE0 + nd], row[k.STRIDE0 : k.STRIDE0 + nd]], axis=1)
            parts.append(pairs.reshape(-1))
    return np.concatenate(parts).astype(np.int64)


def addresses(buffers: Sequence[Any], out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None):
    """The address, byte size (``-1`` for ``None``) and read-only flag of each buffer (host arrays with the buffer
    protocol), as three int64 arrays (written into ``out`` when given, of the same length).

    >>> a = np.zeros(8, np.uint8)
    >>> addr, size, ro = addresses([a, None])
    >>> size.tolist(), ro.tolist(), int(addr[0]) == a.ctypes.data
    ([8, -1], [0, 1], True)
    """
    n = len(buffers)
    addr, size, ro = out if out is not None else (np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64))
    if _native is not None:
        _native.addresses(buffers, addr.ctypes.data, size.ctypes.data, ro.ctypes.data)
        return addr, size, ro
    for i, b in enumerate(buffers):
        if b is None:
            addr[i], size[i], ro[i] = 0, -1, 1
        else:
            size[i], ro[i] = b.nbytes, not b.flags.writeable
            addr[i] = b.ctypes.data if b.nbytes else 0
    return addr, size, ro


class Replay:
    """One compiled schedule bound to one communicator: its operations and the transport's prepared groups (final).

    Built by :func:`replay_of` on a schedule's first step and cached; :meth:`run` replays it.

    Attributes:
      steps: how many steps it ran (the first prepared it).
      native_steps: how many of them ran in the compiled replay.
      rows_steps: how many ran their packs and unpacks compiled and their groups from Python (prepared groups the
        compiled replay cannot drive: NIXL's).
    """

    def __init__(self, key: object, ops: Ops, comm: Communicator):
        self._key = key  # the compiled schedule: kept alive, so its id names it while cached
        self.ops = ops
        self.prepared: PreparedGroups | None = comm.prepare(ops.groups)
        self.graph: StepGraph | None = comm.graph(ops)
        self.steps = self.native_steps = self.rows_steps = 0
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._checked: np.ndarray | None = None  # the sizes the native rows were last checked against
        self._checked_cut = False  # whether the operations cut at messages were checked against them too
        self._args: tuple | None = None
        self._empty: tuple[np.ndarray, np.ndarray] | None = None  # _no_groups
        self.intact = True  # whether the step wrote no destination byte before the rounds (no same-device copies)
        self._hook_times = np.zeros(5)  # where an observed step's hooks add their time

    def release(self) -> None:
        """Free the transport's prepared requests and graph."""
        if self.graph is not None:
            self.graph.release()
            self.graph = None
        if self.prepared is not None:
            self.prepared.release()
            self.prepared = None

    def run(
        self,
        comm: Communicator,
        buffers: Buffers[Any],
        bufs: Mapping[int, list],
        bases: list[Any],
        timeout_s: float,
        clock: Callable[[], float],
    ) -> np.ndarray:
        """Run every operation for one step; returns seconds per phase ``[pack, network, fanout, unpack, idle]``.

        Raises:
          TransferTimeoutError, PeerError: from the transport (the posted group given up);
          ValueError, TransferError: a row or message that would leave its buffer (nothing was posted).
        """
        self.steps += 1
        if self.graph is not None:
            return self.graph.run(
                buffers, bufs, bases, timeout_s, lambda: self._run_python(comm, buffers, bufs, bases, timeout_s, clock)
            )
        prepared = self.prepared
        rows = self.ops.native is not None and buffers.native_rows and prepared is not None
        native = rows and prepared is not None and prepared.native is not None
        if prepared is not None:
            arrays = self._arrays
            if arrays is None or len(arrays[0]) != len(bases):
                arrays = self._arrays = tuple(np.zeros(len(bases), np.int64) for _ in range(3))  # type: ignore[assignment]
                self._checked, self._args = None, None
            assert arrays is not None
            addr, size, ro = addresses(bases, arrays)
            try:
                prepared.bind(addr, size, bases)
                if native and self._native_checked(addr, size, ro):
                    self.native_steps += 1
                    return self._run_native(timeout_s)
                if rows and self._native_checked(addr, size, ro):
                    self.rows_steps += 1
                    return self._run_rows(timeout_s, clock)
                return self._run_python(comm, buffers, bufs, bases, timeout_s, clock)
            finally:
                prepared.finish()
        return self._run_python(comm, buffers, bufs, bases, timeout_s, clock)

    def _native_checked(self, addr: np.ndarray, size: np.ndarray, ro: np.ndarray) -> bool:
        """Whether every native row and in-process copy lies inside this step's buffers and every buffer written is
        writable (checked again whenever a size changed, and every step under ``JRESHARD_CHECK_BOUNDS=1``).

        Raises:
          TransferError: a row or in-process copy leaves its buffer, or a buffer written is read-only (nothing written).
        """
        written = self.ops.written
        if len(written) and ro[written].any():  # every step: a buffer can turn read-only and keep its size
            b = int(written[np.nonzero(ro[written])[0][0]])
            raise TransferError(
                f"execute: buffer {b} of the step is read-only, and the rounds would write into it; nothing was "
                "written by the rounds",
                destination_intact=self.intact,
            )
        cut = self.prepared is not None and self.prepared.by_message
        if (
            self._checked is not None
            and np.array_equal(size, self._checked)
            and (self._checked_cut or not cut)
            and not checking_bounds()
        ):
            return True
        assert _native is not None and self.ops.native is not None and self.prepared is not None
        n = self.prepared.native
        groups, copies = (n.groups, n.copies) if n is not None else self._no_groups()
        self._checked = None
        for ops in (self.ops.native, *([self._fine().native] if cut else [])):
            bad = _native.validate(
                ops.ctypes.data, len(ops), groups.ctypes.data, len(groups), copies.ctypes.data, len(copies),
                addr.ctypes.data, size.ctypes.data, len(addr),
            )  # fmt: skip
            if bad >= 0:
                break
        if bad >= 0:
            k = bad - len(ops)
            what = f"operation {bad} ({ops[bad].tolist()})" if bad < len(ops) else f"in-process message {k}"
            raise TransferError(
                f"execute: a prepared refit's {what} would leave its buffer: a shard or staging arena is smaller "
                "than the schedule it was prepared for; nothing was written by the rounds",
                destination_intact=self.intact,
            )
        self._checked, self._checked_cut = size.copy(), cut
        return True

    def _fine(self) -> ByMessage:
        """The operations cut at messages (:func:`by_message`, built on the first step that asks, kept in
        :attr:`Ops.cut`)."""
        cut = self.ops.cut
        if not cut:
            fine = by_message(self.ops)
            assert fine is not None  # asked for only where there are native operations
            cut.append(fine)
        return cut[0]

    def _in_parts(
        self,
        ops: np.ndarray,
        fine: ByMessage | None,
        run: Callable[[int, int], None],
        start_wait: Callable[[int], None],
    ) -> None:
        """The native operations ``ops`` of a step (:attr:`ByMessage.native` where the prepared groups read every
        message, ``fine``) in parts cut at every start and wait: ``run(lo, hi)`` runs operations ``lo:hi`` compiled,
        ``start_wait(at)`` the start or wait at ``at`` with its hooks; by message, each message is also handed over
        after the pack or unpack that wrote or read it last (the hook's time counts to that operation's phase)."""
        prepared = self.prepared
        assert prepared is not None
        cuts = set(np.nonzero((ops[:, 0] == START) | (ops[:, 0] == WAIT))[0].tolist())
        if fine is not None:
            cuts |= {*fine.after, *fine.unpacked}
        times = self._hook_times
        lo, posted = 0, -1  # the group started and not yet waited on
        for at in sorted(cuts):
            run(lo, at)
            code = int(ops[at, 0])
            if code == START or code == WAIT:
                start_wait(at)
                posted = int(ops[at, 1]) if code == START else -1
            else:
                phase = PHASE_PACK if code == PACK else PHASE_UNPACK
                assert fine is not None
                run(at, at + 1)
                t = time.perf_counter()
                try:
                    for group, sends in fine.after.get(at, ()):
                        prepared.packed(group, sends)
                    for group, recvs in fine.unpacked.get(at, ()):
                        prepared.unpacked(group, recvs)
                except BaseException as err:  # a hook between the packs that run while a group is posted
                    if posted >= 0:
                        prepared.abort(posted, f"what observes the step failed while the group was posted: {err!r}")
                    raise
                times[phase] += time.perf_counter() - t
            lo = at + 1
        run(lo, len(ops))

    def _starting(self, group: int, fine: ByMessage | None) -> None:
        """The hooks before group ``group`` starts: where the groups read every message, its sends not handed over
        after their packs (``fine``: the step's operations cut at messages; ``None``: none was), then ``starting``."""
        prepared = self.prepared
        assert prepared is not None
        if prepared.by_message:
            rest = fine.sends[group] if fine is not None else tuple(range(len(self.ops.groups[group][0])))
            if rest:
                prepared.packed(group, rest)
        prepared.starting(group, self.ops.kept[group][0])

    def _landed(self, group: int, fine: ByMessage | None) -> None:
        """The hooks after group ``group`` landed: ``landed``, then, where the groups read every message, its receives
        not handed over after their unpacks (``fine`` as in :meth:`_starting`)."""
        prepared = self.prepared
        assert prepared is not None
        prepared.landed(group, self.ops.kept[group][1])
        if prepared.by_message:
            rest = fine.recvs[group] if fine is not None else tuple(range(len(self.ops.groups[group][1])))
            if rest:
                prepared.unpacked(group, rest)

    def _run_native(self, timeout_s: float) -> np.ndarray:
        """The operations in the compiled loop: in one call, or, where the prepared groups observe the step
        (:attr:`PreparedGroups.observes`), in parts cut around every start and wait, their hooks run between."""
        prepared = self.prepared
        assert _native is not None and prepared is not None and self._arrays is not None
        n = prepared.native
        ops = self.ops.native
        assert n is not None and ops is not None
        if self._args is None:
            addr, size, _ = self._arrays
            self._times, self._fail = np.zeros(5), np.zeros(4, np.int64)
            self._posted = np.zeros(len(n.groups), np.int64)  # each group's start time, across the parts
            self._args = (
                n.groups.ctypes.data, len(n.groups), n.copies.ctypes.data, len(n.copies),
                addr.ctypes.data, size.ctypes.data, len(addr), n.expect.ctypes.data, n.requests.ctypes.data,
                n.req_size, n.status.ctypes.data, n.status_size, n.byte_type, n.start, n.test, n.count,
            )  # fmt: skip
        times, fail = self._times, self._fail
        times[:] = 0
        fail[:] = 0
        tail = (int(timeout_s * 1e9), times.ctypes.data, fail.ctypes.data, self._posted.ctypes.data)
        if not prepared.observes:
            self._run_part(ops, 0, len(ops), tail, timeout_s)
            return times.copy()
        self._hook_times = times
        fine = self._fine() if prepared.by_message else None
        step = fine.native if fine is not None else ops

        def run(lo: int, hi: int) -> None:
            self._run_part(step, lo, hi, tail, timeout_s)

        def start_wait(at: int) -> None:
            group, phase = int(step[at, 1]), int(step[at, 5])
            t = time.perf_counter()
            if step[at, 0] == START:
                self._starting(group, fine)
                times[phase] += time.perf_counter() - t
                run(at, at + 1)
            else:
                _waiting(prepared, group)
                times[phase] += time.perf_counter() - t
                run(at, at + 1)
                t = time.perf_counter()
                self._landed(group, fine)
                times[phase] += time.perf_counter() - t

        self._in_parts(step, fine, run, start_wait)
        return times.copy()

    def _no_groups(self) -> tuple[np.ndarray, np.ndarray]:
        """Groups with no request and no in-process copy, and no copies: what the compiled code is told of prepared
        groups it does not drive (:meth:`_run_rows`), so that it checks and runs the packs and unpacks alone."""
        assert _native is not None
        if self._empty is None:
            self._empty = (
                np.zeros((len(self.ops.groups), _native.GROUP_WORDS), np.int64),
                np.zeros((0, _native.COPY_WORDS), np.int64),
            )
        return self._empty

    def _run_rows(self, timeout_s: float, clock: Callable[[], float]) -> np.ndarray:
        """The operations of prepared groups that have no compiled replay (NIXL's): every run of packs and unpacks
        between two starts or waits in one compiled call over the rows compacted once (:attr:`Ops.native`, checked
        against this step's buffers by :meth:`_native_checked`), each start and wait from Python, with the hooks of
        groups that observe the step, as :meth:`_run_python` runs them. Where :meth:`_run_python` analyses each
        table again every step (its rows, buffers and addresses), this reads them from the step's address list."""
        assert _native is not None and self.prepared is not None and self.ops.native is not None
        assert self._arrays is not None
        prepared = self.prepared
        groups, copies = self._no_groups()
        addr, size, _ = self._arrays
        times = np.zeros(5)
        fail = np.zeros(4, np.int64)
        args = (
            groups.ctypes.data, 0, copies.ctypes.data, 0, addr.ctypes.data, size.ctypes.data, len(addr),
            0, 0, 0, 0, 0, 0, 0, 0, 0, int(timeout_s * 1e9), times.ctypes.data, fail.ctypes.data, 0,
        )  # fmt: skip
        fine = self._fine() if prepared.observes and prepared.by_message else None
        ops = fine.native if fine is not None else self.ops.native
        started = -1

        def run(lo: int, hi: int) -> None:
            """Packs and unpacks only: no group is named, so the compiled code drives none."""
            if hi <= lo:
                return
            try:
                code = _native.run(ops.ctypes.data + lo * ops.strides[0], hi - lo, *args)
                if code:  # (none of these operations waits on a group: no failure code is expected)
                    raise TransferError(f"replay: the compiled packs and unpacks stopped with code {code}")
            except BaseException as err:
                if started >= 0:
                    prepared.abort(started, f"a pack failed while a group was posted: {err!r}")
                raise

        def start_wait(at: int) -> None:
            nonlocal started
            group, phase = int(ops[at, 1]), int(ops[at, 5])
            t = clock()
            if ops[at, 0] == START:
                if prepared.observes:
                    self._starting(group, fine)
                prepared.start(group, timeout_s)
                started = group
            else:
                if prepared.observes:
                    _waiting(prepared, group)
                started = -1
                prepared.wait(group)
                if prepared.observes:
                    self._landed(group, fine)
            times[phase] += clock() - t

        self._hook_times = times
        self._in_parts(ops, fine, run, start_wait)
        return times

    def _run_part(self, ops: np.ndarray, lo: int, hi: int, tail: tuple, timeout_s: float) -> None:
        """Operations ``lo:hi`` of the native operations ``ops`` (:attr:`Ops.native`, or cut by message) in one
        compiled call."""
        assert _native is not None and self.prepared is not None
        assert self._args is not None
        if hi <= lo:
            return
        fail = self._fail
        start = ops.ctypes.data + lo * ops.strides[0]
        try:
            code = _native.run(start, hi - lo, *self._args, *tail)
        except BaseException:  # a signal while a group was posted: give it up, then let the exception go
            if fail[1] >= 0 and fail[0]:
                self.prepared.abort(int(fail[1]), "interrupted while waiting")
            raise
        if code:
            self.prepared.failed(int(fail[1]), code, int(fail[2]), int(fail[3]), timeout_s)

    def _run_python(
        self,
        comm: Communicator,
        buffers: Buffers[Any],
        bufs: Mapping[int, list],
        bases: list[Any],
        timeout_s: float,
        clock: Callable[[], float],
    ) -> np.ndarray:
        """The operations from Python: the transport's prepared groups where it has them, else each group posted
        afresh (:meth:`Communicator.exchange_rows`, :meth:`Communicator.start_rows`)."""
        times = np.zeros(5)
        prepared, groups = self.prepared, self.ops.groups
        observes = prepared is not None and prepared.observes
        pack, unpack, fence = buffers.pack, buffers.unpack, buffers.fence
        posted: Posted | None = None
        started = -1  # the prepared group started and not yet waited on
        t = clock()
        for op in self.ops.ops:
            code = op[0]
            if code == PACK or code == FENCE:
                try:
                    if code == PACK:
                        pack(op[1], bufs[op[2]], bases[op[3]])
                    else:
                        fence()  # ordered before the sends; no host wait where the buffers can avoid one
                except BaseException as err:
                    why = f"a pack failed while a group was posted: {err!r}"
                    if posted is not None:
                        posted.abort(why)
                    elif started >= 0 and prepared is not None:
                        prepared.abort(started, why)
                    raise
            elif code == UNPACK:
                unpack(op[1], bases[op[3]], bufs[op[2]])
            elif code == EXCHANGE:
                if prepared is not None:
                    if observes:
                        self._starting(op[1], None)
                    prepared.start(op[1], timeout_s)
                    if observes:
                        _waiting(prepared, op[1])
                    prepared.wait(op[1])
                    if observes:
                        self._landed(op[1], None)
                else:
                    sends, recvs = groups[op[1]]
                    comm.exchange_rows(sends, recvs, bases, timeout_s=timeout_s)
            elif code == START:
                if prepared is not None:
                    if observes:
                        self._starting(op[1], None)
                    prepared.start(op[1], timeout_s)
                    started = op[1]
                else:
                    sends, recvs = groups[op[1]]
                    posted = comm.start_rows(sends, recvs, bases, timeout_s=timeout_s)
            else:  # WAIT
                if prepared is not None:
                    if observes:
                        _waiting(prepared, op[1])
                    started = -1
                    prepared.wait(op[1])
                    if observes:
                        self._landed(op[1], None)
                else:
                    assert posted is not None
                    p, posted = posted, None
                    p.wait()
            t2 = clock()
            times[op[-1]] += t2 - t
            t = t2
        return times


def _waiting(prepared: PreparedGroups, group: int) -> None:
    """Run the :meth:`PreparedGroups.waiting` hook of a posted group; a hook that fails gives the group up."""
    try:
        prepared.waiting(group)
    except BaseException as err:
        prepared.abort(group, f"what observes the step failed while the group was posted: {err!r}")
        raise


_by_comm: weakref.WeakKeyDictionary[Communicator, collections.OrderedDict[tuple, Replay]] = weakref.WeakKeyDictionary()


_ops: collections.OrderedDict[tuple, tuple[object, Ops]] = collections.OrderedDict()
_ops_lock = threading.Lock()


def ops_cached(key: object, shape: tuple, build: Callable[[], Ops]) -> Ops:
    """The operations of compiled schedule ``key`` over a step's buffers laid out as ``shape`` says (where each rank's
    buffers start, how many, which rounds pack ahead: every input of :func:`ops_of` besides the rounds), built with
    ``build()`` the first time and kept for the last :data:`OPS_KEPT` schedules.

    A :class:`Replay` is kept per communicator (:func:`replay_of`); these are kept apart from any, for a schedule
    replayed over a new communicator each step (an elastic refit makes one per version), whose first step on it
    would otherwise compact every table of the schedule again. Operations are read-only, so replays share them.
    """
    k = (id(key), shape)
    with _ops_lock:
        hit = _ops.get(k)
        if hit is not None and hit[0] is key:
            _ops.move_to_end(k)
            return hit[1]
    ops = build()
    with _ops_lock:
        _ops[k] = (key, ops)  # the key held: its id names it while it is here
        while len(_ops) > OPS_KEPT:
            _ops.popitem(last=False)
    return ops


def _clear_ops() -> None:
    with _ops_lock:
        _ops.clear()


register_clear(_clear_ops)


def replay_of(
    comm: Communicator,
    key: object,
    build: Callable[[], Ops],
    *,
    posts_ahead: bool,
) -> tuple[Replay, bool]:
    """The cached :class:`Replay` of compiled schedule ``key`` on ``comm`` (built with ``build()`` on its first
    step), and whether it was built now.

    ``key`` is the compiled schedule (held while cached, so its identity names it). At most :data:`PER_COMM`
    replays are kept per communicator; the oldest is released when a new one comes.
    """
    try:
        cache = _by_comm.get(comm)
        if cache is None:
            cache = _by_comm[comm] = collections.OrderedDict()
    except TypeError:  # a communicator that takes no weak reference: nothing is cached for it
        return Replay(key, build(), comm), True
    k = (id(key), posts_ahead)
    hit = cache.get(k)
    if hit is not None and hit._key is key:
        cache.move_to_end(k)
        return hit, False
    replay = cache[k] = Replay(key, build(), comm)
    while len(cache) > PER_COMM:
        _, old = cache.popitem(last=False)
        old.release()
    return replay, True


def release(comm: Communicator) -> None:
    """Free every replay prepared on ``comm`` (before it closes)."""
    cache = _by_comm.pop(comm, None)
    for replay in (cache or {}).values():
        replay.release()
