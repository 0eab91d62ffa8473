"""Pictures of plans (matplotlib, imported only when a function is called).

:func:`draw_plan` shows one tensor: its source shards and its destination shards
as grids coloured by rank, and an arrow for every (sender, receiver, link) pair
of the plan, styled by link kind (same-device copy, fast link, network), its width
growing with the bytes it carries. :func:`draw_loads` shows a whole plan (a
whole model): the bytes every rank sends and receives over the network and over
fast links, as a bar chart.

Tensors of more than two dimensions are drawn projected onto two of them (by
default the dimensions the layouts split); boxes that differ only in a hidden
dimension are drawn on top of each other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jreshard.sharding.box import Box, intersect
from jreshard.sharding.layout import Layout
from jreshard.sharding.topology import Link
from jreshard.types import MplAxes, MplFigure

Plan = Any  # a jreshard.Plan; named here, not imported: the planning house never depends on its pictures

__all__ = ["LINK_STYLE", "draw_loads", "draw_plan"]

# Arrow colour, line style and legend label of each link kind.
LINK_STYLE: dict[Link, tuple[str, str, str]] = {
    Link.SAME_DEVICE: ("#555555", ":", "same-device copy"),
    Link.FAST: ("#2a9d3a", "--", "fast link (same domain)"),
    Link.NETWORK: ("#d62728", "-", "network (between domains)"),
}
_GAP = 0.45  # space between drawn grids, in units of a grid's width


_UNITS = ("B", "kB", "MB", "GB", "TB")  # decimal, as the command line, the reports and the docs print bytes


def _fmt_bytes(n: float) -> str:
    """Bytes in decimal units (1 GB = 1e9 bytes), as ``python -m jreshard plan`` prints them.

    >>> _fmt_bytes(512), _fmt_bytes(8 << 20), _fmt_bytes(141.11e9)
    ('512 B', '8.39 MB', '141.11 GB')
    """
    for unit in _UNITS:
        if abs(n) < 1000 or unit == _UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _rank_colours(ranks: Sequence[int]) -> dict[int, Any]:
    import matplotlib

    ranks = sorted(set(ranks))
    cmap = matplotlib.colormaps["tab10" if len(ranks) <= 10 else "tab20" if len(ranks) <= 20 else "turbo"]
    n = max(len(ranks) - 1, 1)
    pick = (lambda i: cmap(i % cmap.N)) if len(ranks) <= 20 else (lambda i: cmap(0.05 + 0.9 * i / n))
    return {r: pick(i) for i, r in enumerate(ranks)}


def _view_dims(layouts: Sequence[Layout], dims: Sequence[int] | None) -> tuple[int | None, int | None]:
    """(row dimension, column dimension) to draw; None draws one cell along that axis."""
    ndim = layouts[0].ndim
    if dims is not None:
        dims = tuple(int(d) for d in dims)
        if len(dims) != 2 or len(set(dims)) != 2 or not all(0 <= d < ndim for d in dims):
            raise ValueError(f"draw_plan: dims={dims} must name two distinct dimensions of a rank-{ndim} tensor")
        return dims[0], dims[1]
    if ndim == 0:
        return None, None
    if ndim == 1:
        return None, 0
    shape = layouts[0].shape
    split = [d for d in range(ndim) if any(b.lo[d] > 0 or b.hi[d] < shape[d] for lay in layouts for b in lay.boxes)]
    if len(split) >= 2:
        return split[-2], split[-1]
    if len(split) == 1:
        d = split[0]
        other = max((e for e in range(ndim) if e != d), key=lambda e: (shape[e], e))
        return (other, d) if other < d else (d, other)
    return ndim - 2, ndim - 1


class _Grid:
    """Where one drawn copy of the tensor sits, and how global indices map into it."""

    def __init__(self, x0: float, y0: float, w: float, h: float, shape: tuple[int, ...], dims: tuple):
        self.x0, self.y0, self.w, self.h, self.shape, self.dims = x0, y0, w, h, shape, dims

    def rect(self, box: Box) -> tuple[float, float, float, float]:
        """(x, y, width, height) of ``box``; rows grow downwards, like a matrix."""
        row, col = self.dims
        c0, c1 = _span(box, col, self.shape)
        r0, r1 = _span(box, row, self.shape)
        return self.x0 + c0 * self.w, self.y0 + self.h * (1 - r1), (c1 - c0) * self.w, (r1 - r0) * self.h

    def centre(self, box: Box) -> tuple[float, float]:
        x, y, w, h = self.rect(box)
        return x + w / 2, y + h / 2


def _span(box: Box, dim: int | None, shape: tuple[int, ...]) -> tuple[float, float]:
    """Where ``box`` starts and ends along ``dim``, as fractions of the drawn extent: all of it for an undrawn
    dimension, or one of size 0 (a tensor of no element: every box is all of nothing)."""
    if dim is None or shape[dim] == 0:
        return 0.0, 1.0
    return box.lo[dim] / shape[dim], box.hi[dim] / shape[dim]


def _copies(dst: Layout) -> list[list[int]]:
    """Destination ranks split into copies of the tensor whose boxes do not overlap (one per replica)."""
    copies: list[list[int]] = []
    for r, b in zip(dst.ranks, dst.boxes, strict=True):
        for c in copies:
            if all(intersect(b, dst.box_of(q)) is None for q in c):
                c.append(r)
                break
        else:
            copies.append([r])
    return copies


def _label(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    shown = ", ".join(map(str, ranks[:6])) + (", ..." if len(ranks) > 6 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def draw_plan(
    plan: Plan,
    tensor: int | str = 0,
    ax: MplAxes = None,
    *,
    dims: Sequence[int] | None = None,
    max_copies: int = 4,
) -> MplFigure:
    """Draw one tensor of ``plan``: source and destination shard grids and what moves where.

    The source grid is on the left, the destination on the right, one grid per
    destination replica (ranks whose boxes tile the tensor once), at most
    ``max_copies`` of them. Each box is coloured by its rank. Each arrow is every
    piece one sender gives one receiver over one link, drawn from the piece in
    the sender's box to the piece in the receiver's box; its colour and style give
    the link kind and its width the bytes.

    Args:
      plan: a :class:`jreshard.Plan` (jreshard's or a baseline's).
      tensor: the tensor's index in the plan, or its name.
      ax: a matplotlib Axes to draw on; a new figure when None.
      dims: the two tensor dimensions to draw (rows, columns); by default the split ones.
      max_copies: the most destination replicas drawn.

    Returns:
      The matplotlib Axes.

    Raises:
      KeyError: no tensor of that name; IndexError: no tensor at that index.

    Example:
      >>> import numpy as np, jreshard
      >>> from jreshard.draw import draw_plan
      >>> src = jreshard.Layout.from_mesh(np.arange(4), ("tp",), (None, "tp"), (8, 16), "float32")
      >>> dst = jreshard.Layout.from_mesh(np.arange(4, 8).reshape(2, 2), ("dp", "tp"), (None, "tp"), (8, 16), "float32")
      >>> p = jreshard.plan(src, dst, jreshard.Topology.uniform(range(8), domain_size=4))
      >>> ax = draw_plan(p)
      >>> sorted(t.get_text() for t in ax.get_legend().get_texts())[:2]
      ['fast link (same domain)', 'network (between domains)']
      >>> import matplotlib.pyplot as plt; plt.close("all")
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch, Rectangle

    t = _tensor_index(plan, tensor)
    spec = plan.tensors[t]
    src, dst = spec.src, spec.dst
    row, col = _view_dims([src, dst], dims)
    shape = src.shape
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 6), layout="constrained")

    # Grid geometry: width 1, height from the drawn aspect ratio, clipped to stay readable.
    rows_n = shape[row] if row is not None else 1
    cols_n = shape[col] if col is not None else 1
    h = min(max(rows_n / max(cols_n, 1), 0.35), 1.2)
    copies = _copies(dst)
    shown = copies[:max_copies]
    gap = max(_GAP * h, 0.28)
    dst_top = (len(shown) - 1) * (h + gap)
    src_grid = _Grid(0.0, dst_top / 2, 1.0, h, shape, (row, col))
    dst_grids = [_Grid(1 + 2 * _GAP, dst_top - k * (h + gap), 1.0, h, shape, (row, col)) for k in range(len(shown))]
    where_dst = {r: dst_grids[k] for k, c in enumerate(shown) for r in c}
    colours = _rank_colours((*src.ranks, *dst.ranks))

    def boxes(grid: _Grid, lay: Layout, ranks: Sequence[int]) -> None:
        by_box: dict[Box, list[int]] = {}
        for r in ranks:
            by_box.setdefault(lay.box_of(r), []).append(r)
        for b, rs in by_box.items():
            x, y, w, hh = grid.rect(b)
            ax.add_patch(Rectangle((x, y), w, hh, facecolor=colours[rs[0]], alpha=0.45, edgecolor="black", lw=1))
            text = _label(rs)
            flat = w >= 0.025 * len(text) and hh >= 0.07
            upright = not flat and w >= 0.05 and hh >= 0.018 * len(text) + 0.02
            if flat or upright:
                ax.text(
                    x + w / 2,
                    y + hh - 0.03 * min(hh, grid.h) if flat else y + hh / 2,
                    text,
                    ha="center",
                    va="top" if flat else "center",
                    fontsize=9 if w > 0.2 else 7,
                    rotation=0 if flat else 90,
                    zorder=6,
                    bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "alpha": 0.8, "lw": 0},
                )
        ax.add_patch(Rectangle((grid.x0, grid.y0), grid.w, grid.h, fill=False, edgecolor="black", lw=2))

    boxes(src_grid, src, src.ranks)
    label_box = {"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.9, "lw": 0}

    def title(grid: MplAxes, text: str) -> None:
        ax.text(grid.x0 + 0.5, grid.y0 + h + 0.03, text, ha="center", va="bottom", fontsize=10, weight="bold",
                bbox=label_box, zorder=7)  # fmt: skip

    title(src_grid, f"source: {_label(src.ranks)}")
    for k, (grid, c) in enumerate(zip(dst_grids, shown, strict=True)):
        boxes(grid, dst, c)
        name = "destination" if len(copies) == 1 else f"destination replica {k + 1}/{len(copies)}"
        title(grid, f"{name}: {_label(c)}")

    # One arrow per (sender, receiver, link): pieces summed, drawn between the centres of their unions.
    src_set, dst_set = set(src.ranks), set(dst.ranks)
    arrows: dict[tuple[int, int, Link], list] = {}
    for tr in plan.transfers():
        if tr.tensor != t:
            continue
        if tr.dst in dst_set and tr.dst not in where_dst:
            continue  # a receiver in a replica not drawn
        a = arrows.setdefault((tr.src, tr.dst, tr.link), [0, None, None])
        a[0] += tr.nbytes
        s_box = tr.box if tr.src not in src_set else intersect(tr.box, src.box_of(tr.src)) or src.box_of(tr.src)
        r_box = intersect(tr.box, dst.box_of(tr.dst)) if tr.dst in dst_set else None
        a[1] = _hull(a[1], s_box)
        a[2] = _hull(a[2], r_box or (src.box_of(tr.dst) if tr.dst in src_set else tr.box))
    biggest = max((a[0] for a in arrows.values()), default=1)
    for (s, r, link), (nbytes, s_box, r_box) in sorted(arrows.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        s_grid = src_grid if s in src_set else where_dst.get(s)
        r_grid = where_dst[r] if r in dst_set else src_grid
        if s_grid is None:
            continue
        p0, p1 = s_grid.centre(s_box), r_grid.centre(r_box)
        if math.dist(p0, p1) < 1e-9:
            continue
        colour, style, _ = LINK_STYLE[link]
        ax.add_patch(
            FancyArrowPatch(
                p0,
                p1,
                arrowstyle="-|>",
                mutation_scale=12,
                color=colour,
                linestyle=style,
                lw=0.8 + 2.7 * nbytes / biggest,
                connectionstyle=f"arc3,rad={0.45 if s_grid is r_grid else 0.12}",
                alpha=0.85,
                zorder=5,
            )
        )

    handles = [Line2D([], [], color=c, linestyle=ls, lw=2, label=lab) for c, ls, lab in LINK_STYLE.values()]  # type: ignore[arg-type]
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.08),
        ncol=3,
        fontsize=9,
        frameon=False,
        title="arrows: what moves where (width ~ bytes)",
        title_fontsize=9,
    )
    stats = plan.stats() if len(plan.tensors) == 1 else None
    extra = (
        (
            f"\nnetwork {_fmt_bytes(stats.network_bytes)} (lower bound {_fmt_bytes(stats.network_bytes_lower_bound)}), "
            f"fast {_fmt_bytes(stats.fast_bytes)}, same-device {_fmt_bytes(stats.same_device_bytes)}"
        )
        if stats
        else ""
    )
    ax.set_title(f"{plan.kind} plan: tensor {spec.name!r} {list(shape)} {src.dtype}{extra}", fontsize=11)
    ax.set_xlabel(f"tensor dimension {col} ({cols_n} elements) →" if col is not None else "(one cell)")
    ax.set_ylabel(f"← tensor dimension {row} ({rows_n} elements)" if row is not None else "(one cell)")
    if len(copies) > len(shown):
        ax.text(
            2 + 2 * _GAP,
            dst_grids[-1].y0 - 0.1 * h,
            f"(+{len(copies) - len(shown)} more replicas not drawn)",
            ha="right",
            va="top",
            fontsize=8,
        )
    ax.set_xlim(-0.05, 2 + 2 * _GAP + 0.05)
    ax.set_ylim(dst_grids[-1].y0 - 0.2 * h, max(dst_top, src_grid.y0) + h + 0.3)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_visible(False)
    return ax


