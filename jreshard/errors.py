"""Exceptions raised by jreshard.

Every error about a bad argument is a ``ValueError`` subclass that names the
argument and shows the offending values; errors about the world (a peer that
died, a backend that cannot start) are ``RuntimeError`` subclasses.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

__all__ = [
    "AuthenticationError",
    "BackendUnavailableError",
    "IndivisibleError",
    "IntegrityError",
    "JReshardError",
    "LayoutError",
    "LayoutJSONError",
    "LayoutMismatchError",
    "PeerError",
    "RefitCancelledError",
    "TopologyError",
    "TransferError",
    "TransferTimeoutError",
    "cuda_extra",
]


class JReshardError(Exception):
    """Base class of every exception jreshard raises on purpose."""


class LayoutError(JReshardError, ValueError):
    """A layout is malformed: boxes out of bounds, unknown or repeated mesh axes,
    duplicated ranks, a source that does not cover what the destination needs."""


class IndivisibleError(LayoutError):
    """A tensor dimension is not divisible by the mesh axes that split it."""


class LayoutMismatchError(JReshardError, ValueError):
    """Source and destination disagree on global shape, dtype or structure.

    Attributes:
      src: the source value (shape, dtype or tree structure).
      dst: the destination value.
      what: which property differs.
    """

    def __init__(self, message: str, *, src: object = None, dst: object = None, what: str = ""):
        super().__init__(message)
        self.src = src
        self.dst = dst
        self.what = what


class LayoutJSONError(LayoutError):
    """A serialized layout or topology could not be parsed."""


class TopologyError(JReshardError, ValueError):
    """A topology is malformed or does not know a rank that a layout uses."""


class BackendUnavailableError(JReshardError, RuntimeError):
    """The requested backend cannot start; the message names what to install."""


class TransferError(JReshardError, RuntimeError):
    """A transfer failed after it started. ``destination_intact`` says whether
    the destination buffers still hold their previous contents."""

    def __init__(self, message: str, *, destination_intact: bool | None = None):
        super().__init__(message)
        self.destination_intact = destination_intact


class TransferTimeoutError(TransferError):
    """A peer did not answer within ``Options.timeout_s``."""


class PeerError(TransferError):
    """A peer reported a failure or disagreed on the declared layouts."""


class RefitCancelledError(TransferError):
    """A background refit this process cancelled (``PullHandle.cancel``); its previous version stays."""


class IntegrityError(PeerError):
    """The bytes a destination received are not those its source sent (their digests differ): the version
    was refused on every process and every destination keeps its previous one. ``streams`` lists the
    ``(source rank, destination rank)`` pairs that differ."""

    def __init__(self, message: str, *, streams: tuple[tuple[int, int], ...] = ()):
        super().__init__(message, destination_intact=True)
        self.streams = streams


class AuthenticationError(PeerError):
    """A connection did not prove it holds the shared secret (or this side has none to prove)."""


def cuda_extra(find_spec: Callable[[str], object] = importlib.util.find_spec) -> str:
    """The pip extra that installs CuPy and NCCL for the jax CUDA build in use.

    ``jreshard[cuda13]`` when the ``jax_cuda13_plugin`` package is present,
    ``jreshard[cuda12]`` when ``jax_cuda12_plugin`` is, else both are named.

    Example:
      >>> cuda_extra(lambda name: object() if name == "jax_cuda13_plugin" else None)
      "pip install 'jreshard[cuda13]'"
    """
    if find_spec("jax_cuda13_plugin") is not None:
        return "pip install 'jreshard[cuda13]'"
    if find_spec("jax_cuda12_plugin") is not None:
        return "pip install 'jreshard[cuda12]'"
    return "pip install 'jreshard[cuda12]' (CUDA 12) or 'jreshard[cuda13]' (CUDA 13)"
