"""plan() and the baselines for layouts, arrays and pytrees.

``src`` and ``dst`` may be a :class:`Layout` (or a list of them), or pytrees:
``src`` of ``jax.Array`` / ``jax.ShapeDtypeStruct`` (with a sharding), ``dst`` of
the same or of ``jax.sharding.Sharding`` leaves (shape and dtype then come from
``src``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jreshard.errors import LayoutError, LayoutMismatchError
from jreshard.options import Options
from jreshard.sharding.baselines import flat_direct_layouts, gather_broadcast_layouts
from jreshard.sharding.layout import Layout
from jreshard.sharding.plan import Plan
from jreshard.sharding.planner import plan_layouts
from jreshard.sharding.topology import Topology
from jreshard.types import PyTree, TreeLeaf

__all__ = ["PyTree", "flat_direct", "gather_broadcast", "layout_pairs", "plan"]


def _is_layout_seq(x: TreeLeaf) -> bool:
    return isinstance(x, Layout) or (
        isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(v, Layout) for v in x)
    )


def layout_pairs(src: PyTree, dst: PyTree) -> tuple[list[tuple[Layout, Layout]], list[str], list[Any]]:
    """Flatten ``src`` and ``dst`` into layout pairs, tensor names and the jax devices involved."""
    if _is_layout_seq(src) or _is_layout_seq(dst):
        s = [src] if isinstance(src, Layout) else list(src)
        d = [dst] if isinstance(dst, Layout) else list(dst)
        if len(s) != len(d) or not all(isinstance(v, Layout) for v in s + d):
            raise LayoutMismatchError(
                f"src has {len(s)} layouts and dst has {len(d)}; give two equally long lists of Layouts",
                src=len(s),
                dst=len(d),
                what="structure",
            )
        return list(zip(s, d, strict=True)), [str(i) for i in range(len(s))], []
    import jax

    s_leaves, s_tree = jax.tree_util.tree_flatten_with_path(src)
    d_leaves, d_tree = jax.tree_util.tree_flatten(dst, is_leaf=lambda v: isinstance(v, jax.sharding.Sharding))
    if s_tree.num_leaves != d_tree.num_leaves or len(s_leaves) != len(d_leaves):  # type: ignore[attr-defined]
        raise LayoutMismatchError(
            f"src has {len(s_leaves)} leaves and dst {len(d_leaves)}: src tree {s_tree}, dst tree {d_tree}",
            src=s_tree,
            dst=d_tree,
            what="structure",
        )
    pairs: list[tuple[Layout, Layout]] = []
    names: list[str] = []
    devices: set[Any] = set()
    for (path, a), b in zip(s_leaves, d_leaves, strict=True):
        name = jax.tree_util.keystr(path) or "x"
        sl = _leaf_layout(a, None, "src", name)
        dl = _leaf_layout(b, a, "dst", name)
        pairs.append((sl, dl))
        names.append(name)
        for leaf in (a, b):
            sh = leaf if isinstance(leaf, jax.sharding.Sharding) else getattr(leaf, "sharding", None)
            if sh is not None:
                devices.update(sh.device_set)
    return pairs, names, sorted(devices, key=lambda d: d.id)


def _leaf_layout(leaf: TreeLeaf, like: PyTree, which: str, name: str) -> Layout:
    import jax

    if isinstance(leaf, jax.sharding.Sharding):
        if like is None:
            raise LayoutError(f"{which} leaf {name} is a sharding; src leaves must carry shape and dtype")
        return Layout.from_sharding(leaf, like.shape, like.dtype)
    sharding = getattr(leaf, "sharding", None)
    if sharding is None or not hasattr(leaf, "shape"):
        raise LayoutError(
            f"{which} leaf {name} is {type(leaf).__name__}; "
            "expected a jax.Array, a ShapeDtypeStruct with a sharding, or a Sharding"
        )
    return Layout.from_sharding(sharding, leaf.shape, leaf.dtype)


def _topology(topology: Topology | None, devices: Sequence[Any]) -> Topology | None:
    if topology is None and devices:
        return Topology.from_devices(devices)
    return topology


def plan(src: PyTree, dst: PyTree, topology: Topology | None = None, options: Options | None = None) -> Plan:
    """The minimal, topology-aware plan moving ``src`` to ``dst``.

    Args:
      src: a Layout, a list of Layouts, or a pytree of jax arrays / ShapeDtypeStructs.
      dst: the same kind, or a pytree of shardings matching ``src``.
      topology: ranks, domains and links; by default from the jax devices
        involved (one domain per process), or every rank its own domain for layouts.
      options: planning options (relays, striping).

    Example:
      >>> import numpy as np, jreshard
      >>> src = jreshard.Layout.from_mesh(np.arange(4), ("tp",), (None, "tp"), (8, 16), "float32")
      >>> dst = jreshard.Layout.from_mesh(np.arange(4, 8).reshape(2, 2), ("dp", "tp"), (None, "tp"), (8, 16), "float32")
      >>> p = jreshard.plan(src, dst, jreshard.Topology.uniform(range(8), domain_size=4))
      >>> s = p.stats()
      >>> s.network_bytes == s.network_bytes_lower_bound == 512
      True
    """
    Topology.check_arg(topology)
    Options.of(options)
    pairs, names, devices = layout_pairs(src, dst)
    return plan_layouts(pairs, _topology(topology, devices), options, names)


def gather_broadcast(
    src: PyTree, dst: PyTree, topology: Topology | None = None, options: Options | None = None, *, ring: bool = False
) -> Plan:
    """The gather-broadcast baseline as a Plan (see ``jreshard.sharding.baselines``);
    ``ring=True`` ("gather-broadcast (ring)") broadcasts along a chain of destinations, as NCCL does."""
    Topology.check_arg(topology)
    Options.of(options)
    pairs, names, devices = layout_pairs(src, dst)
    return gather_broadcast_layouts(pairs, _topology(topology, devices), options, names, ring=ring)


def flat_direct(src: PyTree, dst: PyTree, topology: Topology | None = None, options: Options | None = None) -> Plan:
    """The flat-direct baseline as a Plan (see ``jreshard.sharding.baselines``)."""
    Topology.check_arg(topology)
    Options.of(options)
    pairs, names, devices = layout_pairs(src, dst)
    return flat_direct_layouts(pairs, _topology(topology, devices), options, names)
