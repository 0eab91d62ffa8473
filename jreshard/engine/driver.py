"""Multi-controller transfer: every process of one ``jax.distributed`` cluster calls ``transfer``.

This is the case ``jax.device_put`` refuses: source and target shardings on
different processes, on different devices of the same processes, or
overlapping. Every process plans only the ranks of its own devices: their
programs (:func:`jreshard.sharding.planner.rank_programs`, from the two global
shardings, no communication), then their rounds, agreed with their peers by a
few small messages (:func:`jreshard.schedule.pairsched.pair_schedule`); no process
builds the whole plan or every rank's schedule. It runs them through the shared
engine (:func:`jreshard.engine.rounds.execute`) over the transport it is given (chosen and built by
:mod:`jreshard.routes`: MPI, NCCL, or local copies). A device's
rank is its ``device.id``, which is unique in a jax cluster.

**Device buffers.** The scheduling mail travels in the ``buffers`` backend's memory, as
the chunks do (:func:`jreshard.engine.mail.comm_mail`): on GPUs, a few integers per
peer go through small device buffers over NCCL (not run on GPU); on CPU, in host memory
with no copy. So every transport takes the same rank-local path.

**What each process gets.** A global ``jax.Array`` per leaf with the target
sharding, exactly as jax represents global arrays in a multi-controller
program: its addressable shards are this process's target devices, filled with
their bytes. A process that holds no target device gets an array with no
addressable shards (``x.addressable_shards == []``, ``x.is_fully_addressable``
is false); its shape, dtype and sharding are those of the target, and it is
safe to pass on to jitted code or to drop.

This module imports no transport: the caller hands it one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jreshard.engine.buffers import BufferBackend, CpuBuffers
from jreshard.engine.comm import Communicator
from jreshard.engine.mail import comm_mail
from jreshard.engine.rounds import ExecStats, Shards, execute
from jreshard.options import Options
from jreshard.planning import layout_pairs
from jreshard.report import ReportBuilder
from jreshard.schedule.pairsched import pair_schedule
from jreshard.schedule.steps import Schedule, build_schedule
from jreshard.sharding.dtypes import storage_bytes
from jreshard.sharding.plan import Plan, RankProgram
from jreshard.sharding.planner import prepare_pairs, rank_programs
from jreshard.sharding.rows import TensorSpec
from jreshard.sharding.topology import Topology

__all__ = ["assemble", "run_leaves", "run_plan", "run_schedule", "schedule_local"]


def run_plan(
    plan: Plan,
    comm: Communicator,
    sources: Mapping[tuple[int, int], Any],
    targets: Mapping[tuple[int, int], Any],
    *,
    options: Options | None = None,
    backend: BufferBackend | None = None,
    report: ReportBuilder | None = None,
) -> tuple[dict[tuple[int, int], Any], ExecStats]:
    """Run this process's ranks of ``plan`` on its global schedule and return the new destination shards.

    For callers that hold the whole plan (the elastic pairs); :func:`jreshard.routes.transfer_multiprocess` and
    ``RefitGroup`` plan and schedule only this process's ranks (:func:`run_schedule`).

    Args:
      plan: the plan every process computed.
      comm: the transport; its local ranks are this process's.
      sources: ``{(tensor, rank): single-device jax array}``, the source shards held here.
      targets: ``{(tensor, rank): jax device}``, the destination shards to make here.
      options: chunking, staging, timeout.
      backend: buffer operations (default numpy on CPU).
      report: where the engine adds its phases, bytes per link and messages.

    Returns:
      ``({(tensor, rank): single-device jax array}, stats)``. The arrays alias
      freshly allocated buffers: nothing the caller holds is written.
    """
    options = options or plan.options
    sched = build_schedule(plan, options)
    return run_schedule(plan.tensors, sched, comm, sources, targets, options=options, backend=backend, report=report)


def run_schedule(
    tensors: Sequence[TensorSpec],
    schedule: Schedule,
    comm: Communicator,
    sources: Mapping[tuple[int, int], Any],
    targets: Mapping[tuple[int, int], Any],
    *,
    options: Options,
    backend: BufferBackend | None = None,
    report: ReportBuilder | None = None,
) -> tuple[dict[tuple[int, int], Any], ExecStats]:
    """Run ``schedule`` (rounds of this process's ranks) and return the new destination shards.

    Args:
      tensors: the tensors the schedule moves (their destination layouts size the new shards).
      schedule: the rounds, from :func:`~jreshard.schedule.pairsched.pair_schedule` or
        :func:`~jreshard.schedule.steps.build_schedule`.
      comm, sources, targets, options, backend, report: as for :func:`run_plan`.
    """
    backend = backend or CpuBuffers()
    src = {k: backend.export_source(a) for k, a in sources.items()}
    dst, meta = {}, {}
    devices: dict[int, Any] = {}
    for (t, r), device in targets.items():
        lay = tensors[t].dst
        box = lay.box_of(r)
        (dst[(t, r)],) = backend.allocate([storage_bytes(lay.np_dtype, box.volume)], device)
        meta[(t, r)] = (box.shape, lay.np_dtype, device)
        devices[r] = device
    for (_, r), a in sources.items():
        devices.setdefault(r, next(iter(a.devices())))
    stats = execute(
        None,
        comm,
        Shards(src=src, dst=dst),
        options=options,
        backend=backend,
        devices=devices,
        report=report,
        schedule=schedule,
    )
    out = {k: backend.import_shard(dst[k], *meta[k]) for k in dst}
    return out, stats


def assemble(shape: tuple[int, ...], dtype: Any, sharding: Any, shards: Mapping[Any, Any]) -> Any:
    """A global jax array from this process's shards ``{device: array}`` (none: no addressable shards)."""
    import jax

    arrays = [shards[d] for d in sorted(shards, key=lambda d: d.id)]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=dtype)


