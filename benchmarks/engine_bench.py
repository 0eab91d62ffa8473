"""The engine's host cost per round on the real path: one DeepSeek-V3 128 + 128 destination rank's rounds, run
by the engine over real CPU buffers and real MPI messages, each step after the first replayed from the schedule
the first prepared.

**What runs.** Two MPI processes (``mpiexec -n 2``, started by this script). Process 0 is the destination rank:
``jreshard.engine.rounds.execute`` over an :class:`~jreshard.mpi.comm.MpiComm` and :class:`CpuBuffers`, exactly as
a refit calls it, step after step. Process 1 plays every peer of that rank: per exchange group, the sends the rank
receives and the receives of what it sends, in the same order, from a prepared schedule of its own.

**What is cut.** The rank's real schedule is kept whole: its 2,586 rounds, every group, message, peer, tag and
descriptor row, in real shard buffers of their real sizes (sparse memory: only the pages the rows touch are
ever written) and in its staging arena. What is cut is the bytes: every message and every descriptor row moves
at most ``--row-bytes`` bytes (64 by default) from where it would start. So the wall time of a step is the host
time the engine spends per round (packs and unpacks of every row, starting and completing every request, the
round loop, the report), with the bytes, which the wire and memory would move, taken out. That host time is
then set beside the refit's time the cost model predicts (labelled predicted) for the same model, ranks and
links as ``plan_bench.py`` (GB200 NVL72 racks, 50 GB/s NIC, 900 GB/s NVLink).

Columns, in the same run: the **prepared** engine (the default: the first step prepares, the others replay), the
**per-op** engine (the same rounds with every group posted afresh, operation by operation, as before prepared
refits), and the null transport and null buffers (the round loop alone, no bytes and no messages); then the
prepared column again in processes that initialise MPI at ``MPI_THREAD_SERIALIZED`` (mpi4py's default is
``MULTIPLE``, where MPICH takes a lock in every call). The headline line is mpi4py's default. Then, where NIXL is
installed, the same rank over NIXL (two processes, UCX on loopback): prepared groups and per-operation posts, both
with the box MACs checking every message as ``RefitGroup`` and elastic replicas run NIXL, and prepared groups with
NIXL's per-message tags instead (``--nixl off``: not run).

**Host time** is the wall time of a replayed step less the time the engine waited idle (``TransferReport.idle_s``:
its polls that completed nothing, after the first of each stretch, and the back-off between them), per round. It
counts the polls that received a message, and preemption by other processes: on a loaded host it grows, and the
load average of the runs is printed beside it (the CPU time of the engine's thread too, which counts the idle
polls but not preemption).

**MPI's own floor.** ``mpi_floor.c`` (built with the MPI's ``mpicc``) runs the rank's groups with nothing of
jreshard: the same sends and receives a group, as persistent requests of 0 bytes built once, each group started
(``MPI_Startall``) and its requests tested in order (``MPI_Test``), as the compiled replay does, in two C processes,
in ``--launches`` launches. What it prints per round is what MPI alone costs the rank's rounds on this machine at
this moment; the engine's host time cannot be below it.

**Launches.** MPICH on the 2-core development VM runs at one of two speeds from one ``mpiexec`` launch to the next
(about 1.3-1.8 or 2.7-3.1 us a round; a process that only starts and completes the same persistent requests moves
with it), so one launch's number is a draw. The prepared column therefore runs in ``--launches`` launches (5 by
default: the first with every column, the others alone), and the last line is over their medians.

Run: ``JAX_PLATFORMS=cpu python benchmarks/engine_bench.py [--repeat 7] [--launches 5]``. The schedule is built as
``plan_bench.py`` builds it (its peers' side of the mail answered from their own rank plans, computed in a
separate, untimed process). The last line is ``engine host: <median> us/round (<min>-<max>), <pct>% of the
predicted refit``: the median of the launches' medians (each over its replayed steps), and their range.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_bench_local import answer_mail, peer_mail_process

from jreshard.engine import replay
from jreshard.engine import rounds as rounds_module
from jreshard.engine.buffers import Buffers, CpuBuffers
from jreshard.engine.comm import Communicator, RecvOp, Row, SendOp
from jreshard.engine.digest import DigestComm, mismatches
from jreshard.engine.rounds import CompiledRounds, Shards, compile_rounds, execute
from jreshard.models import refit, refit_topology
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder
from jreshard.schedule import kernels
from jreshard.schedule.pairsched import pair_paced
from jreshard.sharding.planner import rank_plans
from jreshard.sharding.rows import TensorSpec
from jreshard.sharding.simulate import simulate_layouts

NIC, NVLINK, DOMAIN = 50e9, 900e9, 64  # as plan_bench.py: GB200 NVL72 racks of 64 GPUs of a job


class _Null:
    """A buffer that is every slice of itself: the engine cuts regions out of it and nothing is stored."""

    def __getitem__(self, _: Any) -> _Null:
        return self


_NULL = _Null()


class NullBuffers(Buffers[_Null]):
    """Buffers that move no byte: the engine's host work alone remains (final)."""

    def export_source(self, shard: Any) -> Any:
        return _NULL

    def writable_view(self, array: Any) -> Any:
        return _NULL

    def allocate(self, sizes: Sequence[int], device: Any) -> list[Any]:
        return [_NULL for _ in sizes]

    def import_shard(self, buffer: Any, shape: Sequence[int], dtype: np.dtype, device: Any) -> Any:
        return None

    def staging(self, nbytes: int, device: Any = None) -> Any:
        return _NULL

    def pack(self, table: np.ndarray, buffers: Sequence[Any], staging: Any) -> None:
        pass

    def unpack(self, table: np.ndarray, staging: Any, buffers: Sequence[Any]) -> None:
        pass

    def copy(self, src_table: np.ndarray, src: Sequence[Any], dst_table: np.ndarray, dst: Sequence[Any]) -> None:
        pass

    def upload(self, data: np.ndarray, device: Any) -> Any:
        return data

    def download(self, buffer: Any) -> np.ndarray:
        return np.asarray(buffer)


