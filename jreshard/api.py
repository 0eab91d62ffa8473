"""transfer() and transfer_into(): move jax arrays and pytrees between shardings.

**Which backend.** ``options.backend`` and where the arrays live pick the
transport (:func:`jreshard.nccl.backend.select_backend`), and the choice is final:
an explicit backend that cannot start raises :class:`BackendUnavailableError`
saying why, never falling back to another.

- ``local``: every device taking part is addressable here (a single-controller
  program on CPU devices, or one host's GPUs). Each piece of each destination shard
  is copied straight from a source shard that holds it: no staging, no messages,
  and the global array is never materialised on the host. Source shards are
  exported zero-copy with DLPack; destination shards are taken from a pool of
  buffers that jax has released (warm memory, :mod:`jreshard.nccl.pool`), imported
  zero-copy on their device, and assembled with
  ``jax.make_array_from_single_device_arrays``.
- ``mpi``: :func:`jreshard.multi.transfer_multiprocess`, the message-passing
  engine over MPI; every process of the cluster calls ``transfer``.
- ``nccl``: the same engine over ``NcclComm``, in one process with GPUs or across
  the processes of a ``jax.distributed`` cluster (through
  :func:`jreshard.multi.transfer_multiprocess`). Not run on GPU.

All the work that depends only on shapes, dtypes and shardings is cached
(:func:`jreshard.nccl.direct.direct_transfer`): the second transfer of the same
pytree spends no time planning. Every check runs before any byte is written.
``report=True`` returns a :class:`~jreshard.report.TransferReport` with the result.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jreshard.errors import BackendUnavailableError, TransferError
from jreshard.nccl.backend import BackendChoice, Placement, select_backend
from jreshard.nccl.buffers import BufferBackend, CpuBuffers
from jreshard.nccl.comm import Communicator
from jreshard.nccl.direct import DirectTransfer, assemble, flatten, local_devices, prepare
from jreshard.nccl.engine import ExecStats, Shards, execute
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder, ReportPhase, TransferReport
from jreshard.sharding.plan import Plan
from jreshard.sharding.planner import plan_layouts
from jreshard.sharding.topology import Topology

__all__ = ["TransferReport", "transfer", "transfer_into", "transfer_with"]


def _route(leaves: list, targets: list, what: str, options: Options) -> tuple[BackendChoice, bool]:
    """The backend for these leaves and targets, and whether one process addresses every device
    (the checks of each leaf come later, in order)."""
    shardings = {leaf.sharding for leaf in leaves if isinstance(leaf, jax.Array)}
    for t in targets:
        sh = t.sharding if what == "into" and isinstance(t, jax.Array) else t
        if isinstance(sh, jax.sharding.Sharding):
            shardings.add(sh)
    devices = set()
    for sh in shardings:
        try:
            devices |= sh.device_set
        except Exception:
            continue
    if not devices:  # nothing to place: an empty tree
        return BackendChoice(backend=Backend.LOCAL, reason="no devices take part (an empty pytree)"), True
    placement = Placement.of_devices(devices, jax.process_index())
    return select_backend(options.backend, placement), placement.single_process


def _prepare(x: Any, target: Any, what: str, topology: Topology | None, options: Options) -> tuple:
    leaves, treedef, targets, names = flatten(x, target, what)
    choice, here = _route(leaves, targets, what, options)
    if choice.backend is not Backend.LOCAL:
        return (choice, here), leaves, treedef, targets, None
    return (choice, here), leaves, treedef, targets, prepare(leaves, treedef, targets, names, what, topology, options)


def _buffers(leaves: list) -> BufferBackend:
    """numpy buffers, or CuPy ones when the arrays are on GPUs (not run on GPU)."""
    on_gpu = any(d.platform in ("gpu", "cuda") for leaf in leaves[:1] for d in leaf.sharding.device_set)
    if not on_gpu:
        return CpuBuffers()
    from jreshard.nccl.gpu_buffers import CupyBuffers

    return CupyBuffers()


def _copy(prog: DirectTransfer, backend: BufferBackend, src: list, dst: list) -> None:
    if isinstance(backend, CpuBuffers):
        prog.direct.run(src, dst)
        return
    # GPUs (not run on GPU): one backend copy per destination device, then wait.
    d = prog.direct
    rank_of_buf = np.array([r for _, r in prog.dst_keys], dtype=np.int64)
    rows = rank_of_buf[d.dst_table[:, 0]] if len(d.dst_table) else rank_of_buf[:0]
    for r in sorted(set(rows.tolist())):
        mask = rows == r
        backend.copy(d.src_table[mask], src, d.dst_table[mask], dst)
    backend.synchronize()


def _begin(x: Any, target: Any, what: str, topology: Topology | None, options: Options) -> tuple:
    """Check and plan (timed as the report's ``plan`` phase) and pick the backend."""
    builder = ReportBuilder(Backend.LOCAL)
    with builder.timed(ReportPhase.PLAN):
        route, leaves, treedef, targets, prog = _prepare(x, target, what, topology, options)
    builder.choose(route[0].backend, route[0].reason)
    return builder, route, leaves, treedef, targets, prog


def _elsewhere(
    route: tuple[BackendChoice, bool],
    x: Any,
    target: Any,
    what: str,
    topology: Topology | None,
    options: Options,
    builder: ReportBuilder,
) -> Any:
    """Run a transfer that the direct path does not: across processes (MPI), or over NCCL."""
    choice, single_process = route
    if what == "into":
        raise BackendUnavailableError(
            f"transfer_into runs in one process with backend 'local', but {choice.reason} picked backend "
            f"{choice.backend.value!r}. The fix is jreshard.RefitGroup.pull(into=...) across processes, "
            "or backend='auto' or 'local' in one process"
        )
    if choice.backend is Backend.MPI:
        from jreshard.multi import transfer_multiprocess

        if isinstance(target, jax.sharding.Sharding):
            target = jax.tree.map(lambda _: target, x)
        return transfer_multiprocess(x, target, topology=topology, options=options)
    from jreshard.nccl.nccl_route import nccl_in_process, nccl_multiprocess

    if not single_process:
        return nccl_multiprocess(x, target, topology, options)
    return nccl_in_process(x, target, topology, options, builder)


def _finish(builder: ReportBuilder, result: Any, report: bool) -> Any:
    return (result, builder.build()) if report else result


def transfer(
    x: Any, target: Any, *, topology: Topology | None = None, options: Options | None = None, report: bool = False
) -> Any:
    """Move ``x`` (a jax.Array or a pytree of them) to ``target`` shardings.

    Args:
      x: a ``jax.Array`` or a pytree of them.
      target: a ``jax.sharding.Sharding`` (for every leaf) or a pytree matching ``x``
        whose leaves are shardings; a ``None`` leaf keeps that leaf where it is.
      topology: ranks and domains (default: ``Topology.from_devices``, rank = ``device.id``);
        part of the cache key.
      options: ``jreshard.Options``; ``backend`` picks the transport (module docstring).
      report: also return a :class:`TransferReport` (backend and why, bytes per link,
        seconds per phase, the destination bytes allocated fresh).

    Returns:
      The same structure, each leaf committed to exactly its target sharding and equal
      to ``x`` (with ``report=True``: ``(result, report)``). Leaves whose sharding
      already is the target are returned as they are (no bytes move); destination
      shards that equal a source shard on the same device share its buffer.
      Destination buffers come from a pool of buffers jax released earlier
      (``jreshard.nccl.pool.default_pool()``; ``.clear()`` gives them back).

    Raises:
      LayoutMismatchError: ``target`` does not match the structure of ``x``.
      LayoutError: a leaf is not a jax.Array, was deleted or donated, or a target is not a
        sharding; IndivisibleError: a target cannot hold the leaf's shape.
      TopologyError: a target uses devices that do not exist.
      BackendUnavailableError: ``options.backend`` cannot run these arrays (the message says why).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, jreshard
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> devs = np.array(jax.devices())
      >>> train = Mesh(devs[:4], ("fsdp",))
      >>> infer = Mesh(devs[4:].reshape(2, 2), ("dp", "tp"))
      >>> w = jax.device_put(jnp.arange(32.0).reshape(4, 8), NamedSharding(train, P("fsdp")))
      >>> out = jreshard.transfer({"w": w}, {"w": NamedSharding(infer, P(None, "tp"))})
      >>> out["w"].sharding.spec, np.array_equal(out["w"], w)
      (P(None, 'tp'), True)
      >>> out["w"].addressable_shards[0].data.shape
      (4, 4)
      >>> out, rep = jreshard.transfer(w, NamedSharding(infer, P("dp")), report=True)
      >>> rep.backend.value, rep.bytes_by_link()[jreshard.Link.FAST], rep.moved_bytes == 2 * w.nbytes
      ('local', 256, True)
    """
    options = options or Options()
    builder, route, leaves, treedef, targets, prog = _begin(x, target, "target", topology, options)
    if prog is None:
        return _finish(builder, _elsewhere(route, x, target, "target", topology, options, builder), report)
    if not prog.moves:
        return _finish(builder, treedef.unflatten(assemble(prog, leaves, targets, {}, "target")), report)
    backend = _buffers(leaves)
    devices = {d.id: d for d in local_devices()}
    pool = backend.pool if isinstance(backend, CpuBuffers) else None
    fresh0 = pool.stats().fresh_bytes if pool is not None else 0
    with builder.timed(ReportPhase.BUFFERS):
        shards = [{s.device.id: s.data for s in leaves[i].addressable_shards} for i in prog.moves]
        src_bufs = [backend.export_source(shards[t][h]) for t, h in prog.src_keys]
        dst_bufs = [backend.allocate([prog.dst_nbytes(t, r)], devices[r])[0] for t, r in prog.dst_keys]
    with builder.timed(ReportPhase.COPY):
        _copy(prog, backend, src_bufs, dst_bufs)
    with builder.timed(ReportPhase.BUFFERS):
        parts: dict[int, list] = {t: [] for t in range(len(prog.moves))}
        for (t, r), buf in zip(prog.dst_keys, dst_bufs, strict=True):
            lay = prog.pairs[t][1]
            parts[t].append(backend.import_shard(buf, prog.dst_shape(t, r), lay.np_dtype, devices[r]))
        for t, r in prog.aliases:
            parts[t].append(shards[t][r])
        out = treedef.unflatten(assemble(prog, leaves, targets, parts, "target"))
        del src_bufs, dst_bufs
    for link, n in prog.link_bytes:
        builder.add_bytes(link, n)
    if pool is not None:
        builder.add_fresh(pool.stats().fresh_bytes - fresh0)
    return _finish(builder, out, report)


def transfer_into(
    x: Any, into: Any, *, topology: Topology | None = None, options: Options | None = None, report: bool = False
) -> Any:
    """Write ``x`` into the existing arrays ``into`` (same structure, shapes and dtypes), in one process.

    The caller donates ``into``: its buffers are overwritten in place, so an inference
    engine's weights are updated without a second copy. Use the returned arrays (they
    alias ``into``'s memory) and not ``into`` itself afterwards, and make sure no
    computation still reads ``into`` concurrently. A ``None`` leaf in ``into`` keeps
    that leaf of ``x``. On any error raised here, ``into`` is untouched: every check
    runs before the first byte is written.

    Args:
      x: a ``jax.Array`` or a pytree of them.
      into: a matching pytree of ``jax.Array`` (or ``None`` leaves), the destinations.
      topology: as for :func:`transfer`.
      options: as for :func:`transfer`; the backend must resolve to ``"local"``.
      report: also return a :class:`TransferReport`.

    Returns:
      Arrays with ``into``'s shardings, equal to ``x``, over ``into``'s buffers (with
      ``report=True``: ``(result, report)``).

    Raises:
      LayoutMismatchError: structure, shape or dtype differ between ``x`` and ``into``;
      BackendUnavailableError: the arrays span processes, or the backend is not local;
      and the errors of :func:`transfer`.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, jreshard
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> devs = np.array(jax.devices())
      >>> a = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
      >>> b = NamedSharding(Mesh(devs[4:], ("y",)), P(None, "y"))
      >>> src = jax.device_put(jnp.arange(16.0).reshape(4, 4), a)
      >>> dst = jax.device_put(jnp.zeros((4, 4)), b)
      >>> ptr = dst.addressable_shards[0].data.unsafe_buffer_pointer()
      >>> out, rep = jreshard.transfer_into(src, dst, report=True)
      >>> np.array_equal(out, src), out.addressable_shards[0].data.unsafe_buffer_pointer() == ptr
      (True, True)
      >>> rep.moved_bytes, rep.fresh_bytes
      (64, 0)
    """
    options = options or Options()
    builder, route, leaves, treedef, targets, prog = _begin(x, into, "into", topology, options)
    if prog is None:
        return _finish(builder, _elsewhere(route, x, into, "into", topology, options, builder), report)
    backend = _buffers(leaves) if prog.moves else CpuBuffers()
    with builder.timed(ReportPhase.BUFFERS):
        src_bufs = []
        if prog.moves:
            shards = [{s.device.id: s.data for s in leaves[i].addressable_shards} for i in prog.moves]
            src_bufs = [backend.export_source(shards[t][h]) for t, h in prog.src_keys]
        dst_shards = [{s.device.id: s.data for s in targets[i].addressable_shards} for i in prog.moves]
        dst_bufs = [backend.writable_view(dst_shards[t][r]) for t, r in prog.dst_keys]
    with builder.timed(ReportPhase.COPY):
        try:
            _copy(prog, backend, src_bufs, dst_bufs)
        except Exception as err:  # every check passed before this point: say what state `into` is in
            raise TransferError(
                f"transfer_into failed while copying ({type(err).__name__}: {err}); the destination arrays "
                "`into` are partly overwritten and hold neither the old nor the new values",
                destination_intact=False,
            ) from err
    with builder.timed(ReportPhase.BUFFERS):
        parts = {t: list(d.values()) for t, d in enumerate(dst_shards)}
        out = treedef.unflatten(assemble(prog, leaves, targets, parts, "into"))
        del src_bufs, dst_bufs
    for link, n in prog.link_bytes:
        builder.add_bytes(link, n)
    return _finish(builder, out, report)


def transfer_with(
    x: Any,
    target: Any,
    comm: Communicator,
    *,
    topology: Topology | None = None,
    options: Options | None = None,
    buffers: BufferBackend | None = None,
    report: ReportBuilder | None = None,
) -> tuple[Any, ExecStats, Plan]:
    """:func:`transfer` through the message-passing engine (the path MPI and NCCL take), over
    ``comm`` whose ``local_ranks`` must be every rank taking part. For tests and comparisons.

    Args:
      buffers: the buffer backend (default numpy buffers from the pool).
      report: a builder the engine adds its phases, bytes and staging to.

    Returns:
      ``(result, stats, plan)``: the moved pytree, what the engine did, and the plan it ran.
    """
    options = options or Options()
    backend = buffers or CpuBuffers()
    leaves, treedef, targets, names = flatten(x, target, "target")
    prog = prepare(leaves, treedef, targets, names, "target", topology, options)
    devices = {d.id: d for d in local_devices()}
    used = sorted({r for p in prog.pairs for lay in p for r in lay.ranks})
    topo = topology or Topology.from_devices([devices[r] for r in used])
    plan = plan_layouts(prog.pairs, topo, options, [str(i) for i in prog.moves])
    src, dst = {}, {}
    for t, i in enumerate(prog.moves):
        for s in leaves[i].addressable_shards:
            src[(t, s.device.id)] = backend.export_source(s.data)
        lay = prog.pairs[t][1]
        for r in lay.ranks:
            (dst[(t, r)],) = backend.allocate([prog.dst_nbytes(t, r)], devices[r])
    stats = execute(
        plan, comm, Shards(src=src, dst=dst), options=options, backend=backend, devices=devices, report=report
    )
    parts = {
        t: [backend.import_shard(dst[(t, r)], lay.box_of(r).shape, lay.np_dtype, devices[r]) for r in lay.ranks]
        for t, (_, lay) in enumerate(prog.pairs)
    }
    return treedef.unflatten(assemble(prog, leaves, targets, parts, "target")), stats, plan
