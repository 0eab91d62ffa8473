"""Pictures of plans: the arrows drawn are the plan's (sender, receiver, link) pairs, the legend names
every link kind, the axes are labelled, and the figure renders to a PNG."""

from __future__ import annotations

import io

import matplotlib
import matplotlib.colors
import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.patches import FancyArrowPatch

import jreshard
from jreshard.draw import LINK_STYLE, draw_loads, draw_plan

matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _seed(kind: str = "jreshard", shape=(8, 16)):
    src = jreshard.Layout.from_mesh(np.arange(4), ("tp",), (None, "tp"), shape, "float32")
    dst = jreshard.Layout.from_mesh(np.arange(4, 8).reshape(2, 2), ("dp", "tp"), (None, "tp"), shape, "float32")
    topo = jreshard.Topology.uniform(range(8), domain_size=4)
    make = {
        "jreshard": jreshard.plan,
        "gather": jreshard.baselines.gather_broadcast,
        "flat": jreshard.baselines.flat_direct,
    }[kind]
    return make(src, dst, topo)


def _arrows(ax) -> list[FancyArrowPatch]:
    return [p for p in ax.patches if isinstance(p, FancyArrowPatch)]


def test_draw_plan_one_arrow_per_sender_receiver_link():
    p = _seed()
    ax = draw_plan(p)
    pairs = {(t.src, t.dst, t.link) for t in p.transfers()}
    assert len(_arrows(ax)) == len(pairs) == 8  # 4 network landings, 4 fast-link fan-outs
    colours = {matplotlib.colors.to_hex(a.get_edgecolor()) for a in _arrows(ax)}
    assert colours == {LINK_STYLE[jreshard.Link.NETWORK][0], LINK_STYLE[jreshard.Link.FAST][0]}


def test_draw_plan_labels_legend_and_title():
    ax = draw_plan(_seed())
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [lab for _, _, lab in LINK_STYLE.values()]
    assert ax.get_xlabel().startswith("tensor dimension 1")
    assert ax.get_ylabel().endswith("tensor dimension 0 (8 elements)")
    assert "lower bound 512 B" in ax.get_title()
    texts = {t.get_text() for t in ax.texts}
    assert {"rank 0", "rank 3", "rank 4", "rank 7"} <= texts
    assert "source: ranks 0-3" in texts


def test_draw_plan_gather_broadcast_draws_gather_and_broadcast():
    p = _seed("gather")
    ax = draw_plan(p)
    # the trainer's ring all-gather (0 -> 1 -> 2 -> 3 -> 0: 4 arrows), then rank 0 to each of 4 inference ranks
    assert len(_arrows(ax)) == len({(t.src, t.dst, t.link) for t in p.transfers()}) == 8
    assert p.kind in ax.get_title()


def test_draw_plan_renders_png_and_accepts_an_axes():
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    assert draw_plan(_seed(), ax=a) is a
    assert draw_loads(_seed(), ax=b) is b
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"


def test_draw_plan_3d_tensor_and_max_copies():
    shape = (4, 32, 64)
    src = jreshard.Layout.from_mesh(np.arange(4), ("ep",), ("ep",), shape, "float32")
    dst = jreshard.Layout.from_mesh(np.arange(4, 16).reshape(6, 2), ("dp", "tp"), (None, None, "tp"), shape, "float32")
    p = jreshard.plan(src, dst, jreshard.Topology.uniform(range(16), domain_size=4))
    ax = draw_plan(p, max_copies=2)
    assert ax.get_xlabel().startswith("tensor dimension 2")
    assert ax.get_ylabel().startswith("← tensor dimension 0")
    assert any("4 more replicas not drawn" in t.get_text() for t in ax.texts)
    ax2 = draw_plan(p, dims=(1, 2))
    assert ax2.get_ylabel().startswith("← tensor dimension 1")


def test_draw_plan_by_name_and_bad_arguments():
    p = _seed()
    draw_plan(p, tensor="0")
    with pytest.raises(KeyError, match="no tensor named 'w'"):
        draw_plan(p, tensor="w")
    with pytest.raises(IndexError, match="the plan has 1 tensors"):
        draw_plan(p, tensor=3)
    with pytest.raises(ValueError, match="two distinct dimensions"):
        draw_plan(p, dims=(0, 0))


def test_draw_loads_bars_are_the_plan_loads():
    p = _seed()
    ax = draw_loads(p)
    assert ax.get_xlabel() == "rank"
    assert ax.get_ylabel() == "bytes moved (B)"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "network send",
        "network receive",
        "fast-link send",
        "fast-link receive",
    ]
    loads = p.rank_loads()
    heights = [r.get_height() for r in ax.containers[0]]  # network send, ranks 0..7
    assert heights == [loads["network_send"].get(r, 0) for r in range(8)]
    heights = [r.get_height() for r in ax.containers[3]]  # fast receive
    assert heights == [loads["fast_recv"].get(r, 0) for r in range(8)]


def test_titles_and_axes_use_the_decimal_units_the_command_line_prints():
    """``plan`` prints GB (1e9 bytes); the pictures of the same plans say the same numbers."""
    shape = (1024, 4096)
    src = jreshard.Layout.from_mesh(np.arange(4), ("tp",), (None, "tp"), shape, "bfloat16")
    dst = jreshard.Layout.from_mesh(np.arange(4, 8).reshape(2, 2), ("dp", "tp"), (None, "tp"), shape, "bfloat16")
    p = jreshard.plan(src, dst, jreshard.Topology.uniform(range(8), domain_size=4))
    assert p.stats().network_bytes == 8 << 20  # 8.39 MB, 8 MiB
    title = draw_plan(p).get_title()
    assert "network 8.39 MB (lower bound 8.39 MB)" in title and "iB" not in title
    ax = draw_loads(p)
    assert "network 8.39 MB" in ax.get_title() and ax.get_ylabel() == "bytes moved (MB)"
    plt.close("all")
