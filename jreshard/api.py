"""transfer() and transfer_into(): move jax arrays and pytrees between shardings.

**Which backend.** ``options.backend`` and where the arrays live pick the
transport (:func:`jreshard.nccl.backend.select_backend`), and the choice is final:
an explicit backend that cannot start raises :class:`BackendUnavailableError`
saying why, never falling back to another.

- ``local``: every device taking part is addressable in this process (a
  single-controller program on CPU devices). The plan of each layout group is
  lowered to local copies (:mod:`jreshard.nccl.lowering`) and run for every leaf of
  the group at once (:mod:`jreshard.nccl.inprocess`): source shards are read through
  their buffers, destination shards come from a pool of memory jax has released
  (:mod:`jreshard.nccl.pool`), and the global array is never materialised on the
  host. On GPUs in one process the engine below runs over local copies.
- ``mpi``: :func:`jreshard.multi.transfer_multiprocess`, the message-passing
  engine over MPI; every process of the cluster calls ``transfer``.
- ``nccl``: the same engine over ``NcclComm``, in one process with GPUs or across
  the processes of a ``jax.distributed`` cluster (through
  :func:`jreshard.multi.transfer_multiprocess`). Not run on GPU.

All the work that depends only on shapes, dtypes and shardings is cached
(:mod:`jreshard.frontdoor`): the second transfer of the same pytree spends no time
planning. Every check runs before any byte is written.
``report=True`` returns a :class:`~jreshard.report.TransferReport` with the result.
"""

from __future__ import annotations

from typing import Any

import jax

from jreshard.errors import BackendUnavailableError
from jreshard.frontdoor import Mode, Prepared, prepare
from jreshard.nccl.backend import BackendChoice, Placement, select_backend
from jreshard.normalize import normalize
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder, ReportPhase, TransferReport
from jreshard.sharding.topology import Topology

__all__ = ["TransferReport", "transfer", "transfer_into", "transfer_with"]

PyTree = Any


def _route(x: PyTree, target: PyTree, mode: Mode, options: Options) -> tuple[BackendChoice, bool]:
    """The backend for these arrays, and whether one process addresses every device."""
    shardings = set()
    for leaf in jax.tree_util.tree_leaves(x):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            shardings.add(leaf.sharding)
    is_leaf = None if mode is Mode.INTO else (lambda v: v is None or not isinstance(v, (dict, list, tuple)))
    for t in jax.tree_util.tree_leaves(target, is_leaf=is_leaf):
        if isinstance(t, jax.Array):
            shardings.add(t.sharding)
        elif isinstance(t, jax.sharding.Sharding):
            shardings.add(t)
        elif isinstance(t, jax.ShapeDtypeStruct) and t.sharding is not None:
            shardings.add(t.sharding)
    devices: set = set()
    for sh in shardings:
        try:
            devices |= sh.device_set
        except Exception:  # an abstract mesh: the front door says so
            continue
    if not devices:  # nothing to place: an empty tree
        return BackendChoice(backend=Backend.LOCAL, reason="no devices take part (an empty pytree)"), True
    placement = Placement.of_devices(devices, jax.process_index())
    return select_backend(options.backend, placement), placement.single_process


def _on_gpus(prep: Prepared) -> bool:
    return any(d.platform in ("gpu", "cuda") for leaf in prep.leaves[:1] for d in leaf.sharding.device_set)


def _run(
    x: PyTree, target: PyTree, mode: Mode, topology: Topology | None, options: Options | None, report: bool
) -> Any:
    """The one path of every call: route, front door, run the backend's lowering, assemble."""
    options = Options.of(options)
    Topology.check_arg(topology)
    if _has_views(x):
        return _run_views(x, target, mode, topology, options, report)
    if mode is Mode.TRANSFER:  # array targets, casts, host data and host memory: what device_put takes
        x, target = normalize(x, target)
    builder = ReportBuilder(Backend.LOCAL)
    with builder.timed(ReportPhase.PLAN):
        choice, single_process = _route(x, target, mode, options)
        builder.choose(choice.backend, choice.reason)
        if choice.backend is Backend.LOCAL or single_process:
            prep = prepare(x, target, mode, topology, options)
    if mode is Mode.INTO and choice.backend is not Backend.LOCAL:
        raise BackendUnavailableError(
            f"transfer_into runs in one process with backend 'local', but {choice.reason} picked backend "
            f"{choice.backend.value!r}. The fix is jreshard.RefitGroup.pull(into=...) across processes, "
            "or backend='auto' or 'local' in one process"
        )
    if choice.backend is Backend.LOCAL and not _on_gpus(prep):
        from jreshard.nccl.inprocess import run_local

        leaves = run_local(prep, topology, options, builder)
        result = prep.treedef.unflatten(leaves)
    else:
        result = _engine(x, target, choice, single_process, topology, options, builder)
    return (result, builder.build()) if report else result


