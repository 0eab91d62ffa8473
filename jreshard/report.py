"""TransferReport: what one transfer (one refit) moved, how long each phase took,
and which backend ran it.

``jreshard.transfer(..., report=True)`` and ``transfer_into(..., report=True)``
return one with their result; the in-process path fills the ``plan``, ``buffers``
and ``copy`` phases, and the message-passing engine (``engine.execute(...,
report=builder)``) the ``pack``, ``network``, ``fanout`` and ``unpack`` phases.
Every number is measured, never predicted: bytes are
counted as the engine hands them to a link, times are host wall-clock seconds
around each phase (on GPUs a phase's time includes the stream synchronisation
that ends it, so a phase that only enqueues work reads as short and the wait
shows up in the phase that synchronises). Definitions are in ``docs/metrics.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import time
from collections.abc import Callable, Iterator

from jreshard.options import Backend
from jreshard.sharding.topology import Link

__all__ = ["NotInPlace", "ReportBuilder", "ReportPhase", "TransferReport"]


class ReportPhase(enum.Enum):
    """The timed phases of a transfer, in the order they first run."""

    PLAN = "plan"  # checks, plan lookup or planning, and building this rank's plan
    PACK = "pack"  # gathering strided pieces into staging buffers
    NETWORK = "network"  # point-to-point messages between domains (and their waits)
    FANOUT = "fanout"  # messages inside a fast-link domain
    UNPACK = "unpack"  # scattering staging buffers into destination shards, and same-device copies
    COPY = "copy"  # in one process: the direct copies from source shards into destination shards (xla: the computation)
    BUFFERS = "buffers"  # in one process: DLPack export, destination allocation, import, assembly
    COMPILE = "compile"  # backend xla: tracing, lowering and compiling the computation (0 when it was cached)


class NotInPlace(enum.Enum):
    """Why ``transfer_into`` wrote a leaf into fresh memory instead of over its ``into`` array."""

    DELETED = "the into array was already deleted"
    SHARES_A_SOURCE = "the into array shares memory with a source leaf"
    SHARES_ANOTHER_INTO = "the into array shares memory with another into leaf"
    NOT_HANDED_OVER = (
        "jax could not hand the into array's memory over (memory jax did not allocate, such as a "
        "transfer result's, or another reference to it such as a numpy view)"
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TransferReport:
    """One transfer's measured bytes, times and backend (frozen).

    Attributes:
      backend: the backend that ran the transfer (never ``Backend.AUTO``).
      backend_reason: why it was picked, in words (``"auto: arrays on GPUs and cupy.cuda.nccl imports"``).
      network_bytes, fast_bytes, same_device_bytes: bytes this process moved over each link kind
        (counted once, at the sender; a same-device copy counts at the destination).
      plan_s, pack_s, network_s, fanout_s, unpack_s, copy_s, buffers_s: seconds spent in
        each :class:`ReportPhase`.
      fresh_bytes: destination bytes allocated new for this transfer (their pages are
        faulted in on first touch, the slow case on CPU hosts); the others were reused
        warm from the buffer pool or written in place.
      total_s: wall-clock seconds from the start of the transfer to its end; at least
        the sum of the phases (phases may overlap when chunks are pipelined, so the sum
        can also exceed it).
      not_in_place_bytes: ``transfer_into`` destination bytes written into fresh buffers
        instead of in place, because the ``into`` leaf shared memory with a source leaf or
        with another ``into`` leaf, had been deleted, or jax could not hand its memory over
        (see the ownership rule in ``transfer_into``).
      not_in_place: per such leaf, ``(leaf index in x's flattened order, why)``.
      peak_staging_bytes: the most staging memory held at once.
      messages: point-to-point messages this process sent.
      compile_s: backend xla: seconds compiling the computation (0 when it came from the cache).
      padding_bytes: backend xla: bytes this process's collectives sent beyond the payload (every pair
        of a ``ppermute`` sends the length of its largest member); not counted in ``moved_bytes``.
      rounds: exchange rounds the engine ran for this process (0 in one process's direct copies).
      replayed_rounds: of those, the rounds replayed from a schedule an earlier call prepared (on the same
        communicator, schedule and arenas); the others were prepared by this call.
      idle_s: of the pack, network, fanout and unpack seconds, those the engine spent waiting for peers or the
        wire (polling a group that had not completed); 0 where the transport cannot tell.

    Example:
      >>> r = TransferReport(backend=Backend.LOCAL, same_device_bytes=2_000_000_000, total_s=1.0)
      >>> r.moved_bytes, r.achieved_gbps
      (2000000000, 2.0)
    """

    backend: Backend
    backend_reason: str = ""
    network_bytes: int = 0
    fast_bytes: int = 0
    same_device_bytes: int = 0
    plan_s: float = 0.0
    pack_s: float = 0.0
    network_s: float = 0.0
    fanout_s: float = 0.0
    unpack_s: float = 0.0
    copy_s: float = 0.0
    buffers_s: float = 0.0
    total_s: float = 0.0
    peak_staging_bytes: int = 0
    messages: int = 0
    fresh_bytes: int = 0
    not_in_place_bytes: int = 0
    not_in_place: tuple[tuple[int, NotInPlace], ...] = ()
    compile_s: float = 0.0
    padding_bytes: int = 0
    rounds: int = 0
    replayed_rounds: int = 0
    idle_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.backend, Backend) or self.backend is Backend.AUTO:
            raise ValueError(f"TransferReport: backend={self.backend!r} must be a resolved Backend, not AUTO")
        for f in (
            "network_bytes",
            "fast_bytes",
            "same_device_bytes",
            "peak_staging_bytes",
            "messages",
            "fresh_bytes",
            "not_in_place_bytes",
            "padding_bytes",
            "rounds",
            "replayed_rounds",
        ):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"TransferReport: {f}={v!r} must be an int >= 0")
        seconds = (
            "plan_s",
            "pack_s",
            "network_s",
            "fanout_s",
            "unpack_s",
            "copy_s",
            "buffers_s",
            "compile_s",
            "total_s",
        )
        for f in seconds:
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"TransferReport: {f}={v!r} must be a number of seconds >= 0")

    @property
    def moved_bytes(self) -> int:
        """Bytes moved over every link kind."""
        return self.network_bytes + self.fast_bytes + self.same_device_bytes

    @property
    def achieved_gbps(self) -> float:
        """``moved_bytes / total_s`` in GB/s (1e9 bytes per second); 0 when nothing was timed."""
        return self.moved_bytes / self.total_s / 1e9 if self.total_s > 0 else 0.0

    @property
    def network_gbps(self) -> float:
        """``network_bytes / network_s`` in GB/s; 0 when no network time was recorded."""
        return self.network_bytes / self.network_s / 1e9 if self.network_s > 0 else 0.0

    @property
    def host_us_per_round(self) -> float:
        """The engine's host time per round, in microseconds: its pack, network, fan-out and unpack seconds less
        the seconds it waited idle (:attr:`idle_s`), over :attr:`rounds` (0 when no round ran). Over a wire that
        moves the bytes slower than the host packs them this is the host's share of each round."""
        busy = self.pack_s + self.network_s + self.fanout_s + self.unpack_s - self.idle_s
        return max(busy, 0.0) / self.rounds * 1e6 if self.rounds else 0.0

    def bytes_by_link(self) -> dict[Link, int]:
        """``{Link.SAME_DEVICE: ..., Link.FAST: ..., Link.NETWORK: ...}``."""
        return {Link.SAME_DEVICE: self.same_device_bytes, Link.FAST: self.fast_bytes, Link.NETWORK: self.network_bytes}

    def seconds_by_phase(self) -> dict[ReportPhase, float]:
        """Seconds per :class:`ReportPhase`."""
        return {p: getattr(self, f"{p.value}_s") for p in ReportPhase}

    def summary(self) -> str:
        """One line for logs."""
        phases = ", ".join(f"{p.value} {s * 1e3:.1f} ms" for p, s in self.seconds_by_phase().items() if s)
        return (
            f"{self.backend.value}: {self.moved_bytes} B (network {self.network_bytes}, fast {self.fast_bytes}, "
            f"same-device {self.same_device_bytes}) in {self.total_s * 1e3:.1f} ms = {self.achieved_gbps:.2f} GB/s; "
            f"{phases or 'no phase timed'}; peak staging {self.peak_staging_bytes} B; {self.messages} messages; "
            f"fresh {self.fresh_bytes} B; {self.backend_reason}"
        )


class ReportBuilder:
    """Accumulates one transfer's measurements; :meth:`build` freezes them (final).

    Args:
      backend: the resolved backend.
      reason: why it was picked.
      clock: a monotonic clock in seconds (``time.perf_counter`` unless a test passes another).

    Example:
      >>> ticks = iter([0.0, 1.0, 1.5, 3.0])
      >>> b = ReportBuilder(Backend.MPI, clock=lambda: next(ticks))
      >>> with b.timed(ReportPhase.NETWORK):
      ...     b.add_bytes(Link.NETWORK, 100)
      >>> b.staging(64); b.staging(-64); b.staging(32)
      >>> r = b.build()
      >>> r.network_s, r.total_s, r.peak_staging_bytes, r.network_bytes
      (0.5, 3.0, 64, 100)
    """

    __slots__ = (
        "_backend",
        "_bytes",
        "_clock",
        "_fresh",
        "_idle",
        "_messages",
        "_padding",
        "_peak",
        "_reason",
        "_replayed",
        "_rounds",
        "_seconds",
        "_staging",
        "_start",
        "_unowned",
        "_why",
    )

    def __init__(self, backend: Backend, reason: str = "", *, clock: Callable[[], float] = time.perf_counter):
        self._backend = backend
        self._reason = reason
        self._clock = clock
        self._start = clock()
        self._seconds = dict.fromkeys(ReportPhase, 0.0)
        self._bytes = dict.fromkeys(Link, 0)
        self._staging = 0
        self._peak = 0
        self._messages = 0
        self._fresh = 0
        self._unowned = 0
        self._why: list[tuple[int, NotInPlace]] = []
        self._padding = 0
        self._rounds = self._replayed = 0
        self._idle = 0.0

    def choose(self, backend: Backend, reason: str) -> None:
        """Record the backend once it is picked (a builder starts before the choice is made)."""
        self._backend, self._reason = backend, reason

    @contextlib.contextmanager
    def timed(self, phase: ReportPhase) -> Iterator[None]:
        """Add the wall-clock time of the ``with`` body to ``phase``."""
        t0 = self._clock()
        try:
            yield
        finally:
            self._seconds[phase] += self._clock() - t0

    @property
    def clock(self) -> Callable[[], float]:
        """The builder's clock, for a caller that times phases itself (then :meth:`add_seconds`)."""
        return self._clock

    def add_seconds(self, phase: ReportPhase, seconds: float) -> None:
        """Add seconds measured elsewhere (a CUDA event pair, say) to ``phase``."""
        self._seconds[phase] += float(seconds)

    def add_bytes(self, link: Link, nbytes: int, *, messages: int = 0) -> None:
        """Count ``nbytes`` moved over ``link`` and ``messages`` messages sent."""
        self._bytes[Link(link)] += int(nbytes)
        self._messages += int(messages)

    def add_fresh(self, nbytes: int) -> None:
        """Count destination bytes allocated new (not reused from a pool)."""
        self._fresh += int(nbytes)

    def add_unowned(self, nbytes: int, leaf: int = -1, why: NotInPlace | None = None) -> None:
        """Count ``transfer_into`` bytes written to fresh buffers because ``into`` was not exclusively owned
        (leaf ``leaf`` of x, for the reason ``why``)."""
        self._unowned += int(nbytes)
        if why is not None:
            self._why.append((int(leaf), why))

    def add_padding(self, nbytes: int) -> None:
        """Count bytes a collective sent beyond its payload (backend xla)."""
        self._padding += int(nbytes)

    def add_rounds(self, rounds: int, *, replayed: bool, idle_s: float = 0.0) -> None:
        """Count ``rounds`` the engine ran (``replayed``: from a schedule an earlier call prepared), of whose phase
        time ``idle_s`` seconds were spent waiting on peers."""
        self._rounds += int(rounds)
        self._replayed += int(rounds) if replayed else 0
        self._idle += float(idle_s)

    def staging(self, delta: int) -> None:
        """Staging memory grew (``delta > 0``) or shrank; the peak is kept."""
        self._staging += int(delta)
        self._peak = max(self._peak, self._staging)

    def build(self) -> TransferReport:
        """The frozen report; ``total_s`` runs from construction to this call."""
        s = self._seconds
        return TransferReport(
            backend=self._backend,
            backend_reason=self._reason,
            network_bytes=self._bytes[Link.NETWORK],
            fast_bytes=self._bytes[Link.FAST],
            same_device_bytes=self._bytes[Link.SAME_DEVICE],
            plan_s=s[ReportPhase.PLAN],
            pack_s=s[ReportPhase.PACK],
            network_s=s[ReportPhase.NETWORK],
            fanout_s=s[ReportPhase.FANOUT],
            unpack_s=s[ReportPhase.UNPACK],
            copy_s=s[ReportPhase.COPY],
            buffers_s=s[ReportPhase.BUFFERS],
            compile_s=s[ReportPhase.COMPILE],
            total_s=max(self._clock() - self._start, 0.0),
            peak_staging_bytes=self._peak,
            messages=self._messages,
            fresh_bytes=self._fresh,
            not_in_place_bytes=self._unowned,
            not_in_place=tuple(sorted(self._why, key=lambda w: w[0])),
            padding_bytes=self._padding,
            rounds=self._rounds,
            replayed_rounds=self._replayed,
            idle_s=self._idle,
        )