class NullComm(Communicator):
    """Completes every exchange at once and moves nothing; counts the operations it was given.

    It takes the round loop's rows as they come (as a transport that posts from a base pointer and an
    offset does); :class:`SlicingNullComm` takes them through the default adapter instead.
    """

    def __init__(self, ranks: Sequence[int]):
        self._ranks = tuple(ranks)
        self.exchanges = 0
        self.ops = 0

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self._ranks

    def exchange(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> None:
        self.exchanges += 1
        self.ops += len(sends) + len(recvs)

    def exchange_rows(self, sends: Sequence[Row], recvs: Sequence[Row], buffers: Sequence[Any], *, timeout_s: float):
        self.exchanges += 1
        self.ops += len(sends) + len(recvs)


class SlicingNullComm(NullComm):
    """:class:`NullComm` behind :meth:`Communicator.exchange_rows`'s default: a slice and an operation object
    per chunk, what a transport that takes buffer objects pays (MPI, the loopback ones) (final)."""

    exchange_rows = Communicator.exchange_rows


def schedule_of(name: str, n: int, rank: int) -> tuple[Any, list[TensorSpec], Any, Any]:
    r = refit(name, n, n)
    topo = refit_topology(n, n, DOMAIN, network_bw=NIC, fast_bw=NVLINK)
    peers = peer_mail_process(name, n, rank, DOMAIN, NIC, NVLINK)
    tensors = [TensorSpec(nm, s, d) for nm, (s, d) in zip(r.names, r.pairs, strict=True)]
    opts = Options()
    talk = pair_paced(tensors, rank_plans(r.pairs, [rank], topo, names=r.names), opts)
    _, want = next(talk)
    try:
        while True:
            _, want = talk.send(answer_mail(want, *peers[:4]))
    except StopIteration as done:
        sched = done.value
    return sched, tensors, r, topo


_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; mmap exports it from Python 3.13 on


def sparse(nbytes: int) -> np.ndarray:
    """``nbytes`` of zero-filled memory that takes no room until written (anonymous, reserving no swap, in small
    pages: a row written into a huge page would fault in and zero 2 MiB)."""
    m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        m.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(m, np.uint8)[:nbytes]


def _cut_table(table: np.ndarray, row_bytes: int) -> np.ndarray:
    """``table`` with each row cut to its first ``row_bytes`` bytes at the same buffer and staging offsets."""
    t = np.array(table, np.int64)
    n = np.minimum(t[:, kernels.NBYTES], row_bytes)
    t[:, kernels.NDIM] = 1
    t[:, kernels.SHAPE0 : kernels.SHAPE0 + kernels.MAX_DIMS] = 1
    t[:, kernels.STRIDE0 : kernels.STRIDE0 + kernels.MAX_DIMS] = 0
    t[:, kernels.SHAPE0], t[:, kernels.STRIDE0], t[:, kernels.NBYTES] = n, 1, n
    t.setflags(write=False)
    return t


def cut_rounds(compiled: CompiledRounds, row_bytes: int) -> CompiledRounds:
    """``compiled`` with every message and descriptor row cut to at most ``row_bytes`` bytes (rounds, groups, peers,
    tags, rows and offsets unchanged)."""

    def rows(rs: tuple) -> tuple:
        return tuple((*r[:5], min(r[5], row_bytes)) for r in rs)

    rounds = tuple(
        (
            tuple((_cut_table(t, row_bytes), r, a) for t, r, a in packs),
            tuple((rows(s), rows(v)) for s, v in groups),
            tuple((_cut_table(t, row_bytes), r, a) for t, r, a in unpacks),
            network,
        )
        for packs, groups, unpacks, network in compiled.rounds
    )
    return CompiledRounds(
        rounds=rounds,
        ahead=compiled.ahead,
        sent_bytes=compiled.sent_bytes,
        messages=compiled.messages,
        chunks=compiled.chunks,
        needs=compiled.needs,
    )


def mirror_rounds(compiled: CompiledRounds, row_bytes: int) -> tuple[tuple, int]:
    """The rounds of the process that plays every peer of ``compiled``'s rank: per group of the rank, one group with a
    send for each of its receives and a receive for each of its sends, each in its own slot of one scratch buffer
    (buffer 0); and the scratch buffer's size. The peer replays them as the engine does (prepared and compiled), so
    that it keeps pace with the rank."""
    rounds, widest = [], 0
    for _, groups, _, network in compiled.rounds:
        mirrored = []
        for sends, recvs in groups:
            widest = max(widest, len(sends) + len(recvs))
            ms = tuple((s, d, t, 0, k * row_bytes, n) for k, (s, d, t, _, _, n) in enumerate(recvs))
            mr = tuple((s, d, t, 0, (len(recvs) + k) * row_bytes, n) for k, (s, d, t, _, _, n) in enumerate(sends))
            mirrored.append((ms, mr))
        rounds.append(((), tuple(mirrored), (), network))
    return tuple(rounds), max(widest, 1) * max(row_bytes, 1)


def _worker(path: str) -> None:
    """One of the two MPI processes of the real path (see the module docstring)."""
    with open(path, "rb") as f:
        job = pickle.load(f)
    import mpi4py

    mpi4py.rc.thread_level = job["thread_level"]  # read when MPI is initialised, below
    from mpi4py import MPI

    from jreshard.mpi.comm import MpiComm

    level = {"multiple": MPI.THREAD_MULTIPLE, "serialized": MPI.THREAD_SERIALIZED}[job["thread_level"]]
    if MPI.Query_thread() != level:  # MPI was initialised before the level was set
        raise SystemExit(f"engine_bench: MPI runs at thread level {MPI.Query_thread()}, not {job['thread_level']}")

    class PerOpMpiComm(MpiComm):
        """MpiComm with no prepared groups: every group posted afresh, operation by operation (the engine's
        path before prepared refits)."""

        def prepare(self, groups):
            return None

    sched, rank, sizes, repeat = job["schedule"], job["rank"], job["sizes"], job["repeat"]
    world = MPI.COMM_WORLD
    opts = Options()
    arenas = 2 if 2 * sched.staging.get(rank, 0) <= opts.staging_bytes else 1
    compiled = compile_rounds(sched, (rank,), (arenas,), opts.max_group_ops)
    cache = rounds_module._compiled[sched]  # execute() finds its compiled rounds here: it runs the cut rounds
    (key,) = (k for k, v in cache.items() if v is compiled)
    peers = sorted(
        {row[1] for _, gs, _, _ in compiled.rounds for s, _ in gs for row in s}
        | {row[0] for _, gs, _, _ in compiled.rounds for _, v in gs for row in v}
    )
    rank_process = {rank: 0, **dict.fromkeys(peers, 1)}
    kinds = {"prepared": MpiComm, "per-op": PerOpMpiComm}
    out: dict[str, Any] = {}
    if world.Get_rank() == 0:
        total = sum(-(-n // 64) * 64 for n in sizes.values())
        memory, at, dst = sparse(total), 0, {}
        for t, n in sorted(sizes.items()):
            dst[(t, rank)] = memory[at : at + n]
            at += -(-n // 64) * 64
        shards = Shards(src={}, dst=dst)
    for name, kind, row_bytes in job["columns"]:
        cut = cut_rounds(compiled, row_bytes)
        cache[key] = cut
        comm = kinds[kind](world, rank_process)
        if world.Get_rank() == 0:
            times, cpu, reports = [], [], []
            for step in range(repeat + 1):
                if step == 1:
                    _counters(None)
                world.Barrier()
                rep = ReportBuilder(Backend.MPI)
                c0, t0 = time.thread_time(), time.perf_counter()
                execute(sched, comm, shards, options=opts, buffers=CpuBuffers(), report=rep)
                times.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
                reports.append(rep.build())
            out[name] = {
                "times": times,
                "cpu": cpu,
                "idle": [r.idle_s for r in reports],
                "rounds": reports[-1].rounds,
                "replayed": [r.replayed_rounds for r in reports],
                "ops": sum(len(s) + len(v) for _, gs, _, _ in cut.rounds for s, v in gs),
                "row_bytes": row_bytes,
                "kind": kind,
            }
            out[name]["peer_busy"] = world.recv(source=1)
            _counters(f"{name}, the rank", repeat * len(cut.rounds))
        else:
            rounds, nbytes = mirror_rounds(cut, row_bytes)
            peer = replay.Replay(rounds, replay.ops_of(rounds, (False,) * len(rounds), {}, 0), comm)
            busy: list[float] = []
            scratch = [np.zeros(nbytes, np.uint8)]
            for step in range(repeat + 1):
                if step == 1:
                    _counters(None)
                world.Barrier()
                t0 = time.perf_counter()
                phases = peer.run(comm, CpuBuffers(), {}, scratch, opts.timeout_s, time.perf_counter)
                busy.append(time.perf_counter() - t0 - phases[4])
            peer.release()
            _counters(f"{name}, the peers", repeat * len(cut.rounds))
            world.send(busy, dest=0)
        comm.close()
    if world.Get_rank() == 0:
        out["compiled"] = replay.compiled_replay()
        print("RESULT " + json.dumps(out), flush=True)


def mpi_floor(compiled: CompiledRounds, repeat: int, launches: int) -> list[float]:
    """MPI's own host time per round for the rank's rounds, nothing of jreshard: ``mpi_floor.c`` (built here with
    the MPI's ``mpicc``) starts and tests persistent requests of 0 bytes in the rank's groups, with the same sends
    and receives a group, in ``launches`` launches of two processes; each launch's median us per group (a round
    is one group here). Empty when it cannot be built."""
    bindir = Path(sys.executable).parent
    counts = [len(x) for _, gs, _, _ in compiled.rounds for s, v in gs for x in (s, v)]
    with tempfile.TemporaryDirectory() as tmp:
        exe, data = os.path.join(tmp, "mpi_floor"), os.path.join(tmp, "counts")
        np.array([len(counts) // 2, *counts], dtype=np.int32).tofile(data)
        src = str(Path(__file__).resolve().parent / "mpi_floor.c")
        built = subprocess.run([str(bindir / "mpicc"), "-O2", src, "-o", exe], capture_output=True, text=True)
        if built.returncode:
            sys.stderr.write(f"engine_bench: mpi_floor.c not built: {built.stderr[-500:]}\n")
            return []
        out = []
        for _ in range(launches):
            cmd = [str(bindir / "mpiexec"), "-n", "2", exe, data, str(repeat)]  # MPI_THREAD_MULTIPLE, as mpi4py
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("floor ")), None)
            if done.returncode or line is None:
                raise SystemExit(f"engine_bench: mpi_floor failed (rc {done.returncode}):\n{done.stderr[-2000:]}")
            out.append(float(line.split()[1]))
    return out


def _counters(label: str | None, rounds: int = 1) -> None:
    """Where the compiled replay's time went, when ``_replay.c`` was built with ``-DREPLAY_PROFILE`` (a profiling
    build; a release has no counters and this does nothing): clear the counters (``label`` None), or print them per
    round to stderr (the parent passes those lines on)."""
    read = getattr(replay._native, "profile", None)
    if read is None:
        return
    start, poll, polls, failed, copy, waits = read()
    if label is not None and waits:  # the compiled replay ran
        print(
            f"   replay counters ({label}): start {start / rounds / 1e3:.2f} us, polls {poll / rounds / 1e3:.2f} us "
            f"({polls / rounds:.1f} a round, {failed / rounds:.1f} found nothing), packs and unpacks "
            f"{copy / rounds / 1e3:.2f} us per round",
            file=sys.stderr,
            flush=True,
        )


COLUMNS = (
    ("prepared", "prepared", 0),
    ("per-op", "per-op", 0),
    ("prepared, 64 B rows", "prepared", 64),
)
"""The real path's columns: (name, engine, bytes each message and descriptor row keeps)."""

SERIALIZED = (("prepared, serialized", "prepared", 0),)
"""The column run again in processes that initialise MPI at ``MPI_THREAD_SERIALIZED`` (``mpi4py.rc.thread_level =
"serialized"``) instead of mpi4py's default ``MPI_THREAD_MULTIPLE``, where MPICH takes a lock in every call."""


def _job(tmp: str, sched: Any, tensors: list[TensorSpec], rank: int, **more: Any) -> str:
    """A pickled job for the worker processes in ``tmp``: the schedule, the rank, the byte size of each of its
    destination shards, and ``more``; its path."""
    sizes = {
        t: spec.dst.box_of(rank).volume * spec.dst.itemsize for t, spec in enumerate(tensors) if rank in spec.dst.ranks
    }
    path = os.path.join(tmp, "job.pkl")
    with open(path, "wb") as f:
        pickle.dump({"schedule": sched, "rank": rank, "sizes": sizes, **more}, f, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def real_path(
    sched: Any,
    tensors: list[TensorSpec],
    rank: int,
    repeat: int,
    columns: tuple = COLUMNS,
    thread_level: str = "multiple",
) -> dict:
    """Run :func:`_worker` in two MPI processes, MPI initialised at ``thread_level`` (mpi4py's names); their
    measurements."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    with tempfile.TemporaryDirectory() as tmp:
        path = _job(tmp, sched, tensors, rank, repeat=repeat, columns=columns, thread_level=thread_level)
        env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
        cmd = [str(mpiexec), "-n", "2", sys.executable, str(Path(__file__).resolve()), "--worker", path]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    sys.stderr.write("".join(ln + "\n" for ln in done.stderr.splitlines() if "replay counters" in ln))
    if done.returncode or line is None:
        raise SystemExit(f"engine_bench: the MPI run failed (rc {done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads(line[len("RESULT ") :])


# ---- NIXL: the same real path over NixlComm, prepared groups beside per-operation posts ------------------------
NIXL_COLUMNS = (("NIXL prepared", True, True), ("NIXL per-op", False, True), ("NIXL prepared, tags", True, False))
"""The NIXL columns: (name, whether ``NixlComm.prepares``, whether the box MACs check the messages). The box MACs
are how ``RefitGroup`` and elastic replicas run NIXL (``NixlComm.tags`` off, a :class:`DigestComm` over it, keyed
by the connection's session and a nonce per step, see :mod:`jreshard.refit.boxes`); the last column is NIXL's own
per-message tags instead (what the box MACs replaced), for comparison."""


def _box_macs(comm: Any, session: Any, step: int) -> Any:
    """Start one step's box MACs on ``comm`` (a :class:`DigestComm`), as a refit does; its :class:`Digests`. Both
    processes derive the step's nonce from its index (a refit's source draws one and sends it in its vote)."""
    from jreshard.refit import boxes

    nonce = hashlib.sha256(b"engine_bench %d" % step).hexdigest()[:32]
    digests = boxes.digests_for("mac", comm.local_ranks, lambda r: boxes.keyed(session, nonce))
    comm.begin(digests)
    return digests


def _nixl_worker(path: str, me: int) -> None:
    """One of the two processes of the NIXL path: process 0 the rank (``execute`` over ``NixlComm`` and
    :class:`CpuBuffers`), process 1 every peer of it (the mirrored rounds replayed over its own ``NixlComm``),
    connected by an authenticated channel on loopback, one NIXL agent (UCX) each."""
    from jreshard.net.channel import accept_one, connect, format_address, listen, parse_address
    from jreshard.nixl import NixlAgent, NixlComm

    with open(path, "rb") as f:
        job = pickle.load(f)
    sched, rank, sizes, repeat, row_bytes = job["schedule"], job["rank"], job["sizes"], job["repeat"], job["row_bytes"]
    key = b"engine-bench-nixl-key-0123456789"
    address = path + ".address"
    if me == 0:
        server = listen("127.0.0.1", 0)
        with open(address + ".tmp", "w") as f:
            f.write(format_address(*server.getsockname()[:2]))
        os.replace(address + ".tmp", address)
        ch = accept_one(server, "the peers' process", key=key, timeout_s=120)
    else:
        ch = connect(parse_address(address, timeout_s=120), "the rank's process", key=key, timeout_s=120)
    opts = Options(timeout_s=300.0)
    want = CpuBuffers().staging_buffers  # NixlComm does not post ahead
    arenas = want if want * sched.staging.get(rank, 0) <= opts.staging_bytes else 1
    compiled = compile_rounds(sched, (rank,), (arenas,), opts.max_group_ops)
    cache = rounds_module._compiled[sched]
    (k,) = (k for k, v in cache.items() if v is compiled)
    cut = cache[k] = cut_rounds(compiled, row_bytes)  # execute() finds it here
    peers = sorted(
        {row[1] for _, gs, _, _ in cut.rounds for s, _ in gs for row in s}
        | {row[0] for _, gs, _, _ in cut.rounds for _, v in gs for row in v}
    )
    agent = NixlAgent.shared()
    out: dict[str, Any] = {}
    if me == 0:
        total = sum(-(-n // 64) * 64 for n in sizes.values())
        memory, at, dst = sparse(total), 0, {}
        for t, n in sorted(sizes.items()):
            dst[(t, rank)] = memory[at : at + n]
            at += -(-n // 64) * 64
        shards = Shards(src={}, dst=dst)
    for name, prepares, macs in NIXL_COLUMNS:
        remote = dict.fromkeys(peers, ch) if me == 0 else {rank: ch}
        wire = NixlComm(agent, [rank] if me == 0 else peers, remote, timeout_s=opts.timeout_s)
        wire.prepares = prepares
        comm: Any = wire
        if macs:  # as RefitGroup and elastic replicas run NIXL
            wire.tags = False
            comm = DigestComm(wire)
        ch.send_control({"op": "bench.ready"}, timeout_s=60)
        ch.recv_control(timeout_s=120)
        times, cpu, streams, macs_s = [], [], {}, []
        if me != 0:
            rounds, nbytes = mirror_rounds(cut, row_bytes)
            peer = replay.Replay(rounds, replay.ops_of(rounds, (False,) * len(rounds), {}, 0), comm)
            scratch = [np.zeros(nbytes, np.uint8)]
        for step in range(repeat + 1):
            c0, t0 = time.thread_time(), time.perf_counter()
            digests = _box_macs(comm, ch.session, step) if macs else None
            try:
                if me == 0:
                    report = ReportBuilder(Backend.MPI)
                    execute(sched, comm, shards, options=opts, buffers=CpuBuffers(), report=report)
                else:
                    peer.run(comm, CpuBuffers(), {}, scratch, opts.timeout_s, time.perf_counter)
                if digests is not None:
                    comm.finish()
            finally:
                if digests is not None:
                    comm.end()
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            if digests is not None:
                streams, macs_s = digests.streams(), [*macs_s, digests.cost().seconds]
        if me == 0:
            out[name] = {"times": times, "cpu": cpu, "rounds": len(cut.rounds), "row_bytes": row_bytes}
            out[name]["ops"] = sum(len(s) + len(v) for _, gs, _, _ in cut.rounds for s, v in gs)
            got = ch.recv_control(timeout_s=600)
            out[name]["peer_busy"], out[name]["macs_s"] = got["busy"], macs_s
            if macs:  # every message digested alike at both ends: what a refit's commit vote compares
                bad = mismatches(streams["sent"], got["streams"]["landed"])
                bad += mismatches(got["streams"]["sent"], streams["landed"])
                if bad or not streams["sent"] or not streams["landed"]:
                    raise SystemExit(f"engine_bench: the box MACs of the two processes differ: {bad[:5]}")
        else:
            peer.release()
            ch.send_control({"op": "bench.busy", "busy": cpu, "streams": streams}, timeout_s=60)
        comm.close()
    if me == 0:
        print("RESULT " + json.dumps(out), flush=True)
    ch.close()


def nixl_path(sched: Any, tensors: list[TensorSpec], rank: int, repeat: int, row_bytes: int = 64) -> dict:
    """Run :func:`_nixl_worker` in two processes; the rank's measurements."""
    with tempfile.TemporaryDirectory() as tmp:
        path = _job(tmp, sched, tensors, rank, repeat=repeat, row_bytes=row_bytes)
        env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
        procs = [
            subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--nixl-worker", path, "--nixl-process", str(p)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for p in (0, 1)
        ]
        try:
            done = [p.communicate(timeout=1800) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    line = next((ln for ln in done[0][0].splitlines() if ln.startswith("RESULT ")), None)
    if any(p.returncode for p in procs) or line is None:
        raise SystemExit(f"engine_bench: the NIXL run failed:\n{done[0][1][-3000:]}\n{done[1][1][-3000:]}")
    return json.loads(line[len("RESULT ") :])


def nixl_section(sched: Any, tensors: list[TensorSpec], rank: int, repeat: int, label: str) -> None:
    """Print the NIXL columns: host time per round with prepared groups beside the per-operation way."""
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        print("   NIXL: not run (nixl-cu12 is not installed)")
        return
    got = nixl_path(sched, tensors, rank, repeat)
    print(f"   NIXL ({label}): execute() over CpuBuffers and NixlComm (UCX, loopback), 2 processes (the rank; one")
    print("   playing all its peers), wall and CPU time of the engine's thread per round (no idle time is reported")
    print("   over NIXL: wall is host time plus the waits); the peer's CPU time per round. With the box MACs (as")
    print("   RefitGroup and elastic replicas run NIXL; checked equal at both ends) or NIXL's per-message tags")
    cpu: dict[str, float] = {}
    for name, col in got.items():
        r = max(col["rounds"], 1)
        wall = [t / r * 1e6 for t in col["times"][1:]]
        cpus = [c / r * 1e6 for c in col["cpu"][1:]]
        cpu[name] = statistics.median(cpus)
        macs = f"; box MACs {_spread([m / r * 1e6 for m in col['macs_s'][1:]])} us" if col["macs_s"] else ""
        print(
            f"   {name:>19}: rows of {col['row_bytes']} B, {col['ops']} messages; first step "
            f"{col['times'][0] * 1e3:.1f} ms; wall {_spread(wall)}, CPU {_spread(cpus)} us per round{macs}; the "
            f"peer's CPU {_spread([b / r * 1e6 for b in col['peer_busy'][1:]])} us"
        )
    names = [n for n, _, _ in NIXL_COLUMNS]
    print(f"   NIXL per-op / prepared CPU time per round: {cpu[names[1]] / cpu[names[0]]:.1f}x (same run)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--ranks", type=int, default=128, help="ranks per side")
    ap.add_argument("--repeat", type=int, default=7, help="replayed steps per column (after the one that prepares)")
    ap.add_argument("--profile", action="store_true", help="print where the null round loop's time goes")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # a pickled job: run as one of the two MPI processes
    ap.add_argument("--nixl", choices=("same", "off"), default="same", help="the NIXL columns: this rank, or none")
    ap.add_argument(
        "--launches",
        type=int,
        default=5,
        help="mpiexec launches of the prepared column (the first with every column); the last line's median and "
        "range are over their medians (default 5)",
    )
    ap.add_argument("--nixl-worker", help=argparse.SUPPRESS)  # a pickled job: run as one of the two NIXL processes
    ap.add_argument("--nixl-process", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return
    if args.nixl_worker:
        _nixl_worker(args.nixl_worker, args.nixl_process)
        return
    n = args.ranks
    rank = n + n // 2 + 3  # plan_bench.py's destination rank
    sched, tensors, r, topo = schedule_of(args.model, n, rank)
    shards = Shards(src={}, dst={(t, rank): _NULL for t, spec in enumerate(tensors) if rank in spec.dst.ranks})
    t0 = time.perf_counter()
    rank_rounds = compile_rounds(sched, (rank,), (1,), Options().max_group_ops)  # once per schedule, then cached
    compile_s = time.perf_counter() - t0

    def timed(kind: type[NullComm]) -> tuple[list[float], Any, NullComm]:
        times, stats, comm = [], None, kind([rank])
        for _ in range(args.repeat):
            comm.exchanges = comm.ops = 0  # one step's counts
            t0 = time.perf_counter()
            stats = execute(
                sched, comm, shards, options=Options(), buffers=NullBuffers(), report=ReportBuilder(Backend.MPI)
            )
            times.append(time.perf_counter() - t0)
        return times, stats, comm

    times, stats, null = timed(NullComm)
    assert stats is not None
    med = statistics.median(times)
    per_round_null = med / max(stats.rounds, 1)
    if args.profile:
        from plan_bench_local import profile

        run = lambda: execute(sched, NullComm([rank]), shards, options=Options(), buffers=NullBuffers())  # noqa: E731
        for what, share in profile(run, top=12):
            print(f"   {share * 100:5.1f}%  {what}")
    predicted = simulate_layouts(r.pairs, topo, Options(), r.names).prediction.seconds
    load = os.getloadavg()[0]
    real = real_path(sched, tensors, rank, args.repeat)
    compiled = real.pop("compiled")
    launches = [real["prepared"]] + [  # the first launch's prepared column, then more launches of it alone
        real_path(sched, tensors, rank, args.repeat, (COLUMNS[0],))["prepared"] for _ in range(args.launches - 1)
    ]
    serialized = real_path(sched, tensors, rank, args.repeat, SERIALIZED, "serialized")
    serialized.pop("compiled")
    floor = mpi_floor(rank_rounds, args.repeat, args.launches)
    load = max(load, os.getloadavg()[0])
    rounds = real["prepared"]["rounds"]
    print(f"== engine host cost: {args.model} {n} + {n}, destination rank {rank}, {rounds} rounds")
    print(
        f"   real path: execute() over CpuBuffers and MpiComm, 2 MPI processes (the rank; one playing all its "
        f"peers), {real['prepared']['ops']} messages a step; compiled replay "
        f"{'built' if compiled else 'NOT built (replayed from Python)'}; MPI_THREAD_MULTIPLE (mpi4py's default) but "
        f"where the column says serialized; {os.cpu_count()} cores, load average up to {load:.1f} during the runs"
    )
    print("   per column: the step that prepares, then per round the median [min-max] of the others: the wall time;")
    print("   the engine's host time (the wall time less the time it waited idle: the polls that completed nothing")
    print("   after the first of each stretch of them, and the back-off between them; per-op posts do not tell, so")
    print("   there it is the wall time); and the CPU time of the engine's thread (its polls while it waits included,")
    print("   sleep and preemption not)")
    host: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for name, col in {**real, **serialized}.items():
        r = max(col["rounds"], 1)
        wall = [t / r * 1e6 for t in col["times"][1:]]
        host[name] = _host_us(col)
        cpu[name] = [c / r * 1e6 for c in col["cpu"][1:]]
        print(
            f"   {name:>19}: rows of {col['row_bytes']} B; first step {col['times'][0] * 1e3:.1f} ms; wall "
            f"{_spread(wall)}, host {_spread(host[name])}, CPU {_spread(cpu[name])} us per round; replayed "
            f"{col['replayed'][1]}/{col['rounds']} rounds a step; the peer's host time, MPI alone: "
            f"{_spread([b / r * 1e6 for b in col['peer_busy'][1:]])} us"
        )
    ratio = statistics.median(cpu["per-op"]) / statistics.median(cpu["prepared"])
    print(f"   per-op / prepared CPU time per round: {ratio:.1f}x (same run)")
    print(
        f"   null transport and buffers (Python round loop, nothing moved): {per_round_null * 1e6:.2f} us per round "
        f"(median of {args.repeat}; exchanges {null.exchanges}, operations {null.ops}, one step's); compiling the "
        f"rounds (once per schedule, cached): {compile_s * 1e3:.1f} ms"
    )
    print(f"   predicted refit (cost model, not measured): {predicted * 1e3:.1f} ms")
    if args.nixl != "off":
        nixl_section(sched, tensors, rank, args.repeat, f"{args.model} {n} + {n}, rank {rank}")
    per_launch = [statistics.median(_host_us(col)) for col in launches]
    print(
        f"   prepared, host us per round in each of {len(launches)} launches (median of its replayed steps): "
        + ", ".join(f"{x:.2f}" for x in per_launch)
        + " (MPICH here runs at one of two speeds from one launch to the next)"
    )
    if floor:
        print(
            f"   MPI's own floor (benchmarks/mpi_floor.c: the rank's {rounds} groups of persistent requests of 0 B, "
            f"started and tested as the replay does, nothing of jreshard), us per round in each of {len(floor)} "
            "launches: " + ", ".join(f"{x:.2f}" for x in floor) + f"; median {statistics.median(floor):.2f}"
        )
    mid = statistics.median(per_launch)
    pct = mid * rounds / 1e6 / predicted * 100
    spread = f"{mid:.2f} us/round ({min(per_launch):.2f}-{max(per_launch):.2f})"
    print(f"engine host: {spread}, {pct:.2f}% of the predicted refit")


def _host_us(col: dict) -> list[float]:
    """A column's host time per round of each replayed step, in us: the wall time less the time it waited idle."""
    r = max(col["rounds"], 1)
    return [(t - i) / r * 1e6 for t, i in zip(col["times"][1:], col["idle"][1:], strict=True)]


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


if __name__ == "__main__":
    main()
