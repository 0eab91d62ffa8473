"""Draw the README's pictures into docs/images/: ``python docs/make_images.py`` (numpy and matplotlib only).

- ``seed_plan.png``, ``seed_gather_broadcast.png``: the seed example, an [8, 16] tensor from TP4 on one node to
  TP2 x DP2 on another, as jreshard plans it and as gather-broadcast does.
- ``llama3_loads.png``: per-rank loads of a whole Llama-3-70B refit (16 trainer GPUs to 16 inference GPUs,
  8-GPU nodes), jreshard beside gather-broadcast.
- ``at_scale.png``: predicted refit times from ``notebooks/at_scale.json`` (if present).
"""

from __future__ import annotations

import json
import pathlib

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np

import jreshard
from jreshard.draw import draw_loads, draw_plan
from jreshard.models import refit, refit_topology

HERE = pathlib.Path(__file__).parent
IMAGES = HERE / "images"


def seed() -> None:
    src = jreshard.Layout.from_mesh(np.arange(4), ("tp",), (None, "tp"), (8, 16), "float32")
    dst = jreshard.Layout.from_mesh(np.arange(4, 8).reshape(2, 2), ("dp", "tp"), (None, "tp"), (8, 16), "float32")
    topo = jreshard.Topology.uniform(range(8), domain_size=4)
    for name, p in (
        ("seed_plan", jreshard.plan(src, dst, topo)),
        ("seed_gather_broadcast", jreshard.baselines.gather_broadcast(src, dst, topo)),
    ):
        ax = draw_plan(p)
        ax.figure.savefig(IMAGES / f"{name}.png", dpi=110)
        plt.close(ax.figure)


def loads() -> None:
    r = refit("llama3-70b", 16, 16)
    topo = refit_topology(16, 16, domain_size=8)
    src, dst = [s for s, _ in r.pairs], [d for _, d in r.pairs]
    fig, axes = plt.subplots(2, 1, figsize=(12, 7.5), layout="constrained", sharey=True)
    for ax, p in zip(
        axes, (jreshard.plan(src, dst, topo), jreshard.baselines.gather_broadcast(src, dst, topo)), strict=True
    ):
        draw_loads(p, ax=ax)
    fig.suptitle(
        f"Llama-3-70B refit, {r.trainer.name} (ranks 0-15) -> {r.inference.name} (ranks 16-31), "
        "8 GPUs per node: bytes per rank, counted from the plans"
    )
    fig.savefig(IMAGES / "llama3_loads.png", dpi=100)
    plt.close(fig)


def at_scale() -> None:
    path = HERE.parent / "notebooks" / "at_scale.json"
    if not path.exists():
        return
    rows = json.loads(path.read_text())["rows"]
    kinds = ("jreshard", "gather-broadcast (ring)", "flat-direct")
    colours = ("tab:blue", "tab:red", "tab:orange")
    fig, ax = plt.subplots(figsize=(9, 4.5), layout="constrained")
    labels = [f"{r['model']}\n{r['n_gpus']} GPUs" for r in rows]
    x = np.arange(len(rows))
    for i, (kind, colour) in enumerate(zip(kinds, colours, strict=True)):
        vals = [r["plans"][kind]["predicted_s"] for r in rows]
        bars = ax.bar(x + (i - 1) * 0.27, vals, 0.27, label=f"{kind} (predicted)", color=colour)
        ax.bar_label(bars, [f"{v:.2f} s" for v in vals], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(0.3, max(r["plans"][k]["predicted_s"] for r in rows for k in kinds) * 5)
    ax.set_xticks(x, labels)
    ax.set_ylabel("predicted refit time (s, log scale)")
    ax.set_title(
        "Predicted whole-model refit time (cost model; NVL72: 72 GPUs per domain, 50 GB/s NIC, 900 GB/s NVLink)",
        fontsize=11,
    )
    ax.legend(fontsize=8, loc="upper left", ncol=3)
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(IMAGES / "at_scale.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    IMAGES.mkdir(exist_ok=True)
    seed()
    loads()
    at_scale()
    print("wrote", sorted(p.name for p in IMAGES.glob("*.png")))
