"""Delta refits of elastic replicas: what each trainer process keeps per replica, and what it may encode.

A replica says in its hello whether it takes deltas (its ``Options.delta``); the trainer's process 0 uses
them for a replica when both sides have them on. Each trainer process keeps, per replica, the chunks it
last sent it (:class:`~jreshard.engine.deltarounds.DeltaBases`, committed as soon as its part of the refit
ran: the bytes of a version are the same whoever receives them); each replica process keeps the chunks it
received, committed with the version it commits, and reports that base version when it commits (its
``at`` message). A replica that caught up from a peer replica, or whose refit failed, holds no base or an
older one; process 0 tells every trainer process the base each replica process reported, and a chunk goes
as a delta only to a replica process holding exactly the version the sender's copy is of; otherwise it goes
whole (the replica's report says ``full`` and why).

Both ends of a pair must run the same rounds (delta rounds or the prepared ones): the ``refit`` and
``catchup`` messages, and process 0's dispatch to the other trainer processes, carry the decision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jreshard.engine.deltarounds import DeltaBases, DeltaRefit
from jreshard.options import Delta, Options
from jreshard.refit.delta import DeltaReport, wire_unit

__all__ = ["ReplicaBases", "TrainerBases", "delta_on", "pair_report", "unit_of"]


def delta_on(options: Options) -> bool:
    """Whether this side takes part in delta refits (``auto``: yes, a replica is another program)."""
    return options.delta is not Delta.OFF


def unit_of(decls: Sequence[Mapping[str, Any]]) -> int:
    """The comparison unit of a replica's tensors: :func:`~jreshard.refit.delta.wire_unit` of the dtypes its
    declarations (one per process) give them."""
    return wire_unit([p[2] for d in decls for p in d.get("params", [])])


def pair_report(
    version: int,
    name: str,
    refit: DeltaRefit | None,
    before: int | None,
    bases: Sequence[int | None],
    why_off: str,
    seconds: float,
    full_bytes: int,
) -> DeltaReport:
    """The report of one trainer process's part of a refit to replica ``name``.

    Args:
      refit: the delta settings it ran with (``None``: the prepared rounds, ``why_off`` says why).
      before: the version its copies for the replica were of before the refit.
      bases: per replica process, the base it reported.
      full_bytes: what it sent, when not as deltas.
    """
    if refit is None:
        return DeltaReport.off(version, (why_off,) if why_off else (), full_bytes, seconds)
    reasons = []
    if before is None:
        reasons.append(f"this trainer process holds no copy for replica {name!r} yet (its first refit from here)")
    for j, b in enumerate(bases):
        if b is None:
            reasons.append(
                f"replica {name!r} process {j} holds no base (it joined late, caught up from a peer replica, "
                "or its last refit failed)"
            )
        elif before is not None and b != before:
            reasons.append(f"replica {name!r} process {j} holds version {b}, the trainer's copies are of {before}")
    return DeltaReport.of(version, tuple(reasons), refit.stats, refit.bases, seconds)


class TrainerBases:
    """One trainer process's bases, per replica (by member id)."""

    def __init__(self, options: Options):
        self._limit = options.delta_bytes
        self._by_member: dict[int, DeltaBases] = {}

    def refit(self, member: int, bases: Sequence[int | None], ranks: Sequence[Sequence[int]], unit: int) -> DeltaRefit:
        """The delta settings of one refit to ``member``.

        Args:
          member: the replica's id.
          bases: per replica process, the base version it reported (``None``: none).
          ranks: per replica process, its ranks in the pair.
          unit: the comparison unit.
        """
        held = self._by_member.setdefault(member, DeltaBases(self._limit))
        base_of = {r: b for b, rs in zip(bases, ranks, strict=True) for r in rs}
        return DeltaRefit(bases=held, peer_base=base_of.get, unit=unit)

    def sent(self, member: int, version: int) -> None:
        """This process's part of the refit of ``version`` to ``member`` ran: its copies are of ``version``."""
        held = self._by_member.get(member)
        if held is not None:
            held.commit(version)

    def failed(self, member: int) -> None:
        """Its part failed: the copies of the version before stay."""
        held = self._by_member.get(member)
        if held is not None:
            held.abort()

    def forget(self, member: int) -> None:
        """The replica is gone: drop what was kept for it."""
        self._by_member.pop(member, None)

    @property
    def kept_bytes(self) -> int:
        """Bytes kept for every replica."""
        return sum(b.kept_bytes for b in self._by_member.values())


class ReplicaBases:
    """One replica process's bases: staged with a version, committed with it."""

    def __init__(self, options: Options):
        self.on = delta_on(options)
        self.bases = DeltaBases(options.delta_bytes)
        self._staged: int | None = None
        self._delta = False

    def refit(self, delta: bool, unit: int) -> DeltaRefit | None:
        """The delta settings of a refit the trainer said is (``delta``) or is not a delta refit."""
        self.bases.abort()  # a version staged and never committed: its copies go
        self._delta = bool(delta) and self.on
        if not self._delta:
            return None
        return DeltaRefit(bases=self.bases, peer_base=lambda rank: None, unit=unit)

    def staged(self, version: int) -> None:
        self._staged = version

    def committed(self, version: int) -> None:
        """The replica committed ``version``: the bases are of it when it came as delta rounds; otherwise
        (from a peer replica, or a full refit) it holds none."""
        if self._delta and self._staged == version:
            self.bases.commit(version)
        else:
            self.bases.clear()
        self._staged = None

    @property
    def version(self) -> int | None:
        """The version the kept chunks are of (``None``: none kept)."""
        return self.bases.version if self.on else None
