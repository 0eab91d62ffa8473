"""The one cache helper: bounded, and clear_caches() empties every planner cache."""

from __future__ import annotations

import numpy as np
import pytest

from jreshard.sharding.caches import cache, clear_caches
from jreshard.sharding.layout import Layout
from jreshard.sharding.planner import plan_layouts


def test_clear_caches_forgets_plans():
    a = Layout.from_mesh(np.arange(2), ("x",), ("x",), (4,), "float32")
    b = Layout.from_mesh(np.arange(2, 4), ("x",), ("x",), (4,), "float32")
    first = plan_layouts([(a, b)])
    assert plan_layouts([(a, b)]) is first
    clear_caches()
    again = plan_layouts([(a, b)])
    assert again is not first
    assert [len(tp) for tp in again.tensor_plans] == [len(tp) for tp in first.tensor_plans]


def test_cache_is_bounded():
    calls = []

    @cache(max_size=2)
    def f(x: int) -> int:
        calls.append(x)
        return x

    for x in (1, 2, 3, 1):
        f(x)
    assert calls == [1, 2, 3, 1]  # 1 was evicted by 3
    assert f.cache_info().currsize == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_cache_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=rf"max_size={bad!r}"):
        cache(max_size=bad)
