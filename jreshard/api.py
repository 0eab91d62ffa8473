"""transfer() and transfer_into(): move jax arrays and pytrees between shardings.

**Which backend.** ``options.backend`` and where the arrays live pick the
transport (:func:`jreshard.call.routes.select_backend`), and the choice is final:
an explicit backend that cannot start raises :class:`BackendUnavailableError`
saying why, never falling back to another.

- ``local``: every device taking part is addressable in this process (a
  single-controller program on CPU devices). The plan of each layout group is
  lowered to in-process copies (:mod:`jreshard.engine.copies`) and run for every leaf of
  the group at once (:mod:`jreshard.engine.inprocess`): source shards are read through
  their buffers, destination shards come from a pool of memory jax has released
  (:mod:`jreshard.engine.pool`), and the global array is never materialised on the
  host. On GPUs in one process the engine below runs over in-process copies.
- ``mpi``: :func:`jreshard.call.routes.transfer_multiprocess`, the message-passing
  engine over MPI; every process of the cluster calls ``transfer``.
- ``nccl``: the same engine over ``NcclComm``, in one process with GPUs or across
  the processes of a ``jax.distributed`` cluster (through
  :func:`jreshard.call.routes.transfer_multiprocess`). Not run on GPU.
- ``xla``: the plan compiled into one jitted ``shard_map`` of ``ppermute``s over the devices
  (:mod:`jreshard.xla`), in one process or across the processes of a ``jax.distributed``
  cluster (every process calls). Only when asked for. Not run on GPU or TPU.
- ``nixl``: moves weights between two programs (``RefitGroup``, :mod:`jreshard.elastic`); a call
  with it raises :class:`BackendUnavailableError` naming the backends that can run it.

Each backend is a transport of the registry (:mod:`jreshard.call.routes`), asked by name.

All the work that depends only on shapes, dtypes and shardings is cached
(:mod:`jreshard.call.front`): the second transfer of the same pytree spends no time
planning. Every check runs before any byte is written.
``report=True`` returns a :class:`~jreshard.report.TransferReport` with the result.
"""

from __future__ import annotations

from typing import Any

import jax

from jreshard.call import repack
from jreshard.call.front import Call, Mode, flatten, plain_key, prepare, shape_of
from jreshard.call.normalize import normalize
from jreshard.call.routes import BackendChoice, route, route_shardings, run_engine, runner, target_shardings
from jreshard.engine.buffers import Buffers
from jreshard.engine.comm import Communicator
from jreshard.engine.prepared import Prepared, Shape
from jreshard.errors import BackendUnavailableError
from jreshard.options import Backend, Options
from jreshard.report import NotInPlace, ReportBuilder, ReportPhase, TransferReport
from jreshard.sharding.caches import cache
from jreshard.sharding.topology import Topology
from jreshard.types import PyTree, Target, TreeDef

__all__ = ["TransferReport", "transfer", "transfer_into", "transfer_with"]


def _run(
    x: PyTree, target: PyTree, mode: Mode, topology: Topology | None, options: Options | None, report: bool
) -> PyTree:
    """The one path of every call: flatten once, route, check, run, assemble."""
    options = Options.of(options)
    Topology.check_arg(topology)
    leaves, treedef, targets = flatten(x, target, mode.value if mode is Mode.INTO else "target")
    if not jax.sharding.get_abstract_mesh().empty:
        resolved = [_mesh_resolved(t) for t in targets]
        if any(r is not t for r, t in zip(resolved, targets, strict=True)):
            targets, target = resolved, treedef.unflatten(resolved)
    with _outside_context_mesh():
        return _run_flat_tree(x, target, mode, topology, options, report, leaves, treedef, targets)


def _mesh_resolved(t: Target) -> Target:
    """A ``ShapeDtypeStruct`` target given a ``PartitionSpec`` (which jax resolves against the context mesh
    each time its sharding is read) as one with that ``NamedSharding``, read while the mesh is set."""
    if isinstance(t, jax.ShapeDtypeStruct) and isinstance(getattr(t, "_sharding", None), jax.sharding.PartitionSpec):
        return jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=t.sharding, weak_type=t.weak_type)
    return t


