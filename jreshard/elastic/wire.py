"""Framed messages over one loopback TCP connection, with deadlines (no jax, no MPI).

A :class:`Channel` carries two kinds of frames between two processes:

- *control* frames: a small JSON object (a hello, a vote, a version report);
- *data* frames: the bytes of one engine message ``(src rank, dst rank, tag)``,
  received straight into the buffer the engine posted for it.

Every frame starts with the same 25-byte header ``kind, src, dst, tag, nbytes``
(network byte order). Sockets are non-blocking; every wait is a ``select`` with
a deadline, so a silent peer becomes :class:`TransferTimeoutError` and a peer
that closed or died (the kernel closes a killed process's sockets) becomes
:class:`PeerError` at once. Only loopback addresses are accepted.
"""

from __future__ import annotations

import collections
import json
import os
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from jreshard.errors import PeerError, TransferTimeoutError

__all__ = ["Channel", "listen", "open_channel", "parse_address"]

_HEADER = struct.Struct("!BIIQQ")  # kind, src, dst, tag, nbytes
_CONTROL, _DATA = 1, 2
_LOOPBACK = ("127.0.0.1", "localhost")
_READ = 1 << 20

# match(src, dst, tag, nbytes) -> the writable memoryview the payload lands in
Matcher = Callable[[int, int, int, int], memoryview]


def parse_address(address: str, *, timeout_s: float) -> tuple[str, int]:
    """``"127.0.0.1:PORT"``, or the path of a file holding it (waited for up to ``timeout_s``).

    Example:
      >>> parse_address("127.0.0.1:5000", timeout_s=1.0)
      ('127.0.0.1', 5000)
    """
    if not isinstance(address, str):
        raise TypeError(f"address={address!r} must be a str: '127.0.0.1:PORT' or a file path holding it")
    text = address
    host, sep, port = text.rpartition(":")
    if not (sep and port.isdigit()) or os.path.sep in text:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(address):
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"address file {address!r} did not appear within timeout_s={timeout_s}")
            time.sleep(0.02)
        with open(address) as f:
            text = f.read().strip()
        host, sep, port = text.rpartition(":")
    if not (sep and port.isdigit()):
        raise ValueError(f"address={text!r} must be 'HOST:PORT'")
    if host not in _LOOPBACK:
        raise ValueError(f"address={text!r}: elastic refit connects over loopback only (127.0.0.1)")
    return "127.0.0.1", int(port)


def listen(port: int = 0) -> socket.socket:
    """A non-blocking listening socket on ``127.0.0.1:port`` (0: any free port)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(64)
    s.setblocking(False)
    return s


def open_channel(address: tuple[str, int], peer: str, *, timeout_s: float, retry: bool = True) -> Channel:
    """Connect to ``address``; with ``retry``, keep trying until ``timeout_s`` (the listener may not be up
    yet), without, a refused connection (nobody listens: the peer is gone) raises at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection(address, timeout=max(0.05, deadline - time.monotonic()))
            return Channel(sock, peer)
        except OSError as err:
            if not retry and isinstance(err, ConnectionRefusedError):
                raise PeerError(f"{peer} refused the connection at {address[0]}:{address[1]}: it is gone") from err
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"could not connect to {peer} at {address[0]}:{address[1]} within timeout_s={timeout_s}: {err}"
                ) from err
            time.sleep(0.05)


