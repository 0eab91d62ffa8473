"""Multi-controller transfer: every process of one ``jax.distributed`` cluster calls ``transfer``.

This is the case ``jax.device_put`` refuses: source and target shardings on
different processes, on different devices of the same processes, or
overlapping. Every process plans only the ranks of its own devices: their
rank plans (:func:`jreshard.sharding.planner.rank_plans`, from the two global
shardings, no communication), then their rounds, agreed with their peers by a
few small messages (:func:`jreshard.schedule.pairsched.pair_schedule`); no process
builds the whole plan or every rank's schedule. It runs them through the shared
engine (:func:`jreshard.engine.rounds.execute`) over the transport it is given (chosen and built by
:mod:`jreshard.call.routes`: MPI, NCCL, or in-process copies). A device's
rank is its ``device.id``, which is unique in a jax cluster.

**Device buffers.** The scheduling mail travels in the ``buffers``' memory, as
the chunks do (:func:`jreshard.engine.mail.comm_mail`): on GPUs, a few integers per
peer go through small device buffers over NCCL (not run on GPU); on CPU, in host memory
with no copy. So every transport takes the same per-process path.

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

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jreshard.engine.buffers import Buffers, CpuBuffers
from jreshard.engine.comm import Communicator
from jreshard.engine.deltarounds import DeltaRefit
from jreshard.engine.mail import comm_mail
from jreshard.engine.ownership import device_shards, source_addresses, storage, take
from jreshard.engine.rounds import ExecStats, Shards, execute
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder
from jreshard.schedule.pairsched import pair_schedule
from jreshard.schedule.steps import Schedule
from jreshard.sharding.dtypes import storage_bytes
from jreshard.sharding.plan import RankPlan
from jreshard.sharding.planner import prepare_pairs, rank_plans
from jreshard.sharding.rows import TensorSpec
from jreshard.sharding.topology import Topology
from jreshard.sharding.trees import layout_pairs
from jreshard.types import DType, Sharding

__all__ = ["Landed", "assemble", "landed_array", "receive_schedule", "run_leaves", "run_schedule", "schedule_local"]

if TYPE_CHECKING:
    from jreshard.engine.put import BatchedPut


Landed = dict[tuple[int, int], tuple[Any, tuple[int, ...], np.dtype, Any]]
"""``{(tensor, rank): (buffer, shard shape, dtype, device)}``: the new destination shards :func:`receive_schedule`
filled, as the buffers they landed in."""


def run_schedule(
    *args: Any, buffers: Buffers | None = None, **kwargs: Any
) -> tuple[dict[tuple[int, int], Any], ExecStats]:
    """:func:`receive_schedule` (the same arguments; ``buffers`` default numpy on CPU), with each new destination shard
    imported as a single-device array: ``({(tensor, rank): array, or the given buffer}, stats)``."""
    buffers = buffers or CpuBuffers()
    landed, kept, stats = receive_schedule(*args, buffers=buffers, **kwargs)
    return kept | {k: buffers.import_shard(*v) for k, v in landed.items()}, stats


def receive_schedule(
    tensors: Sequence[TensorSpec],
    schedule: Schedule,
    comm: Communicator,
    sources: Mapping[tuple[int, int], Any],
    targets: Mapping[tuple[int, int], Any],
    *,
    options: Options,
    buffers: Buffers,
    report: ReportBuilder | None = None,
    given: Mapping[tuple[int, int], Any] | None = None,
    delta: DeltaRefit | None = None,
) -> tuple[Landed, dict[tuple[int, int], Any], ExecStats]:
    """Run ``schedule`` (rounds of this process's ranks): ``(landed, given, stats)``, the destination shards written
    into new buffers (:data:`Landed`, for the caller to make arrays over: :func:`landed_array`), those written into
    ``given`` (the caller's buffers), and what the engine did.

    Args:
      tensors: the tensors the schedule moves (their destination layouts size the new shards).
      schedule: the rounds of ``comm``'s local ranks (:func:`schedule_local`).
      comm: the transport; its local ranks are this process's.
      sources: ``{(tensor, rank): single-device array}``, the source shards held here.
      targets: ``{(tensor, rank): device}``, the destination shards to make here.
      options: chunking, staging, timeout.
      buffers: buffer operations (numpy on CPU: :class:`CpuBuffers`).
      report: where the engine adds its phases, bytes per link and messages.
      given: destination buffers to write into instead of new ones (``transfer_into``, a receiving
        endpoint's).
      delta: send what changed since the receivers' bases (:mod:`jreshard.engine.deltarounds`).
    """
    given = given or {}
    src = {k: buffers.export_source(a) for k, a in sources.items()}
    dst: dict[tuple[int, int], Any] = {}
    meta: dict[tuple[int, int], tuple[Any, Any, Any]] = {}
    devices: dict[int, Any] = {}
    by_device: dict[Any, list[tuple[int, int]]] = {}
    for (t, r), device in targets.items():
        devices[r] = device
        if (t, r) in given:  # the caller's buffer: nothing to size or to import
            continue
        lay = tensors[t].dst
        meta[(t, r)] = (lay.box_of(r).shape, lay.np_dtype, device)
        by_device.setdefault(device, []).append((t, r))
    for device, keys in by_device.items():  # one call per device for all its new destination shards
        sizes = [storage_bytes(meta[k][1], math.prod(meta[k][0])) for k in keys]
        dst.update(zip(keys, buffers.allocate(sizes, device), strict=True))
    dst.update((k, v) for k, v in given.items() if k in targets)
    for (_, r), a in sources.items():
        devices.setdefault(r, next(iter(a.devices())))
    stats = execute(
        schedule,
        comm,
        Shards(src=src, dst=dst),
        options=options,
        buffers=buffers,
        devices=devices,
        report=report,
        delta=delta,
    )
    kept = {k: v for k, v in given.items() if k in targets}
    return {k: (dst[k], *meta[k]) for k in meta}, kept, stats


def landed_array(
    t: int,
    shape: tuple[int, ...],
    dtype: DType,
    sharding: Sharding,
    landed: Landed,
    buffers: Buffers,
    put: BatchedPut | None,
    weak_type: bool = False,
    ranks: Mapping[Any, int] | None = None,
) -> Any:
    """Tensor ``t``'s global array over this process's shards of it in ``landed`` (:func:`receive_schedule`), keyed
    by each device's rank: ``ranks[device]``, or its id where ``ranks`` is not given.

    Where every addressable device of ``sharding`` is a CPU device with its shard here and ``put`` (jax's batched
    put, :func:`jreshard.engine.put.batched_put`) is given, one call makes the array over the buffers (zero-copy
    where jax aliases them; a copy is as good: every byte has landed), a few microseconds a shard; otherwise each
    shard is imported (:meth:`Buffers.import_shard`) and the array assembled from them (:func:`assemble`).
    """
    from jreshard.sharding.jax import addressable_order

    devices = addressable_order(sharding)
    keys = [(t, d.id if ranks is None else ranks.get(d, -1)) for d in devices]  # (-1: not a rank here)
    if (
        put is not None
        and devices
        and all(k in landed and d.platform == "cpu" for k, d in zip(keys, devices, strict=True))
    ):
        views = []
        for k in keys:
            buf, box, np_dtype, _ = landed[k]
            views.append(buf.view(np_dtype).reshape(box))
        return put.raw(put.aval(shape, dtype, weak_type), sharding, views, list(devices), True)
    mine = {d: buffers.import_shard(*landed[k]) for k, d in zip(keys, devices, strict=True) if k in landed}
    return assemble(shape, dtype, sharding, mine, weak_type)


def assemble(
    shape: tuple[int, ...], dtype: DType, sharding: Sharding, shards: Mapping[Any, Any], weak_type: bool = False
) -> Any:
    """A global jax array from this process's shards ``{device: array}`` (none: no addressable shards), weakly
    typed where asked (:func:`jreshard.engine.arrays.assembled`)."""
    from jreshard.engine.arrays import assembled

    return assembled(shape, dtype, sharding, [shards[d] for d in sorted(shards, key=lambda d: d.id)], weak_type)


def run_leaves(
    leaves: Sequence[Any],
    shardings: Sequence[Any],
    *,
    topology: Topology | None = None,
    options: Options | None = None,
    transport: Communicator,
    buffers: Buffers | None = None,
    report: ReportBuilder | None = None,
    into: Sequence[Any] | None = None,
) -> tuple[list[Any], ExecStats, dict[int, RankPlan]]:
    """Move flat leaves to their target shardings through the message-passing engine: every process of
    the cluster calls it with the same leaves and shardings.

    The front door (:func:`jreshard.call.front.flatten`) flattened the pytree and read each
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
      into: per leaf, the array to write into (``transfer_into``, one process), or ``None``: the leaves
        the ownership rule claims (:mod:`jreshard.engine.ownership`) are donated, the engine writes
        into the donated memory through ``buffers.writable_view``, and the result leaf is the donated
        output; the others get fresh buffers. Bytes written anywhere but ``into``'s own memory are
        counted in ``report`` (``not_in_place_bytes``, with the reason).

    Returns:
      ``(result leaves, stats, rank_plans)``: the moved leaves (see the module docstring for
      processes that hold no target device), what the engine did for this process's ranks, and
      their plans ``{rank: RankPlan}``. No process builds the whole plan.

    Raises:
      TransferTimeoutError: a peer process did not answer within ``options.timeout_s``.
      LayoutMismatchError, LayoutError: the shapes or dtypes disagree.
    """
    import jax

    from jreshard.engine.put import batched_put, put_allowed

    options = options or Options()
    planned = options  # the schedule's options: two arenas a rank must fit options.staging_bytes together
    if buffers is not None and buffers.staging_buffers > 1:
        n = buffers.staging_buffers
        planned = dataclasses.replace(
            options,
            staging_bytes=options.staging_bytes // n,
            chunk_bytes=min(options.chunk_bytes, options.staging_bytes // n),
        )
    moved = [i for i, s in enumerate(shardings) if s is not None]
    pairs, names, devices = layout_pairs([leaves[i] for i in moved], [shardings[i] for i in moved])
    topology = topology or Topology.from_devices(devices)
    where = {d.id: d for d in jax.local_devices()}
    tensors, plans, sched = schedule_local(pairs, names, topology, planned, transport, buffers, where)
    sources, targets = {}, {}
    me = jax.process_index()
    for t, i in enumerate(moved):
        src_ranks = set(pairs[t][0].ranks)
        for d, data in device_shards(leaves[i]):
            if d.id in src_ranks:
                sources[(t, d.id)] = data
        for d in shardings[i].device_set:
            if d.process_index == me:
                targets[(t, d.id)] = d
    builder = report or ReportBuilder(Backend.LOCAL)
    weak = [bool(getattr(a, "weak_type", False)) for a in leaves]  # as jax.device_put keeps it
    taken = take(into, moved, source_addresses(leaves), builder, weak) if into is not None else None
    owned = {i: a for i, (a, _) in taken.donated.items()} if taken is not None else {}
    buffers = buffers or CpuBuffers()
    given = {
        (t, sh.device.id): buffers.writable_view(sh.data)
        for t, i in enumerate(moved)
        if i in owned
        for sh in owned[i].addressable_shards
        if (t, sh.device.id) in targets
    }
    landed, _, stats = receive_schedule(
        tensors, sched, transport, sources, targets, options=options, buffers=buffers, report=report, given=given
    )
    put = batched_put(put_allowed()) if isinstance(buffers, CpuBuffers) else None
    out = list(leaves)
    for t, i in enumerate(moved):
        if i in owned:  # written in place: the donated output is the result
            out[i] = owned[i]
            continue
        a = leaves[i]
        out[i] = landed_array(t, tuple(a.shape), a.dtype, shardings[i], landed, buffers, put, weak[i])
        if taken is not None:  # an into leaf not claimed: its bytes went to fresh buffers
            taken.count(builder, i, storage(out[i]))
    return out, stats, plans


def schedule_local(
    pairs: Sequence[tuple[Any, Any]],
    names: Sequence[str],
    topology: Topology,
    options: Options,
    comm: Communicator,
    buffers: Buffers | None = None,
    devices: Mapping[int, Any] | None = None,
) -> tuple[list[TensorSpec], dict[int, RankPlan], Schedule]:
    """The tensors, the plans of ``comm``'s local ranks and their pair-paced rounds (agreed with the
    peers over ``comm``, the mail in ``buffers`` on ``devices[rank]``): all a process needs to run
    its part, without the whole plan."""
    tensors = [TensorSpec(n, s, d) for n, (s, d) in zip(names, pairs, strict=True)]
    plans = rank_plans(pairs, comm.local_ranks, topology, options, names)
    canonical, _, _ = prepare_pairs(pairs, topology, options, names)
    key = (
        canonical,
        tuple(names),
        topology,
        options.plan_key(),
        options.chunk_bytes,
        options.staging_bytes,
        options.max_group_ops,
        tuple(sorted(plans)),
    )
    mail = comm_mail(comm, options.timeout_s, buffers=buffers, devices=devices)
    sched = pair_schedule(tensors, plans, options, mail, key=key)
    return tensors, plans, sched