def _outside_context_mesh() -> Any:
    """A context without the caller's ``jax.set_mesh`` mesh, for everything after :func:`flatten` (which
    read it: a ``PartitionSpec`` target means that mesh).

    jreshard's own device computations (casts, the repacking of sub-byte and key leaves, the donation
    of ``into``) name every sharding they use; under a context mesh jax refuses any of them whose
    arrays lie on other devices ("incompatible devices for jitted computation"), where
    ``jax.device_put`` between the same shardings runs.
    """
    import contextlib

    if jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    try:
        return jax.set_mesh(None)
    except ValueError:  # inside a traced function: the checks below refuse the traced leaves by name
        return contextlib.nullcontext()


def _run_flat_tree(
    x: PyTree,
    target: PyTree,
    mode: Mode,
    topology: Topology | None,
    options: Options,
    report: bool,
    leaves: list[Any],
    treedef: TreeDef,
    targets: list[Any],
) -> PyTree:
    """:func:`_run` after the flattening."""
    builder = ReportBuilder(Backend.LOCAL)
    with builder.timed(ReportPhase.PLAN):
        plain = _plain(leaves, treedef, targets, mode, topology, options)
    if plain is not None:  # the common call: checked, routed and planned from its key in one pass
        from jreshard.engine.inprocess import run_local

        prep, choice = plain
        builder.choose(choice.backend, choice.reason)
        result = treedef.unflatten(run_local(prep, topology, options, builder))
        return (result, builder.build()) if report else result
    if _has_views(leaves):
        call = Call(mode=mode, leaves=leaves, treedef=treedef, targets=targets, x=x)
        return _run_views(call, topology, options, report)
    norm = None
    if mode is Mode.TRANSFER:  # array targets, casts, host data and host memory: what device_put takes
        norm = normalize(leaves, treedef, targets, x, target)
        leaves, targets = norm.leaves, norm.targets
    encs = repack.encodings(leaves, targets if mode is Mode.INTO else None)
    if encs is None:
        out = _run_flat(leaves, treedef, targets, mode, topology, options, builder, x)
    else:
        out = _run_repacked(leaves, treedef, targets, encs, mode, topology, options, builder, x)
    if norm is not None:
        out = norm.finish(out)
    result = treedef.unflatten(out)
    return (result, builder.build()) if report else result


def _plain(
    leaves: list[Any], treedef: TreeDef, targets: list[Any], mode: Mode, topology: Topology | None, options: Options
) -> tuple[Prepared, BackendChoice] | None:
    """A plain call (:func:`~jreshard.call.front.plain_key`: live, row-major jax arrays to ``NamedSharding`` or
    ``SingleDeviceSharding`` targets or into live arrays) that runs in this process over CPU devices with nothing
    to normalize or repack: its prepared call and route, at the cost of one pass over its leaves. Everything the
    full path would check beyond that pass depends on the key alone and is checked (and cached) once per key.
    ``None`` for any other call: the full path runs it, and raises what is wrong with it."""
    key = plain_key(leaves, treedef, targets, mode, topology, options)
    if key is None:
        return None
    try:
        known = _plain_route(key)
    except Exception:  # the full path raises it again, naming the leaf by its key path
        return None
    if known is None:
        return None
    choice, shape = known
    return Prepared(mode, leaves, targets, treedef, shape), choice


@cache(max_size=256)
def _plain_route(key: tuple) -> tuple[BackendChoice, Shape] | None:
    """The backend and :class:`Shape` of a plain call with this key when it runs in this process over CPU
    devices with every leaf as it is (device memory, a dtype the engine addresses: nothing for
    :func:`normalize` or :mod:`jreshard.call.repack` to do), else ``None``.

    Raises:
      LayoutError, IndivisibleError, TopologyError, BackendUnavailableError: what the key fails.
    """
    _treedef, specs, _mode, _topology, options = key
    shardings = {sh for spec in specs for sh in spec[2:4] if sh is not None}
    if any(getattr(sh, "memory_kind", None) not in (None, "device") for sh in shardings):
        return None
    if any(repack.encoding_of(dtype) is not None for dtype in {spec[1] for spec in specs}):
        return None
    choice, single_process = route_shardings(shardings, options)
    if choice.backend is not Backend.LOCAL or not single_process:
        return None
    if any(d.platform != "cpu" for sh in shardings for d in sh.device_set):
        return None
    return choice, shape_of(key)


