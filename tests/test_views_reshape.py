"""Reshape views: every box of a reshaped (and further composed) view is covered exactly once by its
regions, and the elements they read are numpy's ``reshape`` of the source, element by element."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jreshard import views
from jreshard.sharding.box import Box
from jreshard.views.algebra import Leaf, Reshape, _reshape_groups
from jreshard.views.bounds import evaluate
from jreshard.views.casts import cast


def _by_regions(view, box: Box) -> np.ndarray:
    """The box of ``view`` assembled from its regions alone (each leaf holds element ids); -1 where none
    wrote, and a count of writes per element."""
    out = np.full(box.shape, -1, np.int64)
    count = np.zeros(box.shape, np.int32)
    for m in view.regions(box):
        src = np.asarray(m.leaf.source)
        sub = src[m.src_box().slices()]
        run = [a for a in m.axes if a >= 0]
        assert len(set(run)) == len(run), f"two axes run along one source axis: {m.axes}"
        assert all(sub.shape[a] == 1 for a in range(src.ndim) if a not in run)
        sub = np.transpose(sub, run + [a for a in range(src.ndim) if a not in run])
        sub = sub.reshape(sub.shape[: len(run)])
        sub = sub.reshape([m.box.hi[d] - m.box.lo[d] for d in range(view.ndim)])
        at = tuple(slice(lo - b, hi - b) for lo, hi, b in zip(m.box.lo, m.box.hi, box.lo, strict=True))
        out[at] = sub
        count[at] += 1
    return out, count


def _factorizations(n: int) -> list[tuple[int, ...]]:
    outs = [(n,)]
    for a in range(1, n + 1):
        if n % a == 0:
            outs.append((a, n // a))
            for b in range(1, n // a + 1):
                if (n // a) % b == 0:
                    outs.append((a, b, n // a // b))
    return outs


@st.composite
def reshaped(draw):
    shape = draw(st.sampled_from([(4, 6), (2, 3, 4), (24,), (1, 12, 2), (6, 1, 4), (3, 8)]))
    ids = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    v, ref = Leaf(ids), ids
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["reshape", "reshape", "transpose", "slice"]))
        if op == "reshape":
            target = list(draw(st.sampled_from(_factorizations(v.size))))
            if draw(st.booleans()):
                target.insert(draw(st.integers(0, len(target))), 1)
            v, ref = views.reshape(v, target), ref.reshape(target)
        elif op == "transpose" and v.ndim > 1:
            perm = draw(st.permutations(list(range(v.ndim))))
            v, ref = views.transpose(v, perm), np.transpose(ref, perm)
        elif op == "slice" and v.shape[0] > 1:
            a = draw(st.integers(0, v.shape[0] - 1))
            b = draw(st.integers(a + 1, v.shape[0]))
            v, ref = v[a:b], ref[a:b]
    return v, ref


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_regions_of_random_boxes_read_what_numpy_reshape_gives(data):
    view, ref = data.draw(reshaped())
    assert view.shape == ref.shape
    np.testing.assert_array_equal(evaluate(view, lambda leaf: leaf.source, cast), ref)
    lo = [data.draw(st.integers(0, n - 1)) for n in view.shape]
    hi = [data.draw(st.integers(a + 1, n)) for a, n in zip(lo, view.shape, strict=True)]
    box = Box(tuple(lo), tuple(hi))
    got, count = _by_regions(view, box)
    assert (count == 1).all(), "every element of the box is read by exactly one region"
    np.testing.assert_array_equal(got, ref[box.slices()])


def test_merging_heads_costs_one_region_per_head():
    q = Leaf(np.zeros((16, 4, 8)))  # [embed, heads, head_dim]
    merged = views.reshape(views.transpose(q, (1, 2, 0)), (32, 16))  # [heads * head_dim, embed]
    assert len(merged.regions(Box((8, 0), (24, 16)))) == 2  # heads 1 and 2, each one run
    assert len(merged.regions(Box((4, 0), (12, 16)))) == 2  # half of head 0, half of head 1


@pytest.mark.parametrize(
    ("src", "dst", "groups"),
    [
        ((4, 6), (24,), [((0, 1), (0,))]),
        ((24,), (2, 3, 4), [((0,), (0, 1, 2))]),
        ((2, 3, 4), (6, 4), [((0, 1), (0,)), ((2,), (1,))]),
        ((4, 1), (4,), [((0,), (0,)), ((1,), ())]),
        ((4,), (1, 4, 1), [((0,), (0, 1)), ((), (2,))]),  # a leading 1 joins the next group
        ((6, 4), (4, 6), [((0, 1), (0, 1))]),
        ((0, 3), (3, 0), [((0, 1), (0, 1))]),
    ],
)
def test_groups_of_a_reshape(src, dst, groups):
    assert _reshape_groups(src, dst) == tuple(groups)


@pytest.mark.parametrize(
    ("shape", "match"),
    [((5, 5), "cannot have shape"), ((-1, -1), "at most one -1"), ((-1, 5), "cannot infer"), ((-2, 12), "negative")],
)
def test_a_bad_shape_names_both_shapes(shape, match):
    with pytest.raises(ValueError, match=match):
        views.reshape(Leaf(np.zeros((4, 6))), shape)


def test_a_reshape_survives_the_named_form():
    from jreshard.views.named import decode, encode, param

    v = views.reshape(views.transpose(param("q", (8, 2, 4), "float32"), (1, 2, 0)), (8, 8))
    form = encode(v)
    back = decode(form, lambda name: param(name, (8, 2, 4), "float32"))
    assert isinstance(back, Reshape) and back.shape == (8, 8) and encode(back) == form