class Channel:
    """One connection to one peer process: control and data frames (final).

    Args:
      sock: a connected TCP socket (made non-blocking here).
      peer: names the peer in error messages (``"replica 'r1'"``).

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

    def __init__(self, sock: socket.socket, peer: str):
        sock.setblocking(False)
        if sock.family == socket.AF_INET:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.peer = peer
        self.inbox: collections.deque[dict] = collections.deque()
        self.eof = False
        self._rbuf = bytearray()
        self._out: collections.deque[memoryview] = collections.deque()
        self._fill: tuple[memoryview, int] | None = None  # payload being received: (view, bytes so far)

    def fileno(self) -> int:
        return self.sock.fileno()

    def closed_error(self) -> PeerError:
        return PeerError(f"{self.peer} closed the connection (it left, or its process exited or was killed)")

    # sending -------------------------------------------------------------------------------------
    def queue_control(self, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self._out.append(memoryview(_HEADER.pack(_CONTROL, 0, 0, 0, len(body)) + body))

    def queue_data(self, src: int, dst: int, tag: int, buffer: Any) -> None:
        view = memoryview(buffer).cast("B")
        self._out.append(memoryview(_HEADER.pack(_DATA, src, dst, tag, view.nbytes)))
        if view.nbytes:
            self._out.append(view)

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
                raise TransferTimeoutError(f"{self.peer} took no message within timeout_s={timeout_s}")
            select.select([], [self.sock], [], min(left, 0.05))

    # receiving -----------------------------------------------------------------------------------
    def _read_some(self) -> bool:
        try:
            chunk = self.sock.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            chunk = b""
        if not chunk:
            self.eof = True
            return False
        self._rbuf += chunk
        return True

    def pump(self, match: Matcher | None = None) -> bool:
        """Read what is available now: control frames go to :attr:`inbox`; data frames into
        ``match(...)``'s buffer (without ``match``, reading stops before a data frame).

        Returns whether a data payload completed.
        """
        completed = False
        while True:
            if self._fill is not None:
                view, got = self._fill
                if self._rbuf:
                    take = min(len(self._rbuf), view.nbytes - got)
                    view[got : got + take] = self._rbuf[:take]
                    del self._rbuf[:take]
                    got += take
                elif not self.eof:
                    try:
                        n = self.sock.recv_into(view[got:])
                    except (BlockingIOError, InterruptedError):
                        n = -1
                    except OSError:
                        n = 0
                    if n == 0:
                        self.eof = True
                    if n <= 0:
                        self._fill = (view, got)
                        return completed
                    got += n
                else:
                    return completed
                self._fill = None if got == view.nbytes else (view, got)
                completed = completed or self._fill is None
                continue
            if len(self._rbuf) >= _HEADER.size:
                kind, src, dst, tag, nbytes = _HEADER.unpack_from(self._rbuf)
                if kind == _CONTROL:
                    if len(self._rbuf) >= _HEADER.size + nbytes:
                        body = bytes(self._rbuf[_HEADER.size : _HEADER.size + nbytes])
                        del self._rbuf[: _HEADER.size + nbytes]
                        self.inbox.append(json.loads(body))
                        continue
                elif kind == _DATA:
                    if match is None:
                        return completed
                    view = match(src, dst, tag, nbytes)
                    del self._rbuf[: _HEADER.size]
                    self._fill = (view, 0)
                    if nbytes == 0:
                        self._fill = None
                        completed = True
                    continue
                else:
                    self.eof = True
                    raise PeerError(f"{self.peer} sent a frame of unknown kind {kind}: not a jreshard peer")
            if self.eof or not self._read_some():
                return completed

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
                raise TransferTimeoutError(f"no message from {self.peer} within timeout_s={timeout_s}")
            select.select([self.sock], [], [], min(left, 0.05))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:  # pragma: no cover - already closed
            pass
        self.eof = True


def stop_service(cv: Any, owner: Any, timeout_s: float) -> None:
    """Stop ``owner``'s service thread at once: mark it stopping (under ``cv``), wake its ``select``
    through the socket pair, and wait at most ``timeout_s`` for it to end. A second call does nothing.

    ``owner`` has ``_stop`` (bool), ``_wake_w`` (the writing end of the wake-up pair) and ``_thread``.
    """
    with cv:
        if owner._stop:
            return
        owner._stop = True
        owner._wake_w.send(b"x")
    owner._thread.join(timeout_s)