def _run_flat(
    leaves: list[Any],
    treedef: TreeDef,
    targets: list[Any],
    mode: Mode,
    topology: Topology | None,
    options: Options,
    builder: ReportBuilder,
    x: PyTree,
) -> list[Any]:
    """Route, check and run one call's flat leaves; returns the result leaves."""
    with builder.timed(ReportPhase.PLAN):
        choice, single_process = route(leaves, targets, options)
        builder.choose(choice.backend, choice.reason)
        prep = None
        if choice.backend is Backend.LOCAL or (single_process and choice.backend is not Backend.XLA):
            prep = prepare(leaves, treedef, targets, mode, topology, options, x)
    if choice.backend is Backend.XLA:
        run_xla = runner(choice.backend.value)
        shardings = (
            target_shardings(targets) if mode is Mode.TRANSFER else [getattr(t, "sharding", None) for t in targets]
        )
        return run_xla(leaves, targets, shardings, mode, topology, options, builder)
    if mode is Mode.INTO and choice.backend is not Backend.LOCAL:
        raise BackendUnavailableError(
            f"transfer_into runs in one process with backend 'local', but {choice.reason} picked backend "
            f"{choice.backend.value!r}. The fix is jreshard.RefitGroup.pull(into=...) across processes, "
            "or backend='auto' or 'local' in one process"
        )
    if prep is not None and choice.backend is Backend.LOCAL and not prep.on_gpus:
        from jreshard.engine.inprocess import run_local

        return run_local(prep, topology, options, builder)
    shardings = list(prep.shape.shardings) if prep is not None else target_shardings(targets)
    into = targets if mode is Mode.INTO else None
    return run_engine(leaves, shardings, choice, single_process, topology, options, builder, into)


def _run_repacked(
    leaves: list[Any],
    treedef: TreeDef,
    targets: list[Any],
    encs: list[repack.Encoding | None],
    mode: Mode,
    topology: Topology | None,
    options: Options,
    builder: ReportBuilder,
    x: PyTree,
) -> list[Any]:
    """A call with leaves the engine cannot address as they are (:mod:`jreshard.call.repack`): those are
    encoded on their devices, moved as plain arrays, and decoded at their targets.

    Order: every check, then the encoded leaves' transfer (new arrays: nothing of the caller's is
    touched if it fails), then the other leaves' call, then the decodes (which consume the ``into``
    leaves they write over).
    """
    plan = repack.plan_leaves(leaves, targets, encs, mode)
    special = [i for i, e in enumerate(encs) if e is not None]
    moved = [i for i in special if plan[i] is not None]
    sub: list[Any] = []
    if moved:
        encoded = [repack.encode(leaves[i], encs[i]) for i in moved]  # type: ignore[arg-type]
        enc_targets = [plan[i].encoded_sharding for i in moved]  # type: ignore[union-attr]
        enc_tree = jax.tree_util.tree_structure(encoded)
        sub = _run_flat(encoded, enc_tree, enc_targets, Mode.TRANSFER, topology, options, builder, None)
    rest_targets = [None if e is not None else t for e, t in zip(encs, targets, strict=True)]
    out = _run_flat(leaves, treedef, rest_targets, mode, topology, options, builder, x)
    for i in special:
        if plan[i] is None:  # a None target, or (transfer) already the target sharding
            out[i] = leaves[i] if mode is Mode.TRANSFER or targets[i] is None else targets[i]
    why = repack.exclusive_into(leaves, targets, moved) if mode is Mode.INTO else {}
    for i, m in zip(moved, sub, strict=True):
        owned = mode is Mode.INTO and i not in why
        before = repack.held_addresses(targets[i]) if owned else frozenset()
        out[i] = repack.decode(m, encs[i], plan[i].sharding, targets[i] if owned else None)  # type: ignore[arg-type,union-attr]
        if i in why:
            builder.add_unowned(repack.storage_of(leaves[i]), i, why[i])
        elif owned and before != repack.held_addresses(out[i]):  # XLA copied: into's memory was not reused
            builder.add_unowned(repack.storage_of(out[i]), i, NotInPlace.NOT_HANDED_OVER)
    return out


