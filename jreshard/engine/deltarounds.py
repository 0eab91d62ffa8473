"""Delta rounds: the round loop of a refit where each chunk travels as what changed since the base its
receiver holds.

The rounds are the compiled rounds of the refit (:func:`jreshard.engine.rounds.compile_rounds`, the same
packs, exchange groups and unpacks as a full refit): per round, the packs fill the staging arenas, then for
each exchange group every send row's chunk (its wire bytes, after a view's cast) is encoded against the
copy of the same chunk this process kept when it last sent it (:mod:`jreshard.engine.delta`), the encodings
cross, and every receive row's chunk is rebuilt from the copy its receiver kept, written where the full
chunk would have landed (staging or the destination shard), and the unpacks run as always. A chunk is named
by its row's ``(sender rank, receiver rank, tag)``, the same from one refit of a schedule to the next.

**The wire.** An encoding is a 16-byte header (kind, whether the receiver keeps the chunk, the comparison
unit, the base version it was encoded against) and its body, so its length varies, but never past the
header and the chunk itself (the encoder's contract: a body is never longer than its chunk). Each group is
one :meth:`~jreshard.engine.comm.Communicator.exchange_sized`: every receive is posted at that bound, the
sender sends the encoding alone, and its length travels with it (NIXL: in the WRITE's notification; MPI:
the receive's status), checked against the bound by the transport before a byte is read and again here.
A transport that cannot carry a length sends the lengths first (8 bytes each), then the encodings: one
more message latency per group. Nothing is sized from a guess.

**What is kept** (:class:`DeltaBases`): per process, a copy of every chunk it sent and every chunk it
received, at the version the group last committed, at most ``limit`` bytes of sent chunks (a sender keeps
the chunks that fit in the order it sends them and tells the receiver whether to keep each). A refit's new
copies are held aside and replace the kept ones only when the whole group committed
(:meth:`DeltaBases.commit`); a refit that failed leaves every process on the bases it had
(:meth:`DeltaBases.abort`). A chunk is encoded against a base only when the receiver's process reported
that it holds the same version (the ``peer_base`` of :class:`DeltaRefit`); otherwise it goes whole. A
receiver checks every header against what it holds (version, kept copy, sizes) and raises
:class:`~jreshard.errors.TransferError` rather than build a chunk on a base the sender did not mean.
"""

from __future__ import annotations

import dataclasses
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jreshard.engine import delta as codec
from jreshard.engine.buffers import aligned_empty
from jreshard.engine.comm import Communicator, RecvOp, Row, SendOp
from jreshard.errors import TransferError

__all__ = ["HEADER", "DeltaBases", "DeltaRefit", "DeltaStats", "run_delta_rounds"]

HEADER = 16
_HEAD = struct.Struct("<BBHIq")  # kind, keep, unit, reserved, base version (-1: none)
_LEN = 8  # the bytes of one length message

ChunkKey = tuple[int, int, int]


@dataclasses.dataclass(frozen=True, slots=True)
class _Patch:
    """A kept copy's next version, made at :meth:`DeltaBases.commit`: ``base`` (the kept copy a chunk was encoded
    against, or rebuilt from) with the body its bases hold at ``[at, at + size)`` applied in place."""

    base: np.ndarray
    kind: int
    at: int
    size: int
    unit: int

    @property
    def nbytes(self) -> int:
        return int(self.base.nbytes)


Kept = np.ndarray | _Patch
"""A refit's copy of a chunk until commit: the chunk itself, or the patch that makes it from the kept one."""