def _has_views(x: PyTree) -> bool:
    from jreshard.views.algebra import View

    return any(isinstance(v, View) for v in jax.tree_util.tree_leaves(x, is_leaf=lambda v: isinstance(v, View)))


def _run_views(x: PyTree, target: PyTree, mode: Mode, topology: Topology | None, options: Options, report: bool) -> Any:
    """A pytree with views among its leaves (casts, fused parameters...): :mod:`jreshard.views`, in one
    process, or across the processes of a multi-controller cluster over MPI (``transfer`` only)."""
    from jreshard.views.algebra import View

    views = jax.tree_util.tree_leaves(x, is_leaf=lambda v: isinstance(v, View))
    devices = {d for v in views if isinstance(v, View) for leaf in v.leaves() for d in leaf.source.sharding.device_set}
    _, single = _route([v for v in views if isinstance(v, jax.Array)], target, mode, options)
    single = single and all(d.process_index == jax.process_index() for d in devices)
    allowed = (Backend.AUTO, Backend.LOCAL) if single else (Backend.AUTO, Backend.MPI)
    if options.backend not in allowed:
        where = "in one process" if single else "across processes"
        raise BackendUnavailableError(
            f"views {where} run with backend {' or '.join(repr(b.value) for b in allowed)}; "
            f"options.backend={options.backend.value!r} cannot run them"
        )
    if not single:
        if mode is Mode.INTO:
            raise BackendUnavailableError(
                "transfer_into of views runs in one process; across processes, call jreshard.transfer on every "
                "process (its results are new arrays)"
            )
        from jreshard.views.cluster import transfer_cluster

        builder = ReportBuilder(Backend.MPI, "views across processes: MPI")
        result = transfer_cluster(x, target, topology=topology, options=options, report=builder)
        return (result, builder.build()) if report else result
    from jreshard.views import execute

    builder = ReportBuilder(Backend.LOCAL, "views run in one process")
    run = execute.transfer_into if mode is Mode.INTO else execute.transfer
    result = run(x, target, topology=topology, report=builder, threads=options.copy_threads)
    return (result, builder.build()) if report else result


def _engine(
    x: PyTree,
    target: PyTree,
    choice: BackendChoice,
    single_process: bool,
    topology: Topology | None,
    options: Options,
    builder: ReportBuilder,
) -> Any:
    """The message-passing engine: MPI across processes, NCCL, or GPUs in one process (not run on GPU)."""
    from jreshard.multi import transfer_multiprocess

    if choice.backend is Backend.MPI:
        return transfer_multiprocess(x, target, topology=topology, options=options, report=builder)
    if choice.backend is Backend.LOCAL:  # GPUs in one process: the engine over local copies
        from jreshard.nccl.gpu_buffers import CupyBuffers
        from jreshard.nccl.local import LocalComm

        ranks = sorted({d.id for leaf in jax.tree_util.tree_leaves(x) for d in leaf.sharding.device_set})
        return transfer_multiprocess(
            x,
            target,
            topology=topology,
            options=options,
            transport=LocalComm(ranks),
            buffers=CupyBuffers(),
            report=builder,
        )
    from jreshard.nccl.nccl_route import nccl_in_process, nccl_multiprocess

    if not single_process:
        return nccl_multiprocess(x, target, topology, options, builder)
    return nccl_in_process(x, target, topology, options, builder)


