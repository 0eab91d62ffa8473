"""simulate_layouts: the cost model from the planner's templates, equal to predicting the whole plan."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from strategies import overlap_case, plan_case

from jreshard.cost import predict
from jreshard.models import refit, refit_topology
from jreshard.options import Options
from jreshard.sharding.planner import plan_layouts
from jreshard.sharding.simulate import simulate_layouts


def _same(pairs, topo, opts):
    whole = plan_layouts(pairs, topo, opts)
    sim = simulate_layouts(pairs, topo, opts)
    s = whole.stats()
    assert sim.prediction == predict(whole)
    assert (sim.network_bytes, sim.fast_bytes, sim.same_device_bytes) == (
        s.network_bytes,
        s.fast_bytes,
        s.same_device_bytes,
    )
    assert sim.network_bytes_lower_bound == s.network_bytes_lower_bound
    assert sim.rows == sum(len(tp) for tp in whole.tensor_plans)
    assert sim.stats == s


@given(plan_case())
def test_simulation_equals_prediction_of_the_whole_plan(case):
    src, dst, topo, opts = case
    _same([(src, dst), (dst, src), (src, dst), (src, dst)], topo, Options(**opts))


@given(overlap_case())
def test_simulation_with_overlapping_destinations(case):
    src, dst, topo, opts = case
    _same([(src, dst)] * 3, topo, Options(**opts))


def test_deepseek_v3_refit_on_128_plus_128():
    r = refit("deepseek-v3", 128, 128)
    topo = refit_topology(128, 128, 64, network_bw=50e9, fast_bw=900e9)
    _same(r.pairs, topo, Options())
    sim = simulate_layouts(r.pairs, topo)
    assert sim.network_bytes == sim.network_bytes_lower_bound
    assert np.isfinite(sim.prediction.seconds) and sim.prediction.seconds >= sim.prediction.bound_seconds