def _hull(a: Box | None, b: Box | None) -> Box | None:
    if a is None or b is None:
        return b if a is None else a
    return Box(tuple(map(min, a.lo, b.lo)), tuple(map(max, a.hi, b.hi)))


def _tensor_index(plan: Plan, tensor: int | str) -> int:
    if isinstance(tensor, str):
        names = [s.name for s in plan.tensors]
        if tensor not in names:
            shown = names[:8] + (["..."] if len(names) > 8 else [])
            raise KeyError(f"draw_plan: no tensor named {tensor!r}; the plan's tensors are {shown}")
        return names.index(tensor)
    if not -len(plan.tensors) <= tensor < len(plan.tensors):
        raise IndexError(f"draw_plan: tensor={tensor} but the plan has {len(plan.tensors)} tensors")
    return tensor % len(plan.tensors)


def draw_loads(plan: Plan, ax: MplAxes = None, *, title: str | None = None) -> MplFigure:
    """Bar chart of every rank's network and fast-link loads over a whole plan.

    Four bars per rank: bytes sent and received over the network (its NIC) and
    over fast links. A balanced plan has bars of equal height across the ranks
    of each side; the busiest NIC sets the (predicted) time.

    Args:
      plan: a :class:`jreshard.Plan` (jreshard's or a baseline's).
      ax: a matplotlib Axes; a new figure when None.
      title: the title; by default the plan's kind and its network bytes.

    Returns:
      The matplotlib Axes.

    Example:
      >>> import numpy as np, jreshard
      >>> from jreshard.draw import draw_loads
      >>> src = jreshard.Layout.from_mesh(np.arange(4), ("tp",), (None, "tp"), (8, 16), "float32")
      >>> dst = jreshard.Layout.from_mesh(np.arange(4, 8).reshape(2, 2), ("dp", "tp"), (None, "tp"), (8, 16), "float32")
      >>> ax = draw_loads(jreshard.plan(src, dst, jreshard.Topology.uniform(range(8), domain_size=4)))
      >>> ax.get_xlabel()
      'rank'
      >>> import matplotlib.pyplot as plt; plt.close("all")
    """
    import matplotlib.pyplot as plt
    import numpy as np

    loads = plan.rank_loads()
    ranks = sorted({r for s in plan.tensors for r in (*s.src.ranks, *s.dst.ranks)})
    series = [
        ("network_send", "network send", "#d62728", ""),
        ("network_recv", "network receive", "#ff9896", "//"),
        ("fast_send", "fast-link send", "#2a9d3a", ""),
        ("fast_recv", "fast-link receive", "#98df8a", "//"),
    ]
    peak = max((v for k, _, _, _ in series for v in loads[k].values()), default=0)
    unit, scale = next(
        ((u, 1000.0**i) for i, u in reversed(list(enumerate(_UNITS))) if peak >= 1000.0**i),
        ("B", 1.0),
    )
    if ax is None:
        _, ax = plt.subplots(figsize=(min(4 + 0.35 * len(ranks), 16), 4.5), layout="constrained")
    x = np.arange(len(ranks))
    width = 0.8 / len(series)
    for i, (key, label, colour, hatch) in enumerate(series):
        vals = np.array([loads[key].get(r, 0) for r in ranks], dtype=float) / scale
        ax.bar(x + (i - 1.5) * width, vals, width, label=label, color=colour, hatch=hatch, edgecolor="black", lw=0.3)
    step = max(1, math.ceil(len(ranks) / 32))
    ax.set_xticks(x[::step], [str(r) for r in ranks[::step]], fontsize=8)
    ax.set_xlabel("rank")
    ax.set_ylabel(f"bytes moved ({unit})")
    s = plan.stats()
    ax.set_title(
        title
        or f"{plan.kind}: per-rank loads, network {_fmt_bytes(s.network_bytes)} "
        f"(lower bound {_fmt_bytes(s.network_bytes_lower_bound)}), fast {_fmt_bytes(s.fast_bytes)}",
        fontsize=10,
    )
    ax.set_ylim(0, max(peak / scale, 1e-9) * 1.25)
    ax.legend(fontsize=8, ncol=4, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    return ax
