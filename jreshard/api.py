"""transfer() and transfer_into(): move jax arrays and pytrees between shardings in one process.

Every device taking part is addressable here (a single-controller program on CPU
devices, or one host's GPUs), so each piece of each destination shard is copied
straight from a source shard that holds it: no staging, no messages, and the
global array is never materialised on the host. Source shards are exported
zero-copy with DLPack; destination shards are allocated aligned and imported
zero-copy on their device, then assembled with
``jax.make_array_from_single_device_arrays``.

All the work that depends only on shapes, dtypes and shardings (layouts, the
pieces of every shard, the descriptor tables) is cached by the pytree structure,
the shapes, dtypes and shardings of its leaves, the topology and the options: the
second transfer of the same pytree spends no time planning. Every check runs
before any byte is written.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jreshard.errors import BackendUnavailableError, LayoutError, LayoutMismatchError, TopologyError
from jreshard.nccl import kernels
from jreshard.nccl.buffers import BufferBackend, CpuBuffers
from jreshard.nccl.comm import Communicator
from jreshard.nccl.engine import ExecStats, Shards, execute
from jreshard.nccl.local import DirectProgram, direct_copies
from jreshard.options import Backend, Options
from jreshard.sharding.layout import Layout
from jreshard.sharding.program import Plan, plan_layouts
from jreshard.sharding.topology import Topology

__all__ = ["transfer", "transfer_into", "transfer_with"]


class _Kind(enum.IntEnum):
    KEEP = 0  # the leaf stays as it is (a None target, or the very same sharding)
    REWRAP = 1  # same shards on the same devices: a new jax.Array over the same buffers
    MOVE = 2  # bytes move


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Program:
    """Everything about one transfer that depends only on the cache key."""

    kinds: tuple[_Kind, ...]
    moves: tuple[int, ...]  # leaf index of each moved tensor
    pairs: tuple[tuple[Layout, Layout], ...]  # per moved tensor
    names: tuple[str, ...]
    src_keys: tuple[tuple[int, int], ...]  # (moved tensor, rank) of each source buffer
    dst_keys: tuple[tuple[int, int], ...]  # (moved tensor, rank) of each written destination buffer
    aliases: frozenset[tuple[int, int]]  # (moved tensor, rank): the destination shard is the source shard
    direct: DirectProgram


def _leaf_error(i: int, names: Sequence[str], what: str) -> str:
    return f"leaf {names[i]} (#{i}) {what}"


def _check_source(leaf: Any, i: int, names: Sequence[str], which: str = "source") -> None:
    if not isinstance(leaf, jax.Array):
        raise LayoutError(_leaf_error(i, names, f"of the {which} is {type(leaf).__name__}, not a jax.Array"))
    if leaf.is_deleted():
        raise LayoutError(
            _leaf_error(i, names, f"of the {which} has been deleted or donated; the fix is to pass a live array")
        )
    if not leaf.is_fully_addressable:
        raise TopologyError(
            _leaf_error(i, names, f"of the {which} spans other processes; transfer() runs in one process")
        )


def _check_target(sharding: Any, i: int, names: Sequence[str]) -> None:
    if not isinstance(sharding, jax.sharding.Sharding):
        raise LayoutError(_leaf_error(i, names, f"has target {sharding!r}; expected a jax Sharding or None"))
    try:
        devices = sharding.device_set
    except Exception as err:  # an abstract mesh has no devices
        raise TopologyError(_leaf_error(i, names, f"has target {sharding} with no concrete devices: {err}")) from err
    known = _local_devices()
    missing = [d for d in devices if d not in known]
    if missing:
        raise TopologyError(
            _leaf_error(i, names, f"has target on devices {missing} that this process cannot address (local {known})")
        )


@functools.cache
def _local_devices() -> frozenset:
    return frozenset(jax.local_devices())


def _same_boxes(a: Layout, b: Layout) -> bool:
    return a._index() == b._index()


@functools.lru_cache(maxsize=64)
def _program(key: tuple, mode: str) -> _Program:
    _treedef, leaves = key[0], key[1]
    names = tuple(str(i) for i in range(len(leaves)))
    kinds, moves, pairs = [], [], []
    for i, (shape, dtype, src_sh, dst_sh) in enumerate(leaves):
        if dst_sh is None or (mode == "transfer" and dst_sh == src_sh):
            kinds.append(_Kind.KEEP)
            continue
        try:
            src, dst = Layout.from_sharding(src_sh, shape, dtype), Layout.from_sharding(dst_sh, shape, dtype)
        except LayoutError as err:  # IndivisibleError, a spec naming unknown axes...
            raise type(err)(f"leaf #{i} of shape {shape}: {err}") from err
        if mode == "transfer" and _same_boxes(src, dst):
            kinds.append(_Kind.REWRAP)
            continue
        kinds.append(_Kind.MOVE)
        moves.append(i)
        pairs.append((src, dst))
    src_keys: dict[tuple[int, int], int] = {}
    dst_keys: dict[tuple[int, int], int] = {}
    aliases: set[tuple[int, int]] = set()
    rows = []
    for t, (src, dst) in enumerate(pairs):
        isz = src.itemsize
        sidx, didx = src._index(), dst._index()
        for r, h, box in direct_copies(src, dst):
            if mode == "transfer" and r in sidx and sidx[r] == didx[r]:
                aliases.add((t, r))  # a shard already where it must be: share its buffer
                continue
            sb, db, bb = kernels.byte_box(sidx[h], isz), kernels.byte_box(didx[r], isz), kernels.byte_box(box, isz)
            si = src_keys.setdefault((t, h), len(src_keys))
            di = dst_keys.setdefault((t, r), len(dst_keys))
            rows.append((si, sb.shape, bb.relative_to(sb), di, db.shape, bb.relative_to(db)))
        for r in dst.ranks:  # shards with nothing to copy (zero-size) still need a buffer
            if (t, r) not in aliases:
                dst_keys.setdefault((t, r), len(dst_keys))
    return _Program(
        kinds=tuple(kinds),
        moves=tuple(moves),
        pairs=tuple(pairs),
        names=names,
        src_keys=tuple(src_keys),
        dst_keys=tuple(dst_keys),
        aliases=frozenset(aliases),
        direct=DirectProgram.build(rows),
    )


def _flatten(x: Any, target: Any, what: str) -> tuple[list, Any, list, list[str]]:
    leaves_p, treedef = jax.tree_util.tree_flatten_with_path(x)
    names = [jax.tree_util.keystr(p) or "x" for p, _ in leaves_p]
    leaves = [v for _, v in leaves_p]
    if what == "target" and isinstance(target, jax.sharding.Sharding):
        return leaves, treedef, [target] * len(leaves), names
    try:
        targets = treedef.flatten_up_to(target)
    except (ValueError, TypeError) as err:
        raise LayoutMismatchError(
            f"{what} does not match the structure of x ({treedef}): {err}", src=treedef, dst=target, what="structure"
        ) from None
    return leaves, treedef, targets, names


def _prepare(x: Any, target: Any, what: str, topology: Topology | None, options: Options) -> tuple:
    if options.backend not in (Backend.AUTO, Backend.LOCAL):
        raise BackendUnavailableError(
            f"transfer() moves arrays inside one process (backend 'auto' or 'local'), got backend="
            f"{options.backend.value!r}; the fix is to use jreshard.RefitGroup for transfers across processes"
        )
    leaves, treedef, targets, names = _flatten(x, target, what)
    specs = []
    for i, (leaf, tgt) in enumerate(zip(leaves, targets, strict=True)):
        _check_source(leaf, i, names)
        if what == "into" and tgt is not None:
            _check_source(tgt, i, names, "destination (into)")
            if tgt.shape != leaf.shape or tgt.dtype != leaf.dtype:
                have = f"is {leaf.dtype}{list(leaf.shape)} but into holds {tgt.dtype}{list(tgt.shape)}"
                raise LayoutMismatchError(
                    _leaf_error(i, names, have),
                    src=(leaf.shape, leaf.dtype),
                    dst=(tgt.shape, tgt.dtype),
                    what="shape" if tgt.shape != leaf.shape else "dtype",
                )
            sh = tgt.sharding
        else:
            sh = tgt
        if sh is not None:
            _check_target(sh, i, names)
        specs.append((tuple(leaf.shape), np.dtype(leaf.dtype), leaf.sharding, sh))
    key = (treedef, tuple(specs), topology, options)
    return leaves, treedef, targets, _program(key, "into" if what == "into" else "transfer")


def _export(prog: _Program, leaves: list, backend: BufferBackend) -> tuple[list, list[dict]]:
    shards = [{s.device.id: s.data for s in leaves[i].addressable_shards} for i in prog.moves]
    return [backend.export_source(shards[t][h]) for t, h in prog.src_keys], shards


def _dst_shape(prog: _Program, t: int, r: int) -> tuple[int, ...]:
    return prog.pairs[t][1].box_of(r).shape


def _allocate(prog: _Program, backend: BufferBackend, devices: dict) -> list:
    by_dev: dict[int, list[int]] = {}
    for k, (_t, r) in enumerate(prog.dst_keys):
        by_dev.setdefault(r, []).append(k)
    out: list = [None] * len(prog.dst_keys)
    for r, ks in by_dev.items():
        sizes = []
        for k in ks:
            t, _ = prog.dst_keys[k]
            sizes.append(int(np.prod(_dst_shape(prog, t, r))) * prog.pairs[t][0].itemsize)
        for k, buf in zip(ks, backend.allocate(sizes, devices[r]), strict=True):
            out[k] = buf
    return out


def _assemble(prog: _Program, leaves: list, targets: list, parts: dict, what: str) -> list:
    out = []
    t = 0
    for i, kind in enumerate(prog.kinds):
        leaf, tgt = leaves[i], targets[i]
        sh = tgt.sharding if what == "into" and tgt is not None else tgt
        if kind == _Kind.KEEP:
            out.append(leaf if what != "into" or tgt is None else tgt)
        elif kind == _Kind.REWRAP:
            same = [s.data for s in leaf.addressable_shards]
            out.append(jax.make_array_from_single_device_arrays(leaf.shape, sh, same))
        else:
            out.append(jax.make_array_from_single_device_arrays(leaf.shape, sh, parts[t]))
            t += 1
    return out


def transfer(x: Any, target: Any, *, topology: Topology | None = None, options: Options | None = None) -> Any:
    """Move ``x`` (a jax.Array or a pytree of them) to ``target`` shardings, in one process.

    Args:
      x: a ``jax.Array`` or a pytree of them, every device addressable from this process.
      target: a ``jax.sharding.Sharding`` (for every leaf) or a pytree matching ``x``
        whose leaves are shardings; a ``None`` leaf keeps that leaf where it is.
      topology: ranks and domains (default: ``Topology.from_devices``, rank = ``device.id``);
        part of the cache key.
      options: ``jreshard.Options``; ``backend`` must be ``"auto"`` or ``"local"``.

    Returns:
      The same structure, each leaf committed to exactly its target sharding and equal
      to ``x``. Leaves whose sharding already is the target are returned as they are (no
      bytes move); destination shards that equal a source shard on the same device share
      its buffer.

    Raises:
      LayoutMismatchError: ``target`` does not match the structure of ``x``.
      LayoutError: a leaf is not a jax.Array, was deleted or donated, or a target is not a
        sharding; IndivisibleError: a target cannot hold the leaf's shape.
      TopologyError: a target uses devices this process cannot address.
      BackendUnavailableError: ``options.backend`` is ``"mpi"`` or ``"nccl"``.

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
    """
    options = options or Options()
    backend = CpuBuffers()
    leaves, treedef, targets, prog = _prepare(x, target, "target", topology, options)
    if not prog.moves:
        return treedef.unflatten(_assemble(prog, leaves, targets, {}, "target"))
    src_bufs, shards = _export(prog, leaves, backend)
    devices = {d.id: d for d in _local_devices()}
    dst_bufs = _allocate(prog, backend, devices)
    prog.direct.run(src_bufs, dst_bufs)
    parts: dict[int, list] = {t: [] for t in range(len(prog.moves))}
    for (t, r), buf in zip(prog.dst_keys, dst_bufs, strict=True):
        dt = prog.pairs[t][1].np_dtype
        parts[t].append(backend.import_shard(buf, _dst_shape(prog, t, r), dt, devices[r]))
    for t, r in prog.aliases:
        parts[t].append(shards[t][r])
    return treedef.unflatten(_assemble(prog, leaves, targets, parts, "target"))


def transfer_into(x: Any, into: Any, *, topology: Topology | None = None, options: Options | None = None) -> Any:
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
      options: as for :func:`transfer`.

    Returns:
      Arrays with ``into``'s shardings, equal to ``x``, over ``into``'s buffers.

    Raises:
      LayoutMismatchError: structure, shape or dtype differ between ``x`` and ``into``;
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
      >>> out = jreshard.transfer_into(src, dst)
      >>> np.array_equal(out, src), out.addressable_shards[0].data.unsafe_buffer_pointer() == ptr
      (True, True)
    """
    options = options or Options()
    backend = CpuBuffers()
    leaves, treedef, targets, prog = _prepare(x, into, "into", topology, options)
    src_bufs, _ = _export(prog, leaves, backend)
    dst_shards = [{s.device.id: s.data for s in targets[i].addressable_shards} for i in prog.moves]
    dst_bufs = [backend.writable_view(dst_shards[t][r]) for t, r in prog.dst_keys]
    prog.direct.run(src_bufs, dst_bufs)
    parts = {t: list(d.values()) for t, d in enumerate(dst_shards)}
    return treedef.unflatten(_assemble(prog, leaves, targets, parts, "into"))


