"""What NcclComm needs from CuPy beyond the calls themselves: the unique id's type and
waits bounded by ``timeout_s`` (CUDA event status and buffer pointers: :mod:`jreshard.cuda.runtime`).

**The unique id.** CuPy 13's ``nccl.get_unique_id()`` returns 128 C ``char`` values
as a tuple and ``NcclCommunicator(ndev, commId: tuple, rank)`` takes one; CuPy 14
returns ``bytes`` and ``NcclCommunicator(ndev, commId: bytes, rank, config=None)``
refuses a tuple. The id always travels between processes as 128 bytes; each process
hands NCCL the type its own CuPy declares (:func:`uid_argument`).

**Bounded waits.** CuPy's ``NcclConfig`` exposes only ``split_share``, not NCCL's
non-blocking mode, so ``ncclCommInitRank`` and ``ncclGroupEnd`` are blocking calls.
:func:`run_bounded` runs one in a daemon thread and stops waiting for it after
``timeout_s``; :class:`Watchdog` aborts communicators from another thread when a
deadline passes, which is how a blocked ``groupEnd`` or stream wait returns (with an
error): one watchdog thread per process serves every exchange, so rounds start no
threads. What is bounded, and what is not, is listed in ``docs/gpu.md``. Not run on GPU.
"""

from __future__ import annotations

import importlib
import platform
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar

from jreshard.errors import BackendUnavailableError, TransferTimeoutError, cuda_extra
from jreshard.types import CupyModule

__all__ = [
    "Watchdog",
    "import_cupy",
    "run_bounded",
    "uid_argument",
    "uid_from_bytes",
    "uid_to_bytes",
]

T = TypeVar("T")

# C ``char`` is signed on x86 and unsigned on ARM and POWER Linux; CuPy 13's
# get_unique_id returns, and its NcclCommunicator expects, 128 values of that type.
_SIGNED_CHAR = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}


def uid_to_bytes(uid: bytes | Sequence[int]) -> bytes:
    """The 128 ``char`` values of an NCCL unique id as bytes (CuPy 14 ids already are).

    Example:
      >>> uid_from_bytes(uid_to_bytes((-1, 0, 127)), signed=True)
      (-1, 0, 127)
      >>> uid_to_bytes(b"\\x01\\xff")
      b'\\x01\\xff'
    """
    if isinstance(uid, bytes | bytearray):
        return bytes(uid)
    return bytes(int(v) & 0xFF for v in uid)


def uid_from_bytes(raw: bytes, *, signed: bool = _SIGNED_CHAR) -> tuple[int, ...]:
    """Bytes back to ``char`` values of this platform's signedness (CuPy 13's id)."""
    return tuple(b - 256 if signed and b > 127 else b for b in raw)


def _declared_id_type(nccl: CupyModule) -> type | None:
    """``bytes`` or ``tuple``: what ``NcclCommunicator``'s signature line says ``commId`` is."""
    doc = (getattr(nccl.NcclCommunicator, "__doc__", None) or "").lstrip().split("\n", 1)[0]
    if "bytes commId" in doc:
        return bytes
    if "tuple commId" in doc:
        return tuple
    return None


def uid_argument(nccl: CupyModule, raw: bytes, made: Any = None) -> bytes | tuple[int, ...]:
    """The unique id in the form this CuPy's ``NcclCommunicator`` takes.

    Args:
      nccl: the ``cupy.cuda.nccl`` module (or a stand-in).
      raw: the 128 id bytes every process received.
      made: what ``nccl.get_unique_id()`` returned, in the process that called it
        (its type is then authoritative).

    Returns:
      ``bytes`` for CuPy 14, a tuple of C ``char`` values for CuPy 13.

    Example:
      >>> class Nccl14:
      ...     class NcclCommunicator:
      ...         "NcclCommunicator(int ndev, bytes commId, int rank, NcclConfig config=None)"
      >>> uid_argument(Nccl14, b"\\x05\\xfb")
      b'\\x05\\xfb'
      >>> class Nccl13:
      ...     class NcclCommunicator:
      ...         "NcclCommunicator(int ndev, tuple commId, int rank)"
      >>> uid_argument(Nccl13, b"\\x05\\x06")
      (5, 6)
    """
    kind = type(made) if made is not None else _declared_id_type(nccl)
    if kind is bytes:
        return bytes(raw)
    if kind is tuple or kind is list:
        return uid_from_bytes(raw)
    # Neither declared nor made here: CuPy >= 14 is the one both extras resolve to.
    return bytes(raw)


