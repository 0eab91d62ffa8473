"""Options: the explicit, frozen settings of a transfer (and of its plan)."""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import operator

import numpy as np

__all__ = ["Backend", "Delta", "Options", "as_int", "wait_s"]


class Backend(enum.Enum):
    """Which transport runs a transfer: the name of a transport of the registry (:mod:`jreshard.call.routes`)."""

    AUTO = "auto"  # direct copies in one process; NCCL on GPUs across processes; else MPI
    LOCAL = "local"  # one process, every device addressable: direct copies
    MPI = "mpi"  # mpi4py (CPU buffers, or CUDA-aware MPI)
    NCCL = "nccl"  # cupy.cuda.nccl point-to-point
    XLA = "xla"  # the plan compiled into one jitted shard_map of ppermutes (jreshard.xla); not run on GPU or TPU
    NIXL = "nixl"  # one-sided NIXL WRITEs between two programs (RefitGroup, jreshard.elastic); no transfer call yet


class Delta(enum.Enum):
    """Whether versioned refits send only what changed (:attr:`Options.delta`)."""

    OFF = "off"  # every refit sends every byte
    ON = "on"  # every refit between programs sends, per chunk, what changed since the receiver's version
    AUTO = "auto"  # on between programs (RefitGroup, elastic replicas); a transfer() in one process never diffs


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """Settings of a transfer. Frozen and hashable: part of every plan cache key.

    Args:
      backend: "auto", "local", "mpi", "nccl", "xla" or "nixl" (or a :class:`Backend`). ``"nixl"`` moves
        weights between two programs (``RefitGroup.connect(transport="nixl")``, :mod:`jreshard.elastic`);
        a ``transfer`` call with it raises :class:`~jreshard.errors.BackendUnavailableError` naming the
        backends that can run it.
      staging_bytes: the most staging memory one rank may hold at once.
      chunk_bytes: messages are cut into chunks of at most this many bytes;
        the fast-link fan-out of chunk k runs while chunk k+1 crosses the network.
      timeout_s: a wait on a peer longer than this aborts the transfer.
      relays: let a destination that received a piece forward it to another
        domain when destination domains outnumber source replicas.
      min_stripe_bytes: a piece landing in a domain is cut along its outermost
        dimension to balance the receiving NICs, never into stripes smaller than this.
      copy_threads: host threads for the in-process copies on CPU (numpy releases
        the GIL, so copies run in parallel); ``None`` uses every core.
      max_group_ops: the most send/recv operations one rank posts in one exchange
        group (one NCCL group); a round with more runs as several groups, cut the
        same way on every rank.
      secret: the shared key that programs connecting over the network (elastic refit,
        ``RefitGroup`` over NIXL) prove they hold before any declaration or byte moves
        (HMAC-SHA256 challenge-response, :mod:`jreshard.net.auth`); at least 16 bytes. ``None``:
        the ``JRESHARD_SECRET`` environment variable, or the file named by
        ``JRESHARD_SECRET_FILE``. Never printed (not in the repr) and not part of a plan's key.
      encrypt: seal the weights on the wire too (NIXL between programs: each message encrypted with
        AES-256-GCM under keys derived from the handshake before it leaves, opened after it lands);
        host buffers only. Set it on both sides; a receiver's setting decides how it receives.
      verify: hash every message of a refit between programs on both sides (XXH3-128, the ``xxhash``
        package: ``pip install 'jreshard[verify]'``) and compare the digests of every destination box's
        streams before the version is published (:mod:`jreshard.engine.digest`); a mismatch refuses the
        version everywhere. Programs that share a secret always compare keyed MACs instead (the secure
        sibling); ``verify`` then adds nothing. Set it on both sides.
      delta: ``"off"``, ``"on"`` or ``"auto"`` (or a :class:`Delta`): versioned refits between programs
        (``RefitGroup``, elastic replicas) send, for each chunk of the plan, only what changed since the
        version its receiver holds, compared bit for bit in the wire dtype; a receiver whose version the
        sender cannot encode against gets the whole chunk. ``"auto"`` is on between programs, and a
        sender whose deltas stop paying (over 7/8 of the elements it sent had changed, as when
        float32 weights are served as float32) sends whole refits for a while (1, 2, 4, ... up to
        64 refits), then tries again; ``"on"`` always diffs. A ``transfer()`` has no earlier version
        and never diffs. Every process of a group must have it on for a refit to use it (else the
        refit is full and its report says why).
      delta_bytes: the most bytes of sent chunks one process keeps, in the wire dtype, to diff the next
        refit against (its receivers keep the same chunks); chunks past it are sent whole every refit.

    Example:
      >>> Options(backend="mpi", chunk_bytes=1 << 20).backend
      <Backend.MPI: 'mpi'>
    """

    backend: Backend = Backend.AUTO
    staging_bytes: int = 256 << 20
    chunk_bytes: int = 8 << 20
    timeout_s: float = 300.0
    relays: bool = True
    min_stripe_bytes: int = 64 << 10
    copy_threads: int | None = None
    max_group_ops: int = 2048
    secret: bytes | None = dataclasses.field(default=None, repr=False)
    encrypt: bool = False
    verify: bool = False
    delta: Delta = Delta.AUTO
    delta_bytes: int = 16 << 30

    def __post_init__(self) -> None:
        b = self.backend
        if not isinstance(b, Backend):
            try:
                b = Backend(str(b).lower())
            except ValueError:
                raise ValueError(
                    f"Options: backend={self.backend!r}; expected one of {[m.value for m in Backend]}"
                ) from None
            object.__setattr__(self, "backend", b)
        for f in ("staging_bytes", "chunk_bytes"):
            if self._whole(f) < 1:
                raise ValueError(f"Options: {f}={getattr(self, f)!r} must be a positive int")
        if self.chunk_bytes > self.staging_bytes:
            raise ValueError(
                f"Options: chunk_bytes={self.chunk_bytes} exceeds staging_bytes={self.staging_bytes}; "
                "a chunk must fit in staging"
            )
        t = self.timeout_s
        if not _seconds(t) or t == 0:
            raise ValueError(
                f"Options: timeout_s={t!r} must be a positive, finite number of seconds (every wait on a peer is "
                "bounded by it)"
            )
        object.__setattr__(self, "timeout_s", float(t))
        if self.copy_threads is not None and self._whole("copy_threads") < 1:
            raise ValueError(f"Options: copy_threads={self.copy_threads!r} must be None or an int >= 1")
        if self._whole("max_group_ops") < 1:
            raise ValueError(f"Options: max_group_ops={self.max_group_ops!r} must be an int >= 1")
        if self.secret is not None and (not isinstance(self.secret, bytes) or len(self.secret) < 16):
            shown = f"{len(self.secret)} bytes" if isinstance(self.secret, bytes) else type(self.secret).__name__
            raise ValueError(f"Options: secret must be None or bytes of length >= 16 (got {shown})")
        if not isinstance(self.encrypt, bool):
            raise TypeError(f"Options: encrypt={self.encrypt!r} must be True or False")
        if not isinstance(self.verify, bool):
            raise TypeError(f"Options: verify={self.verify!r} must be True or False")
        d = self.delta
        if not isinstance(d, Delta):
            try:
                d = Delta(d.lower() if isinstance(d, str) else d)
            except ValueError:
                raise ValueError(
                    f"Options: delta={self.delta!r}; expected one of {[m.value for m in Delta]} "
                    '("auto": on between programs)'
                ) from None
            object.__setattr__(self, "delta", d)
        if self._whole("delta_bytes") < 0:
            raise ValueError(f"Options: delta_bytes={self.delta_bytes!r} must be an int >= 0 (0: keep nothing)")
        if not isinstance(self.relays, bool):
            raise TypeError(f"Options: relays={self.relays!r} must be True or False")
        if self._whole("min_stripe_bytes") < 0:
            raise ValueError(f"Options: min_stripe_bytes={self.min_stripe_bytes!r} must be an int >= 0")

    def _whole(self, field: str) -> int:
        """Field ``field`` as a Python int, stored back (:func:`as_int`); -1 for a value that is not one, which every
        caller refuses with its own message."""
        n = as_int(getattr(self, field))
        if n is None:
            return -1
        object.__setattr__(self, field, n)
        return n

    @staticmethod
    def of(options: object, name: str = "options") -> Options:
        """``options`` itself, or the defaults for ``None``.

        Raises:
          TypeError: ``options`` is neither an :class:`Options` nor None (a dict, a string...).

        Example:
          >>> Options.of(None) == Options()
          True
        """
        if options is None:
            return Options()
        if not isinstance(options, Options):
            raise TypeError(f"{name}={options!r} is a {type(options).__name__}; expected jreshard.Options(...) or None")
        return options

    def plan_key(self) -> tuple:
        """The fields that change a plan (the rest change only how it runs)."""
        return (self.relays, self.min_stripe_bytes)


