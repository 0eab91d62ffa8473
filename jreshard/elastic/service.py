"""Stopping an elastic program's service thread (the trainer's and each replica's)."""

from __future__ import annotations

from typing import Any

__all__ = ["stop_service"]


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