class DeltaBases:
    """What one process keeps to encode against and to apply onto (final).

    Args:
      limit: the most bytes of sent chunks kept (received chunks are kept as their senders say).

    Attributes:
      version: the version every kept chunk holds (``None``: none kept yet, or cleared).
    """

    def __init__(self, limit: int):
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"DeltaBases: limit={limit!r} must be an int >= 0")
        self.limit = limit
        self.version: int | None = None
        self.sent: dict[ChunkKey, np.ndarray] = {}
        self.recv: dict[ChunkKey, np.ndarray] = {}
        self._pending: tuple[dict[ChunkKey, Kept], dict[ChunkKey, Kept]] | None = None
        self._scratch: dict[str, np.ndarray] = {}
        self._spare: dict[tuple[str, ChunkKey], np.ndarray] = {}  # the copies the last commit replaced, reused
        self._bodies = np.empty(0, np.uint8)  # the bodies of this refit's patches, one after the other
        self._used = 0

    @property
    def kept_bytes(self) -> int:
        """Bytes held now: the kept chunks, sent and received."""
        return sum(a.nbytes for a in self.sent.values()) + sum(a.nbytes for a in self.recv.values())

    def begin(self) -> tuple[dict[ChunkKey, Kept], dict[ChunkKey, Kept]]:
        """Fresh places for this refit's copies (sent, received), held aside until :meth:`commit`."""
        self._pending = ({}, {})
        self._used = 0
        return self._pending

    def commit(self, version: int) -> None:
        """The group committed ``version``: its copies become the kept ones (chunks not kept this time go). A
        chunk that went as a delta is kept by applying its body to the copy it was encoded against, in place:
        a few changed units written, where a copy would write the whole chunk."""
        if self._pending is None:
            raise ValueError("DeltaBases.commit: no refit began")
        spare = {("sent", k): a for k, a in self.sent.items()} | {("recv", k): a for k, a in self.recv.items()}
        kept: list[dict[ChunkKey, np.ndarray]] = []
        for side, pending in zip(("sent", "recv"), self._pending, strict=True):
            now: dict[ChunkKey, np.ndarray] = {}
            for key, entry in pending.items():
                if isinstance(entry, _Patch):
                    # the body was made against this copy by this process's encoder, or already applied once
                    # to rebuild the chunk: it cannot be malformed for it
                    codec.apply(self._bodies[entry.at : entry.at + entry.size], entry.kind, entry.base, entry.unit)
                    if spare.get((side, key)) is entry.base:
                        del spare[(side, key)]
                    now[key] = entry.base
                else:
                    now[key] = entry
            kept.append(now)
        self.sent, self.recv = kept
        self._spare = spare
        self._pending = None
        self._used = 0
        self.version = int(version)

    def abort(self) -> None:
        """The refit failed: drop its copies; the kept ones and their version stay."""
        self._pending = None

    def clear(self) -> None:
        """Forget every base (the next refit is full)."""
        self.sent, self.recv, self._pending, self.version, self._spare = {}, {}, None, None, {}

    def patch(self, base: np.ndarray, kind: int, body: np.ndarray, unit: int) -> _Patch:
        """This refit's copy of a chunk encoded against (or rebuilt from) the kept copy ``base`` as ``body`` of
        ``kind``: the body is held (in memory reused from refit to refit) and applied to ``base`` at
        :meth:`commit`, so nothing reads or writes the whole chunk."""
        n = len(body)
        if self._used + n > len(self._bodies):
            grown = aligned_empty(max(2 * len(self._bodies), self._used + n, 4096))
            grown[: self._used] = self._bodies[: self._used]
            self._bodies = grown
        self._bodies[self._used : self._used + n] = body
        self._used += n
        return _Patch(base=base, kind=kind, at=self._used - n, size=n, unit=unit)

    def copy_of(self, side: str, key: ChunkKey, data: np.ndarray) -> np.ndarray:
        """A copy of ``data`` for this refit's ``side`` (``"sent"`` / ``"recv"``) copies, in the memory of the copy
        the last commit replaced where there is one (no allocation, no page faults from one refit to the next).
        A kept copy is written only at :meth:`commit` (a patch), when it becomes the new version; the replaced
        ones are reused, which nothing reads any more."""
        spare = self._spare.pop((side, key), None)
        if spare is None or spare.shape != data.shape:
            return data.copy()
        spare[...] = data
        return spare

    def scratch(self, name: str, nbytes: int) -> np.ndarray:
        """A reusable buffer of at least ``nbytes`` (the same memory from refit to refit, so a transport that
        registers memory registers it once)."""
        buf = self._scratch.get(name)
        if buf is None or len(buf) < nbytes:
            buf = self._scratch[name] = aligned_empty(max(nbytes, 64))
        return buf


