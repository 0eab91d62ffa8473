"""Authenticated, bounded control connections between jreshard programs over TCP (no jax, no MPI).

A :class:`Channel` carries small JSON objects (a hello, a declaration, a vote, a version, the
descriptors of the NIXL transport) between two processes on any hosts. Weights never travel on it:
they move over a transfer engine (:mod:`jreshard.nixl`).

- **Authenticated.** Before anything else, both ends prove they hold the shared secret
  (:mod:`jreshard.net.auth`). The client side does it in :func:`connect`; the server side in
  :meth:`Channel.pump`, without blocking, so a server thread that owns many connections keeps
  serving while a slow, silent or hostile client is refused.
- **Sealed.** Every frame after the handshake is encrypted and authenticated with the session's
  ChaCha20-Poly1305 keys (:class:`jreshard.net.auth.Session`, derived from the handshake), its sequence
  number in its direction as the nonce: someone on the path reads nothing, and a frame that was
  altered, replayed, reordered, dropped or injected is refused (:class:`AuthenticationError`) and
  ends the connection.
- **Bounded.** Every frame is ``kind (1 byte), nbytes (8 bytes)`` then ``nbytes`` of sealed UTF-8
  JSON, and a header claiming more than ``max_frame_bytes`` is refused before anything is allocated
  for it; before authentication only the fixed-size handshake is read.
- **Admission.** A server end must finish the handshake within ``handshake_s`` (default
  :data:`HANDSHAKE_S`, apart from the transfer's ``timeout_s``), and a listener keeps at most
  :data:`MAX_UNAUTHENTICATED_PER_HOST` connections per source address (and
  :data:`MAX_UNAUTHENTICATED` in all) still authenticating: a new one displaces the oldest
  (:func:`make_room`), which is told why. Silent connections cannot hold a legitimate peer out.
- **Deadlines.** Sockets are non-blocking; every wait is a ``select`` with a deadline, so a silent
  peer becomes :class:`TransferTimeoutError`, and one that closed or died (the kernel closes a
  killed process's sockets) :class:`PeerError` at once.

Addresses are ``"HOST:PORT"`` (``"[v6]:PORT"``) on any interface, or a file that holds one.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import numbers
import os
import select
import socket
import struct
import time
from typing import Any, NoReturn, TypeVar

from jreshard.errors import AuthenticationError, JReshardError, PeerError, TransferTimeoutError
from jreshard.net import auth

__all__ = [
    "HANDSHAKE_S",
    "INT64",
    "MAX_FRAME_BYTES",
    "MAX_PEER_PROCESSES",
    "MAX_UNAUTHENTICATED",
    "MAX_UNAUTHENTICATED_PER_HOST",
    "TRANSPORT_OPS",
    "Channel",
    "accept_first",
    "accept_one",
    "connect",
    "format_address",
    "listen",
    "make_room",
    "parse_address",
    "peer_int",
]

log = logging.getLogger("jreshard.net.channel")

_HEADER = struct.Struct("!BQ")  # kind, nbytes
_CONTROL = 1  # a plain frame: only on a channel built without a session (a socketpair in one process)
_SEALED = 2  # a frame sealed with the session's keys: every connection between programs
# recv allocates its whole limit before it reads: at 1 MiB a read costs ~65 us with a message and
# ~14 us without one (measured), at 64 KiB ~4 us and ~2 us; a large frame takes more reads.
_READ = 1 << 16
MAX_FRAME_BYTES = 64 << 20  # a declaration of tens of thousands of leaves fits; 2^60 does not
TRANSPORT_OPS = "nixl."  # the ops of the data transport's messages on a shared connection
HANDSHAKE_S = 10.0  # the longest a server end waits for a connection to authenticate (a peer answers in ms)
MAX_UNAUTHENTICATED_PER_HOST = 32  # connections from one address still authenticating, per listener
MAX_UNAUTHENTICATED = 256  # connections still authenticating, per listener
_ACCEPTS_PER_TURN = 64
# What a server end sends, in place of its proof, to a connection it drops before the handshake ended:
# a fixed size, so the client reads it where the proof would be and names the true reason.
_DROPPED = {
    b"JRSH:CROWDED".ljust(auth.PROOF_BYTES, b"\0"): "too many connections from its address (or in all) were still "
    "authenticating, and this one was the oldest: something is flooding the listener",
    b"JRSH:TOO-SLOW".ljust(auth.PROOF_BYTES, b"\0"): "it did not answer the challenge within the handshake deadline",
}


def parse_address(address: str, *, timeout_s: float) -> tuple[str, int]:
    """``"HOST:PORT"`` (or ``"[v6]:PORT"``), or the path of a file holding it (waited for up to ``timeout_s``).

    Example:
      >>> parse_address("10.0.0.2:5000", timeout_s=1.0), parse_address("[::1]:7", timeout_s=1.0)
      (('10.0.0.2', 5000), ('::1', 7))
    """
    if not isinstance(address, str):
        raise TypeError(f"address={address!r} must be a str: 'HOST:PORT' or a file path holding it")
    text = address
    if _split(text) is None or os.path.sep in text:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(address):
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"address file {address!r} did not appear within {timeout_s:.3g} s")
            time.sleep(0.02)
        with open(address) as f:
            text = f.read().strip()
    parsed = _split(text)
    if parsed is None:
        raise ValueError(f"address={text!r} must be 'HOST:PORT' (or '[IPv6]:PORT')")
    return parsed


def _split(text: str) -> tuple[str, int] | None:
    host, sep, port = text.rpartition(":")
    if not (sep and host and port.isdigit() and int(port) <= 65535):
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def format_address(host: str, port: int) -> str:
    """``"HOST:PORT"``, with brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A non-blocking listening socket bound to ``host:port`` (``port`` 0: any free port).

    ``host`` is any address of this host: ``"0.0.0.0"`` every IPv4 interface, ``"::"`` every IPv6 one.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as err:
        s.close()
        raise ValueError(f"listen: cannot bind {format_address(host, port)} ({err})") from err
    s.listen(128)
    s.setblocking(False)
    return s


