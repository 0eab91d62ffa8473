"""Bad arguments to plan() and the baselines: a TypeError naming the argument and value, before any planning."""

from __future__ import annotations

import pytest

import jreshard
from jreshard import Layout
from jreshard.sharding.planner import plan_layouts, rank_plan

SRC = Layout.replicated([0], (8,), "float32")
DST = Layout.replicated([1], (8,), "float32")


@pytest.mark.parametrize("fn", [jreshard.plan, jreshard.baselines.flat_direct, jreshard.baselines.gather_broadcast])
@pytest.mark.parametrize("value", ["fast", {}, 1])
def test_options_not_options(fn, value):
    with pytest.raises(TypeError, match=rf"options={value!r} is a {type(value).__name__}"):
        fn(SRC, DST, options=value)


@pytest.mark.parametrize("fn", [jreshard.plan, jreshard.baselines.flat_direct, jreshard.baselines.gather_broadcast])
@pytest.mark.parametrize("value", ["abc", {0: 0}])
def test_topology_not_topology(fn, value):
    with pytest.raises(TypeError, match=rf"topology={value!r} is a {type(value).__name__}"):
        fn(SRC, DST, topology=value)


def test_layout_level_entry_points_check_too():
    with pytest.raises(TypeError, match=r"options='fast' is a str"):
        plan_layouts([(SRC, DST)], options="fast")
    with pytest.raises(TypeError, match=r"topology='abc' is a str"):
        rank_plan([(SRC, DST)], 0, topology="abc")
