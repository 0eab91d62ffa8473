"""Two authenticated channels joined over loopback in one process, for the tests that drive both ends of a
NIXL pair themselves."""

from __future__ import annotations

import threading
from typing import Any

from jreshard.net.channel import accept_one, connect, listen


def channel_pair(key: bytes) -> tuple[Any, Any]:
    """``(a, b)``: the listening end (authenticated as it accepted) and the connecting end, each with the
    other's name ("b" and "a")."""
    listener = listen("127.0.0.1", 0)
    made: dict = {}
    client = threading.Thread(
        target=lambda: made.setdefault("c", connect(listener.getsockname()[:2], "b", key=key, timeout_s=10))
    )
    client.start()
    server = accept_one(listener, "a", key=key, timeout_s=10)
    client.join(10)
    listener.close()
    return server, made["c"]