def transfer(
    x: Any, target: Any, *, topology: Topology | None = None, options: Options | None = None, report: bool = False
) -> Any:
    """Move ``x`` (a jax.Array or a pytree of them) to ``target`` shardings.

    Args:
      x: a ``jax.Array`` or a pytree of them.
      target: a ``jax.sharding.Sharding`` (for every leaf) or a pytree matching ``x``
        whose leaves are shardings, ``jax.ShapeDtypeStruct``s or ``jax.Array``s with a
        sharding (of the leaf's shape; of another dtype, the leaf is cast to it), or ``None``
        (keep that leaf where it is). Sources are ``jax.Array``s, numpy arrays or scalars
        (placed by ``jax.device_put``); leaves in or to ``pinned_host`` / ``unpinned_host``
        memory move with ``jax.device_put`` in this process (:mod:`jreshard.normalize`). It
        runs outside ``jax.jit``, and under any ``jax.transfer_guard`` that allows
        ``jax.device_put`` between the same devices.
      topology: ranks and domains (default: ``Topology.from_devices``, rank = ``device.id``);
        part of the cache key.
      options: ``jreshard.Options``; ``backend`` picks the transport (module docstring).
      report: also return a :class:`TransferReport` (backend and why, bytes per link,
        seconds per phase, the destination bytes allocated fresh).

    Returns:
      The same structure, each leaf committed to exactly its target sharding and equal
      to ``x`` (with ``report=True``: ``(result, report)``). A leaf whose sharding
      already is the target, or whose target is ``None``, is returned as it is (as
      ``jax.device_put`` does); every other result owns new memory and shares no buffer
      with ``x``, even where a destination shard equals a source shard on the same
      device (colocated meshes, renamed axes): a train step that donates ``x`` never
      deletes a result. Nothing in ``x`` is written. Destination buffers come from a
      pool of memory that jax released earlier (``jreshard.nccl.pool.default_pool()``;
      ``.clear()`` gives it back).

    Raises:
      LayoutMismatchError: ``target`` does not match the structure of ``x``, or an array or
        ShapeDtypeStruct target has another shape.
      LayoutError: a leaf is neither an array nor a scalar, was deleted or donated, or a target
        is not a sharding; IndivisibleError: a target cannot hold the leaf's shape.
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
    return _run(x, target, Mode.TRANSFER, topology, options, report)


def transfer_into(
    x: Any, into: Any, *, topology: Topology | None = None, options: Options | None = None, report: bool = False
) -> Any:
    """Write ``x`` into the existing arrays ``into`` (same structure, shapes and dtypes), in one process.

    **Ownership.** ``transfer_into`` consumes ``into`` the way
    ``jax.jit(..., donate_argnums=...)`` consumes donated arguments: after the call,
    every ``into`` leaf it wrote is deleted (using it raises jax's "deleted" error) and
    only the returned arrays are live; they own the memory ``into`` had, so an
    inference engine's weights are updated without a second copy. It writes in place
    only into memory that no other live array can observe: never into a buffer that
    is also a source leaf's, nor one that another ``into`` leaf names (the same array
    twice). Such leaves, and ``into`` leaves already deleted, get fresh buffers
    instead: they are left as they are, and the report counts those bytes
    (``not_in_place_bytes``). Nothing in ``x`` ever changes. A ``None`` leaf in
    ``into`` returns that leaf of ``x`` itself. On any error raised before the copy,
    ``into`` is untouched: every check runs before the first byte is written. On GPUs in
    one process (not run on GPU) the engine writes new arrays and leaves ``into`` as it is.

    Args:
      x: a ``jax.Array`` or a pytree of them.
      into: a matching pytree of ``jax.Array`` (or ``None`` leaves), the destinations.
      topology: as for :func:`transfer`.
      options: as for :func:`transfer`; the backend must resolve to ``"local"``.
      report: also return a :class:`TransferReport`.

    Returns:
      Arrays with ``into``'s shardings, equal to ``x``, over ``into``'s memory where
      it was exclusively owned (with ``report=True``: ``(result, report)``).

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
      >>> rep.moved_bytes, rep.fresh_bytes, dst.is_deleted()
      (64, 0, True)
    """
    return _run(x, into, Mode.INTO, topology, options, report)


def transfer_with(
    x: PyTree,
    target: PyTree,
    comm: Any,
    *,
    topology: Topology | None = None,
    options: Options | None = None,
    buffers: Any = None,
    report: ReportBuilder | None = None,
) -> tuple[Any, Any, Any]:
    """:func:`transfer` through the message-passing engine over ``comm`` (whose local ranks are every
    rank taking part): the path MPI and NCCL take, in one process. For tests and comparisons.

    Returns:
      ``(result, stats, programs)``: the moved pytree, what the engine did, and the programs
      ``{rank: RankProgram}`` of ``comm``'s ranks it ran (each planned alone, no whole plan).
    """
    from jreshard.multi import transfer_multiprocess

    return transfer_multiprocess(
        x, target, topology=topology, options=options, transport=comm, buffers=buffers, report=report, details=True
    )
