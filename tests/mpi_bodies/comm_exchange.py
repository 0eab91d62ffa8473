"""MpiComm: random groups of messages among every process, checked byte for byte; then a timeout.

Every process drives ``JRESHARD_RANKS_PER_PROC`` jreshard ranks. Each seeded round, every ordered
pair of ranks exchanges 0-2 messages of random sizes (including pairs inside one process); all
processes derive the same messages from the seed, so each checks what it received.
"""

import os
import time

import numpy as np
from _common import main
from mpi4py import MPI

from jreshard.engine.comm import RecvOp, SendOp
from jreshard.errors import TransferTimeoutError
from jreshard.mpi.comm import MpiComm


def payload(src: int, dst: int, tag: int, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 31 + src * 7 + dst * 13 + tag).astype(np.uint8)


def body() -> dict:
    world = MPI.COMM_WORLD
    k = int(os.environ.get("JRESHARD_RANKS_PER_PROC", "1"))
    procs = world.Get_size()
    rank_process = {r: r // k for r in range(procs * k)}
    comm = MpiComm(world, rank_process)
    assert comm.local_ranks == tuple(r for r in range(procs * k) if r // k == world.Get_rank())
    received = 0
    for seed in range(5):
        rng = np.random.default_rng(seed)
        msgs = []
        for src in rank_process:
            for dst in rank_process:
                for t in range(int(rng.integers(0, 3))):
                    msgs.append((src, dst, seed * 10 + t, int(rng.integers(0, 70_000))))
        rng.shuffle(msgs)
        sends = [SendOp(s, d, t, payload(s, d, t, n)) for s, d, t, n in msgs if s in comm.local_ranks]
        recvs = [RecvOp(s, d, t, np.zeros(n, np.uint8)) for s, d, t, n in msgs if d in comm.local_ranks]
        comm.exchange(sends, recvs, timeout_s=60.0)
        for r in recvs:
            np.testing.assert_array_equal(r.buffer, payload(r.src, r.dst, r.tag, r.buffer.size))
            received += r.buffer.size
    # Sized messages (exchange_sized, the delta rounds' encodings): each receive is posted at a bound its
    # message may fall short of; the sizes come back in order and nothing past the message is written.
    sized = 0
    for seed in range(5, 8):
        rng = np.random.default_rng(seed)
        msgs = []
        for src in rank_process:
            for dst in rank_process:
                for t in range(int(rng.integers(0, 3))):
                    n = int(rng.integers(0, 70_000))
                    msgs.append((src, dst, seed * 10 + t, n, n + int(rng.integers(0, 3)) * int(rng.integers(1, 500))))
        rng.shuffle(msgs)
        sends = [SendOp(s, d, t, payload(s, d, t, n)) for s, d, t, n, _ in msgs if s in comm.local_ranks]
        recvs = [RecvOp(s, d, t, np.full(b, 0xEE, np.uint8)) for s, d, t, _, b in msgs if d in comm.local_ranks]
        want = [n for s, d, t, n, _ in msgs if d in comm.local_ranks]
        assert comm.exchange_sized(sends, recvs, timeout_s=60.0) == want
        for r, n in zip(recvs, want, strict=True):
            np.testing.assert_array_equal(r.buffer[:n], payload(r.src, r.dst, r.tag, n))
            assert (r.buffer[n:] == 0xEE).all()
            sized += n
    # A silent peer: the last process never sends what process 0 waits for.
    timed_out, elapsed = None, None
    if world.Get_rank() == 0 and procs > 1:
        last = max(rank_process)
        t0 = time.monotonic()
        try:
            comm.exchange([], [RecvOp(last, 0, 99, np.zeros(8, np.uint8))], timeout_s=1.0)
        except TransferTimeoutError as err:
            timed_out, elapsed = str(err), time.monotonic() - t0
        assert comm.broken is not None
    world.Barrier()
    return {
        "received": received,
        "sized": sized,
        "timed_out": timed_out,
        "elapsed": elapsed,
        "pipelines_packs": comm.pipelines_packs,
        "cores": os.cpu_count(),
    }


if __name__ == "__main__":
    main("comm", body)
