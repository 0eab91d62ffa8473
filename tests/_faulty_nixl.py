"""A NIXL agent whose calls can be made to fail, for the transport fault tests.

:func:`failing` swaps the shared :class:`~jreshard.nixl.NixlAgent`'s ``nixl_agent`` for a proxy
that raises NIXL's own ``nixlRemoteDisconnectError`` (what a WRITE's poll raises when its peer was
killed with the bytes in flight), or returns a given state, on one method's calls from one thread;
every other call goes to the real agent.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from jreshard.nixl import NixlAgent


def disconnect_error() -> Exception:
    from nixl_cu12 import _bindings

    return _bindings.nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT (planted by the test)")


class _Handle:
    """A transfer handle whose ``release`` goes through the proxy."""

    def __init__(self, real: Any, proxy: FaultyAgent):
        self.real, self._proxy = real, proxy

    def release(self) -> None:
        self._proxy._maybe_fail("release")
        self.real.release()


class FaultyAgent:
    """The real agent, but ``method`` fails (raises, or returns ``state``) from its ``nth`` call on,
    for calls from ``thread`` (default: any)."""

    def __init__(self, real: Any, method: str, *, nth: int = 1, thread: int | None = None, state: str | None = None):
        self._real, self.method, self.nth, self.thread, self.state = real, method, nth, thread, state
        self.calls = 0
        self.failed = 0
        self._lock = threading.Lock()

    def _maybe_fail(self, name: str) -> Any:
        if name != self.method or (self.thread is not None and threading.get_ident() != self.thread):
            return None
        with self._lock:
            self.calls += 1
            if self.calls < self.nth:
                return None
            self.failed += 1
        if self.state is not None:
            return self.state
        raise disconnect_error()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            args = tuple(a.real if isinstance(a, _Handle) else a for a in args)
            planted = self._maybe_fail(name)
            if planted is not None:
                return planted
            out = attr(*args, **kwargs)
            return _Handle(out, self) if name == "initialize_xfer" else out

        return call


@contextlib.contextmanager
def failing(method: str, **kw: Any) -> Iterator[FaultyAgent]:
    """The shared agent's ``method`` fails (see :class:`FaultyAgent`) inside the block."""
    agent = NixlAgent.shared()
    real = agent._agent
    proxy = FaultyAgent(real, method, **kw)
    agent._agent = proxy
    try:
        yield proxy
    finally:
        agent._agent = real
