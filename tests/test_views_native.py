"""The compiled float32 <-> bfloat16 casts of the views executor: bit for bit against ml_dtypes (which matches
``jnp.astype``), the cast-and-scatter kernel against numpy on adversarial geometry, and the executor's two paths
(compiled and numpy) against each other."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard import views
from jreshard.engine import viewcopy
from jreshard.views import native

pytestmark = pytest.mark.skipif(not native.available(), reason="the compiled casts are not built here")
BF16 = np.dtype(ml_dtypes.bfloat16)


def _f32_patterns() -> np.ndarray:
    """Every upper half of a float32 with low halves at the rounding edges (ties, just above and below) and
    random ones: every exponent, sign, NaN payload, subnormal and overflow case."""
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000, 0x17FFF & 0xFFFF, 0x2468], np.uint32)
    lows = np.concatenate([lows, np.random.default_rng(0).integers(0, 1 << 16, 6, dtype=np.uint32)])
    return ((np.arange(1 << 16, dtype=np.uint32)[:, None] << 16) | lows[None, :]).ravel().view(np.float32)


def test_f32_to_bf16_is_bit_exact_with_ml_dtypes():
    x = _f32_patterns()
    out = np.empty(x.shape, BF16)
    assert native.cast_into(out, x)
    with np.errstate(invalid="ignore"):
        want = x.astype(BF16)
    np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))


def test_bf16_to_f32_is_bit_exact_with_ml_dtypes():
    x = np.arange(1 << 16, dtype=np.uint16).view(BF16)
    out = np.empty(x.shape, np.float32)
    assert native.cast_into(out, x)
    np.testing.assert_array_equal(out.view(np.uint32), x.astype(np.float32).view(np.uint32))


def test_f32_to_bf16_matches_jnp_astype():
    x = _f32_patterns()[::7].copy()
    out = np.empty(x.shape, BF16)
    assert native.cast_into(out, x)
    np.testing.assert_array_equal(out.view(np.uint16), np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).view(np.uint16))


@pytest.mark.parametrize(
    ("index", "taken"),
    [
        ((slice(None), slice(None), slice(None)), True),
        ((slice(3, 9), slice(None), slice(5, 30)), True),
        ((1, slice(2, 40), slice(None)), True),
        ((slice(None, None, 2), slice(None), slice(None)), True),
        ((slice(0, 0), slice(None), slice(None)), True),
        ((slice(None), slice(None), slice(None, None, 2)), False),  # the last axis is not contiguous
    ],
)
def test_cast_into_takes_only_layouts_it_covers(index, taken):
    x = np.random.default_rng(1).standard_normal((16, 48, 40)).astype(np.float32)
    src = x[index]
    out = np.zeros((*src.shape[:-1], src.shape[-1] + 3), BF16)[..., 1 : 1 + src.shape[-1]]
    before = out.copy()
    assert native.cast_into(out, src) == taken
    np.testing.assert_array_equal(out.view(np.uint16), (src.astype(BF16) if taken else before).view(np.uint16))


def test_cast_into_refuses_mismatched_or_transposed_arrays():
    x = np.ones((8, 6), np.float32)
    assert not native.cast_into(np.empty((6, 8), BF16), x)
    assert not native.cast_into(np.empty((6, 8), BF16), x.T[:, :8].T.T)  # transposed: last axis strided
    assert not native.cast_into(np.empty((8, 6), np.float16), x)  # no kernel for the pair
    raw = np.zeros(8 * 6 * 4 + 1, np.uint8)[1:].view(np.float32).reshape(8, 6)  # misaligned float32
    assert not raw.flags.aligned and not native.cast_into(np.empty((8, 6), BF16), raw)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_scatter_kernel_writes_each_run_where_the_table_says(data):
    rows, cols = data.draw(st.integers(1, 6)), data.draw(st.sampled_from([1, 3, 64, 130, 4096, 5000, 9000]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    band = (rng.standard_normal((rows, cols)) * 100).astype(np.float32)
    band.ravel()[rng.integers(0, band.size, 3)] = [np.nan, np.inf, -np.nan]
    dest = np.zeros(2 * band.size * 3 + 64, BF16)
    entries, at = [], data.draw(st.integers(0, 7))  # odd starts: destinations 2-byte aligned only
    for r in range(rows):
        for _ in range(data.draw(st.integers(0, 3))):
            c0 = data.draw(st.integers(0, cols - 1))
            n = data.draw(st.integers(1, cols - c0))
            entries.append((r, c0, n, at))
            at += n + data.draw(st.integers(0, 9))
    if at > dest.size:
        return
    end = dest.ctypes.data + dest.nbytes
    rows_ = [(r, c, n, dest.ctypes.data + 2 * off, end) for r, c, n, off in entries]
    table = np.array(rows_ or np.empty((0, 5)), np.int64)
    native.SCATTER["float32", ("bfloat16",)](band.ctypes.data, cols * 4, rows, cols, table.reshape(-1, 5))
    want = np.zeros_like(dest)
    with np.errstate(invalid="ignore"):
        for r, c, n, off in entries:
            want[off : off + n] = band[r, c : c + n].astype(BF16)
    np.testing.assert_array_equal(dest.view(np.uint16), want.view(np.uint16))


def _fused_case(d=64, layers=2, tp=2):
    devs = np.array(jax.devices())
    trainer, server = Mesh(devs[:4], ("fsdp",)), Mesh(devs[4:].reshape(2, tp), ("dp", "tp"))
    rng = np.random.default_rng(3)
    shapes = {"q": (d, d), "k": (d, d // 8), "v": (d, d // 8), "gate": (d, 4 * d), "up": (d, 4 * d), "o": (d, d)}
    params = {
        n: jax.device_put(rng.standard_normal((layers, *s)).astype(np.float32), NamedSharding(trainer, P(None, "fsdp")))
        for n, s in shapes.items()
    }
    col, row = NamedSharding(server, P(None, "tp")), NamedSharding(server, P("tp", None))
    tree, want = [], []
    for i in range(layers):
        q, k, v, g, u, o = (views.unstack(params[n])[i] for n in shapes)
        kk, vv = (views.concat([x] * tp, axis=1) for x in (k, v))
        tree.append(
            {
                "qkv": views.astype(views.concat([q, kk, vv], axis=1, groups=tp), jnp.bfloat16),
                "gate_up": views.astype(views.concat([g, u], axis=1, groups=tp), jnp.bfloat16),
                "o": views.astype(o, jnp.bfloat16),
            }
        )
        full = {n: params[n][i] for n in shapes}
        full["k"], full["v"] = (jnp.concatenate([full[n]] * tp, axis=1) for n in "kv")

        def grouped(xs):
            return jnp.concatenate([jnp.split(x, tp, axis=1)[j] for j in range(tp) for x in xs], axis=1)

        want.append(
            {
                "qkv": grouped([full["q"], full["k"], full["v"]]).astype(jnp.bfloat16),
                "gate_up": grouped([full["gate"], full["up"]]).astype(jnp.bfloat16),
                "o": full["o"].astype(jnp.bfloat16),
            }
        )
    target = [{"qkv": col, "gate_up": col, "o": row} for _ in range(layers)]
    return tree, target, want


def _bits(x):
    return {s.device.id: np.asarray(s.data).view(np.uint16) for s in x.addressable_shards}


@pytest.mark.parametrize("band_bytes", [None, 200])
def test_fused_refit_runs_the_kernel_and_equals_the_numpy_path(monkeypatch, band_bytes):
    tree, target, want = _fused_case()
    ran, kernel_runs = [], []
    real = viewcopy._run_scatter
    key = ("float32", ("bfloat16",))
    kernel = native.SCATTER_RAW[key]

    def counted(*args):
        ran.append(real(*args))
        return ran[-1]

    def counted_kernel(*args):
        kernel_runs.append(args)
        return kernel(*args)

    monkeypatch.setattr(viewcopy, "_run_scatter", counted)
    monkeypatch.setitem(native.SCATTER_RAW, key, counted_kernel)
    if band_bytes is not None:
        monkeypatch.setattr(viewcopy, "BLOCK_BYTES", band_bytes)
    jreshard.clear_caches()
    fast = jreshard.transfer(tree, target)
    # every block of this refit runs compiled: all from the one table, none one by one
    assert kernel_runs and not ran
    monkeypatch.setattr(native, "SCATTER", {})
    monkeypatch.setattr(native, "SCATTER_RAW", {})
    monkeypatch.setattr(native, "KERNELS", {})
    jreshard.clear_caches()
    slow = jreshard.transfer(tree, target)
    jreshard.clear_caches()
    for f, s, w in zip(jax.tree.leaves(fast), jax.tree.leaves(slow), jax.tree.leaves(want), strict=True):
        ref = _bits(jax.device_put(w, f.sharding))
        assert _bits(f).keys() == ref.keys()
        for dev, bits in _bits(f).items():
            np.testing.assert_array_equal(bits, ref[dev])
            np.testing.assert_array_equal(_bits(s)[dev], ref[dev])


@pytest.mark.skipif(not native.available(), reason="the compiled casts were not built")
@pytest.mark.parametrize(
    "entry",
    [
        (0, 0, 9, 0),  # one bfloat16 past the end of the destination
        (0, 5, 4, 0),  # columns past the end of the band row
        (2, 0, 1, 0),  # a row the band does not have
        (0, -1, 2, 0),  # a negative column
    ],
)
def test_scatter_kernel_refuses_an_entry_outside_its_buffers_and_writes_nothing(entry):
    band = np.arange(16, dtype=np.float32).reshape(2, 8)
    dest = np.zeros(8, BF16)
    guard = np.full(4, 7, np.uint16)  # bytes right after dest in one allocation
    block = np.concatenate([dest.view(np.uint16), guard])
    out = block[:8]
    r, c, n, off = entry
    good = (1, 0, 8, out.ctypes.data, out.ctypes.data + out.nbytes)
    table = np.array([good, (r, c, n, out.ctypes.data + 2 * off, out.ctypes.data + out.nbytes)], np.int64)
    table = table[np.argsort(table[:, 0], kind="stable")]
    with pytest.raises(ValueError, match=r"outside the band|past the end"):
        native.SCATTER["float32", ("bfloat16",)](band.ctypes.data, 32, 2, 8, table)
    assert not block[:8].any() and (block[8:] == 7).all()  # nothing written, the neighbour intact


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_contiguous_span_matches_numpy(data):
    """Where ``_contiguous_span`` calls ``a[index]`` one run of ``a``, numpy agrees on its start, its size and its
    contiguity; where it says ``None``, the slice is empty or not one run of ``a``."""
    ndim = data.draw(st.integers(1, 4))
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    index = []
    for n in shape[: data.draw(st.integers(0, ndim))]:
        lo = data.draw(st.integers(0, n))
        index.append(slice(lo, data.draw(st.integers(lo, n)), data.draw(st.sampled_from([None, 1, 2]))))
    a = np.zeros(shape, np.float32)
    part = a[tuple(index)]
    got = viewcopy._contiguous_span(shape, tuple(index), 4)
    one_run = part.size > 0 and part.flags.c_contiguous
    if got is None:
        assert not one_run
    else:
        assert one_run
        assert got == (part.ctypes.data - a.ctypes.data, part.nbytes)


def _cast_tree(n=24):
    """``n`` float32 leaves of several shapes, FSDP over devices 0-3, and their bfloat16 TP2 x DP2 targets."""
    devs = np.array(jax.devices())
    fsdp = NamedSharding(Mesh(devs[:4], ("fsdp",)), P("fsdp"))
    tp = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    rng = np.random.default_rng(5)
    shapes = [(8, 4), (16, 16), (4, 2), (32, 8)]
    xs = [jax.device_put(rng.standard_normal(shapes[i % len(shapes)]).astype(np.float32), fsdp) for i in range(n)]
    return xs, tp


def _bits_equal(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.sharding == w.sharding
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16), np.asarray(w).view(np.uint16))


def test_many_cast_leaves_run_from_one_table_bit_exact(monkeypatch):
    """A tree of many cast leaves runs every block from the one table (no block built one by one), bit for bit
    ``jnp.astype`` then ``jax.device_put``, in ``transfer`` and in a steady ``transfer_into`` loop."""
    xs, tp = _cast_tree()
    want = [jax.device_put(x.astype(jnp.bfloat16), tp) for x in xs]
    ran, kernel_runs = [], []
    real, key = viewcopy._run_scatter, ("float32", ("bfloat16",))
    kernel = native.SCATTER_RAW[key]
    monkeypatch.setattr(viewcopy, "_run_scatter", lambda *a: ran.append(a) or real(*a))
    monkeypatch.setitem(native.SCATTER_RAW, key, lambda *a: kernel_runs.append(a) or kernel(*a))
    jreshard.clear_caches()
    got = jreshard.transfer([views.astype(x, jnp.bfloat16) for x in xs], [tp] * len(xs))
    assert len(kernel_runs) >= len(xs) and not ran
    _bits_equal(got, want)
    for step in range(3):  # transfer_into, donating the last results: written in place, from the table
        xs = [x + 1 for x in xs]
        want = [jax.device_put(x.astype(jnp.bfloat16), tp) for x in xs]
        kernel_runs.clear()
        got = jreshard.transfer_into([views.astype(x, jnp.bfloat16) for x in xs], got)
        assert len(kernel_runs) >= len(xs) and not ran, step
        _bits_equal(got, want)


def test_scatter_table_refuses_shards_unlike_the_compiled_ones():
    """The one-table run is not taken (and nothing is written) where a shard is not as the table was compiled for:
    another dtype, another shape, a read-only destination; the blocks then run one by one."""
    from jreshard.call import views as call_views

    xs, tp = _cast_tree(3)
    jreshard.clear_caches()
    jreshard.transfer([views.astype(x, jnp.bfloat16) for x in xs], [tp] * len(xs))
    ((_, tasks, _),) = call_views._CACHE.values()
    sc = tasks.scatters
    assert sc is not None
    src = {k: np.zeros(s, np.float32) for k, s in zip(sc.src_keys, sc.src_shapes, strict=True)}
    dst: dict = {}
    for (t, r), s in zip(sc.dst_keys, sc.dst_shapes, strict=True):
        dst.setdefault(t, {})[r] = np.zeros(s, BF16)
    dsts = [dst[t] for t in range(max(dst) + 1)]
    calls, table = viewcopy._kernel_calls(sc, src, dsts)
    assert calls is not None and table is not None
    (t0, r0) = sc.dst_keys[0]
    for bad in (
        np.zeros(sc.dst_shapes[0], np.float16),  # another dtype
        np.zeros((1, *sc.dst_shapes[0]), BF16),  # another shape
        np.zeros(sc.dst_shapes[0], BF16),  # read-only
    ):
        if bad.dtype == BF16 and bad.shape == sc.dst_shapes[0]:
            bad.flags.writeable = False
        dsts[t0] = {**dst[t0], r0: bad}
        assert viewcopy._kernel_calls(sc, src, dsts) == (None, None)
    dsts[t0] = dst[t0]
    k0 = sc.src_keys[0]
    assert viewcopy._kernel_calls(sc, {**src, k0: np.zeros(sc.src_shapes[0], np.float64)}, dsts) == (None, None)