def transfer_with(
    x: Any, target: Any, comm: Communicator, *, topology: Topology | None = None, options: Options | None = None
) -> tuple[Any, ExecStats, Plan]:
    """:func:`transfer` through the message-passing engine (the path MPI and NCCL take), over
    ``comm`` whose ``local_ranks`` must be every rank taking part. For tests and comparisons.

    Returns:
      ``(result, stats, plan)``: the moved pytree, what the engine did, and the plan it ran.
    """
    options = options or Options()
    backend = CpuBuffers()
    leaves, treedef, targets, prog = _prepare(x, target, "target", topology, options)
    devices = {d.id: d for d in _local_devices()}
    used = sorted({r for p in prog.pairs for lay in p for r in lay.ranks})
    topo = topology or Topology.from_devices([devices[r] for r in used])
    plan = plan_layouts(prog.pairs, topo, options, [str(i) for i in prog.moves])
    src, dst = {}, {}
    for t, i in enumerate(prog.moves):
        for s in leaves[i].addressable_shards:
            src[(t, s.device.id)] = backend.export_source(s.data)
        lay = prog.pairs[t][1]
        for r in lay.ranks:
            (dst[(t, r)],) = backend.allocate([int(np.prod(lay.box_of(r).shape)) * lay.itemsize], devices[r])
    stats = execute(plan, comm, Shards(src=src, dst=dst), options=options, backend=backend)
    parts = {
        t: [backend.import_shard(dst[(t, r)], lay.box_of(r).shape, lay.np_dtype, devices[r]) for r in lay.ranks]
        for t, (_, lay) in enumerate(prog.pairs)
    }
    return treedef.unflatten(_assemble(prog, leaves, targets, parts, "target")), stats, plan
