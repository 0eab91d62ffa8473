"""The engine over MpiComm on pair-paced rounds: no process builds the whole plan.

Each process plans only its own ranks (``rank_plans``), agrees on the rounds with its
peers over the same communicator (``pair_schedule``), runs the engine on that schedule, checks its
destination shards byte for byte against numpy and reports the bytes it sent. The refit is the
seeded one of ``engine_groups.case``.
"""

from __future__ import annotations


def body() -> dict:
    import os

    from engine_groups import case, check, shards_for
    from mpi4py import MPI

    from jreshard.engine.mail import comm_mail
    from jreshard.engine.rounds import execute
    from jreshard.mpi.comm import MpiComm
    from jreshard.options import Options
    from jreshard.schedule.pairsched import pair_schedule
    from jreshard.sharding.planner import rank_plans
    from jreshard.sharding.rows import TensorSpec
    from jreshard.sharding.topology import Topology

    world = MPI.COMM_WORLD
    n = world.Get_size()
    _, pairs, globals_ = case(n)  # the seeded layouts and values (its plan is not used)
    topo = Topology.uniform(range(n), domain_size=4)
    comm = MpiComm(world, {r: r for r in range(n)})
    max_ops = int(os.environ.get("JRESHARD_MAX_GROUP_OPS", str(Options().max_group_ops)))
    opts = Options(chunk_bytes=64, staging_bytes=4096, timeout_s=60, max_group_ops=max_ops)
    tensors = [TensorSpec(str(t), s, d) for t, (s, d) in enumerate(pairs)]
    rank_plans = rank_plans(pairs, comm.local_ranks, topo, opts)
    sched = pair_schedule(tensors, rank_plans, opts, comm_mail(comm, opts.timeout_s))
    shards = shards_for(pairs, globals_, set(comm.local_ranks))
    stats = execute(sched, comm, shards, options=opts)
    checked = check(pairs, globals_, shards)
    comm.close()
    return {
        "checked": checked,
        "sent": {lk.name: v for lk, v in stats.sent_bytes.items()},
        "rounds": sched.rounds,
        "staging": max(sched.staging.values(), default=0),
        "cut_rounds": len(sched.groups or {}),
    }


if __name__ == "__main__":
    from _common import main

    main("pairs", body)
