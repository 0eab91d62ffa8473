"""A free port for a ``jax.distributed`` coordinator, held until the coordinator has bound it.

Picking a port by binding to port 0 and closing the socket leaves a window in which any other
process may take the port (an outgoing connection's own port is drawn from the same range), and
then the coordinator's gRPC server cannot bind it: jax logs ``Failed to add port to server`` and
the process dies with SIGSEGV, not an exception. So the port stays bound here, with
``SO_REUSEPORT``, until the coordinator is up. gRPC binds its servers with ``SO_REUSEPORT`` on
Linux, so its bind succeeds beside the held socket, and the held socket never listens, so every
connection reaches the coordinator. The socket is bound to the wildcard address of the family
gRPC uses for ``[::]:port`` (IPv6 dual-stack, or IPv4 where the host has no IPv6).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


def _held_socket() -> socket.socket:
    """A socket bound to a free port on the wildcard address gRPC takes, with ``SO_REUSEPORT``."""
    failed: list[str] = []
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):  # dual-stack first, as gRPC
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError as err:  # no IPv6 on this host
            failed.append(f"{host}: {err}")
            continue
        try:
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((host, 0))
            return s
        except OSError as err:
            s.close()
            failed.append(f"{host}: {err}")
    raise OSError(f"reserved_port: no free port could be bound ({'; '.join(failed)})")


@contextmanager
def reserved_port() -> Iterator[int]:
    """A port no other socket holds, kept bound (not listening) until the ``with`` block ends.

    Start the coordinator on it inside the block (in this process or a child of the same user)."""
    s = _held_socket()
    try:
        yield int(s.getsockname()[1])
    finally:
        s.close()
