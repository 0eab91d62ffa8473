"""The descriptor table and the numpy pack/unpack/copy kernels, against numpy slicing."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import box_in, byte_shape

from jreshard.schedule import kernels
from jreshard.sharding.box import Box

DTYPES = [np.float32, np.int8, np.float16, np.int64, ml_dtypes.bfloat16, np.bool_]


@st.composite
def shard_and_box(draw, max_ndim: int = 4):
    ndim = draw(st.integers(0, max_ndim))
    shape = tuple(draw(st.integers(1, 5)) for _ in range(ndim))
    box = draw(box_in(shape))
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    return shape, box, dtype


def _random(shape, dtype, rng):
    return rng.integers(0, 100, size=shape).astype(dtype)


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


@given(shard_and_box(), st.integers(0, 2**31))
def test_pack_unpack_match_numpy_slicing(case, seed):
    shape, box, dtype = case
    rng = np.random.default_rng(seed)
    shard = _random(shape, dtype, rng)
    outer = byte_shape(shape, dtype.itemsize)
    table = kernels.build_table([(0, outer, kernels.byte_box(box, dtype.itemsize))], staging_offset=3)
    assert table.shape == (1, kernels.COLUMNS) and 1 <= table[0, kernels.NDIM] <= kernels.MAX_DIMS
    assert kernels.table_bytes(table) == box.volume * dtype.itemsize
    staging = np.zeros(3 + box.volume * dtype.itemsize, np.uint8)
    kernels.pack_cpu(table, [_bytes(shard)], staging)
    expect = np.ascontiguousarray(shard[box.slices()])
    np.testing.assert_array_equal(staging[3:], _bytes(expect))
    back = np.zeros_like(shard)
    kernels.unpack_cpu(table, staging, [_bytes(back)])
    np.testing.assert_array_equal(_bytes(back[box.slices()].copy()), _bytes(expect))
    mask = np.ones(shape, bool)
    mask[box.slices()] = False
    assert not back[mask].astype(bool).any()  # nothing written outside the box


def test_contiguous_piece_is_one_dimension():
    t = kernels.build_table([(0, (4, 6, 8), Box((1, 0, 0), (3, 6, 8)))])
    assert t[0, kernels.NDIM] == 1 and t[0, kernels.SHAPE0] == 96 and t[0, kernels.OFF] == 48
    t = kernels.build_table([(0, (4, 6, 8), Box((1, 2, 0), (3, 4, 8)))])
    assert t[0, kernels.NDIM] == 2 and tuple(t[0, kernels.SHAPE0 : kernels.SHAPE0 + 2]) == (2, 16)
    assert tuple(t[0, kernels.STRIDE0 : kernels.STRIDE0 + 2]) == (48, 1)


def test_empty_boxes_are_skipped_and_many_pieces_pack_back_to_back():
    a = np.arange(24, dtype=np.uint8).reshape(4, 6)
    t = kernels.build_table(
        [(0, (4, 6), Box((0, 0), (0, 6))), (0, (4, 6), Box((0, 0), (1, 2))), (0, (4, 6), Box((3, 4), (4, 6)))]
    )
    assert len(t) == 2 and list(t[:, kernels.STAGE]) == [0, 2]
    staging = np.zeros(4, np.uint8)
    kernels.pack_cpu(t, [a.reshape(-1)], staging)
    assert staging.tolist() == [0, 1, 22, 23]


@given(shard_and_box(), shard_and_box(), st.integers(0, 2**31))
def test_copy_tables_between_differently_shaped_buffers(a, b, seed):
    (sshape, sbox, dtype), (dshape, dbox, _) = a, b
    # Give both boxes the extents of the smaller one in every dimension they share.
    nd = min(len(sshape), len(dshape))
    sshape, dshape = sshape[:nd], dshape[:nd]
    ext = [min(sb - sa, db - da) for sa, sb, da, db in zip(sbox.lo, sbox.hi, dbox.lo, dbox.hi, strict=False)][:nd]
    sbox = Box(sbox.lo[:nd], tuple(lo + e for lo, e in zip(sbox.lo, ext, strict=False)))
    dbox = Box(dbox.lo[:nd], tuple(lo + e for lo, e in zip(dbox.lo, ext, strict=False)))
    rng = np.random.default_rng(seed)
    src = _random(sshape, dtype, rng)
    dst = np.zeros(dshape, dtype)
    isz = dtype.itemsize
    st_, dt_ = kernels.build_copy_tables(
        [
            (
                0,
                byte_shape(sshape, isz),
                kernels.byte_box(sbox, isz),
                0,
                byte_shape(dshape, isz),
                kernels.byte_box(dbox, isz),
            )
        ]
    )
    assert kernels.table_bytes(st_) == kernels.table_bytes(dt_) == sbox.volume * isz
    kernels.copy_cpu(st_, [_bytes(src)], dt_, [_bytes(dst)])
    np.testing.assert_array_equal(_bytes(dst[dbox.slices()].copy()), _bytes(src[sbox.slices()].copy()))


def test_too_many_strided_dimensions_is_refused():
    # Extent 2 of 3 in each of 10 dimensions: no two dimensions merge.
    with pytest.raises(ValueError, match="at most 8"):
        kernels.build_table([(0, (3,) * 10, Box((0,) * 10, (2,) * 10))])
    assert kernels.build_table([(0, (3,) * 8, Box((0,) * 8, (2,) * 8))])[0, kernels.NDIM] == 8


def test_build_table_aligns_staging_offsets_when_asked():
    pieces = [(0, (100,), Box((i,), (i + 1 + i % 5,))) for i in range(0, 90, 7)]
    packed = kernels.build_table(pieces)
    aligned = kernels.build_table(pieces, align=16, staging_offset=32)
    assert packed[0, kernels.STAGE] == 0 and (np.diff(packed[:, kernels.STAGE]) == packed[:-1, kernels.NBYTES]).all()
    assert (aligned[:, kernels.STAGE] % 16 == 0).all() and aligned[0, kernels.STAGE] == 32
    assert (np.diff(aligned[:, kernels.STAGE]) >= aligned[:-1, kernels.NBYTES]).all()
    shard = np.arange(100, dtype=np.uint8)
    staging = np.zeros(int(aligned[-1, kernels.STAGE] + aligned[-1, kernels.NBYTES]), np.uint8)
    kernels.pack_cpu(aligned, [shard], staging)
    back = np.zeros(100, np.uint8)
    kernels.unpack_cpu(aligned, staging, [back])
    for _, _, box in pieces:
        np.testing.assert_array_equal(back[box.slices()], shard[box.slices()])
    with pytest.raises(ValueError, match="align=0"):
        kernels.build_table(pieces, align=0)
