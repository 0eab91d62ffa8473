"""The engine's host cost per round: one DeepSeek-V3 128 + 128 destination rank's rounds, run through the
engine's round loop over a transport and buffers that move nothing.

What it measures is the Python the engine spends per round (reading the round's steps, building the
send and receive operations, the report's bookkeeping, the group cut), with the bytes, the kernels and
the wire taken out: a null transport completes every exchange at once, null buffers pack and unpack
nothing. That host time is then set beside the refit's time the cost model predicts (labelled
predicted) for the same model, ranks and links as ``plan_bench.py`` (GB200 NVL72 racks, 50 GB/s NIC,
900 GB/s NVLink).

Run: ``JAX_PLATFORMS=cpu python benchmarks/engine_bench.py [--repeat 3]``. The schedule is built as
``plan_bench.py`` builds it (its peers' side of the mail answered from their own programs, computed in
a separate, untimed process).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_bench_local import answer_mail, peer_mail_process

from jreshard.engine.buffers import Buffers
from jreshard.engine.comm import Communicator, RecvOp, Row, SendOp
from jreshard.engine.rounds import Shards, compile_rounds, execute
from jreshard.models import refit, refit_topology
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder
from jreshard.schedule.pairsched import pair_paced
from jreshard.sharding.planner import rank_programs
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
    talk = pair_paced(tensors, rank_programs(r.pairs, [rank], topo, names=r.names), opts)
    _, want = next(talk)
    try:
        while True:
            _, want = talk.send(answer_mail(want, *peers[:4]))
    except StopIteration as done:
        sched = done.value
    return sched, tensors, r, topo


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--ranks", type=int, default=128, help="ranks per side")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="print where the round loop's time goes")
    args = ap.parse_args(argv)
    n = args.ranks
    rank = n + n // 2 + 3  # plan_bench.py's destination rank
    sched, tensors, r, topo = schedule_of(args.model, n, rank)
    shards = Shards(src={}, dst={(t, rank): _NULL for t, spec in enumerate(tensors) if rank in spec.dst.ranks})
    t0 = time.perf_counter()
    compile_rounds(sched, (rank,), (1,), Options().max_group_ops)  # once per schedule, then cached
    compile_s = time.perf_counter() - t0

    def timed(kind: type[NullComm]) -> tuple[list[float], Any, NullComm]:
        times, stats, comm = [], None, kind([rank])
        for _ in range(args.repeat):
            comm = kind([rank])
            t0 = time.perf_counter()
            stats = execute(
                sched, comm, shards, options=Options(), buffers=NullBuffers(), report=ReportBuilder(Backend.MPI)
            )
            times.append(time.perf_counter() - t0)
        return times, stats, comm

    times, stats, comm = timed(NullComm)
    sliced, _, _ = timed(SlicingNullComm)
    assert stats is not None
    med = statistics.median(times)
    per_round = med / max(stats.rounds, 1)
    if args.profile:
        from plan_bench_local import profile

        run = lambda: execute(sched, NullComm([rank]), shards, options=Options(), buffers=NullBuffers())  # noqa: E731
        for what, share in profile(run, top=12):
            print(f"   {share * 100:5.1f}%  {what}")
    predicted = simulate_layouts(r.pairs, topo, Options(), r.names).prediction.seconds
    print(f"== engine host cost: {args.model} {n} + {n}, destination rank {rank}, null transport and buffers")
    print(
        f"   rounds {stats.rounds}, exchanges {comm.exchanges}, operations {comm.ops}, chunks received per round "
        f"{comm.ops / max(comm.exchanges, 1):.1f}"
    )
    print(
        f"   host time {med * 1e3:.1f} ms median of {args.repeat} "
        f"(range {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f} ms) = {per_round * 1e6:.1f} us per round"
    )
    sl = statistics.median(sliced)
    print(
        f"   compiling the rounds (once per schedule, cached): {compile_s * 1e3:.1f} ms; with the default adapter's "
        f"slices and operation objects (MPI, loopback transports): {sl * 1e3:.1f} ms "
        f"(range {min(sliced) * 1e3:.1f}-{max(sliced) * 1e3:.1f} ms) = "
        f"{sl / max(stats.rounds, 1) * 1e6:.1f} us per round"
    )
    print(
        f"   predicted refit (cost model, not measured): {predicted * 1e3:.1f} ms; the engine's host time is "
        f"{med / predicted * 100:.1f}% of it"
    )


if __name__ == "__main__":
    main()
