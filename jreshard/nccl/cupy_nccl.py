"""NcclComm: the Communicator over ``cupy.cuda.nccl`` (GPU). Not run on GPU yet.

One NCCL rank per GPU. jreshard ranks that share a GPU (a colocated trainer and
inference engine) share its NCCL rank, because NCCL refuses two ranks of one
communicator on one device; the planner sends no messages between them (those
are same-device copies). A process that drives several GPUs holds one NCCL
communicator per device, created together inside one NCCL group, and issues
every send and receive of an exchange inside one ``groupStart``/``groupEnd``.

Message matching. NCCL matches the sends and receives between two NCCL ranks in
the order they are issued. Both sides issue them sorted by
``(src, dst, tag)`` in jreshard ranks, a key both derive from the plan, so the
n-th send from one GPU to another meets the n-th receive there even when several
jreshard ranks share those GPUs.

Completion and failure. After ``groupEnd`` the host polls a CUDA event recorded
on each device's stream (its status read with ``cudaEventQuery``, so a CUDA
error is raised as one, not waited on) and NCCL's asynchronous error state;
past ``timeout_s`` every communicator of this process is aborted
(``ncclCommAbort``), so no rank waits forever on a dead peer, and
:class:`TransferTimeoutError` names the peers still outstanding. ``groupEnd``
itself is bounded by a watchdog that aborts the communicators at the deadline,
and ``ncclCommInitRank`` by waiting for it in a thread (CuPy exposes no
non-blocking NCCL config). A reported NCCL error aborts the same way and raises
:class:`PeerError`, a CUDA error :class:`TransferError`. Aborted communicators
leave the cache; the next :class:`NcclComm` over the same group makes new ones.

Communicators are cached per process by (namespace, group, local devices) and
reused across refits: building one is a collective over every process of the
group, done once.

The ``nccl`` and ``cuda`` modules are arguments: ``cupy.cuda.nccl`` and
``cupy.cuda`` by default, a recording stand-in in the CPU tests (which checks
the calls and their order, not NCCL).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from jreshard.cuda.runtime import device_pointer, event_done
from jreshard.engine.comm import Communicator, RecvOp, Row, SendOp
from jreshard.errors import PeerError, TransferError, TransferTimeoutError
from jreshard.nccl.nccl_support import (
    Watchdog,
    import_cupy,
    run_bounded,
    uid_argument,
    uid_from_bytes,
    uid_to_bytes,
)
from jreshard.nccl.rendezvous import Rendezvous
from jreshard.types import CudaStream, CupyModule, NcclCommunicator

if TYPE_CHECKING:
    from jreshard.cuda.buffers import CupyBuffers

__all__ = ["NcclComm", "destroy_cached_communicators", "device_pointer", "uid_from_bytes", "uid_to_bytes"]

# Host waits poll at most every 100 µs: backing off further (it was 5 ms) added up to that much to
# every wait, and so to every time measured around one; NCCL progresses on the GPU, not on this thread.
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 100e-6


@dataclasses.dataclass(slots=True)
class _Local:
    """One GPU this process drives: its NCCL rank, communicator and stream."""

    ordinal: int
    nccl_rank: int
    comm: NcclCommunicator
    stream: CudaStream
    aborted: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class _Group:
    """The identity of a set of cached communicators."""

    namespace: str
    world: tuple[int, ...]  # device keys, ascending: NCCL rank i is world[i]
    local: tuple[tuple[int, int], ...]  # (device key, CUDA ordinal) this process drives
    modules: tuple[int, int]  # id() of the nccl and cuda modules in use


_CACHE: dict[_Group, dict[int, _Local]] = {}
_GENERATION: dict[tuple[str, tuple[int, ...]], itertools.count] = {}
_LOCK = threading.Lock()


def destroy_cached_communicators() -> int:
    """Destroy every cached NCCL communicator of this process; returns how many.

    Not run on GPU. Collective in NCCL's sense: every process of a group should call it.
    """
    with _LOCK:
        groups = list(_CACHE.values())
        _CACHE.clear()
    n = 0
    for locals_ in groups:
        for loc in locals_.values():
            loc.comm.destroy()
            n += 1
    return n


class NcclComm(Communicator):
    """Grouped NCCL point-to-point messages between GPUs (final). Not run on GPU.

    Constructing one is collective: every process of the group constructs one
    with the same ``devices`` and ``namespace``, in the same order.

    Args:
      devices: ``{jreshard rank: device key}`` for every rank of the group
        (``Topology.devices``); ranks with one key share a GPU and an NCCL rank.
      local_devices: ``{jreshard rank: CUDA ordinal}`` for the ranks this process drives.
      rendezvous: shares the NCCL unique id (see :mod:`jreshard.nccl.rendezvous`).
      namespace: names the group; two groups with one ``devices`` map need two names.
      timeout_s: how long creating the communicators may wait for the unique id.
      nccl: the NCCL module (``cupy.cuda.nccl`` by default; a stand-in in CPU tests).
      cuda: the CUDA module (``cupy.cuda`` by default; a stand-in in CPU tests).
      graphs: run each schedule's steps after its first as one CUDA graph launch (:mod:`jreshard.nccl.graph`;
        off by default: not run on GPU).

    Raises:
      BackendUnavailableError: CuPy or its NCCL does not import.
      ValueError: a local rank is not in ``devices``, or two local ranks on one
        device key name different CUDA ordinals.
    """

    __slots__ = (
        "_cuda",
        "_deferred",
        "_device_key",
        "_graphs",
        "_group",
        "_local",
        "_local_ranks",
        "_nccl",
        "_nccl_rank",
    )

    def __init__(
        self,
        *,
        devices: Mapping[int, int],
        local_devices: Mapping[int, int],
        rendezvous: Rendezvous,
        namespace: str = "default",
        timeout_s: float = 300.0,
        nccl: ModuleType | Any = None,
        cuda: ModuleType | Any = None,
        graphs: bool = False,
    ):
        self._graphs = bool(graphs)
        self._nccl = nccl if nccl is not None else import_cupy("cupy.cuda.nccl")
        self._cuda = cuda if cuda is not None else import_cupy("cupy.cuda")
        self._device_key = {int(r): int(k) for r, k in devices.items()}
        world = tuple(sorted(set(self._device_key.values())))
        self._nccl_rank = {k: i for i, k in enumerate(world)}
        ordinal_of: dict[int, int] = {}
        for r, o in sorted(local_devices.items()):
            if r not in self._device_key:
                raise ValueError(f"NcclComm: local rank {r} is not in devices (ranks {sorted(self._device_key)})")
            k = self._device_key[r]
            if ordinal_of.setdefault(k, int(o)) != int(o):
                raise ValueError(
                    f"NcclComm: ranks on device key {k} name CUDA ordinals {ordinal_of[k]} and {o}; "
                    "ranks that share a device must share its ordinal"
                )
        if not ordinal_of:
            raise ValueError("NcclComm: local_devices is empty; this process must drive at least one rank")
        self._local_ranks = tuple(sorted(int(r) for r in local_devices))
        self._group = _Group(namespace, world, tuple(sorted(ordinal_of.items())), (id(self._nccl), id(self._cuda)))
        with _LOCK:
            cached = _CACHE.get(self._group)
        self._local = cached if cached is not None else self._create(rendezvous, timeout_s)
        self._deferred = False

    def _create(self, rendezvous: Rendezvous, timeout_s: float) -> dict[int, _Local]:
        nccl, cuda, g = self._nccl, self._cuda, self._group
        gen = next(_GENERATION.setdefault((g.namespace, g.world), itertools.count()))
        key = f"nccl-uid/{g.namespace}/{hash(g.world) & 0xFFFFFFFF:08x}/{len(g.world)}/{gen}"
        makes_id = any(self._nccl_rank[k] == 0 for k, _ in g.local)
        made = nccl.get_unique_id() if makes_id else None
        raw = rendezvous.share(key, uid_to_bytes(made) if made is not None else None, timeout_s=timeout_s)
        uid = uid_argument(nccl, raw, made)

        def init() -> dict[int, _Local]:
            out: dict[int, _Local] = {}
            several = len(g.local) > 1
            if several:  # ncclCommInitRank for several devices of one thread must be grouped
                nccl.groupStart()
            try:
                for k, ordinal in g.local:
                    with cuda.Device(ordinal):
                        comm = nccl.NcclCommunicator(len(g.world), uid, self._nccl_rank[k])
                        out[k] = _Local(ordinal, self._nccl_rank[k], comm, cuda.Stream(non_blocking=True))
            finally:
                if several:
                    nccl.groupEnd()
            return out

        # Blocks until every NCCL rank has joined: bounded, since CuPy offers no non-blocking init.
        out = run_bounded(
            init, timeout_s, f"ncclCommInitRank for NCCL ranks {[self._nccl_rank[k] for k, _ in g.local]}"
        )
        with _LOCK:
            _CACHE[g] = out
        return out

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self._local_ranks

    def buffers(self, *, timeout_s: float = 300.0, cupy: CupyModule = None) -> CupyBuffers:
        """A :class:`~jreshard.cuda.buffers.CupyBuffers` on this communicator's streams,
        and from now on exchanges that do not wait on the host. Not run on GPU.

        Sends and receives then run on this communicator's stream per GPU, packs and unpacks on
        the buffers' own streams, ordered by events; the one host wait is the buffers'
        ``synchronize()`` at the end of a refit, which polls NCCL's errors while it waits and
        aborts every communicator past ``timeout_s``.
        """
        from jreshard.cuda.buffers import CupyBuffers

        self._deferred = True
        streams = {loc.ordinal: loc.stream for loc in self._local.values()}
        return CupyBuffers(streams=streams, cupy=cupy, timeout_s=timeout_s, watcher=self)

    def check_errors(self) -> None:
        """Raise :class:`PeerError` (after aborting every communicator) if NCCL reports an
        asynchronous error on any of them. Not run on GPU."""
        for k, loc in sorted(self._local.items()):
            try:
                loc.comm.check_async_error()
            except Exception as err:
                self._abort()
                raise PeerError(
                    f"NcclComm: NCCL reported an error on device key {k} (GPU {loc.ordinal}) of ranks "
                    f"{self._local_ranks} ({type(err).__name__}: {err}); communicators aborted",
                    destination_intact=False,
                ) from err

    def abort(self) -> None:
        """``ncclCommAbort`` every communicator of this process (they leave the cache). Not run on GPU."""
        self._abort()

    def stream(self, rank: int) -> CudaStream:
        """The CuPy stream NCCL uses for local ``rank``'s device (the comm stream of
        :meth:`buffers`, whose packs and unpacks run on streams of their own)."""
        return self._local[self._device_key[rank]].stream

    def nccl_rank(self, rank: int) -> int:
        """The NCCL rank of jreshard ``rank``'s device."""
        return self._nccl_rank[self._device_key[rank]]

    def exchange(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> None:
        """Post every send and receive in one NCCL group and wait for all. Not run on GPU.

        Each device's NCCL stream first waits on that device's current CuPy stream,
        so buffers packed there are complete before NCCL reads them; after
        :meth:`buffers`, the buffers' ``fence()`` orders their streams before NCCL's
        instead, and the current stream (the legacy default one, unless another was
        entered) is not touched.
        On return every receive has landed (the host waited on an event after the
        group), except after :meth:`buffers`: then the receives are ordered on the
        NCCL streams, which the buffers' kernels share, and the buffers'
        ``synchronize()`` waits for them.

        Raises:
          ValueError: an op's local rank is not driven here, a peer is unknown, or a
            buffer is not a contiguous 1-D uint8 CUDA array.
          TransferTimeoutError: not complete within ``timeout_s``; every communicator
            of this process was aborted.
          PeerError: NCCL reported an error; every communicator was aborted.
        """
        self._post(self._validate(sends, recvs), timeout_s)

    def exchange_rows(
        self, sends: Sequence[Row], recvs: Sequence[Row], buffers: Sequence[Any], *, timeout_s: float
    ) -> None:
        """:meth:`exchange` of rows ``(src, dst, tag, buffer, offset, nbytes)``: each message is posted at
        ``buffers[buffer]``'s device pointer plus ``offset``, with no slice made. Not run on GPU.

        Raises:
          ValueError: as :meth:`exchange`, or a row that runs past its buffer's end.
        """
        self._post(self._issue(self._row_ops(sends, recvs, buffers)), timeout_s)

    @staticmethod
    def _row_ops(
        sends: Sequence[Row], recvs: Sequence[Row], buffers: Sequence[Any]
    ) -> list[tuple[int, int, int, bool, int, int]]:
        bases: dict[int, tuple[int, int]] = {}
        ops = []
        for rows, is_send in ((sends, True), (recvs, False)):
            for src, dst, tag, b, off, n in rows:
                if b not in bases:
                    bases[b] = device_pointer(buffers[b])
                ptr, size = bases[b]
                if off < 0 or n < 0 or off + n > size:
                    raise ValueError(
                        f"NcclComm: the message {src}->{dst} tag {tag} is bytes {off}..{off + n} of a buffer of {size}"
                    )
                ops.append((src, dst, tag, is_send, ptr + off, n))
        return ops

    def issue_rows(
        self, sends: Sequence[Row], recvs: Sequence[Row], buffers: Sequence[Any], stream: CudaStream
    ) -> None:
        """Issue one group's sends and receives (rows as for :meth:`exchange_rows`) in one NCCL group on ``stream``,
        and return: no wait, no watchdog. For a stream under capture (:mod:`jreshard.nccl.graph`), whose launch is
        waited on, bounded, by its caller. Not run on GPU.

        Raises:
          ValueError: as :meth:`exchange_rows`.
        """
        issued = self._issue(self._row_ops(sends, recvs, buffers))
        if not issued:
            return
        nccl = self._nccl
        nccl.groupStart()
        try:
            for k, is_send, peer, ptr, n, _ in issued:
                loc = self._local[k]
                with self._cuda.Device(loc.ordinal):
                    post = loc.comm.send if is_send else loc.comm.recv
                    post(ptr, n, nccl.NCCL_UINT8, self._nccl_rank[peer], stream.ptr)
        finally:
            nccl.groupEnd()

    def graph(self, ops: Any) -> Any:
        """With ``graphs=True``: a :class:`~jreshard.nccl.graph.GraphRefit` of the schedule ``ops`` (the first step
        eager, the others one CUDA graph launch; eager every step where it cannot be captured, with the reason);
        else ``None``. Not run on GPU."""
        if not self._graphs:
            return None
        from jreshard.nccl.graph import GraphRefit, why_eager

        ordinals = sorted({loc.ordinal for loc in self._local.values()})
        return GraphRefit(ops, self, ordinals[0], why_eager(ops, ordinals))

    def _post(self, issued: list[tuple], timeout_s: float) -> None:
        if not issued:
            return
        nccl, cuda = self._nccl, self._cuda
        deadline = time.monotonic() + timeout_s
        used = sorted({k for k, *_ in issued})
        if not self._deferred:  # else the buffers ordered everything on this stream (fence), not the current one
            for k in used:
                loc = self._local[k]
                try:
                    with cuda.Device(loc.ordinal):
                        loc.stream.wait_event(cuda.get_current_stream().record())
                except Exception as err:  # CuPy's own error types
                    self._abort()
                    raise TransferError(
                        f"NcclComm: CUDA failed ordering the group of ranks {self._local_ranks} after the caller's "
                        f"work on GPU {loc.ordinal} ({type(err).__name__}: {err}), before "
                        f"{self._peers(issued, {k})}; communicators aborted",
                        destination_intact=False,
                    ) from err
        # groupEnd blocks while NCCL connects to the peers: a watchdog aborts the
        # communicators at the deadline, which makes it return with an error.
        with Watchdog(timeout_s, self._abort) as dog:
            try:
                nccl.groupStart()
                try:
                    for k, is_send, peer, ptr, n, _ in issued:
                        loc = self._local[k]
                        with cuda.Device(loc.ordinal):
                            if is_send:
                                loc.comm.send(ptr, n, nccl.NCCL_UINT8, self._nccl_rank[peer], loc.stream.ptr)
                            else:
                                loc.comm.recv(ptr, n, nccl.NCCL_UINT8, self._nccl_rank[peer], loc.stream.ptr)
                finally:
                    nccl.groupEnd()
            except Exception as err:
                self._abort()
                if dog.fired:
                    raise TransferTimeoutError(
                        f"NcclComm: posting the group of ranks {self._local_ranks} did not finish within "
                        f"timeout_s={timeout_s} ({self._peers(issued, set(used))}); communicators aborted",
                        destination_intact=False,
                    ) from err
                raise PeerError(
                    f"NcclComm: NCCL failed while posting {len(issued)} sends/receives of ranks {self._local_ranks} "
                    f"({type(err).__name__}: {err}); communicators aborted",
                    destination_intact=False,
                ) from err
        if not self._deferred:  # else the buffers' synchronize() waits, once, at the end
            self._wait(issued, used, deadline, timeout_s)

    def _validate(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp]) -> list[tuple]:
        ops = [(op.src, op.dst, op.tag, True, *device_pointer(op.buffer)) for op in sends]
        ops += [(op.src, op.dst, op.tag, False, *device_pointer(op.buffer)) for op in recvs]
        return self._issue(ops)

    def _issue(self, ops: Sequence[tuple[int, int, int, bool, int, int]]) -> list[tuple]:
        """``(device key, is_send, peer device key, pointer, nbytes, (src, dst))`` in issue order, from
        ``(src, dst, tag, is_send, pointer, nbytes)``."""
        local = set(self._local_ranks)
        rows: list[tuple[tuple[int, int, int, int], tuple]] = []
        for src, dst, tag, is_send, ptr, n in ops:
            mine, peer = (src, dst) if is_send else (dst, src)
            if mine not in local:
                what = "sends from" if is_send else "receives at"
                raise ValueError(
                    f"NcclComm: an op {what} rank {mine}, which this process does not drive {tuple(sorted(local))}"
                )
            if peer not in self._device_key:
                raise ValueError(f"NcclComm: peer rank {peer} is not in this communicator's devices")
            # Sends first, then receives; each sorted by the key both sides share.
            key = (0 if is_send else 1, src, dst, tag)
            rows.append((key, (self._device_key[mine], is_send, self._device_key[peer], ptr, n, (src, dst))))
        rows.sort(key=lambda row: row[0])
        return [r for _, r in rows]

    def _wait(self, issued: list[tuple], used: list[int], deadline: float, timeout_s: float) -> None:
        cuda = self._cuda
        events = {}
        for k in used:
            loc = self._local[k]
            try:
                with cuda.Device(loc.ordinal):
                    events[k] = loc.stream.record()
            except Exception as err:  # CuPy's own error types
                self._abort()
                raise TransferError(
                    f"NcclComm: CUDA failed recording the end of {self._peers(issued, {k})} on GPU {loc.ordinal} "
                    f"({type(err).__name__}: {err}); communicators aborted",
                    destination_intact=False,
                ) from err
        pause = _POLL_MIN_S
        pending = set(used)
        while pending:
            for k in sorted(pending):
                try:
                    done = event_done(events[k], cuda.runtime)
                except Exception as err:  # a CUDA error (sticky ones included), or whatever CuPy raised
                    self._abort()
                    raise TransferError(
                        f"NcclComm: CUDA reported {type(err).__name__}: {err} on GPU {self._local[k].ordinal} "
                        f"(device key {k}) while "
                        f"waiting for {self._peers(issued, {k})}; communicators aborted",
                        destination_intact=False,
                    ) from err
                if done:
                    pending.discard(k)
                    continue
                try:
                    self._local[k].comm.check_async_error()
                except Exception as err:
                    self._abort()
                    raise PeerError(
                        f"NcclComm: NCCL reported an error on device key {k} while waiting for "
                        f"{self._peers(issued, {k})} ({type(err).__name__}: {err}); communicators aborted",
                        destination_intact=False,
                    ) from err
            if not pending:
                break
            if time.monotonic() > deadline:
                self._abort()
                raise TransferTimeoutError(
                    f"NcclComm: ranks {self._local_ranks} still waiting after timeout_s={timeout_s} on "
                    f"{self._peers(issued, pending)}; communicators aborted so no rank hangs",
                    destination_intact=False,
                )
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    @staticmethod
    def _peers(issued: list[tuple], keys: set[int]) -> str:
        sends = sorted({pair[1] for k, s, _, _, _, pair in issued if k in keys and s})
        recvs = sorted({pair[0] for k, s, _, _, _, pair in issued if k in keys and not s})
        return f"sends to ranks {sends} and receives from ranks {recvs}"

    def _abort(self) -> None:
        """ncclCommAbort every communicator of this process and forget them."""
        with _LOCK:
            _CACHE.pop(self._group, None)
            todo = [loc for loc in self._local.values() if not loc.aborted]
            for loc in todo:
                loc.aborted = True  # the watchdog and the failing call may both get here
        for loc in todo:
            try:
                loc.comm.abort()
            except Exception:  # already failing: abort what can be aborted
                pass

    def close(self) -> None:
        """Nothing to release: the communicators stay cached for the next refit
        (:func:`destroy_cached_communicators` destroys them)."""
