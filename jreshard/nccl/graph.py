"""Prepared refits on a GPU as one CUDA graph: a schedule's packs, NCCL groups and unpacks captured once, launched
every step. Not run on GPU: written against CuPy 14's graph API (``Stream.begin_capture``/``end_capture``,
``Graph.launch``) and NCCL's support for capturing point-to-point calls, checked on the CPU stand-ins.

A refit's rounds are the same every step (see :mod:`jreshard.engine.replay`); on a GPU the host work of issuing
them (a kernel launch per pack and unpack, a ``groupStart``, a send or receive per message and a ``groupEnd`` per
group) can cost more than the bytes take on NVLink. :class:`GraphRefit` issues the whole schedule once into a
stream under capture and from then on launches the captured graph: one host call a step.

- **Stable buffers for NCCL.** A captured send or receive keeps its address; the graph's messages move through
  buffers it owns (its staging arenas, and a bounce slot per message that the schedule sends straight from a shard
  or receives straight into one), so one capture serves every step (see :class:`GraphRefit`).
- **The eager step first.** The first step of a schedule runs eagerly (the engine's own loop): NCCL connects to a
  peer on the first message between them, which cannot happen inside a capture.
- **What the graph holds.** Every pack and unpack is the byte kernel of :mod:`jreshard.cuda.kernels`, run
  over a launch table that lives in one device buffer; every exchange group is one NCCL group. Everything runs on
  the NCCL stream of this process's GPU, in the schedule's order (one stream orders it all: no fences), captured
  in CuPy's default mode (``streamCaptureModeRelaxed``: the kernel may be compiled and loaded inside the capture).
- **Every step.** The launch tables are rebuilt on the host from this step's shard addresses (source and
  destination shards move between steps) and copied to the device in one host-to-device copy before the launch,
  so the kernels read this step's addresses. Each launch's rows and blocks are baked into the graph: where they
  changed (a shard's new address allows another copy width), or an arena outgrew the graph's, the schedule is
  captured again before the launch. Nothing is written through a stale pointer.
- **Bounded.** The host waits for the launch on an event, polling NCCL's errors; past ``timeout_s`` every
  communicator of the process is aborted (so a dead peer leaves no GPU waiting forever) and
  :class:`~jreshard.errors.TransferTimeoutError` is raised.

Schedules it does not capture run eagerly every step, with the reason in :attr:`GraphRefit.eager_because`: rows that
cast dtypes (the cast kernel's tables are not refreshed here), ranks on more than one GPU in this process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jreshard.cuda import kernels as CK
from jreshard.cuda.runtime import event_done
from jreshard.engine.comm import StepGraph
from jreshard.engine.replay import EXCHANGE, PACK, START, UNPACK, WAIT, Ops
from jreshard.errors import TransferError, TransferTimeoutError
from jreshard.schedule import kernels as K
from jreshard.types import ByteBuffer, CudaEvent, CudaStream

__all__ = ["GraphRefit", "why_eager"]

_POLL_MIN_S, _POLL_MAX_S = 20e-6, 100e-6


def why_eager(ops: Ops, ordinals: Sequence[int]) -> str | None:
    """Why the schedule ``ops`` of a process driving GPUs ``ordinals`` is not captured, or ``None``.

    >>> from jreshard.engine.replay import ops_of
    >>> why_eager(ops_of((), (), {}, 0), [0, 1])
    'ranks on 2 GPUs in this process (one graph is captured on one stream)'
    """
    if len(set(ordinals)) != 1:
        return f"ranks on {len(set(ordinals))} GPUs in this process (one graph is captured on one stream)"
    for op in ops.ops:
        if op[0] in (PACK, UNPACK) and len(op[1]) and np.asarray(op[1])[:, K.CAST].any():
            return "rows that cast dtypes"
    return None


def _pointer(buffer: ByteBuffer) -> int:
    return 0 if buffer is None else int(buffer.data.ptr)


def _run_rows(places: Sequence[tuple[int, int, int, int]]) -> np.ndarray:
    """A descriptor table (``schedule.kernels``' columns) of plain byte runs ``(buffer, offset, staging offset,
    nbytes)``: the copies between a message's place in a shard and its slot in a graph's own buffer."""
    t = np.zeros((len(places), K.COLUMNS), np.int64)
    if len(places):
        p = np.array(places, np.int64).reshape(-1, 4)
        t[:, K.BUF], t[:, K.OFF], t[:, K.STAGE], t[:, K.NBYTES] = p[:, 0], p[:, 1], p[:, 2], p[:, 3]
        t[:, K.NDIM] = 1
        t[:, K.SHAPE0 : K.SHAPE0 + K.MAX_DIMS] = 1
        t[:, K.SHAPE0], t[:, K.STRIDE0] = p[:, 3], 1
    t.setflags(write=False)
    return t


class GraphRefit(StepGraph):
    """One schedule's steps on this process's GPU: the first eager, the others one CUDA graph launch (final).
    Not run on GPU.

    The graph's messages move through buffers it owns, whose addresses never change: its own staging arenas (the
    schedule's packs and unpacks use them in place of the step's), and one *bounce* buffer with a slot for every
    message that the schedule sends straight from a shard or receives straight into one (a copy kernel moves those
    bytes between the shard and the slot, before the group for a send, after it for a receive). So the only
    addresses that change from step to step, the shards', are read by kernels from the launch tables refreshed
    before each launch, and one capture serves every step while each launch's grid stays the same.

    Args:
      ops: the schedule's operations (:func:`jreshard.engine.replay.ops_of`).
      comm: the :class:`~jreshard.nccl.cupy_nccl.NcclComm` it runs over (its stream is the graph's).
      ordinal: the CUDA ordinal of this process's GPU.
      why: why the schedule runs eagerly every step (:func:`why_eager`), or ``None``.

    Attributes:
      steps: steps run; captures: graphs captured; launches: steps run as a graph launch.
      kernels: the kernels in the graph (packs, unpacks, and the copies to and from the bounce buffer).
      eager_because: why every step runs eagerly, or ``None``.
    """

    def __init__(self, ops: Ops, comm: Any, ordinal: int, why: str | None = None):
        self.ops, self._comm, self._ordinal = ops, comm, int(ordinal)
        self.eager_because = why
        self.steps = self.captures = self.launches = self.kernels = 0
        self._graph: Any = None
        self._baked: tuple | None = None  # each launch's (rows, blocks) when the graph was captured
        self._device: Any = None  # the launch tables on the device, one int64 array of _device_rows rows
        self._device_rows = -1
        self._cp: Any = None
        # Which buffers of the step's list are staging arenas (those that packs and unpacks name), the graph's own
        # arenas and bounce buffer (made on the first capture), and each group's rows over them.
        self._arenas = sorted({op[3] for op in ops.ops if op[0] in (PACK, UNPACK)})
        self._own: list[Any] = []
        self._rows: list[tuple[tuple, tuple]] = []
        self._bounce_sends: list[list[tuple[int, int, int, int]]] = []  # per group: (buffer, offset, slot, n)
        self._bounce_recvs: list[list[tuple[int, int, int, int]]] = []

    def release(self) -> None:
        """Drop the graph and the device memory it holds."""
        self._graph = self._device = self._baked = None
        self._device_rows = -1
        self._own = []

    def run(
        self,
        buffers: Any,
        bufs: Mapping[int, list],
        bases: list[Any],
        timeout_s: float,
        eager: Callable[[], np.ndarray],
    ) -> np.ndarray:
        """One step; seconds per phase ``[pack, network, fanout, unpack, idle]`` (a launch counts to network, its
        wait to idle too).

        Raises:
          TransferTimeoutError: the launch did not finish within ``timeout_s`` (communicators aborted);
          PeerError: NCCL reported an error (from ``NcclComm.check_errors``; communicators aborted);
          TransferError: CUDA failed (communicators aborted);
          ValueError: a message that leaves its buffer (nothing launched).
        """
        self.steps += 1
        if self.eager_because is not None or self.steps == 1:  # NCCL connects on the first, eager, step
            return eager()
        cp = self._cp = buffers.cupy
        t0 = time.perf_counter()
        stream = self._comm.stream(self._comm.local_ranks[0])
        with cp.cuda.Device(self._ordinal):
            own = zip(self._arenas, self._own[:-1], strict=True)
            if not self._own or any(bases[a].nbytes > o.nbytes for a, o in own):  # the first, or a larger arena
                self._layout(bases, stream)
            tables = self._bind(bufs, bases)
            baked = tuple((len(t), CK.grid_size(t)) for t in tables)
            buffers.fence()  # the same-device copies before the rounds, on the buffers' streams, before the graph
            if self._graph is None or baked != self._baked:
                self._capture(tables, stream)
                self._baked = baked
            if tables:  # one host-to-device copy: this step's addresses
                host = np.concatenate(tables)
                self._device[: len(host)].set(host, stream=stream)
            self._graph.launch(stream=stream)
            self.launches += 1
            t1 = time.perf_counter()
            self._wait(stream.record(), timeout_s)
        t2 = time.perf_counter()
        return np.array([0.0, t2 - t0, 0.0, 0.0, t2 - t1])

    def _layout(self, bases: list[Any], stream: CudaStream) -> None:
        """Make the graph's own arenas (as large as the step's) and bounce buffer, and each group's rows over them
        (the graph is captured again).

        Raises:
          ValueError: a message that runs past its buffer's end.
        """
        cp = self._cp
        index = {a: k for k, a in enumerate(self._arenas)}
        bounce = len(self._arenas)  # the bounce buffer's index in the graph's own list
        at = 0
        self._rows, self._bounce_sends, self._bounce_recvs = [], [], []
        for sends, recvs in self.ops.groups:
            out: list[list[tuple]] = [[], []]
            places: list[list[tuple[int, int, int, int]]] = [[], []]
            for side, rows in enumerate((sends, recvs)):
                for src, dst, tag, b, off, n in rows:
                    buf = bases[b]
                    if buf is None or off < 0 or n < 0 or off + n > buf.nbytes:
                        raise ValueError(
                            f"GraphRefit: the message {src}->{dst} tag {tag} is bytes {off}..{off + n} of buffer {b}, "
                            "which is smaller; nothing was launched"
                        )
                    if b in index:
                        out[side].append((src, dst, tag, index[b], off, n))
                    else:  # straight from or into a shard: through a slot of the bounce buffer
                        places[side].append((b, off, at, n))
                        out[side].append((src, dst, tag, bounce, at, n))
                        at += -(-max(n, 1) // 256) * 256
            self._rows.append((tuple(out[0]), tuple(out[1])))
            self._bounce_sends.append(places[0])
            self._bounce_recvs.append(places[1])
        with stream:
            self._own = [cp.empty(max(bases[a].nbytes, 1), cp.uint8) for a in self._arenas]
            self._own.append(cp.empty(max(at, 1), cp.uint8))
        self._graph = None

    def _bind(self, bufs: Mapping[int, list], bases: list[Any]) -> list[np.ndarray]:
        """This step's launch tables, in the order the graph runs them: per pack and unpack (over the graph's own
        arenas), and per group its shard-to-bounce copies before it and bounce-to-shard copies after it."""
        tables: list[np.ndarray] = []
        ptrs: dict[int, list[int]] = {}
        own = {a: _pointer(o) for a, o in zip(self._arenas, self._own[:-1], strict=True)}
        bounce = _pointer(self._own[-1])
        every: list[int] | None = None
        for op in self.ops.ops:
            code = op[0]
            if code in (PACK, UNPACK):
                if not len(op[1]):
                    continue
                table, r = op[1], op[2]
                if r not in ptrs:
                    ptrs[r] = [_pointer(b) for b in bufs[r]]
                if code == PACK:
                    tables.append(CK.pack_launch(table, ptrs[r], own[op[3]]))
                else:
                    tables.append(CK.unpack_launch(table, own[op[3]], ptrs[r]))
            elif code in (EXCHANGE, START, WAIT):
                g = op[1]
                if every is None:
                    every = [_pointer(b) for b in bases]
                if code != WAIT and self._bounce_sends[g]:
                    tables.append(CK.pack_launch(_run_rows(self._bounce_sends[g]), every, bounce))
                if code != START and self._bounce_recvs[g]:
                    tables.append(CK.unpack_launch(_run_rows(self._bounce_recvs[g]), bounce, every))
        return tables

    def _capture(self, tables: list[np.ndarray], stream: CudaStream) -> None:
        """Issue the schedule into ``stream`` under capture, in :meth:`_bind`'s order: a kernel over each launch
        table's place in the device buffer, one NCCL group per exchange group over the graph's own buffers."""
        cp = self._cp
        rows = sum(len(t) for t in tables)
        if rows != self._device_rows:
            with stream:
                self._device = cp.empty((max(rows, 1), CK.LAUNCH_COLUMNS), np.int64)
            self._device_rows = rows
        stream.synchronize()  # nothing of an earlier step may be pending on a stream under capture
        self._graph = None
        at, k = 0, 0

        def kernel() -> None:
            nonlocal at, k
            t = tables[k]
            k += 1
            CK.launch_uploaded(self._device[at : at + len(t)], len(t), CK.grid_size(t), stream, cp)
            at += len(t)

        stream.begin_capture()
        try:
            for op in self.ops.ops:
                code = op[0]
                if code in (PACK, UNPACK):
                    if len(op[1]):
                        kernel()
                elif code in (EXCHANGE, START, WAIT):
                    g = op[1]
                    if code != WAIT:
                        if self._bounce_sends[g]:
                            kernel()
                        sends, recvs = self._rows[g]
                        self._comm.issue_rows(sends, recvs, self._own, stream)
                    if code != START and self._bounce_recvs[g]:  # the stream orders it after the group
                        kernel()
        except BaseException:
            try:
                stream.end_capture()  # the capture is dropped: the stream is usable again
            except Exception:  # already failing
                pass
            raise
        self._graph = stream.end_capture()
        self.captures += 1
        self.kernels = k

    def _wait(self, event: CudaEvent, timeout_s: float) -> None:
        """Poll ``event`` and NCCL's errors until the launch finished; abort every communicator past
        ``timeout_s``."""
        comm, runtime = self._comm, self._cp.cuda.runtime
        deadline = time.monotonic() + timeout_s
        pause = _POLL_MIN_S
        while True:
            try:
                if event_done(event, runtime):
                    return
            except runtime.CUDARuntimeError as err:
                comm.abort()
                raise TransferError(
                    f"GraphRefit: CUDA reported {err} on GPU {self._ordinal} while a refit's graph ran; "
                    "communicators aborted",
                    destination_intact=False,
                ) from err
            comm.check_errors()  # PeerError, the communicators aborted
            if time.monotonic() > deadline:
                comm.abort()
                raise TransferTimeoutError(
                    f"GraphRefit: a refit's graph on GPU {self._ordinal} did not finish within timeout_s={timeout_s}; "
                    "communicators aborted so no rank waits forever",
                    destination_intact=False,
                )
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)