@dataclasses.dataclass(slots=True, kw_only=True)
class DeltaStats:
    """What a delta refit did on this process (summed over its chunks).

    Attributes:
      full_bytes: the wire bytes of the chunks it sent, as a full refit sends them.
      sent_bytes: the bytes it sent instead: headers, bodies, and 8 bytes per chunk for its length.
      units, changed_units: the comparison units of the chunks it sent, and how many changed.
      chunks, delta_chunks: chunks sent, and how many of them went as a delta (not whole).
      encode_s, apply_s: seconds encoding the chunks it sent, rebuilding the chunks it received.
      wire_s: seconds exchanging the encodings, waits on peers included.
      recv_bytes: the bytes it received (headers and bodies).
    """

    full_bytes: int = 0
    sent_bytes: int = 0
    recv_bytes: int = 0
    units: int = 0
    changed_units: int = 0
    chunks: int = 0
    delta_chunks: int = 0
    encode_s: float = 0.0
    apply_s: float = 0.0
    wire_s: float = 0.0

    @property
    def changed_fraction(self) -> float:
        """Changed units over all units of the chunks sent (0.0 when none were sent)."""
        return self.changed_units / self.units if self.units else 0.0


@dataclasses.dataclass(slots=True, kw_only=True)
class DeltaRefit:
    """One refit's delta settings (made by the group for each refit).

    Attributes:
      bases: this process's :class:`DeltaBases`.
      peer_base: the base version the process of a receiving rank holds (``None``: none; its chunks go whole).
      unit: the comparison unit in bytes (the wire dtype's itemsize: 1, 2, 4 or 8).
      stats: filled by the refit.
    """

    bases: DeltaBases
    peer_base: Callable[[int], int | None]
    unit: int = 2
    stats: DeltaStats = dataclasses.field(default_factory=DeltaStats)


def run_delta_rounds(
    rounds: Sequence[tuple[tuple, tuple, tuple, bool]],
    comm: Communicator,
    buffers: Any,
    bufs: Mapping[int, list[Any]],
    bases: Sequence[Any],
    timeout_s: float,
    refit: DeltaRefit,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float, float, float]:
    """Run compiled ``rounds`` with every chunk sent as a delta: ``(pack, network, fan-out, unpack)`` seconds.

    Args:
      rounds: :attr:`CompiledRounds.rounds`.
      comm: the transport.
      buffers: the engine's buffer operations (CPU buffers: the chunks are read and written on the host).
      bufs: per local rank, its shard buffers as the tables index them.
      bases: every buffer a row can name (shard buffers and staging arenas), 1-D uint8.
      timeout_s: the bound of every exchange.
      refit: the bases, the receivers' versions and the statistics.

    Raises:
      TransferError: a received header does not match the base this process holds, or is malformed.
    """
    sent_keep, recv_keep = refit.bases.begin()
    pack_s = network_s = fanout_s = unpack_s = 0.0
    for packs, groups, unpacks, network in rounds:
        t0 = clock()
        for table, r, arena in packs:
            buffers.pack(table, bufs[r], bases[arena])
        t1 = clock()
        for sends, recvs in groups:
            _exchange(comm, sends, recvs, bases, timeout_s, refit, sent_keep, recv_keep, clock)
        t2 = clock()
        for table, r, arena in unpacks:
            buffers.unpack(table, bases[arena], bufs[r])
        t3 = clock()
        pack_s += t1 - t0
        if network:
            network_s += t2 - t1
        else:
            fanout_s += t2 - t1
        unpack_s += t3 - t2
    return pack_s, network_s, fanout_s, unpack_s


