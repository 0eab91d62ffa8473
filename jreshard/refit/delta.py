"""Delta refits of a group: who can be sent a delta, what the source keeps, and the report of each refit.

A group's processes each hold a :class:`~jreshard.engine.deltarounds.DeltaBases` (the chunks they last sent
and received, at the version the group last committed). At a refit's begin vote every process reports
whether it has deltas on and the version of its bases (:meth:`GroupDelta.vote`); every process then decides
the same thing from the same votes (:meth:`GroupDelta.start`):

- some process has deltas off: the refit runs as a full one on every process (the prepared rounds), each
  process's bases are dropped, and the report names the process;
- otherwise the refit runs through the delta rounds, and each chunk goes as a delta exactly when its
  sender's bases and its receiver's process are on the same version; a process that holds none (the
  group's first refit, a refit that failed there) or another version is sent whole chunks, and the report
  of every sender says which process and why.

The bases become the new version only when the whole group committed (:meth:`GroupDelta.commit`); a
failed refit leaves them as they were (:meth:`GroupDelta.abort`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from jreshard.engine.deltarounds import DeltaBases, DeltaRefit
from jreshard.options import Delta, Options
from jreshard.sharding.dtypes import numpy_dtype

__all__ = ["DENSE_CHANGED", "MAX_BACKOFF", "Backoff", "DeltaReport", "GroupDelta", "wire_unit"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DeltaReport:
    """What one refit sent from this process, against what a full refit sends (final).

    Attributes:
      version: the version refit.
      mode: ``"delta"`` (every chunk this process sent could be a delta), ``"full"`` (none could: see
        ``reasons``), ``"mixed"`` (some receivers were sent whole chunks), or ``"off"``.
      reasons: why chunks went whole: one line per process that could not take a delta.
      full_bytes: the bytes this process's ranks send in a full refit.
      sent_bytes: the bytes they sent (encodings, their headers and 8 bytes of length each; ``full_bytes`` when off).
      recv_bytes: the bytes this process's ranks received.
      changed_fraction: the changed comparison units over all units this process sent (1.0 when off).
      encode_s, apply_s: seconds spent encoding what it sent and rebuilding what it received.
      wire_s: seconds in the delta exchanges (waits on peers included).
      seconds: the refit's wall time on this process (begin vote to commit).
      kept_bytes: the bytes this process keeps to diff the next refit against (sent and received chunks).
      kept_limit: :attr:`Options.delta_bytes`.
    """

    version: int
    mode: str
    reasons: tuple[str, ...]
    full_bytes: int
    sent_bytes: int
    recv_bytes: int
    changed_fraction: float
    encode_s: float
    apply_s: float
    wire_s: float
    seconds: float
    kept_bytes: int
    kept_limit: int

    @classmethod
    def off(
        cls, version: int, reasons: tuple[str, ...], full_bytes: int, seconds: float, kept_limit: int = 0
    ) -> DeltaReport:
        """The report of a refit sent whole (no deltas): what it sent is what a full refit sends."""
        return cls(version=version, mode="off", reasons=reasons, full_bytes=full_bytes, sent_bytes=full_bytes,
                   recv_bytes=0, changed_fraction=1.0, encode_s=0.0, apply_s=0.0, wire_s=0.0, seconds=seconds,
                   kept_bytes=0, kept_limit=kept_limit)  # fmt: skip

    @classmethod
    def of(cls, version: int, reasons: tuple[str, ...], stats: Any, bases: Any, seconds: float) -> DeltaReport:
        """The report of a refit that ran the delta rounds: ``stats`` its engine's counts, ``bases`` what
        this process keeps; the mode follows from ``reasons`` and whether any chunk went as a delta."""
        mode = "delta" if not reasons else ("full" if stats.delta_chunks == 0 else "mixed")
        return cls(version=version, mode=mode, reasons=reasons, full_bytes=stats.full_bytes,
                   sent_bytes=stats.sent_bytes, recv_bytes=stats.recv_bytes,
                   changed_fraction=stats.changed_fraction, encode_s=stats.encode_s, apply_s=stats.apply_s,
                   wire_s=stats.wire_s, seconds=seconds, kept_bytes=bases.kept_bytes,
                   kept_limit=bases.limit)  # fmt: skip

    @property
    def sent_ratio(self) -> float:
        """``sent_bytes / full_bytes`` (1.0 when nothing was sent)."""
        return self.sent_bytes / self.full_bytes if self.full_bytes else 1.0

    def summary(self) -> str:
        """One line: mode, bytes against full, changed fraction, times."""
        why = f" ({'; '.join(self.reasons)})" if self.reasons else ""
        return (
            f"version {self.version}: {self.mode}{why}, sent {self.sent_bytes} of {self.full_bytes} bytes "
            f"({100 * self.sent_ratio:.2f}%), {100 * self.changed_fraction:.2f}% changed, encode "
            f"{1e3 * self.encode_s:.2f} ms, apply {1e3 * self.apply_s:.2f} ms, kept {self.kept_bytes} bytes"
        )


def wire_unit(dtypes: Iterable[Any]) -> int:
    """The comparison unit of a group's chunks: the smallest itemsize of the dtypes its destinations receive
    (1, 2, 4 or 8; a sub-byte or odd-sized dtype compares byte by byte). A unit spanning two elements
    would count both as changed when one is; a smaller unit is never wrong, only larger on the wire."""
    sizes = [numpy_dtype(d).itemsize for d in dtypes]
    unit = min(sizes, default=1)
    return unit if unit in (1, 2, 4, 8) else 1


DENSE_CHANGED = 0.875
"""``delta="auto"`` backs off when over this fraction of the elements a process sent had changed."""
MAX_BACKOFF = 64
"""The most refits in a row ``delta="auto"`` sends whole before it tries deltas again."""


class Backoff:
    """``delta="auto"`` stepping aside from deltas that do not pay, for one sender (final).

    After a refit whose every chunk the sender sent went as a delta, :meth:`judge` backs off when over
    :data:`DENSE_CHANGED` of their elements had changed (the deltas are then about as large as the chunks,
    and the encoding and the kept copies cost more than the wire they save): :attr:`whole` for the next
    1, 2, 4, ... :data:`MAX_BACKOFF` refits, each stretch twice the last while the changes stay dense; then
    one refit lays the bases again and the next looks again. Deltas over sparser changes end it. The
    fraction is of elements, not bytes: tiny chunks, whose headers outweigh their changes, do not count.

    Example:
      >>> from jreshard.engine.deltarounds import DeltaStats
      >>> b = Backoff(auto=True)
      >>> b.judge(DeltaStats(units=100, changed_units=97, chunks=2, delta_chunks=2))
      >>> b.whole
      True
      >>> print(b.why())
      97% of the elements of its last deltas had changed; it tries deltas again after 1 more refits
      >>> b.started(); b.whole
      False
    """

    def __init__(self, auto: bool):
        self.auto = auto
        self._skip = 0  # refits left to send whole
        self._backoff = 0  # the length of the last stretch
        self._dense = 1.0  # the changed fraction that started it

    @property
    def whole(self) -> bool:
        """Whether the next refit should go whole."""
        return self._skip > 0

    def started(self) -> None:
        """A refit started (whole or not): one fewer to go whole."""
        self._skip = max(0, self._skip - 1)

    def judge(self, stats: Any) -> None:
        """The sender's :class:`~jreshard.engine.deltarounds.DeltaStats` of a refit that ran the delta rounds."""
        if not self.auto or not stats.units or stats.delta_chunks != stats.chunks:
            return
        changed = stats.changed_units / stats.units
        if changed <= DENSE_CHANGED:
            self._backoff = 0
            return
        self._backoff = min(MAX_BACKOFF, 2 * self._backoff or 1)
        self._skip, self._dense = self._backoff, changed

    def state(self) -> list[float]:
        """``[changed fraction, refits left]``: what a begin vote carries while :attr:`whole`."""
        return [round(self._dense, 4), self._skip]

    def why(self, state: Sequence[float] | None = None) -> str:
        """Why a sender goes whole (its own :meth:`state` by default)."""
        changed, left = state if state is not None else self.state()
        return (
            f"{100 * changed:.0f}% of the elements of its last deltas had changed; it tries deltas again after "
            f"{int(left)} more refits"
        )