def run_bounded(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """``fn()`` in a daemon thread, waited for at most ``timeout_s``.

    On timeout the thread is left blocked (CuPy gives no handle to abort an
    ``ncclCommInitRank`` that has not returned) and :class:`TransferTimeoutError`
    says so. An exception in ``fn`` is raised here.

    Example:
      >>> run_bounded(lambda: 6 * 7, 1.0, "the answer")
      42
    """
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:
            box["error"] = err

    worker = threading.Thread(target=body, name=f"jreshard: {what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TransferTimeoutError(
            f"NcclComm: {what} did not return within timeout_s={timeout_s}; a peer process has not joined "
            "(its thread is left blocked in NCCL)",
            destination_intact=True,
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


class _Deadlines:
    """One daemon thread per process that runs the callbacks of expired :class:`Watchdog` s.

    Arming a watchdog creates no thread (the one thread starts with the first watchdog and
    serves every later one), so a transfer's rounds start none.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._armed: dict[int, Watchdog] = {}
        self._thread: threading.Thread | None = None
        self.threads_started = 0

    def arm(self, dog: Watchdog) -> None:
        with self._cv:
            self._armed[id(dog)] = dog
            if self._thread is None or not self._thread.is_alive():  # none yet, or lost in a fork
                self._thread = threading.Thread(target=self._run, name="jreshard: NCCL watchdog", daemon=True)
                self._thread.start()
                self.threads_started += 1
            self._cv.notify()

    def disarm(self, dog: Watchdog) -> None:
        with self._cv:
            self._armed.pop(id(dog), None)

    def _run(self) -> None:
        while True:
            with self._cv:
                now = time.monotonic()
                due = [d for d in self._armed.values() if d.deadline <= now]
                for d in due:
                    del self._armed[id(d)]
                if not due:
                    nxt = min((d.deadline for d in self._armed.values()), default=None)
                    self._cv.wait(None if nxt is None else nxt - now)
                    continue
            for d in due:  # outside the lock: an abort may take a while
                d._expire()


DEADLINES = _Deadlines()


class Watchdog:
    """Calls ``on_expiry`` from the process's watchdog thread unless cancelled before ``timeout_s``.

    Used as a context manager around a blocking NCCL call: ``fired`` says whether
    it expired (the call then returned because the communicators were aborted).
    Entering one starts no thread: one thread per process serves them all.

    Example:
      >>> hits = []
      >>> with Watchdog(10.0, lambda: hits.append(1)) as dog:
      ...     pass
      >>> dog.fired, hits
      (False, [])
    """

    __slots__ = ("_fn", "_timeout_s", "deadline", "fired")

    def __init__(self, timeout_s: float, on_expiry: Callable[[], None]):
        self._fn = on_expiry
        self._timeout_s = max(float(timeout_s), 0.0)
        self.deadline = float("inf")
        self.fired = False

    def _expire(self) -> None:
        self.fired = True
        self._fn()

    def __enter__(self) -> Watchdog:
        self.deadline = time.monotonic() + self._timeout_s
        DEADLINES.arm(self)
        return self

    def __exit__(self, *exc: object) -> None:
        DEADLINES.disarm(self)


def import_cupy(name: str) -> ModuleType:
    """Import a CuPy module, or raise BackendUnavailableError saying why and what to install."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            mod = importlib.import_module(name)
        except (ImportError, OSError) as err:
            raise BackendUnavailableError(
                f"NcclComm: importing {name} failed ({type(err).__name__}: {err}); the fix is {cuda_extra()}"
            ) from err
    if name == "cupy.cuda.nccl" and mod.available is not True:  # imports without libnccl, says so here
        said = "; ".join(" ".join(str(w.message).split()) for w in caught) or "libnccl was not loaded"
        raise BackendUnavailableError(
            f"NcclComm: cupy.cuda.nccl.available is False ({said}); the fix is {cuda_extra()}"
        )
    return mod