def run_leaves(
    leaves: Sequence[Any],
    shardings: Sequence[Any],
    *,
    topology: Topology | None = None,
    options: Options | None = None,
    transport: Communicator,
    buffers: BufferBackend | None = None,
    report: ReportBuilder | None = None,
) -> tuple[list[Any], ExecStats, dict[int, RankProgram]]:
    """Move flat leaves to their target shardings through the message-passing engine: every process of
    the cluster calls it with the same leaves and shardings.

    The front door (:func:`jreshard.frontdoor.flatten`) flattened the pytree and read each
    target's sharding; this takes its output and never flattens again.

    Args:
      leaves: the source leaves (global jax arrays of the cluster).
      shardings: per leaf, its target sharding, or ``None`` to keep the leaf as it is.
      topology: ranks (device ids), domains and links; default one domain per process.
      options: chunking, staging and ``timeout_s`` (every wait on a peer).
      transport: the :class:`Communicator` to run over (``MpiComm``; ``NcclComm`` on GPUs, not run
        on GPU; ``LocalComm`` in one process); its local ranks must be this process's device ids
        that take part.
      buffers: the buffer operations (default numpy on CPU; ``CupyBuffers`` on GPUs).
      report: a report builder the engine adds its phases, bytes and messages to.

    Returns:
      ``(result leaves, stats, programs)``: the moved leaves (see the module docstring for
      processes that hold no target device), what the engine did for this process's ranks, and
      their programs ``{rank: RankProgram}``. No process builds the whole plan.

    Raises:
      TransferTimeoutError: a peer process did not answer within ``options.timeout_s``.
      LayoutMismatchError, LayoutError: the shapes or dtypes disagree.
    """
    import jax

    options = options or Options()
    moved = [i for i, s in enumerate(shardings) if s is not None]
    pairs, names, devices = layout_pairs([leaves[i] for i in moved], [shardings[i] for i in moved])
    topology = topology or Topology.from_devices(devices)
    where = {d.id: d for d in jax.local_devices()}
    tensors, programs, sched = schedule_local(pairs, names, topology, options, transport, buffers, where)
    sources, targets = {}, {}
    me = jax.process_index()
    for t, i in enumerate(moved):
        src_ranks = set(pairs[t][0].ranks)
        for sh in leaves[i].addressable_shards:
            if sh.device.id in src_ranks:
                sources[(t, sh.device.id)] = sh.data
        for d in shardings[i].device_set:
            if d.process_index == me:
                targets[(t, d.id)] = d
    shards, stats = run_schedule(
        tensors, sched, transport, sources, targets, options=options, backend=buffers, report=report
    )
    out = list(leaves)
    for t, i in enumerate(moved):
        a, sharding = leaves[i], shardings[i]
        mine = {d: shards[(t, d.id)] for d in sharding.device_set if (t, d.id) in shards}
        out[i] = assemble(tuple(a.shape), a.dtype, sharding, mine)
    return out, stats, programs


def schedule_local(
    pairs: Sequence[tuple[Any, Any]],
    names: Sequence[str],
    topology: Topology,
    options: Options,
    comm: Communicator,
    buffers: BufferBackend | None = None,
    devices: Mapping[int, Any] | None = None,
) -> tuple[list[TensorSpec], dict[int, RankProgram], Schedule]:
    """The tensors, the programs of ``comm``'s local ranks and their pair-paced rounds (agreed with the
    peers over ``comm``, the mail in ``buffers`` on ``devices[rank]``): all a process needs to run
    its part, without the whole plan."""
    tensors = [TensorSpec(n, s, d) for n, (s, d) in zip(names, pairs, strict=True)]
    programs = rank_programs(pairs, comm.local_ranks, topology, options, names)
    canonical, _, _ = prepare_pairs(pairs, topology, options, names)
    key = (
        canonical,
        tuple(names),
        topology,
        options.plan_key(),
        options.chunk_bytes,
        options.staging_bytes,
        options.max_group_ops,
        tuple(sorted(programs)),
    )
    mail = comm_mail(comm, options.timeout_s, buffers=buffers, devices=devices)
    sched = pair_schedule(tensors, programs, options, mail, key=key)
    return tensors, programs, sched
