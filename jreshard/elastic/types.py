"""The values elastic refit reports: where a version came from, who holds what, what a push did."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from jreshard.engine.digest import DigestCost

__all__ = ["Arrival", "CatchUp", "Publication", "PushReport", "ReplicaInfo", "ReplicaState"]


class CatchUp(enum.Enum):
    """Where a joining replica takes the latest committed version from.

    ``AUTO`` compares the cost model's predicted time of the two plans (from
    the trainer, from a replica that holds the version) and takes the cheaper;
    on a tie it takes the replica, so the trainer's links stay free for the
    next push. ``TRAINER`` and ``PEER`` force one (``PEER`` falls back to the
    trainer when no replica holds the version).
    """

    AUTO = "auto"
    TRAINER = "trainer"
    PEER = "peer"


class ReplicaState(enum.Enum):
    """Where a replica stands in the trainer's membership."""

    JOINING = "joining"  # connected, catching up to the latest committed version
    READY = "ready"  # holds a committed version, receives every push
    GONE = "gone"  # left, closed, died or failed; its slot is released


class Publication(enum.Enum):
    """Whether a replica may hand out the weights it holds (:attr:`ElasticReplica.publication`).

    ``SYNCING``: connected to the trainer, but not yet holding the trainer's latest committed version
    (nothing yet, or a version it recovered with while the latest is on its way). ``CURRENT``: it holds
    the trainer's latest committed version, as far as the trainer has told it (the trainer closed cleanly
    after it: its last version is final). ``STALE``: it holds a version it cannot vouch for: the
    trainer went away without a word, or this replica was dropped or left. A server refuses traffic
    unless ``CURRENT``; :meth:`ElasticReplica.pull` hands out only a current version unless asked for
    ``allow_stale=True``.
    """

    SYNCING = "syncing"
    CURRENT = "current"
    STALE = "stale"


@dataclasses.dataclass(frozen=True, slots=True)
class Arrival:
    """One version a replica committed.

    Attributes:
      version: the version.
      source: ``"trainer"`` or ``"replica '<name>'"`` (a peer that held it).
      seconds: from the first control message to the staged version (the wire and this process's
        processing; the commit follows when every process of the replica has staged it), measured.
      nbytes: bytes this replica received.
      cpu_s: CPU time the receiving (service) thread used for it: what the receive took from the host
        while the server kept serving.
      digest: what verifying its boxes cost this process (:class:`~jreshard.engine.digest.DigestCost`: the
        keyed MACs of every message it received), ``None`` if nothing was verified.
    """

    version: int
    source: str
    seconds: float
    nbytes: int
    cpu_s: float = 0.0
    digest: DigestCost | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """The trainer's view of one replica.

    Attributes:
      name: the replica's name (unique among live replicas).
      id: the number the trainer gave it when it joined (never reused).
      state: joining, ready or gone.
      version: the last version it reported committed (``None``: none yet).
      caught_up_from: where its first version came from (``"trainer"``, ``"replica '<name>'"``).
      error: why it is gone (``""`` while it is not, ``"left"`` after a clean leave).
    """

    name: str
    id: int
    state: ReplicaState
    version: int | None
    caught_up_from: str = ""
    error: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class PushReport:
    """What one push did.

    Attributes:
      version: the version pushed.
      committed: names of the replicas that committed it.
      lost: ``{name: why}`` for every replica that departed since the previous push's report: dropped
        during this push (it died, stopped answering, or failed), or gone between the two pushes (it
        died, was dropped, or left: ``why`` is ``"left"`` for a clean leave). A name in both
        ``committed`` and ``lost`` committed this version and left after it, or joined again under
        that name after it was lost.
      seconds: wall time of the push, measured.
      delta: ``{name: report}`` of this trainer process's refit of each replica it sent to: a delta or full,
        and why (:class:`~jreshard.refit.delta.DeltaReport`; empty on the other trainer processes).
    """

    version: int
    committed: tuple[str, ...]
    lost: dict[str, str]
    seconds: float
    delta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        """One line: the version, who committed it, who was lost and why.

        Example:
          >>> print(PushReport(5, ("r1",), {"r2": "connection closed"}, 0.25).summary())
          version 5: committed by r1 in 0.250 s; lost r2 (connection closed)
        """
        text = (
            f"version {self.version}: committed by {', '.join(self.committed) or 'no replica'} in {self.seconds:.3f} s"
        )
        if self.lost:
            text += "; lost " + ", ".join(f"{n} ({why})" for n, why in self.lost.items())
        return text
