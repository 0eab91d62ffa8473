"""Receive a refit while serving: a pull in a background thread into shadow buffers, then one flip.

A server that must keep answering while the next version arrives starts the pull in the
background, keeps running its jitted steps on the arrays it holds, and switches to the new
version with one call between two of its steps::

    handle = group.pull_async(into=params)       # returns at once; the receive runs in a thread
    while serving:
        out = step(params, batch)                 # the current version, undisturbed
        if handle.ready():
            params, version = handle.flip()       # between two steps: the new tree, whole
            handle = group.pull_async(into=params)

Why a thread and not ``jax``'s own asynchrony: a refit between programs is host work (the
control plane's votes, the transport's waits, the engine's unpack into fresh buffers) that must
run while the server's Python loop dispatches steps. ``jax`` dispatch is thread-safe, the
jitted step runs without the GIL, and every wait of the receive releases the GIL (MPI's and
NIXL's polls sleep, the sockets ``select``, the engine's compiled replay and copies run
without it), so the thread only takes the GIL for its Python bookkeeping; the benchmark
``benchmarks/serve_bench.py`` measures what that costs the server.

Memory. The new version lands in fresh buffers (the *shadow*: a second copy of this process's
shards) while the current one serves; :class:`Shadow` says what happens to the old one at the
flip, ``max_shadow_bytes`` bounds the shadow (refused before any byte moves), and the report
states its size. Applying staged pieces into the live arrays at the flip is not offered: the
flip would then copy the whole version between two steps, a pause that grows with the model.

Atomic. The handle hands out the new tree only after every process of the group committed it
(the group's commit vote): a refit that fails at any point raises from :meth:`PullHandle.result`
and :meth:`PullHandle.flip`, and the arrays the server holds stay the previous version, whole.
:meth:`PullHandle.cancel` makes this process vote against the refit at the next point it can
(before the data, or at the commit vote): every process then keeps its previous version.

CPU priority. The receive thread lowers its own scheduling priority (``nice``, 10 by default: Linux
gives a thread at nice 10 about a tenth of the CPU of one at 0 when they contend for a core), so
where cores are short the server's steps go first and the refit takes the cycles they leave; the
threads it starts for its copies inherit it. Only that thread changes: the caller's threads and
XLA's keep theirs. ``nice=0`` keeps the caller's priority (on systems other than Linux, where a nice
value is per process, nothing is changed). ``benchmarks/serve_bench.py --nice 0`` against its
default (10) measures what it gives the server.

Cores. ``cpus`` puts the receive thread on cores of the caller's choosing (Linux, that thread and the threads it
starts; the caller's and XLA's keep theirs): a server that gives its steps their own cores gives the receive
others, and a refit then takes no cycle from a step but what the two share (the GIL for the receive's Python
bookkeeping, memory bandwidth, the caches). ``None`` (the default) keeps the caller's cores: the OS then runs the
receive wherever it finds room, on the steps' cores too. ``benchmarks/serve_bench.py`` runs both placements.

Verified boxes (hashing every box on both sides before the commit vote) plug in at the commit
vote of :meth:`jreshard.refit.RefitGroup.pull`, which this handle runs unchanged; nothing here
needs to change for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from jreshard.errors import RefitCancelledError, TransferTimeoutError
from jreshard.options import as_int, wait_s
from jreshard.types import PyTree

__all__ = ["PullHandle", "ServeReport", "Shadow", "shadow_bytes"]


class Shadow(enum.Enum):
    """What the flip does with the version the server held.

    ``KEEP``: nothing; the old arrays live until the caller drops them (two copies until then).
    ``RELEASE``: the flip deletes the old arrays (``into``, donated as ``jax.jit`` donates), so their
    memory returns at the flip rather than when the last reference goes; a step already dispatched on
    them completes first (XLA holds a buffer until its last use is done).
    """

    KEEP = "keep"
    RELEASE = "release"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServeReport:
    """One background refit, measured on this process.

    Attributes:
      version: the version received.
      wait_s: from the start of the pull to the source starting the refit (the begin vote).
      wire_s: the data phase, wall time: the round loop (the wire, and the unpack it overlaps) and the
        commit vote.
      assemble_s: building the new ``jax.Array`` s from the received shards.
      processing_s: CPU time the receive thread used (its host processing: votes, rounds, unpack,
        assembly): what the receive can take from the server's own host work.
      pause_s: inside :meth:`PullHandle.flip`: from the call (the server's last step on the old
        version has been dispatched) to its return (the first step on the new one may start).
      shadow_bytes: the bytes of the shadow copy this process held (its shards of the new version).
    """

    version: int
    wait_s: float
    wire_s: float
    assemble_s: float
    processing_s: float
    pause_s: float
    shadow_bytes: int

    def summary(self) -> str:
        """One line, milliseconds.

        Example:
          >>> r = ServeReport(version=3, wait_s=0.01, wire_s=0.2, assemble_s=0.001, processing_s=0.05,
          ...                 pause_s=2e-5, shadow_bytes=1 << 20)
          >>> print(r.summary())
          version 3: wait 10.0 ms, wire 200.0 ms, assemble 1.0 ms, receive CPU 50.0 ms, pause 0.020 ms, shadow 1.0 MiB
        """
        return (
            f"version {self.version}: wait {1e3 * self.wait_s:.1f} ms, wire {1e3 * self.wire_s:.1f} ms, "
            f"assemble {1e3 * self.assemble_s:.1f} ms, receive CPU {1e3 * self.processing_s:.1f} ms, "
            f"pause {1e3 * self.pause_s:.3f} ms, shadow {self.shadow_bytes / 2**20:.1f} MiB"
        )


def shadow_bytes(tree: PyTree) -> int:
    """The bytes of this process's shards of ``tree`` (arrays or ``ShapeDtypeStruct`` with shardings):
    what a shadow copy of it holds.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import NamedSharding, Mesh, PartitionSpec as P
      >>> s = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("x",)), P("x"))
      >>> shadow_bytes({"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=s)})
      128
    """
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = leaf.sharding
        per = int(np.prod(sharding.shard_shape(tuple(leaf.shape)), dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
        total += per * len(sharding.addressable_devices)
    return total


class PullHandle:
    """A refit received in the background (final; made by :meth:`jreshard.refit.RefitGroup.pull_async`).

    The receive starts at construction, in a daemon thread, and runs :meth:`RefitGroup.pull` unchanged,
    so its checks, its votes and its bounds (``timeout_s``, ``options.timeout_s``) are those of a pull.
    """

    def __init__(
        self,
        group: Any,  # the RefitGroup (which imports this module: named here, not imported)
        *,
        into: PyTree,
        like: PyTree,
        timeout_s: float | None,
        shadow: Shadow,
        nbytes: int,
        nice: int = 0,
        cpus: frozenset[int] | None = None,
    ):
        self._group = group
        self._nice = nice
        self._into = into
        self._shadow = shadow
        self._nbytes = nbytes
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._committing = False  # past the last point where a cancel can stop the refit
        self._done = threading.Event()
        self._flipped = False
        self._out: tuple[Any, int] | None = None
        self._error: BaseException | None = None
        self._phases: dict[str, float] = {}
        self._cpu_s = 0.0
        self.report: ServeReport | None = None
        self._thread = threading.Thread(
            target=self._receive, args=(into, like, timeout_s), name="jreshard-pull-async", daemon=True
        )
        self._t0 = time.monotonic()
        start_on(self._thread, cpus)

    def _receive(self, into: PyTree, like: PyTree, timeout_s: float | None) -> None:
        import jax

        lower_priority(self._nice)
        c0 = time.thread_time()
        try:
            tree, version = self._group.pull(
                into=into, like=like, timeout_s=timeout_s, _phases=self._phases, _abort=self._abort
            )
            jax.block_until_ready(tree)  # resident before ready() says so: the flip never waits on it
            self._out = (tree, version)
        except BaseException as err:  # handed to result() / flip()
            if self._cancel.is_set():
                cancelled = cancelled_error()
                cancelled.__cause__ = err
                err = cancelled
            self._error = err
        finally:
            self._cpu_s = time.thread_time() - c0
            self._group._background = None
            self._done.set()

    def _abort(self, final: bool) -> bool:
        """Asked by the pull before the begin vote and before the commit vote (``final``): vote against?"""
        with self._lock:
            if self._cancel.is_set():
                return True
            self._committing = self._committing or final
            return False

    def ready(self) -> bool:
        """Whether the refit has finished (committed by every process, or failed): ``flip`` will not wait."""
        return self._done.is_set()

    def result(self, timeout_s: float | None = None) -> tuple[Any, int]:
        """Wait for the refit (at most ``timeout_s``; default ``options.timeout_s``) and flip to it.

        Returns:
          ``(new tree, version)``, shaped like ``into`` (or ``like``).

        Raises:
          TransferTimeoutError: the refit is still running after ``timeout_s`` (it goes on; ask again).
          RefitCancelledError: :meth:`cancel` stopped it; the previous version stays.
          PeerError, TransferTimeoutError, ValueError: the refit failed (as :meth:`RefitGroup.pull`); the
            previous version stays.
        """
        wait = wait_s(timeout_s, self._group.options.timeout_s, "PullHandle.result")
        if not self._done.wait(wait):
            raise TransferTimeoutError(
                f"PullHandle.result: the background refit is still running after timeout_s={wait} "
                "(it goes on, bounded by options.timeout_s; call result() again, or cancel())"
            )
        return self.flip()

    def flip(self) -> tuple[Any, int]:
        """Switch to the received version: one call between two steps (the refit must be :meth:`ready`).

        Returns ``(new tree, version)``; with :attr:`Shadow.RELEASE` the old arrays (``into``) are deleted.
        A second call returns the same tree.

        Raises:
          ValueError: the refit has not finished (ask :meth:`ready`, or wait with :meth:`result`).
          RefitCancelledError, PeerError, TransferTimeoutError: as :meth:`result`.
        """
        t0 = time.monotonic()
        if not self._done.is_set():
            raise ValueError("PullHandle.flip: the refit is still running; flip once ready() is True, or result()")
        if self._error is not None:
            raise self._error
        assert self._out is not None  # set whenever the thread ended without an error
        if not self._flipped:
            self._flipped = True
            if self._shadow is Shadow.RELEASE and self._into is not None:
                import jax

                for a in jax.tree_util.tree_leaves(self._into):
                    a.delete()
            self._into = None
            p = self._phases
            self.report = ServeReport(
                version=self._out[1],
                wait_s=p.get("begun", self._t0) - self._t0,
                wire_s=p.get("moved", 0.0) - p.get("begun", 0.0),
                assemble_s=p.get("assembled", 0.0) - p.get("moved", 0.0),
                processing_s=self._cpu_s,
                pause_s=time.monotonic() - t0,
                shadow_bytes=self._nbytes,
            )
        return self._out

    def cancel(self) -> bool:
        """Stop the refit: this process votes against it at the next point it can (before the data moves,
        or at the commit vote), so every process of the group keeps its previous version.

        Returns ``True`` if the refit will not be handed out (:meth:`result` then raises
        :class:`RefitCancelledError`), ``False`` if it is past its commit vote (it will be handed out, or
        fails on its own). This process's begin vote goes out as soon as the pull starts, so a cancel is
        nearly always carried by the commit vote: the refit then fails for the whole group, which is
        broken (as after any failure after data moved; every process keeps its previous version): form
        a new group. Does not wait; ``ready()`` says when the thread is done.
        """
        with self._lock:
            if self._committing or self._done.is_set():
                return False
            self._cancel.set()
            return True


def check_cpus(cpus: Iterable[int] | None, who: str) -> frozenset[int] | None:
    """``cpus`` as the set of cores a receive thread is to run on (``None``: the caller's, unchanged), checked:
    a non-empty collection of core numbers that the OS lets the calling thread run on (tried on the caller, whose
    own cores are put back at once), so a set it refuses is a ValueError before anything starts.

    Raises:
      ValueError: ``cpus`` is not a non-empty collection of ints >= 0, the OS refuses it, or the system has no
        ``os.sched_setaffinity`` (Linux has it)."""
    if cpus is None:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"{who}: cpus={cpus!r} needs os.sched_setaffinity, which this system lacks (Linux has it)")
    try:  # core numbers of any integer type (a numpy array of them too), not bools, floats or strings
        given = [as_int(c) for c in cpus]
    except TypeError:  # not a collection
        given = []
    if not given or any(c is None or c < 0 for c in given):
        raise ValueError(f"{who}: cpus={cpus!r}; expected a non-empty set of core numbers (ints >= 0) or None")
    got = frozenset(c for c in given if c is not None)
    try:
        with _on_cores(got):
            pass
    except (OSError, OverflowError) as err:  # OverflowError: a core number past what the OS can name
        raise ValueError(
            f"{who}: cpus={sorted(got)}: the OS refuses them ({getattr(err, 'strerror', None) or err}); the calling "
            f"thread's cores are {sorted(os.sched_getaffinity(0))}"
        ) from None
    return got


def start_on(thread: threading.Thread, cpus: frozenset[int] | None) -> None:
    """Start ``thread`` on the cores ``cpus`` (from :func:`check_cpus`; ``None``: the caller's). A new thread
    starts with its creator's cores, so the caller takes ``cpus`` for the start and its own back after: no
    thread but the new one changes cores, and it has them before it runs a line."""
    if cpus is None:
        thread.start()
        return
    with _on_cores(cpus):
        thread.start()


@contextlib.contextmanager
def _on_cores(cpus: frozenset[int]) -> Iterator[None]:
    """The calling thread on ``cpus`` inside the block, on its own cores again after (OSError: the OS refused
    ``cpus``, nothing changed)."""
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def check_nice(nice: int, who: str) -> int:
    """``nice`` checked: an int in 0..19 (:func:`~jreshard.options.as_int`'s; ValueError naming ``who`` otherwise)."""
    n = as_int(nice)
    if n is None or not 0 <= n <= 19:
        raise ValueError(f"{who}: nice={nice!r}; expected an int in 0..19")
    return n


def lower_priority(nice: int) -> bool:
    """Add ``nice`` to the calling thread's nice value (Linux: per thread; lowering a priority needs no
    privilege). Returns whether it changed; elsewhere, or for ``nice <= 0``, it changes nothing."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:  # a sandbox that forbids it: the receive runs at the caller's priority
        return False
    return True


def cancelled_error() -> RefitCancelledError:
    """The error a cancelled background pull raises (one message for both points it can stop at)."""
    return RefitCancelledError(
        "RefitGroup.pull_async: cancelled by this process (PullHandle.cancel); the previous version stays",
        destination_intact=True,
    )