def connect(
    address: tuple[str, int], peer: str, *, key: bytes, timeout_s: float, retry: bool = True, **kw: int
) -> Channel:
    """Connect to ``address`` and authenticate both ways (the client side of :mod:`jreshard.net.auth`).

    Args:
      address: ``(host, port)``.
      peer: names the peer in errors (``"the trainer"``).
      key: the shared secret.
      timeout_s: the deadline for connecting and authenticating.
      retry: keep trying a refused connection until ``timeout_s`` (the listener may not be up
        yet); without, a refused connection (nobody listens: the peer is gone) raises at once.
      kw: ``max_frame_bytes`` for the channel.

    Raises:
      AuthenticationError: the peer refused this side's proof, or did not prove it holds the key.
      PeerError: without ``retry``, nobody listens at ``address``.
      TransferTimeoutError: no connection or no answer within ``timeout_s``.
    """
    host, port = address
    where = format_address(host, port)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection(address, timeout=max(0.05, deadline - time.monotonic()))
            break
        except OSError as err:
            if not retry and isinstance(err, ConnectionRefusedError):
                raise PeerError(f"{peer} refused the connection at {where}: it is gone") from err
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"could not connect to {peer} at {where} within {timeout_s:.3g} s: {err}"
                ) from err
            time.sleep(0.05)
    try:
        hello = _read_exact(
            sock, auth.CHALLENGE_BYTES, deadline, peer, where, "before its challenge: it is not a jreshard peer"
        )
        reply = auth.answer(key, hello)
        if reply is None:
            raise AuthenticationError(f"{peer} at {where} did not open with a jreshard challenge: not a jreshard peer")
        message, nonce = reply
        sock.sendall(message)
        server_proof = _read_exact(
            sock,
            auth.PROOF_BYTES,
            deadline,
            peer,
            where,
            "after this side's answer: the two sides hold different secrets (or it is not a jreshard peer)",
        )
        dropped = _DROPPED.get(server_proof)
        if dropped is not None:
            raise AuthenticationError(f"{peer} at {where} dropped this connection before authenticating it: {dropped}")
        if not auth.check_proof(key, nonce, hello[len(auth.MAGIC) :], server_proof):
            raise AuthenticationError(
                f"{peer} at {where} did not prove it holds the shared secret: refused (a process posing as a peer?)"
            )
    except BaseException:
        sock.close()
        raise
    return Channel(sock, peer, session=auth.Session(key, hello[len(auth.MAGIC) :], nonce, client=True), **kw)