def _has_views(leaves: list[Any]) -> bool:
    from jreshard.views.algebra import View

    return any(isinstance(v, View) for v in leaves)


def _run_views(call: Call, topology: Topology | None, options: Options, report: bool) -> PyTree:
    """A pytree with views among its leaves (casts, fused parameters...): :mod:`jreshard.views`, in one
    process, or across the processes of a multi-controller cluster over MPI (``transfer`` only)."""
    from jreshard.views.algebra import View

    leaves, targets, mode = call.leaves, call.targets, call.mode
    devices = {d for v in leaves if isinstance(v, View) for leaf in v.leaves() for d in leaf.source.sharding.device_set}
    _, single = route([v for v in leaves if isinstance(v, jax.Array)], targets, options)
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
        from jreshard.call.views import run_cluster

        builder = ReportBuilder(Backend.MPI, "views across processes: MPI")
        result = run_cluster(call, topology=topology, options=options, report=builder)
        return (result, builder.build()) if report else result
    from jreshard.call import views as execute

    builder = ReportBuilder(Backend.LOCAL, "views run in one process")
    result = execute.run(call, topology=topology, report=builder, threads=options.copy_threads)
    return (result, builder.build()) if report else result


def transfer(
    x: PyTree, target: PyTree, *, topology: Topology | None = None, options: Options | None = None, report: bool = False
) -> PyTree:
    """Move ``x`` (a jax.Array or a pytree of them) to ``target`` shardings.

    Args:
      x: a ``jax.Array`` or a pytree of them.
      target: a ``jax.sharding.Sharding`` (for every leaf) or a pytree matching ``x``
        whose leaves are shardings, ``jax.ShapeDtypeStruct``s or ``jax.Array``s with a
        sharding (of the leaf's shape; of another dtype, the leaf is cast to it), or ``None``
        (keep that leaf where it is). Sources are ``jax.Array``s, numpy arrays or scalars
        (placed by ``jax.device_put``); leaves in or to ``pinned_host`` / ``unpinned_host``
        memory move with ``jax.device_put`` in this process (:mod:`jreshard.call.normalize`). It
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
      pool of memory that jax released earlier (``jreshard.engine.pool.default_pool()``;
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
    x: PyTree, into: PyTree, *, topology: Topology | None = None, options: Options | None = None, report: bool = False
) -> PyTree:
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
    one process (not run on GPU) the engine writes into the donated ``into`` memory the
    same way, through DLPack views of the donated arrays.

    Args:
      x: a ``jax.Array`` or a pytree of them.
      into: a matching pytree of ``jax.Array`` (or ``None`` leaves), the destinations.
      topology: as for :func:`transfer`.
      options: as for :func:`transfer`; the backend must resolve to ``"local"``, or be ``"xla"``
        (the computation donates the ``into`` shards, :mod:`jreshard.xla`; not run on GPU or TPU).
      report: also return a :class:`TransferReport`.

    Returns:
      Arrays with ``into``'s shardings, equal to ``x``, over ``into``'s memory where
      it was exclusively owned (with ``report=True``: ``(result, report)``).

    Raises:
      LayoutMismatchError: structure, shape or dtype differ between ``x`` and ``into``;
      BackendUnavailableError: the arrays span processes, or the backend is neither local nor xla;
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
    comm: Communicator,
    *,
    topology: Topology | None = None,
    options: Options | None = None,
    buffers: Buffers | None = None,
    report: ReportBuilder | None = None,
) -> tuple[Any, Any, Any]:
    """:func:`transfer` through the message-passing engine over ``comm`` (whose local ranks are every
    rank taking part): the path MPI and NCCL take, in one process. For tests and comparisons.

    Returns:
      ``(result, stats, rank_plans)``: the moved pytree, what the engine did, and the plans
      ``{rank: RankPlan}`` of ``comm``'s ranks it ran (each planned alone, no whole plan).
    """
    from jreshard.call.routes import transfer_multiprocess

    return transfer_multiprocess(
        x, target, topology=topology, options=options, transport=comm, buffers=buffers, report=report, details=True
    )