class GroupDelta:
    """One process's delta state in a group (final).

    With ``delta="auto"`` a process that sends votes for whole refits while deltas do not pay
    (:class:`Backoff`: over :data:`DENSE_CHANGED` of the elements it sent had changed, as when float32
    weights are served as float32): the refits then run whole (the prepared rounds, no encoding, no kept
    copies), 1, 2, 4, ... up to :data:`MAX_BACKOFF` of them, then it tries again.

    Args:
      options: the group's options (``delta``, ``delta_bytes``).
      unit: :func:`wire_unit` of the group's destination dtypes.
      rank_process: ``{rank: process}`` of the group.
      describe: a process's name for messages.
    """

    def __init__(self, options: Options, unit: int, rank_process: Mapping[int, int], describe: Callable[[int], str]):
        self.on = options.delta is not Delta.OFF  # auto: a group is between programs
        self.backoff = Backoff(options.delta is Delta.AUTO)
        self.bases = DeltaBases(options.delta_bytes)
        self.unit = unit
        self._rank_process = dict(rank_process)
        self._describe = describe
        self._refit: DeltaRefit | None = None
        self._reasons: tuple[str, ...] = ()
        self._t0 = 0.0
        self.report: DeltaReport | None = None

    def vote(self) -> dict[str, Any]:
        """This process's part of the begin vote."""
        want = self.on and not self.backoff.whole
        vote: dict[str, Any] = {"delta": want, "delta_base": self.bases.version if want else None}
        if self.on and not want:  # auto, backing off: the others' reports say why, and for how long
            vote["delta_dense"] = self.backoff.state()
        return vote

    def start(self, votes: Mapping[int, Mapping[str, Any]], me: int) -> DeltaRefit | None:
        """The delta settings of this refit from every process's begin vote (``None``: a full refit)."""
        self._t0 = time.perf_counter()
        self.backoff.started()
        off = [p for p, v in sorted(votes.items()) if not v.get("delta")]
        if off:
            self.bases.clear()
            self._refit = None
            self._reasons = tuple(self._why_off(p, votes[p]) for p in off) if self.on else ()
            return None
        held = {p: v.get("delta_base") for p, v in votes.items()}
        mine = self.bases.version
        reasons = []
        for p in sorted({self._rank_process[r] for r in self._rank_process} - {me}):
            if held[p] == mine and mine is not None:
                continue
            if mine is None:
                reasons = ["this process holds no base yet (the group's first refit, or its last one failed)"]
                break
            if held[p] is None:
                reasons.append(f"{self._describe(p)} holds no base (its last refit failed or it joined late)")
            else:
                reasons.append(f"{self._describe(p)} holds version {held[p]}, this process's bases are {mine}")
        self._reasons = tuple(reasons)
        rank_process = self._rank_process

        def peer_base(rank: int) -> int | None:
            return held.get(rank_process.get(rank, -1))

        self._refit = DeltaRefit(bases=self.bases, peer_base=peer_base, unit=self.unit)
        return self._refit

    def commit(self, version: int, full_bytes: int) -> None:
        """The group committed ``version``: the bases move to it, and the report is made."""
        seconds = time.perf_counter() - self._t0
        rf = self._refit
        if rf is None:
            self.report = DeltaReport.off(version, self._reasons, full_bytes, seconds, self.bases.limit)
            return
        self.bases.commit(version)
        self.report = DeltaReport.of(version, self._reasons, rf.stats, self.bases, seconds)
        self._refit = None
        if not self._reasons:  # every chunk this process sent could go as a delta
            self.backoff.judge(rf.stats)

    def _why_off(self, process: int, vote: Mapping[str, Any]) -> str:
        """Why ``process`` voted for a whole refit (its begin vote)."""
        dense = vote.get("delta_dense")
        if not dense:
            return f"{self._describe(process)} has delta off"
        return f"{self._describe(process)} sends whole for now (delta='auto': {self.backoff.why(dense)})"

    def abort(self) -> None:
        """The refit failed: the bases stay on the version they had."""
        self.bases.abort()
        self._refit = None