def accept_first(
    listener: socket.socket, pending: list[Channel], *, key: bytes, who: str, wait_s: float
) -> list[tuple[Channel, dict]]:
    """One turn of a listening loop: wait up to ``wait_s`` for activity, accept the connections that
    wait (each the server end of a handshake, as ``who``, admitted by :func:`make_room` with its
    handshake deadline), and read every channel of ``pending``.

    Returns the channels whose first message arrived, each with that message, removed from
    ``pending``. A channel that failed the handshake or sent garbage (logged and closed by
    :meth:`Channel.pump`), or that closed before saying anything, is dropped from ``pending`` and
    closed; the others stay in it.
    """
    waitables: list[Any] = [listener, *pending]
    select.select(waitables, [], [], wait_s)
    for _ in range(_ACCEPTS_PER_TURN):
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            break
        except OSError as err:  # e.g. out of file descriptors: the next turn tries again
            log.debug("accept: %s", err)
            break
        ch = Channel.server(sock, who, key=key)
        victim = make_room(pending, ch)
        if victim is not None:
            pending.remove(victim)
        pending.append(ch)
    ready = []
    for c in list(pending):
        try:
            c.pump()
        except JReshardError:
            pending.remove(c)
            c.close()
            continue
        msg = c.pop()
        if msg is None:
            if c.eof:
                pending.remove(c)
                c.close()
            continue
        pending.remove(c)
        ready.append((c, msg))
    return ready


MAX_PEER_PROCESSES = 1 << 16
"""The most processes a peer may say one side of a group (a role of a rendezvous, a replica) has."""

INT64 = (-(2**63), 2**63 - 1)
"""The range of a peer's int field that goes on into NumPy or a wire format (``peer_int(v, *INT64)``)."""


