"""The gather-broadcast baseline's all-gather, as an FSDP trainer runs it, checked by hand on two domains.

Trainer ranks 0-7 in two fast-link domains of four (0-3, 4-7), inference ranks 8-15 in two more; one
float32 tensor of shape (8, 4) (128 bytes), the inference side TP4 x DP2 on columns.
"""

from __future__ import annotations

import numpy as np
import pytest

import jreshard
from jreshard import Layout, Link, Topology

TOPO = Topology.uniform(range(16), 4)
SHAPE = (8, 4)
DST = Layout.from_mesh(np.arange(8, 16).reshape(2, 4), ("dp", "tp"), (None, "tp"), SHAPE, "float32")


def _gather(plan):
    """Bytes of the trainer's all-gather (rows into trainer ranks) by link."""
    out = {Link.NETWORK: 0, Link.FAST: 0}
    for t in plan.transfers():
        if t.dst < 8:
            out[t.link] += t.nbytes
    return out


def _replay(plan, src: Layout) -> None:
    """Run the rows stage by stage on element masks: a sender holds what it sends (its source box, or what
    it received at an earlier stage); every trainer rank ends with the full tensor, every inference rank
    with its box."""
    have = {r: np.zeros(SHAPE, bool) for r in range(16)}
    for r, b in zip(src.ranks, src.boxes, strict=True):
        have[r][b.slices()] = True
    rows = sorted(plan.transfers(), key=lambda t: t.stage)
    for stage in sorted({t.stage for t in rows}):
        now = [t for t in rows if t.stage == stage]
        for t in now:
            assert have[t.src][t.box.slices()].all(), f"stage {stage}: rank {t.src} sends {t.box} before holding it"
        for t in now:
            have[t.dst][t.box.slices()] = True
    assert all(have[r].all() for r in src.ranks)
    assert all(have[r][b.slices()].all() for r, b in zip(DST.ranks, DST.boxes, strict=True))


def test_fsdp_over_both_domains_gathers_on_one_ring():
    """FSDP over all 8 trainer ranks: one row (16 bytes) each. NCCL's ring 0-1-...-7-0 crosses between the
    domains twice (3 -> 4 and 7 -> 0); each of the 8 ring links carries the 7 rows that pass it:
    network 2 x 7 x 16 = 224 bytes, fast links 6 x 7 x 16 = 672. Gathering every row from its owner
    (the earlier model) counted 8 ranks x 4 rows of the other domain x 16 = 512 network bytes."""
    src = Layout.from_mesh(np.arange(8), ("fsdp",), ("fsdp",), SHAPE, "float32")
    plan = jreshard.baselines.gather_broadcast(src, DST, TOPO)
    assert _gather(plan) == {Link.NETWORK: 224, Link.FAST: 672}
    # The broadcast: rank 0 sends the whole tensor (128 bytes) to each of the 8 inference ranks.
    assert plan.stats().network_bytes == 224 + 8 * 128
    _replay(plan, src)


def test_hsdp_gathers_inside_each_domain():
    """HSDP: shards over the 4 ranks of a domain (rows of 2, 32 bytes), replicated across the two
    domains. Each domain gathers on its own ring: no network byte, 2 x 4 x 3 x 32 = 768 fast bytes.
    The earlier model took each shard from its replicas in turn and sent 384 of them over the network."""
    src = Layout.from_mesh(np.arange(8).reshape(2, 4), ("replica", "fsdp"), ("fsdp",), SHAPE, "float32")
    plan = jreshard.baselines.gather_broadcast(src, DST, TOPO)
    assert _gather(plan) == {Link.NETWORK: 0, Link.FAST: 768}
    assert plan.stats().network_bytes == 8 * 128
    _replay(plan, src)


def test_hsdp_with_replicas_interleaved_across_domains_still_gathers_inside_domains():
    """The replica axis minor: ranks (0, 4), (1, 5), ... hold the same rows. Groups are formed by domain,
    not by mesh position, so each domain still gathers alone."""
    mesh = np.arange(8).reshape(2, 4).T  # mesh[f, replica]: rank f holds row block f, and so does f + 4
    src = Layout.from_mesh(mesh, ("fsdp", "replica"), ("fsdp",), SHAPE, "float32")
    plan = jreshard.baselines.gather_broadcast(src, DST, TOPO)
    assert _gather(plan) == {Link.NETWORK: 0, Link.FAST: 768}
    _replay(plan, src)


@pytest.mark.parametrize("ring", [False, True])
def test_the_broadcast_starts_after_the_gather(ring):
    src = Layout.from_mesh(np.arange(8), ("fsdp",), ("fsdp",), SHAPE, "float32")
    plan = jreshard.baselines.gather_broadcast(src, DST, TOPO, ring=ring)
    gather = [t.stage for t in plan.transfers() if t.dst < 8]
    bcast = [t.stage for t in plan.transfers() if t.dst >= 8]
    assert max(gather) == 6 and min(bcast) == 7  # a ring of 8: 7 steps
    _replay(plan, src)
