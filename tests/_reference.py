"""A numpy reference executor for plans, and brute-force oracles.

It runs a plan's transfers stage by stage on full-size numpy arrays with masks,
so that it can check causality (a sender sends only what it holds before the
stage), exactly-once delivery and the final contents of every destination.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jreshard.sharding.layout import Layout
from jreshard.sharding.plan import Plan
from jreshard.sharding.rows import Phase
from jreshard.sharding.topology import Link, Topology


def random_values(plan: Plan, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for t in plan.tensors:
        dt = t.src.np_dtype
        if dt == np.bool_:
            out.append(rng.integers(0, 2, size=t.src.shape).astype(bool))
        elif np.issubdtype(dt, np.integer):
            out.append(
                rng.integers(-100 if np.issubdtype(dt, np.signedinteger) else 0, 100, size=t.src.shape).astype(dt)
            )
        else:
            out.append((rng.standard_normal(size=t.src.shape) * 100).astype(dt))
    return out


def execute(plan: Plan, values: list[np.ndarray], *, strict: bool = True) -> dict:
    """Run ``plan``; return per (tensor, rank) the destination buffer, its mask and write counts.

    strict (jreshard plans): LAND rows read the sender's *source* buffer, RELAY and
    FANOUT rows read its *destination* buffer, receivers write only into their
    destination box. Non-strict (baselines): one buffer per rank holds whatever
    it has been sent, and senders read from it or from their source box.
    """
    results = {}
    for t, (spec, tp) in enumerate(zip(plan.tensors, plan.tensor_plans, strict=True)):
        v = values[t]
        shape = spec.src.shape
        src_have = {r: np.zeros(shape, bool) for r in spec.src.ranks}
        for r, b in zip(spec.src.ranks, spec.src.boxes, strict=True):
            src_have[r][b.slices()] = True
        ranks = set(spec.src.ranks) | set(spec.dst.ranks) | set(tp.src.tolist()) | set(tp.dst.tolist())
        dst_have = {r: np.zeros(shape, bool) for r in ranks}
        dst_data = {r: np.zeros(shape, v.dtype) for r in ranks}
        writes = {r: np.zeros(shape, np.int64) for r in ranks}
        dst_box = dict(zip(spec.dst.ranks, spec.dst.boxes, strict=True))
        for stage in sorted(set(tp.stage.tolist())):
            idx = np.flatnonzero(tp.stage == stage)
            staged = []
            for i in idx:
                s, d, box = int(tp.src[i]), int(tp.dst[i]), tp.box(i)
                sl = box.slices()
                if strict:
                    have = src_have[s] if tp.phase[i] == Phase.LAND else dst_have[s]
                    data = v if tp.phase[i] == Phase.LAND else dst_data[s]
                    assert d in dst_box and dst_box[d].contains(box), f"row {i} writes {box} outside rank {d}'s box"
                else:
                    have = dst_have[s] | src_have.get(s, np.zeros(shape, bool))
                    data = np.where(dst_have[s], dst_data[s], v)
                assert have[sl].all(), f"stage {stage}: rank {s} sends {box} of tensor {t} before holding it"
                staged.append((d, sl, data[sl].copy()))
            for d, sl, chunk in staged:
                dst_data[d][sl] = chunk
                dst_have[d][sl] = True
                writes[d][sl] += 1
        for r in spec.dst.ranks:
            results[(t, r)] = (dst_data[r], dst_have[r], writes[r])
    return results


def check_destinations(plan: Plan, values: list[np.ndarray], results: dict, *, exactly_once: bool = True) -> None:
    """Every destination rank holds exactly ``global[box]`` (and, for jreshard
    plans, every element of its box was written exactly once)."""
    for t, spec in enumerate(plan.tensors):
        for r, b in zip(spec.dst.ranks, spec.dst.boxes, strict=True):
            data, have, writes = results[(t, r)]
            sl = b.slices()
            assert have[sl].all(), f"tensor {t}: rank {r} is missing part of {b}"
            np.testing.assert_array_equal(data[sl], values[t][sl])
            if exactly_once:
                assert (writes[sl] == 1).all(), f"tensor {t}: rank {r} got some element of {b} {writes[sl].max()}x"
                assert writes.sum() == writes[sl].sum(), f"tensor {t}: rank {r} got bytes outside {b}"


def brute_force_lower_bound(src: Layout, dst: Layout, topo: Topology) -> int:
    """``Σ_G |(∪_beta beta) \\ U(G)|`` with element masks (small shapes only): each element a
    domain needs and does not hold enters it once, however many of its boxes share it."""
    total = 0
    for g in sorted(set(topo.domain_of(r) for r in dst.ranks)):
        u = np.zeros(src.shape, bool)
        for r, b in zip(src.ranks, src.boxes, strict=True):
            if topo.domain_of(r) == g:
                u[b.slices()] = True
        need = np.zeros(src.shape, bool)
        for r, b in zip(dst.ranks, dst.boxes, strict=True):
            if topo.domain_of(r) == g:
                need[b.slices()] = True
        total += int((need & ~u).sum())
    return total * src.itemsize


def network_entries(plan: Plan) -> dict:
    """Per (tensor, domain): how many times each element crossed the network into the domain."""
    topo = plan.topology
    out: dict = {}
    for t, (spec, tp) in enumerate(zip(plan.tensors, plan.tensor_plans, strict=True)):
        for i in np.flatnonzero(tp.link == Link.NETWORK):
            key = (t, topo.domain_of(int(tp.dst[i])))
            arr = out.setdefault(key, np.zeros(spec.src.shape, np.int64))
            arr[tp.box(i).slices()] += 1
    return out


def check_exact_and_minimal(p: Any, src: Any, dst: Any, topo: Any) -> None:
    """A one-tensor plan delivers every destination element exactly, its network bytes equal the
    brute-force union bound, and no element enters a domain over the network twice."""
    values = random_values(p)
    check_destinations(p, values, execute(p, values))
    s = p.stats()
    assert s.network_bytes == s.network_bytes_lower_bound == brute_force_lower_bound(src, dst, topo)
    for key, count in network_entries(p).items():
        assert count.max() <= 1, f"{key}: some element entered the domain over the network {count.max()} times"