def peer_int(value: Any, lo: int | None = None, hi: int | None = None) -> bool:
    """Whether a field of a peer's message is an int (JSON's ``true`` is not one; a NumPy int, as MPI's pickle
    keeps a caller's, is), in ``lo..hi`` where given.

    Example:
      >>> import numpy as np
      >>> peer_int(3, 0, 3), peer_int(True), peer_int(4, 0, 3), peer_int("3"), peer_int(-1, lo=0)
      (True, False, False, False, False)
      >>> peer_int(np.int64(3), *INT64), peer_int(2**64, *INT64), peer_int(3.0)
      (True, False, False)
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return False
    return (lo is None or int(value) >= lo) and (hi is None or int(value) <= hi)


def accept_one(listener: socket.socket, peer: str, *, key: bytes, timeout_s: float) -> Channel:
    """The next connection to ``listener``, as the server end of a handshake with ``peer``, once it proved the key
    (for a program that expects exactly one peer, e.g. a benchmark's or a test's second process).

    Raises:
      TransferTimeoutError: nobody connected, or the handshake did not finish, within ``timeout_s``.
      AuthenticationError: the peer does not hold the key (the channel logged why and closed).
    """
    deadline = time.monotonic() + timeout_s
    if not select.select([listener], [], [], max(0.0, timeout_s))[0]:
        raise TransferTimeoutError(f"nobody connected to {peer!r}'s listener within {timeout_s} s")
    sock, _ = listener.accept()
    ch = Channel.server(sock, peer, key=key)
    while not ch.authenticated:
        left = deadline - time.monotonic()
        if left <= 0 or ch.eof:
            ch.close()
            raise TransferTimeoutError(f"{peer} connected but did not finish the handshake within {timeout_s} s")
        select.select([ch], [], [], min(left, 0.05))
        ch.pump()
    return ch


_Pending = TypeVar("_Pending", "Channel", "tuple[Channel, float]")  # a pending connection, with its deadline or not


def make_room(pending: list[_Pending], new: Channel) -> _Pending | None:
    """Admit ``new`` (a server end still authenticating) among ``pending``: the connection dropped to
    make room for it, if any (already told why and closed; the caller removes it from its list).

    At most :data:`MAX_UNAUTHENTICATED_PER_HOST` unauthenticated connections from one address, and
    :data:`MAX_UNAUTHENTICATED` in all: past either, the answers that already came are read first,
    then the oldest connection still unauthenticated from ``new``'s address (past the total: from the
    address with the most) goes. A flood of silent connections thus only displaces itself; a peer that
    has answered its challenge is never displaced, and the newest connection is never the one refused.
    """
    chans = [p[0] if isinstance(p, tuple) else p for p in pending]
    waiting = [c for c in chans if not c.authenticated and not c.eof]
    same = [c for c in waiting if c.host == new.host]
    if len(same) >= MAX_UNAUTHENTICATED_PER_HOST or len(waiting) >= MAX_UNAUTHENTICATED:
        # read the answers that already came (connections accepted together, e.g. after a busy spell,
        # have not been read yet): only a connection that has not answered may be displaced
        for c in same if len(same) >= MAX_UNAUTHENTICATED_PER_HOST else waiting:
            try:
                c.pump()
            except JReshardError:  # refused and closed: the caller's loop drops it
                pass
        waiting = [c for c in chans if not c.authenticated and not c.eof]
        same = [c for c in waiting if c.host == new.host]
    if len(same) >= MAX_UNAUTHENTICATED_PER_HOST:
        victim = same[0]
    elif len(waiting) >= MAX_UNAUTHENTICATED:
        counts = collections.Counter(c.host for c in waiting)
        busiest = max(counts, key=lambda h: counts[h])
        victim = next(c for c in waiting if c.host == busiest)
    else:
        return None
    victim.drop(b"JRSH:CROWDED")
    return next(p for p in pending if (p[0] if isinstance(p, tuple) else p) is victim)


def _read_exact(sock: socket.socket, n: int, deadline: float, peer: str, where: str, closed: str) -> bytes:
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeoutError(f"{peer} at {where} did not complete authentication within the timeout")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(out))
        except TimeoutError:
            continue
        except OSError as err:
            chunk = b""
            log.debug("reading from %s: %s", where, err)
        if not chunk:
            raise AuthenticationError(f"{peer} at {where} closed the connection during authentication, {closed}")
        out += chunk
    return bytes(out)


def _not_json(name: str) -> NoReturn:
    """``json.loads``'s hook for ``NaN``, ``Infinity`` and ``-Infinity``, which Python writes and JSON has not:
    a peer's frame holding one is refused (a version or size of ``inf`` would fail far from where it came in)."""
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    """``json.loads``'s hook for a number with a fraction or an exponent: one out of a double's range (``1e400``,
    which Python reads as ``inf``) is refused."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


class Channel:
    """One authenticated connection to one peer process: JSON control frames (final).

    Args:
      sock: a connected TCP socket whose peer is authenticated (:func:`connect`, or
        :meth:`Channel.server` until its :attr:`authenticated`; a ``socketpair`` in tests).
      peer: names the peer in error messages (``"replica 'r1'"``).
      max_frame_bytes: the largest frame accepted; a header claiming more is refused.
      session: the keys that seal every frame (:func:`connect` and :meth:`Channel.server` derive them
        in the handshake); ``None``, plain frames: only for a ``socketpair`` inside one process.

    Example:
      >>> import socket
      >>> a, b = socket.socketpair()
      >>> x, y = Channel(a, "x"), Channel(b, "y")
      >>> x.send_control({"op": "hello"}, timeout_s=1.0)
      >>> y.recv_control(timeout_s=1.0)
      {'op': 'hello'}
      >>> x.close(); y.recv_control(timeout_s=1.0)
      Traceback (most recent call last):
      ...
      jreshard.errors.PeerError: y closed the connection (it left, or its process exited or was killed)
      >>> y.close()
    """

    def __init__(
        self,
        sock: socket.socket,
        peer: str,
        *,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        session: auth.Session | None = None,
    ):
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.peer = peer
        self.max_frame_bytes = int(max_frame_bytes)
        self.inbox: collections.deque[dict] = collections.deque()
        self.eof = False
        self.authenticated = True
        self.session = session
        try:
            name = sock.getpeername()
            self.host: str = name[0] if isinstance(name, tuple) else str(name or "?")
        except OSError:
            self.host = "?"
        self._rbuf = bytearray()
        self._out: collections.deque[memoryview] = collections.deque()
        self._key = b""
        self._nonce = b""
        self._handshake_by = 0.0

    @classmethod
    def server(
        cls,
        sock: socket.socket,
        peer: str,
        *,
        key: bytes,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        handshake_s: float = HANDSHAKE_S,
    ) -> Channel:
        """The server end of a just-accepted connection: it sends its challenge now, and :meth:`pump`
        checks the answer (nothing else is read or delivered until the peer is authenticated), which
        must come within ``handshake_s``."""
        ch = cls(sock, peer, max_frame_bytes=max_frame_bytes)
        ch.authenticated = False
        ch._key = key
        ch._handshake_by = time.monotonic() + handshake_s
        message, ch._nonce = auth.challenge()
        ch._out.append(memoryview(message))
        try:
            ch.flush()
        except PeerError:
            pass  # pump() reports the closed connection
        return ch

    def drop(self, why: bytes) -> None:
        """Close a server end that is still authenticating, telling the client ``why`` (a
        :data:`_DROPPED` code, sent where the proof would be) without waiting."""
        log.info("dropped an unauthenticated connection from %s (%s): %s", self.host, self.peer, why.decode())
        try:
            self.sock.send(why.ljust(auth.PROOF_BYTES, b"\0"))
        except OSError:
            pass
        self.close()

    def fileno(self) -> int:
        return self.sock.fileno()

    def closed_error(self) -> PeerError:
        return PeerError(f"{self.peer} closed the connection (it left, or its process exited or was killed)")

    def where(self) -> str:
        """The peer's ``HOST:PORT`` (``"?"`` when the socket has none)."""
        try:
            name = self.sock.getpeername()
        except OSError:
            return "?"
        return format_address(name[0], name[1]) if isinstance(name, tuple) else str(name or "?")

    # sending -------------------------------------------------------------------------------------
    def queue_control(self, obj: dict) -> None:
        body = json.dumps(obj).encode()
        if len(body) + auth.TAG_BYTES > self.max_frame_bytes:
            raise ValueError(
                f"Channel to {self.peer}: a message of {len(body)} bytes exceeds max_frame_bytes={self.max_frame_bytes}"
            )
        if not self.authenticated:
            raise AuthenticationError(f"Channel to {self.peer}: nothing is sent before the peer is authenticated")
        if self.session is None:
            self._out.append(memoryview(_HEADER.pack(_CONTROL, len(body)) + body))
            return
        header = _HEADER.pack(_SEALED, len(body) + auth.TAG_BYTES)
        self._out.append(memoryview(header + self.session.seal(header, body)))

    @property
    def sending(self) -> bool:
        return bool(self._out)

    def flush(self) -> None:
        """Write what the kernel takes now, without blocking."""
        while self._out:
            head = self._out[0]
            try:
                n = self.sock.send(head)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                self.eof = True
                raise PeerError(f"{self.peer}: the connection broke while sending ({err})") from err
            if n == len(head):
                self._out.popleft()
            else:
                self._out[0] = head[n:]
                return

    def send_control(self, obj: dict, *, timeout_s: float) -> None:
        """Send one control message; wait (up to ``timeout_s``) until the kernel took it."""
        self.queue_control(obj)
        deadline = time.monotonic() + timeout_s
        while True:
            self.flush()
            if not self._out:
                return
            if self.eof:
                raise self.closed_error()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(f"{self.peer} took no message within {timeout_s:.3g} s")
            select.select([], [self.sock], [], min(left, 0.05))

    # receiving -----------------------------------------------------------------------------------
    def _read_some(self, limit: int = _READ) -> bool:
        try:
            chunk = self.sock.recv(limit)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            chunk = b""
        if not chunk:
            self.eof = True
            return False
        self._rbuf += chunk
        return True

    def _refuse(self, why: str) -> AuthenticationError:
        where = self.where()
        log.warning("refused a connection from %s (%s): %s", where, self.peer, why)
        self.close()
        return AuthenticationError(f"refused {self.peer} at {where}: {why}")

    def _authenticate(self) -> bool:
        """Read the client's answer (fixed size, nothing more); True once the peer is authenticated."""
        need = auth.ANSWER_BYTES - len(self._rbuf)
        if need > 0 and not self.eof:
            self._read_some(need)
        got = bytes(self._rbuf[: auth.ANSWER_BYTES])
        if got[: len(auth.MAGIC)] != auth.MAGIC[: len(got)]:
            raise self._refuse("it did not answer with the jreshard handshake (garbage, or not a jreshard peer)")
        if len(got) < auth.ANSWER_BYTES:
            if self.eof:
                raise self._refuse("it closed the connection during authentication")
            return False
        nonce = auth.check_answer(self._key, self._nonce, got)
        if nonce is None:
            raise self._refuse("it did not prove it holds the shared secret (wrong or missing key)")
        del self._rbuf[: auth.ANSWER_BYTES]
        self._out.append(memoryview(auth.proof(self._key, self._nonce, nonce)))
        self.session = auth.Session(self._key, self._nonce, nonce, client=False)
        self.authenticated, self._key, self._nonce = True, b"", b""
        self.flush()
        return True

    def pump(self) -> None:
        """Read what is available now: the handshake first (server side), then control frames into
        :attr:`inbox`.

        Raises:
          AuthenticationError: the peer failed the handshake (the connection is closed and logged).
          PeerError: the peer sent a frame over ``max_frame_bytes``, of an unknown kind, or not JSON
            (the connection is closed).
        """
        if not self.authenticated:
            if self.eof:
                return
            if not self._authenticate():
                if time.monotonic() > self._handshake_by:
                    self.drop(b"JRSH:TOO-SLOW")
                    raise AuthenticationError(
                        f"refused {self.peer} at {self.host}: it did not complete the handshake within its deadline"
                    )
                return
        while True:
            if len(self._rbuf) >= _HEADER.size:
                kind, nbytes = _HEADER.unpack_from(self._rbuf)
                if nbytes > self.max_frame_bytes:
                    self.close()
                    raise PeerError(
                        f"{self.peer} sent a frame that claims {nbytes} bytes, over max_frame_bytes="
                        f"{self.max_frame_bytes}: refused"
                    )
                if len(self._rbuf) >= _HEADER.size + nbytes:
                    header = bytes(self._rbuf[: _HEADER.size])
                    body = bytes(self._rbuf[_HEADER.size : _HEADER.size + nbytes])
                    del self._rbuf[: _HEADER.size + nbytes]
                    if kind != (_CONTROL if self.session is None else _SEALED):
                        self.close()
                        raise PeerError(f"{self.peer} sent a frame of unknown kind {kind}: not a jreshard peer")
                    if self.session is not None:
                        opened = self.session.open(header, body)
                        if opened is None:
                            self.close()
                            log.warning(
                                "%s at %s: control frame %d failed its integrity check",
                                self.peer,
                                self.host,
                                self.session.received,
                            )
                            raise AuthenticationError(
                                f"{self.peer} at {self.host}: control frame {self.session.received} failed its "
                                "integrity check (altered, replayed, reordered, dropped or injected on the way): "
                                "the connection is closed"
                            )
                        body = opened
                    try:
                        msg = json.loads(body, parse_constant=_not_json, parse_float=_finite)
                    except (ValueError, RecursionError):  # not JSON, a number out of range, or nested too deep
                        msg = None
                    if not isinstance(msg, dict):
                        self.close()
                        raise PeerError(f"{self.peer} sent a control frame that is not a JSON object")
                    self.inbox.append(msg)
                    continue
            if self.eof or not self._read_some():
                return

    def take(self, accept: set[str]) -> list[dict]:
        """Remove and return, in arrival order, the inbox messages whose ``op`` is in ``accept``."""
        keep: collections.deque[dict] = collections.deque()
        out: list[dict] = []
        for m in self.inbox:
            (out if m.get("op") in accept else keep).append(m)
        self.inbox = keep
        return out

    def pop(self, *, leave: str = TRANSPORT_OPS) -> dict | None:
        """The first inbox message whose ``op`` does not start with ``leave``, removed; ``None`` if none.

        Messages of the transport that shares this connection (ops ``nixl.*``) stay for it, whatever
        order they arrived in.
        """
        for i, m in enumerate(self.inbox):
            if not str(m.get("op", "")).startswith(leave):
                del self.inbox[i]
                return m
        return None

    def recv_control(self, *, timeout_s: float) -> dict:
        """The next control message, waiting up to ``timeout_s``.

        Raises:
          PeerError: the peer closed the connection (noticed at once).
          TransferTimeoutError: nothing arrived in time.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self.pump()
            if self.inbox:
                return self.inbox.popleft()
            if self.eof:
                raise self.closed_error()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(f"no message from {self.peer} within {timeout_s:.3g} s")
            select.select([self.sock], [], [], min(left, 0.05))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:  # pragma: no cover - already closed
            pass
        self.eof = True