def _exchange(
    comm: Communicator,
    sends: Sequence[Row],
    recvs: Sequence[Row],
    bases: Sequence[Any],
    timeout_s: float,
    refit: DeltaRefit,
    sent_keep: dict[ChunkKey, Kept],
    recv_keep: dict[ChunkKey, Kept],
    clock: Callable[[], float],
) -> None:
    """One exchange group: encode every send, exchange the encodings (:meth:`Communicator.exchange_sized`),
    rebuild every receive."""
    st, held, unit = refit.stats, refit.bases, refit.unit
    out = held.scratch("send", sum(HEADER + row[5] for row in sends))
    spans: list[tuple[int, int]] = []
    t0 = clock()
    at = 0
    kept_now = sum(a.nbytes for a in sent_keep.values())
    for src, dst, tag, b, off, n in sends:
        key = (src, dst, tag)
        image = bases[b][off : off + n]
        base = held.sent.get(key)
        version = refit.peer_base(dst)
        usable = base is not None and len(base) == n and version is not None and version == held.version
        keep = key in held.sent or kept_now + n <= held.limit
        body = out[at + HEADER : at + HEADER + n]
        if usable and base is not None:
            kind, size, changed = codec.encode(image, base, body, unit)
            st.delta_chunks += 1
        else:
            kind, size, changed = codec.KIND_FULL, n, -(-n // unit)
            body[:] = image
        _HEAD.pack_into(out.data, at, kind, 1 if keep else 0, unit, 0, version if usable else -1)
        if keep:
            if usable and base is not None and kind != codec.KIND_FULL:  # base + body: patched at commit
                sent_keep[key] = held.patch(base, kind, body[:size], unit)
            else:
                sent_keep[key] = held.copy_of("sent", key, image)
            kept_now += n
        spans.append((at, HEADER + size))
        at += HEADER + n
        st.full_bytes += n
        st.sent_bytes += HEADER + size + _LEN
        st.units += -(-n // unit)
        st.changed_units += changed
        st.chunks += 1
    t1 = clock()
    st.encode_s += t1 - t0
    # Each receive's buffer holds the largest encoding its chunk can have (the header and the chunk itself):
    # a bound from the encoder's contract, so the sender sends only the encoding, in one group.
    bounds = [HEADER + row[5] for row in recvs]
    inbox = held.scratch("recv", sum(bounds) + 8)
    offsets = np.concatenate([[0], np.cumsum(bounds, dtype=np.int64)]).tolist()
    sizes = comm.exchange_sized(
        [SendOp(s, d, t, out[a : a + m]) for (s, d, t, *_), (a, m) in zip(sends, spans, strict=True)],
        [RecvOp(s, d, t, inbox[offsets[i] : offsets[i + 1]]) for i, (s, d, t, *_) in enumerate(recvs)],
        timeout_s=timeout_s,
    )
    for (s, d, t, _, _, n), size in zip(recvs, sizes, strict=True):  # the transport bounds it; checked again
        if not HEADER <= size <= HEADER + n:
            raise TransferError(
                f"delta refit: rank {s} sent rank {d} a chunk of {size} bytes (tag {t}); a chunk of {n} bytes "
                f"encodes in {HEADER} to {HEADER + n}",
                destination_intact=True,
            )
    t2 = clock()
    st.wire_s += t2 - t1
    for i, (s, d, t, b, off, n) in enumerate(recvs):
        payload = inbox[offsets[i] : offsets[i] + sizes[i]]
        st.recv_bytes += len(payload) + _LEN
        kind, keep, unit_in, _, version = _HEAD.unpack_from(payload.data, 0)
        key = (s, d, t)
        target = bases[b][off : off + n]
        if kind != codec.KIND_FULL:
            base = held.recv.get(key)
            if version < 0 or version != held.version or base is None or len(base) != n:
                have = "no copy of it" if base is None else f"version {held.version} ({len(base)} bytes)"
                raise TransferError(
                    f"delta refit: rank {s} sent rank {d} a chunk (tag {t}, {n} bytes) encoded against version "
                    f"{version}, and this process holds {have}",
                    destination_intact=True,
                )
            target[:] = base
        try:
            codec.apply(payload[HEADER:], kind, target, unit_in)
        except ValueError as err:
            raise TransferError(
                f"delta refit: rank {s} sent rank {d} a malformed chunk (tag {t}): {err}", destination_intact=True
            ) from None
        if keep:
            if kind == codec.KIND_FULL:
                recv_keep[key] = held.copy_of("recv", key, target)
            else:  # rebuilt from the kept copy: the same body makes the kept copy this version at commit
                assert base is not None
                recv_keep[key] = held.patch(base, kind, payload[HEADER:], unit_in)
    st.apply_s += clock() - t2
