"""What a group that moves views runs: its lowering, its schedule, and one refit into fresh shards.

Two programs whose declarations differ by casts or a destination's recipe (:mod:`jreshard.refit.decl`,
``validate(..., views=True)`` then ``group_views``) move views. Every process of both programs lowers
the same :class:`~jreshard.refit.decl.GroupViews` to the same pieces (:mod:`jreshard.views.lowering`,
the whole lowering: every rank's), builds the same engine schedule from them
(:mod:`jreshard.schedule.viewsched`), and runs its own ranks of it through the one round loop over the
transport it is given (:func:`jreshard.engine.viewrun.run_view_schedule`), casting while packing and
unpacking in the CPU backend. :class:`jreshard.RefitGroup` and the pairs of :mod:`jreshard.elastic` run
views this way; neither posts a send or copies a buffer itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jreshard.engine.comm import Communicator
from jreshard.engine.deltarounds import DeltaRefit
from jreshard.engine.rounds import ExecStats
from jreshard.options import Options
from jreshard.refit.decl import GroupViews
from jreshard.schedule.viewsched import ViewSchedule
from jreshard.sharding.cost import LoadTable, Prediction, predict_loads
from jreshard.sharding.topology import Link, Topology
from jreshard.views.lowering import LeafLowering

__all__ = ["lower_group", "predict_group", "run_group", "schedule_group"]


def lower_group(gv: GroupViews, topology: Topology) -> list[LeafLowering]:
    """Per destination leaf of ``gv``, its pieces and bytes by link (the same on every process).

    Raises:
      JReshardError: the views cannot be lowered onto these layouts (on every process alike).
    """
    from jreshard.views.lowering import lower_tree

    return lower_tree(gv.views, gv.leaves, gv.layouts, gv.dsts, topology)


def schedule_group(
    gv: GroupViews,
    lowerings: Sequence[LeafLowering],
    topology: Topology,
    options: Options,
    *,
    pipelined: bool = False,
) -> ViewSchedule:
    """The engine's rounds of every rank of ``lowerings`` (block-FP8 leaves with their encode and tile jobs);
    ``pipelined``: the transport's :attr:`~jreshard.engine.comm.Communicator.pipelines_packs`
    (:func:`~jreshard.schedule.viewsched.view_schedule`).

    Raises:
      ValueError: ``options.chunk_bytes`` is below an item on the wire.
    """
    from jreshard.schedule.viewsched import view_schedule
    from jreshard.views.quant import QuantView as _Quant

    quant = [(v.part, v.block, v.x.dtype) if isinstance(v, _Quant) else None for v in gv.views]
    return view_schedule(lowerings, gv.layouts, gv.dsts, topology, options, quant, pipelined=pipelined)


def predict_group(
    vs: ViewSchedule, lowerings: Sequence[LeafLowering], topology: Topology, options: Options
) -> Prediction:
    """The cost model's *predicted* time of a views refit (``docs/cost_model.md``'s model).

    The loads are the schedule's own: every chunk it sends (landing on the network at stage 0,
    forwarded over the fast links at stage 1, as a plan's fan-out) and every same-device copy of the
    lowering, in the bytes they carry (the wire dtype), so a view refit and a plain one are
    predicted by the same formula.
    """
    import numpy as np

    rows: list[tuple[int, int, int, int, int]] = []
    for r, steps in vs.schedule.steps.items():
        for step in steps.values():
            rows += [(r, w.peer, int(w.link), 0 if w.link is Link.NETWORK else 1, w.nbytes) for w in step.sends]
    for low in lowerings:
        pieces = [*low.pieces, *(p for t in low.tasks for p in t.pieces)]
        rows += [
            (p.src_rank, p.dst_rank, int(Link.SAME_DEVICE), 0, p.wire_bytes)
            for p in pieces
            if p.link is Link.SAME_DEVICE
        ]
    cols = np.array(rows, dtype=np.int64).reshape(-1, 5)
    acc = LoadTable.empty(np.array(sorted(topology.ranks), dtype=np.int64))
    acc.add(cols[:, 0], cols[:, 1], cols[:, 2].astype(np.int8), cols[:, 3], cols[:, 4])
    return predict_loads(acc, topology, int(options.chunk_bytes))


def run_group(
    gv: GroupViews,
    vs: ViewSchedule,
    comm: Communicator,
    sources: Mapping[tuple[int, int], Any],
    targets: Mapping[tuple[int, int], Any],
    *,
    options: Options,
    given: Mapping[tuple[int, int], Any] | None = None,
    delta: DeltaRefit | None = None,
) -> tuple[dict[tuple[int, int], Any], ExecStats]:
    """This process's ranks (``comm.local_ranks``) of ``vs`` through the one round loop, into fresh buffers
    (or into ``given`` ones).

    Args:
      gv: the group's views.
      vs: :func:`schedule_group`'s schedule (the same on every process).
      comm: the transport.
      sources: ``{(source leaf, rank): single-device jax array}`` of this process's source shards.
      targets: ``{(destination leaf, rank): jax device}`` of the destination shards this process makes.
      options: chunking, staging, ``timeout_s``.
      given: ``{(destination leaf, rank): 1-D uint8 buffer}`` to write into instead of fresh buffers
        (a receiving endpoint's); those come back as the buffers themselves.
      delta: send what changed since the receivers' bases (:mod:`jreshard.engine.deltarounds`).

    Returns:
      ``({(destination leaf, rank): shard}, this process's engine statistics)``: a fresh shard as the buffer it
      landed in (:data:`~jreshard.engine.driver.Landed`: ``(buffer, shape, dtype, device)``), for the caller to make
      whole arrays over (:func:`~jreshard.engine.driver.landed_array`); a given one as its buffer.
    """
    from jreshard.engine.buffers import CpuBuffers
    from jreshard.engine.viewrun import run_view_schedule
    from jreshard.sharding.dtypes import storage_bytes

    backend = CpuBuffers()
    src = {k: backend.export_source(a) for k, a in sources.items()}
    devices = {r: next(iter(a.devices())) for (_, r), a in sources.items()}
    devices |= {r: d for (_, r), d in targets.items()}
    given = given or {}
    by_device: dict[Any, list[tuple[int, int]]] = {}
    for k, device in targets.items():
        if k not in given:
            by_device.setdefault(device, []).append(k)
    dst: dict[tuple[int, int], Any] = {k: v for k, v in given.items() if k in targets}
    for device, keys in by_device.items():  # one block per device for all its destination shards
        sizes = [storage_bytes(gv.dsts[t].np_dtype, gv.dsts[t].box_of(r).volume) for t, r in keys]
        dst.update(zip(keys, backend.allocate(sizes, device), strict=True))
    stats = run_view_schedule(
        vs,
        gv.views,
        gv.layouts,
        gv.dsts,
        comm,
        src,
        dst,
        options=options,
        buffers=backend,
        devices=devices,
        delta=delta,
    )
    out = {
        (t, r): buf if (t, r) in given else (buf, gv.dsts[t].box_of(r).shape, gv.dsts[t].np_dtype, targets[(t, r)])
        for (t, r), buf in dst.items()
    }
    return out, stats
