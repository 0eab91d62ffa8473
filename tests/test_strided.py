"""The in-process copy kernel: batched strided copies between raw buffers, against numpy slicing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jreshard.engine import strided
from jreshard.engine.copies import geometry
from jreshard.engine.pool import BufferPool


@st.composite
def _copies(draw):
    ndim = draw(st.integers(1, 3))
    src_shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    dst_shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    ext = tuple(draw(st.integers(1, min(a, b))) for a, b in zip(src_shape, dst_shape, strict=True))
    s_lo = tuple(draw(st.integers(0, a - e)) for a, e in zip(src_shape, ext, strict=True))
    d_lo = tuple(draw(st.integers(0, a - e)) for a, e in zip(dst_shape, ext, strict=True))
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    leaves = draw(st.integers(1, 40))
    threads = draw(st.sampled_from([1, 2, 3]))
    return src_shape, dst_shape, ext, s_lo, d_lo, itemsize, leaves, threads


def _strides(shape, itemsize):
    out = [itemsize] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out


@settings(max_examples=60, deadline=None)
@given(_copies(), st.integers(0, 2**31))
def test_batched_copies_equal_numpy_slicing(case, seed):
    """One copy class over many leaves (the batched path), each leaf its own source and destination buffer."""
    src_shape, dst_shape, ext, s_lo, d_lo, itemsize, leaves, threads = case
    rng = np.random.default_rng(seed)
    dt = np.dtype(f"u{itemsize}")
    srcs = [rng.integers(0, 255, size=src_shape).astype(dt) for _ in range(leaves)]
    dsts = [np.zeros(dst_shape, dt) for _ in range(leaves)]
    s_str, d_str = _strides(src_shape, itemsize), _strides(dst_shape, itemsize)
    cls = geometry(ext, itemsize, s_str, d_str)
    s_off = sum(a * b for a, b in zip(s_lo, s_str, strict=True))
    d_off = sum(a * b for a, b in zip(d_lo, d_str, strict=True))
    src = np.array([a.ctypes.data + s_off for a in srcs], np.int64)
    dst = np.array([a.ctypes.data + d_off for a in dsts], np.int64)
    moved = strided.copy_classes([(cls, src, dst)], threads=threads)
    assert moved == int(np.prod(ext)) * itemsize * leaves
    box_s = tuple(slice(a, a + e) for a, e in zip(s_lo, ext, strict=True))
    box_d = tuple(slice(a, a + e) for a, e in zip(d_lo, ext, strict=True))
    for a, b in zip(srcs, dsts, strict=True):
        want = np.zeros(dst_shape, dt)
        want[box_d] = a[box_s]
        np.testing.assert_array_equal(b, want)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_large_pieces_are_cut_across_threads_and_land_exactly(threads):
    pool = BufferPool(max_bytes=0)
    rows, cols = 1024, 1024  # 4 MiB of float32: one-by-one, cut along rows
    src = pool.take(rows * 2 * cols * 4).view(np.float32).reshape(rows, 2 * cols)
    src[:] = np.arange(src.size, dtype=np.float32).reshape(src.shape)
    dst = pool.take(rows * cols * 4).view(np.float32).reshape(rows, cols)
    cls = geometry((rows, cols), 4, (2 * cols * 4, 4), (cols * 4, 4))
    assert cls.piece_bytes >= 4 * strided.LARGE_PIECE and cls.outer == (rows,)
    a = np.array([src.ctypes.data + cols * 4], np.int64)
    b = np.array([dst.ctypes.data], np.int64)
    strided.copy_classes([(cls, a, b)], threads=threads)
    np.testing.assert_array_equal(dst, src[:, cols:])


def test_geometry_merges_only_what_is_contiguous_on_both_sides():
    assert geometry((4, 3), 4, (48, 4), (12, 4)).run == 12
    full = geometry((2, 3, 5), 2, (30, 10, 2), (30, 10, 2))
    assert (full.run, full.outer) == (60, ())
    assert geometry((1, 7, 1), 8, (56, 8, 8), (112, 16, 8)).outer == (7,)


def test_the_calling_thread_runs_the_first_job_however_early_the_pool_wakes(monkeypatch):
    """A pool thread that wakes before the caller (as on a busy host) could otherwise take every job."""
    import concurrent.futures
    import threading

    class Eager(concurrent.futures.ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):  # the pool thread runs to completion before the caller moves on
            future = super().submit(fn, *args, **kwargs)
            future.result()
            return future

    pool = Eager(max_workers=1)
    monkeypatch.setattr(strided, "executor", lambda: pool)
    seen: list[tuple[int, threading.Thread]] = []
    strided.run_shared([lambda i=i: seen.append((i, threading.current_thread())) for i in range(6)], 2)
    pool.shutdown()
    assert sorted(i for i, _ in seen) == list(range(6))
    assert dict(seen)[0] is threading.current_thread()
    assert {t for _, t in seen} - {threading.current_thread()}, "the pool thread took the rest"
