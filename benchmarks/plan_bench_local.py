"""The per-process schedule part of ``plan_bench.py`` (its section 5; the module docstring there
says how the peers' mail is answered), and the small timing helpers both use.

Run as a script, it is the untimed setup's process: ``python plan_bench_local.py MODEL N RANK
DOMAIN NIC FAST`` prints, as one JSON line, the distinct receivers and senders of every peer
of ``RANK`` (:func:`peer_mail`), the time that took and the process's peak memory.
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import resource
import subprocess
import sys
import time

import numpy as np

from jreshard.models import refit, refit_topology
from jreshard.options import Options
from jreshard.schedule.pairsched import COUNT_IN, COUNT_OUT, ROUNDS, pair_paced
from jreshard.sharding.caches import clear_caches
from jreshard.sharding.planner import rank_plans
from jreshard.sharding.rankplan import RECV, SEND
from jreshard.sharding.rows import TensorSpec


def timed(fn):
    """``(fn(), wall seconds, CPU seconds)``."""
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t, time.process_time() - c


def peak_mib() -> float:
    """This process's peak resident memory, MiB: ``VmHWM`` of ``/proc/self/status`` where there is one.

    (``ru_maxrss`` is kept across ``fork`` and ``exec``: a child would report its parent's peak.)
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def profile(fn, top: int = 6) -> list[tuple[str, float]]:
    """Where ``fn`` spends its time: the ``top`` functions by own time (a separate, profiled run)."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    total = sum(v[2] for v in st.stats.values()) or 1.0  # type: ignore[attr-defined]
    return [(f"{os.path.basename(f)}:{line} {func}", tt / total) for (f, line, func), (_, _, tt, _, _) in rows]


def peer_mail(r, topo, rank: int) -> tuple[dict[int, list[int]], dict[int, list[int]], dict[int, int], dict[int, int]]:
    """The peers of ``rank`` and, for each, its distinct receivers and senders, sorted, and the bytes it
    sends and receives in all (what the peers tell ``rank`` in the mail), from the peers' rank plans
    alone (no whole plan).

    ``rank``'s plan lists its peers: the ranks it receives from and those it sends to
    (itself too, if it sends to itself). Each peer's plan lists, in its sent rows, the
    ranks it sends to, and in its received rows those it receives from; its same-device
    landings are no messages and count for neither.
    """
    own = rank_plans(r.pairs, [rank], topo, names=r.names)[rank]
    peers = sorted(set(own.table.peer[int(own.table.cuts[0]) :].tolist()))
    outs: dict[int, list[int]] = {}
    ins: dict[int, list[int]] = {}
    sent: dict[int, int] = {}
    got: dict[int, int] = {}
    for p, rplan in rank_plans(r.pairs, peers, topo, names=r.names).items():
        t = rplan.table
        rows = slice(int(t.cuts[0]), len(t))
        kind, peer, nbytes = t.kind[rows], t.peer[rows], t.nbytes[rows]
        outs[p] = np.unique(peer[kind == SEND]).tolist()
        ins[p] = np.unique(peer[kind == RECV]).tolist()
        sent[p] = int(nbytes[kind == SEND].sum())
        got[p] = int(nbytes[kind == RECV].sum())
    return outs, ins, sent, got


def peer_mail_process(
    name: str, n: int, rank: int, domain: int, nic: float, fast: float
) -> tuple[dict, dict, float, float]:
    """:func:`peer_mail` for ``refit(name, n, n)`` on ``refit_topology(n, n, domain, ...)``, in a
    process of its own: ``(outs, ins, sent, received, its wall time, its peak MiB)``."""
    cmd = [sys.executable, __file__, name, str(n), str(rank), str(domain), repr(nic), repr(fast)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy(), check=True)
    got = json.loads(res.stdout.strip().splitlines()[-1])
    outs, ins, sent, recv = ({int(k): v for k, v in got[f].items()} for f in ("outs", "ins", "sent", "received"))
    return outs, ins, sent, recv, got["seconds"], got["peak_mib"]


def answer_mail(want: dict, outs: dict, ins: dict, sent: dict, received: dict) -> dict:
    """The peers' answers to one round of ``rank``'s scheduling mail, from :func:`peer_mail`'s tables."""
    got = {}
    for (a, b, tag), n in want.items():
        if tag == COUNT_IN:  # receiver a: how many it receives from, where b is among them, its bytes
            got[(a, b, tag)] = np.array([len(ins[a]), ins[a].index(b), received[a]], np.int64)
        elif tag == COUNT_OUT:
            got[(a, b, tag)] = np.array([len(outs[a]), outs[a].index(b), sent[a]], np.int64)
        else:
            got[(a, b, tag)] = np.arange(n, dtype=np.int64) + (tag - ROUNDS)
    return got


def local_schedule(r, topo, rank: int, peers: tuple[dict, dict, float, float]) -> dict:
    """Time one process's own schedule for ``rank``; ``peers`` is :func:`peer_mail_process`'s answer."""
    outs, ins, sent, received, setup_s, setup_mib = peers
    tensors = [TensorSpec(n, s, d) for n, (s, d) in zip(r.names, r.pairs, strict=True)]
    opts = Options()

    def answer(want: dict) -> dict:
        return answer_mail(want, outs, ins, sent, received)

    def build():
        plans = rank_plans(r.pairs, [rank], topo, names=r.names)
        talk = pair_paced(tensors, plans, opts)
        _, want = next(talk)
        try:
            while True:
                _, want = talk.send(answer(want))
        except StopIteration as done:
            return done.value

    clear_caches()
    before_mib = peak_mib()
    _, plans_s, _ = timed(lambda: rank_plans(r.pairs, [rank], topo, names=r.names))
    sched, total_s, total_cpu = timed(build)  # the rank plans are cached now: this is the schedule alone
    steps = sched.steps.get(rank, {})
    out = {
        "local_sched_s": total_s,
        "local_sched_cpu": total_cpu,
        "local_sched_plans_s": plans_s,
        "local_sched_rounds": sched.rounds,
        "local_sched_chunks": sum(len(s.sends) + len(s.recvs) for s in steps.values()),
        "local_sched_rows": sum(len(s.pack) + len(s.unpack) for s in steps.values()),
        # Peak memory before the profiled run (which builds a second schedule while this one is held).
        "local_sched_peak_mib": peak_mib(),
        "local_sched_before_mib": before_mib,
        "local_sched_peers": len(outs),
        "local_sched_setup_s": setup_s,
        "local_sched_setup_mib": setup_mib,
    }
    del sched, steps
    out["local_sched_profile"] = profile(build, top=8)
    return out


def print_local(o: dict) -> None:
    """The rows of :func:`local_schedule`'s answer (with ``local_sched_s_range`` added)."""
    print(
        f"   one process's schedule (its own ranks) {o['local_sched_s']:7.3f} s wall "
        f"({o['local_sched_cpu']:.3f} s CPU){o['local_sched_s_range']}: one destination rank, "
        f"{o['local_sched_chunks']} chunks in {o['local_sched_rounds']} rounds, "
        f"{o['local_sched_rows']} descriptor rows (its plan: {o['local_sched_plans_s']:.3f} s more)"
    )
    print(
        f"     peak memory of the process by then {o['local_sched_peak_mib']:.0f} MiB "
        f"({o['local_sched_before_mib']:.0f} MiB before its plan and schedule"
        f"{': a peak the whole plan set' if 'plan_s' in o else ''}); untimed setup in a process of its own: "
        f"{o['local_sched_peers']} peers' plans in {o['local_sched_setup_s']:.3f} s, "
        f"{o['local_sched_setup_mib']:.0f} MiB peak"
    )
    print("     where the schedule's time goes (own time, profiled run):")
    for what, share in o["local_sched_profile"]:
        print(f"       {share * 100:5.1f}%  {what}")


def main(argv: list[str]) -> None:
    name, n, rank, domain, nic, fast = argv
    r = refit(name, int(n), int(n))
    topo = refit_topology(int(n), int(n), int(domain), network_bw=float(nic), fast_bw=float(fast))
    (outs, ins, sent, received), wall, _ = timed(lambda: peer_mail(r, topo, int(rank)))
    mail = {"outs": outs, "ins": ins, "sent": sent, "received": received}
    print(json.dumps({**mail, "seconds": wall, "peak_mib": peak_mib()}))


if __name__ == "__main__":
    main(sys.argv[1:])
