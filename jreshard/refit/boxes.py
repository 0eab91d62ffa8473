"""Verified boxes between programs: which digest a refit uses, and the check of the streams' digests.

The digests themselves are :mod:`jreshard.engine.digest` (every message crossing processes, on both
sides). This module decides, for a group or an elastic pair, which digest to use and compares what the
two sides report:

- where the weights cross NIXL between programs that share a secret (``RefitGroup`` over NIXL, elastic
  refits), always **keyed MACs**: AES-256-GMAC tags under a key derived from the session of the two
  processes at the ends of the stream and the refit's nonce (drawn by the source side and sent inside the
  sealed channel), each message under its own GCM nonce, its label;
- over MPI, trusted as MPI is, only with ``Options(verify=True)``: keyed MACs between two launches (they
  share a secret), **plain XXH3-128 hashes** in one MPI universe;
- otherwise nothing is digested and a refit costs nothing more.

A mismatch is :class:`~jreshard.errors.IntegrityError` naming each stream's ranks, their processes and
the destination boxes it fills; the version is not published anywhere.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jreshard.engine.digest import Digester, Digests, mismatches, plain
from jreshard.errors import IntegrityError, PeerError
from jreshard.options import Options
from jreshard.sharding.box import intersect
from jreshard.sharding.layout import Layout

__all__ = ["DIGEST_CHUNK", "boxes_at", "check", "digested", "digests_for", "keyed", "mode", "new_nonce", "streams_of"]

_MAC_LABEL = b"jreshard box mac "


DIGEST_CHUNK = 2 << 20
"""The largest message of a refit whose messages are digested: each is digested right after its last pack or
unpack (:attr:`jreshard.engine.comm.PreparedGroups.by_message`), where a message of this size is still in the
core's cache (2 MiB of second-level cache a core on the machines measured); the digests of 8 MiB messages read
them back from memory, at a third to a half of their speed. Of 1, 2 and 4 MiB, 2 MiB gave the fastest refits with
the box MACs over NIXL on the development machine (``benchmarks/nixl_bench.py``: 36-40 ms a 63 MB refit, against
46-49 ms at 1 MiB, where NIXL's own cost a message weighs more, and 43 ms at 4 MiB)."""


def digested(options: Options) -> Options:
    """``options`` as a refit whose messages are digested schedules them: chunks of at most :data:`DIGEST_CHUNK`.

    >>> digested(Options()).chunk_bytes == DIGEST_CHUNK, digested(Options(chunk_bytes=4096)).chunk_bytes
    (True, 4096)
    """
    if options.chunk_bytes <= DIGEST_CHUNK:
        return options
    return dataclasses.replace(options, chunk_bytes=DIGEST_CHUNK)


def mode(options: Options, sessions: Sequence[Any] | None, *, always: bool = False) -> str | None:
    """Which digest a refit uses: ``"mac"``, ``"hash"`` or ``None`` (nothing digested).

    Args:
      options: ``options.verify`` asks for digests.
      sessions: each peer connection's session (``None``: the group has no connections of its own).
      always: the weights cross a transport jreshard connects itself (NIXL): MACs whenever every connection
        has a session, asked or not. Otherwise (MPI, trusted like MPI) only ``verify`` digests: MACs where
        there are sessions (two launches), plain hashes where there are none (one MPI universe).
    """
    keyed = bool(sessions) and all(s is not None for s in sessions or ())
    if keyed and (always or options.verify):
        return "mac"
    return "hash" if options.verify else None


def new_nonce() -> str:
    """A refit's nonce (hex): the MAC key of its messages derives from it, so no refit's key is used twice."""
    return secrets.token_hex(16)


def keyed(session: Any, nonce: str) -> Callable[[bytes, Any], bytes]:
    """The keyed MAC of one connection's messages in one refit: ``mac(label, bytes)``, an AES-GMAC tag under the
    key ``session`` derives for the refit's ``nonce`` (hex, drawn fresh for each refit), each message under its
    ``label`` (:meth:`jreshard.net.auth.Session.box_macs`).

    Raises:
      PeerError: ``nonce`` is not 16 bytes of hex (a malformed vote or message).
    """
    try:
        raw = bytes.fromhex(nonce)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != 16:
        raise PeerError(f"the refit's nonce for the box MACs is malformed ({nonce!r:.80})")
    return session.box_macs(_MAC_LABEL + raw)  # type: ignore[no-any-return]


def digests_for(
    kind: str, local: Sequence[int], mac_of: Callable[[int], Callable[[bytes, Any], bytes]] | None = None
) -> Digests:
    """A refit's :class:`Digests` on one process: keyed MACs (``kind="mac"``: ``mac_of(peer rank)`` is the
    :func:`keyed` MAC shared with that rank's process) or plain hashes (``kind="hash"``).

    Raises:
      ValueError: ``kind`` is neither, or ``"mac"`` without ``mac_of``.
      BackendUnavailableError: ``"hash"`` without ``xxhash``.
    """
    if kind == "hash":
        return Digests(local, plain(), "hash")
    if kind != "mac" or mac_of is None:
        raise ValueError(f"digests_for: kind={kind!r}; expected 'hash', or 'mac' with mac_of")
    cache: dict[int, Callable[[bytes, Any], bytes]] = {}

    def digest(peer: int, label: bytes, data: Any) -> bytes:
        mac = cache.get(peer)
        if mac is None:
            mac = cache[peer] = mac_of(peer)
        return mac(label, data)

    d: Digester = digest
    return Digests(local, d, "mac")


def boxes_at(src: int, dst: int, names: Sequence[str], layouts: Sequence[tuple[Layout | None, Layout]]) -> str:
    """The destination boxes at rank ``dst`` that rank ``src`` may fill, as text: per tensor ``name`` its
    ``(source layout, destination layout)`` (a source layout ``None``: views, every box at ``dst``); a
    source rank that holds none of a tensor may still forward it as a destination (a relay)."""
    out = []
    for name, (s, d) in zip(names, layouts, strict=True):
        if dst not in d.ranks:
            continue
        box = d.box_of(dst)
        if s is None:  # views: any source may fill any box
            out.append(f"{name} {box}")
            continue
        other = s if src in s.ranks else d if src in d.ranks else None
        if other is not None and intersect(box, other.box_of(src)) is not None:
            out.append(f"{name} {box}")
    if not out:
        return "(none)"
    return ", ".join(out[:6]) + (f" ... ({len(out)} in all)" if len(out) > 6 else "")


def streams_of(vote: Mapping[str, Any], who: str) -> tuple[dict[str, str], dict[str, str]]:
    """The ``(sent, landed)`` stream digests in a peer's vote (``{}`` when it digested nothing).

    Raises:
      PeerError: the vote's digests are malformed (naming ``who``).
    """
    d = vote.get("digests")
    if d is None:
        return {}, {}
    try:
        sent, landed = d["sent"], d["landed"]
        ok = all(isinstance(k, str) and isinstance(v, str) for m in (sent, landed) for k, v in m.items())
    except (TypeError, KeyError, AttributeError):
        ok = False
    if not ok:
        raise PeerError(f"{who} sent malformed box digests: {d!r:.200}")
    return dict(sent), dict(landed)


def check(
    sent: Mapping[str, str],
    landed: Mapping[str, str],
    *,
    describe: Callable[[int], str],
    boxes: Callable[[int, int], str],
    kind: str,
) -> None:
    """Compare every stream's two digests (gathered from every process); raise on any difference.

    Args:
      sent, landed: ``{stream: digest}`` from every sender and every receiver.
      describe: a rank, named with its process (``"rank 2 (process 1 (destination))"``).
      boxes: the destination boxes a stream ``(src, dst)`` fills, as text.
      kind: ``"mac"`` or ``"hash"`` (named in the message).

    Raises:
      IntegrityError: some stream differs, or was digested on one side only.
    """
    bad = mismatches(sent, landed)
    if not bad:
        return
    what = "keyed MACs (AES-GMAC)" if kind == "mac" else "hashes (XXH3-128, Options(verify=True))"
    lines = []
    for src, dst, why in bad[:8]:
        state = {"differ": "differ", "not received": "were sent but not received", "not sent": "were not sent"}[why]
        lines.append(
            f"the bytes {describe(dst)} received from {describe(src)} {state} from what it sent; boxes: "
            f"{boxes(src, dst)}"
        )
    if len(bad) > 8:
        lines.append(f"... {len(bad) - 8} more streams")
    raise IntegrityError(
        f"refit refused: the {what} of {len(bad)} stream(s) do not match (altered or corrupted on the way); "
        "the version is not published and every destination keeps its previous version:\n  " + "\n  ".join(lines),
        streams=tuple((s, d) for s, d, _ in bad),
    )