def _seconds(t: object) -> bool:
    """Whether ``t`` is a finite real number >= 0 (numpy's too; not a bool)."""
    return not isinstance(t, bool) and isinstance(t, numbers.Real) and 0 <= float(t) < math.inf


def wait_s(timeout_s: object, default: float, who: str) -> float:
    """The seconds a call waits: ``timeout_s`` as a float, or ``default`` for ``None``.

    Raises:
      ValueError: ``timeout_s`` is not ``None`` nor a finite number of seconds >= 0 (``inf`` and ``nan`` included:
        every wait is bounded), naming ``who``.

    Example:
      >>> wait_s(None, 300.0, "pull"), wait_s(2, 300.0, "pull")
      (300.0, 2.0)
    """
    if timeout_s is None:
        return float(default)
    if not _seconds(timeout_s):
        raise ValueError(f"{who}: timeout_s={timeout_s!r} must be None or a finite number of seconds >= 0")
    return float(timeout_s)  # type: ignore[arg-type]


def as_int(value: object) -> int | None:
    """``value`` as a Python int where it is an integer of any type (numpy's too), else ``None`` (a bool, a float, a
    string: ``int()`` would take ``2.7`` for ``2`` without a word).

    Example:
      >>> import numpy as np
      >>> as_int(np.int64(3)), as_int(3), as_int(2.7), as_int(True), as_int("3")
      (3, 3, None, None, None)
    """
    if isinstance(value, bool | np.bool_):  # (numpy's bool had an __index__ once)
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None
