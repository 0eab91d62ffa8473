"""The compiled byte rows of descriptor tables (``jreshard/schedule/_rows.c``) against the numpy kernels.

``pack_cpu`` and ``unpack_cpu`` run their byte rows through the compiled kernel where it was built (``make test``
builds it and checks it loads). Here every row geometry the tables hold (strided boxes, transposes, many pieces
back to back, pieces large enough for the streaming stores at odd offsets) moves the same bytes as the numpy
kernels, no byte outside a piece changes, and a row that leaves its buffer or staging by one byte, names a
missing buffer or claims the wrong size is refused before anything is written.
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import box_in

from jreshard.schedule import kernels
from jreshard.sharding.box import Box

pytestmark = pytest.mark.skipif(not kernels.compiled_rows(), reason="the compiled byte rows are not built here")

GUARD = 64  # bytes past every buffer's end that no row may touch


def _guarded(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A buffer of ``n`` random bytes (the view handed to the kernels) inside a larger one with random guard bytes."""
    whole = rng.integers(0, 256, n + 2 * GUARD, dtype=np.uint8)
    return whole, whole[GUARD : GUARD + n]


@st.composite
def tables(draw):
    """A table of 1-4 byte rows over up to 3 shard buffers: boxes of C-ordered shards and transposed reads."""
    nbuf = draw(st.integers(1, 3))
    shapes = [tuple(draw(st.integers(1, 6)) for _ in range(draw(st.integers(1, 4)))) for _ in range(nbuf)]
    items = [draw(st.sampled_from([1, 2, 4, 8])) for _ in range(nbuf)]
    rows, stage = [], draw(st.integers(0, 5))
    for _ in range(draw(st.integers(1, 4))):
        b = draw(st.integers(0, nbuf - 1))
        shape, item = shapes[b], items[b]
        box = draw(box_in(shape))
        strides = [item] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        order = draw(st.permutations(range(len(shape))))  # the axis order staging holds (a transpose)
        first = sum(lo * s for lo, s in zip(box.lo, strides, strict=True))
        (row,) = kernels.element_rows(
            [(b, first, tuple(strides[a] for a in order), item)], tuple(box.shape[a] for a in order), stage=stage
        )
        rows.append(row)
        stage += int(row[0, kernels.NBYTES]) + draw(st.integers(0, 3))
    sizes = [int(np.prod(s)) * i for s, i in zip(shapes, items, strict=True)]
    return np.concatenate(rows), sizes, stage


@given(tables(), st.integers(0, 2**31))
def test_compiled_pack_and_unpack_move_the_bytes_numpy_moves(case, seed):
    table, sizes, staging_bytes = case
    rng = np.random.default_rng(seed)
    src = [_guarded(n, rng) for n in sizes]
    stage_whole, staging = _guarded(staging_bytes, rng)
    stage_guards = np.concatenate([stage_whole[:GUARD], stage_whole[-GUARD:]])
    want_stage = staging.copy()
    kernels._pack_numpy(table, [b for _, b in src], want_stage)
    before = [w.copy() for w, _ in src]
    kernels.pack_cpu(table, [b for _, b in src], staging)
    np.testing.assert_array_equal(staging, want_stage)
    assert all((w == b).all() for (w, _), b in zip(src, before, strict=True))  # a pack reads its buffers only
    np.testing.assert_array_equal(np.concatenate([stage_whole[:GUARD], stage_whole[-GUARD:]]), stage_guards)

    dst = [_guarded(n, rng) for n in sizes]
    want = [b.copy() for _, b in dst]
    kernels._unpack_numpy(table, staging, want)
    guards = [np.concatenate([w[:GUARD], w[-GUARD:]]) for w, _ in dst]
    kernels.unpack_cpu(table, staging, [b for _, b in dst])
    for (w, b), exp, g in zip(dst, want, guards, strict=True):
        np.testing.assert_array_equal(b, exp)
        np.testing.assert_array_equal(np.concatenate([w[:GUARD], w[-GUARD:]]), g)


@pytest.mark.parametrize("offset", [0, 1, 13])
def test_large_strided_pieces_take_the_streaming_stores_and_match(offset):
    """Two pieces of 2 MiB in all, runs of 1 KiB + 7 bytes at odd offsets: over the kernel's streaming threshold."""
    rng = np.random.default_rng(offset)
    rows_, run, pitch = 1024, 1031, 4096
    _, shard = _guarded(offset + rows_ * pitch, rng)
    pieces = [
        (0, (rows_, pitch), Box((0, 0), (rows_, run))),
        (0, (rows_, pitch), Box((0, 2000), (rows_, 2000 + run))),
    ]
    table = kernels.build_table(pieces)
    table = table.copy()
    table[:, kernels.OFF] += offset
    assert kernels.table_bytes(table) >= 2 * rows_ * run
    staging = np.zeros(kernels.table_bytes(table) + 5, np.uint8)[5:]
    want = np.zeros_like(staging)
    kernels._pack_numpy(table, [shard], want)
    kernels.pack_cpu(table, [shard], staging)
    np.testing.assert_array_equal(staging, want)
    out_whole, out = _guarded(shard.size, rng)
    tail = out_whole[-GUARD:].copy()
    expect = out.copy()
    kernels._unpack_numpy(table, staging, [expect])
    kernels.unpack_cpu(table, staging, [out])
    np.testing.assert_array_equal(out, expect)
    np.testing.assert_array_equal(out_whole[-GUARD:], tail)


def _one_row(n: int = 6, pitch: int = 8, rows_: int = 4) -> np.ndarray:
    return kernels.build_table([(0, (rows_, pitch), Box((0, 0), (rows_, n)))]).copy()


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda t: t.__setitem__((0, kernels.OFF), 3), "its last byte one past the buffer's end"),
        (lambda t: t.__setitem__((0, kernels.STAGE), 1), "one byte past staging"),
        (lambda t: t.__setitem__((0, kernels.BUF), 1), "a buffer index the list does not have"),
        (lambda t: t.__setitem__((0, kernels.NBYTES), 25), "NBYTES that is not the product of its extents"),
        (lambda t: t.__setitem__((0, kernels.STRIDE0), -8), "a negative stride"),
        (lambda t: t.__setitem__((0, kernels.SHAPE0), 1 << 62), "an extent whose product overflows"),
    ],
)
@pytest.mark.parametrize("unpack", [False, True])
def test_a_row_outside_its_buffer_or_staging_is_refused_before_any_byte_moves(edit, why, unpack):
    good = _one_row()
    table = np.concatenate([good, good]).copy()  # the first row is fine: it must not be written either
    table[1, kernels.STAGE] = 0
    edit(table[1:])
    shard = np.arange(32, dtype=np.uint8)
    staging = np.full(24, 7, np.uint8)
    before = shard.copy(), staging.copy()
    with pytest.raises(ValueError, match="descriptor row"):
        if unpack:
            kernels.unpack_cpu(table, staging, [shard])
        else:
            kernels.pack_cpu(table, [shard], staging)
    np.testing.assert_array_equal(shard, before[0])
    np.testing.assert_array_equal(staging, before[1])


def test_a_missing_buffer_and_a_read_only_target_are_refused():
    table = _one_row()
    staging = np.zeros(24, np.uint8)
    with pytest.raises(ValueError, match="missing buffer"):
        kernels.pack_cpu(table, [None], staging)  # type: ignore[list-item]
    shard = np.arange(32, dtype=np.uint8)
    shard.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        kernels.unpack_cpu(table, staging, [shard])
    assert shard.tolist() == list(range(32))


def test_the_compiled_module_reads_the_columns_this_module_writes():
    from jreshard.schedule import _rows

    for name in ("COLUMNS", "MAX_DIMS", "BUF", "OFF", "STAGE", "NBYTES", "NDIM", "SHAPE0", "STRIDE0", "CAST"):
        assert getattr(_rows, name) == getattr(kernels, name), name


def test_cast_rows_beside_byte_rows_still_cast():
    """A table mixing both: the kernel takes the byte rows and the float32 -> bfloat16 cast row."""
    x = np.arange(12, dtype=np.float32)
    (cast_row,) = kernels.element_rows([(0, 0, (4,), 4)], (12,), ("float32", "bfloat16"), staged_itemsize=2)
    byte = kernels.build_table([(1, (16,), Box((4,), (12,)))], staging_offset=24)
    table = np.concatenate([cast_row, byte])
    other = np.arange(16, dtype=np.uint8)
    staging = np.zeros(32, np.uint8)
    kernels.pack_cpu(table, [x.view(np.uint8), other], staging)
    import ml_dtypes

    np.testing.assert_array_equal(staging[:24].view(ml_dtypes.bfloat16).astype(np.float32), x)
    assert staging[24:].tolist() == list(range(4, 12))


def test_every_row_geometry_of_a_small_box_matches():
    """Exhaustive over a (3, 4, 5) uint8 shard: every box, both directions."""
    shard = np.arange(60, dtype=np.uint8)
    for lo in itertools.product(range(3), range(4), range(5)):
        for hi in itertools.product(*(range(a + 1, n + 1) for a, n in zip(lo, (3, 4, 5), strict=True))):
            t = kernels.build_table([(0, (3, 4, 5), Box(lo, hi))])
            got, want = np.zeros(60, np.uint8), np.zeros(60, np.uint8)
            kernels.pack_cpu(t, [shard], got)
            kernels._pack_numpy(t, [shard], want)
            assert got.tobytes() == want.tobytes(), (lo, hi)


def test_the_numpy_kernels_refuse_a_row_past_its_buffer_too():
    """Where the kernel is not built, numpy runs every row: a byte row one byte past its buffer is refused there."""
    table = _one_row()
    table[0, kernels.OFF] = 3
    shard = np.arange(32, dtype=np.uint8)
    with pytest.raises(ValueError, match="descriptor row leaves its buffer"):
        kernels._pack_numpy(table, [shard], np.zeros(24, np.uint8))
    with pytest.raises(ValueError, match="descriptor row leaves its buffer"):
        kernels._unpack_numpy(table, np.zeros(24, np.uint8), [shard])
    assert shard.tolist() == list(range(32))


def test_a_bad_cast_row_beside_good_byte_rows_stops_the_table_before_any_byte_moves():
    """The numpy rows are checked before the kernel runs the byte rows: a cast row past its buffer writes nothing."""
    x = np.arange(12, dtype=np.float32)
    (cast_row,) = kernels.element_rows([(0, 8, (4,), 4)], (12,), ("float32", "bfloat16"), staged_itemsize=2)
    byte = kernels.build_table([(1, (16,), Box((4,), (12,)))], staging_offset=24)
    table = np.concatenate([byte, cast_row])  # the cast row reads 12 floats from byte 8 of a 48-byte buffer
    other = np.arange(16, dtype=np.uint8)
    staging = np.full(32, 9, np.uint8)
    with pytest.raises(ValueError):
        kernels.pack_cpu(table, [x.view(np.uint8), other], staging)
    assert staging.tolist() == [9] * 32


def test_a_frozen_table_is_split_once_and_a_writable_one_every_call():
    """The schedule's tables are read-only and run every round of every refit: their split into kernel rows and
    numpy rows is kept. A table someone can still write is split again each call, so an edit between two calls
    moves what the edited table says; a table that is read-only over a writable base is not kept either."""
    shard = np.arange(64, dtype=np.uint8)
    x = np.arange(8, dtype=np.float32)
    (cast_row,) = kernels.element_rows([(1, 0, (4,), 4)], (8,), ("float32", "bfloat16"), stage=16, staged_itemsize=2)
    frozen = np.concatenate([kernels.build_table([(0, (64,), Box((8,), (24,)))]), cast_row])
    frozen.setflags(write=False)
    staging = np.zeros(32, np.uint8)
    for _ in range(3):
        staging[:] = 0
        kernels.pack_cpu(frozen, [shard, x.view(np.uint8)], staging)
        assert staging[:16].tolist() == list(range(8, 24))
        np.testing.assert_array_equal(staging[16:].view(ml_dtypes.bfloat16).astype(np.float32), x)
    assert kernels._ROW_CACHE[id(frozen)][0]() is frozen
    writable = kernels.build_table([(0, (64,), Box((0,), (16,)))]).copy()
    kernels.pack_cpu(writable, [shard], staging)
    writable[0, kernels.OFF] = 40
    kernels.pack_cpu(writable, [shard], staging)
    assert staging[:16].tolist() == list(range(40, 56))
    assert id(writable) not in kernels._ROW_CACHE
    base = kernels.build_table([(0, (64,), Box((0,), (16,)))]).copy()
    view = base[:]
    view.setflags(write=False)
    kernels.pack_cpu(view, [shard], staging)
    base[0, kernels.OFF] = 20
    kernels.pack_cpu(view, [shard], staging)
    assert staging[:16].tolist() == list(range(20, 36))
    assert id(view) not in kernels._ROW_CACHE


def test_the_split_of_a_frozen_table_is_kept_while_it_lives_however_many_there_are():
    """A refit runs thousands of read-only tables a step (4,951 on one DeepSeek-V3 destination rank): every one's
    split is kept as long as the table lives, with no cap to overflow, and goes when the table goes."""
    shard = np.arange(64, dtype=np.uint8)
    staging = np.zeros(16, np.uint8)
    tables = []
    for i in range(6000):
        t = kernels.build_table([(0, (64,), Box((i % 48,), (i % 48 + 16,)))]).copy()
        t.setflags(write=False)
        kernels.pack_cpu(t, [shard], staging)
        tables.append(t)
    assert all(kernels._ROW_CACHE[id(t)][0]() is t for t in tables)
    hits = 0
    real = kernels._take

    def counted(*args):
        nonlocal hits
        hits += 1
        return real(*args)

    kernels._take = counted
    try:
        for t in tables:
            kernels.pack_cpu(t, [shard], staging)
    finally:
        kernels._take = real
    assert hits == 0  # every table's split came from the cache
    ids = [id(t) for t in tables]
    del t, tables
    assert not any(i in kernels._ROW_CACHE for i in ids)  # dropped with their tables


def _f32_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` float32 of random bits with the rounding edges, NaNs, infinities and subnormals among them."""
    u = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0x7F800000, 0xFF800000, 0x7FC00001, 0xFFFFFFFF, 0x7F7FFFFF, 0x00008000, 0x3F808000,
                      0x3F818000, 0x3F80FFFF, 0x00000001, 0x80000000, 0x7F80FFFF], np.uint32)  # fmt: skip
    u[: min(n, len(edges))] = edges[: min(n, len(edges))]
    return u.view(np.float32)


@st.composite
def cast_boxes(draw):
    """A float32 shard of 1-4 dimensions, a box of it, the axis order staging holds it in, and a random offset of
    the shard in its buffer (whole floats)."""
    shape = tuple(draw(st.integers(1, 6)) for _ in range(draw(st.integers(1, 4))))
    box = draw(box_in(shape))
    order = draw(st.permutations(range(len(shape))))
    return shape, box, order, draw(st.integers(0, 3)), draw(st.integers(0, 3))


def _cast_row(shape, box, order, lead, stage, chain):
    strides = [4 * int(np.prod(shape[d + 1 :])) for d in range(len(shape))]
    first = 4 * lead + sum(lo * s for lo, s in zip(box.lo, strides, strict=True))
    extents = [box.hi[a] - box.lo[a] for a in order]
    (row,) = kernels.element_rows(
        [(0, first, [strides[a] for a in order], 4)], extents, chain, stage=2 * stage, staged_itemsize=2
    )
    return row


@given(case=cast_boxes(), seed=st.integers(0, 2**16))
def test_compiled_cast_rows_move_the_bits_numpy_moves(case, seed):
    """A pack's float32 -> bfloat16 row and an unpack's bfloat16 -> float32 row, of any box, transposed or not,
    at any offset: the kernel takes them (none left to numpy) and writes the bits the numpy kernels write, and no
    byte outside the row's elements changes (guard bytes around every buffer)."""
    shape, box, order, lead, stage = case
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape)) + lead
    pack = _cast_row(shape, box, order, lead, stage, ("float32", "bfloat16"))
    unpack = _cast_row(shape, box, order, lead, stage, ("bfloat16", "float32"))
    _, shard = _guarded(4 * n, rng)
    shard[:] = _f32_bits(rng, n).view(np.uint8)
    staged = 2 * stage + int(pack[0, kernels.NBYTES])
    got_whole, got = _guarded(staged, rng)
    want_whole = got_whole.copy()
    want = want_whole[GUARD : GUARD + staged]
    compiled, rest = kernels._split(pack, [shard], got, unpack=False)
    assert compiled is not None and len(rest) == 0
    kernels.pack_cpu(pack, [shard], got)
    kernels._pack_numpy(pack, [shard], want)
    assert got_whole.tobytes() == want_whole.tobytes()
    into_whole, into = _guarded(4 * n, rng)
    ref_whole = into_whole.copy()
    ref = ref_whole[GUARD : GUARD + 4 * n]
    compiled, rest = kernels._split(unpack, [into], got, unpack=True)
    assert compiled is not None and len(rest) == 0
    kernels.unpack_cpu(unpack, got, [into])
    kernels._unpack_numpy(unpack, got, [ref])
    assert into_whole.tobytes() == ref_whole.tobytes()


def test_a_cast_row_of_the_other_direction_goes_to_numpy_and_still_casts():
    """An unpack's bfloat16 -> float32 row in a pack (the sender widening) is not the kernel's: numpy runs it."""
    x = np.arange(8, dtype=ml_dtypes.bfloat16)
    (row,) = kernels.element_rows([(0, 0, (2,), 2)], (8,), ("bfloat16", "float32"), staged_itemsize=4)
    staging = np.zeros(32, np.uint8)
    compiled, rest = kernels._split(row, [x.view(np.uint8)], staging, unpack=False)
    assert compiled is None and len(rest) == 1
    kernels.pack_cpu(row, [x.view(np.uint8)], staging)
    np.testing.assert_array_equal(staging.view(np.float32), x.astype(np.float32))


@pytest.mark.parametrize(
    ("edit", "unpack"),
    [
        ({}, False),  # as made: taken (the control)
        ({}, True),
        ({kernels.OFF: 4}, False),  # the last float one element past the buffer
        ({kernels.OFF: 2}, True),  # the last float's last two bytes past the buffer
        ({kernels.NBYTES: 26}, False),  # a staged size that is not 2 bytes an element
        ({kernels.STAGE: 10}, True),  # staging one element short
        ({kernels.CAST: kernels.chain_code(("float32", "bfloat16"))}, True),  # a pack's cast in an unpack
    ],
)
def test_a_cast_row_outside_its_buffer_or_staging_is_refused_before_any_byte_moves(edit, unpack):
    """The kernel's checks, called directly: a cast row that leaves its buffer or staging by one element or less,
    claims another staged size, or casts the other way is refused, and nothing is written."""
    from jreshard.schedule import _rows

    (row,) = kernels.element_rows([(0, 0, (4,), 4)], (12,), ("float32", "bfloat16"), staged_itemsize=2)
    row = row.copy()
    if unpack:
        row[0, kernels.CAST] = kernels.chain_code(("bfloat16", "float32"))
    for col, value in edit.items():
        row[0, col] = value
    shard = np.full(48, 7, np.uint8)
    staging = np.full(32, 9, np.uint8)
    addresses = np.array([shard.ctypes.data], np.int64)
    sizes = np.array([shard.nbytes], np.int64)
    bad = _rows.copy_rows(
        row.ctypes.data,
        1,
        addresses.ctypes.data,
        sizes.ctypes.data,
        1,
        staging.ctypes.data,
        24 + 2 * (not unpack) * 4,
        unpack,
    )
    if not edit:
        assert bad == -1 and (shard.tolist() != [7] * 48 or staging.tolist() != [9] * 32)
        return
    assert bad == 0
    assert shard.tolist() == [7] * 48 and staging.tolist() == [9] * 32


@pytest.mark.parametrize(("lead", "stage", "transposed"), [(0, 0, False), (3, 5, False), (1, 2, True)])
def test_large_cast_rows_take_the_streaming_stores_and_match(lead, stage, transposed):
    """A pack's cast rows of more than the streaming threshold (runs of 2,050 elements, cast in chunks and streamed
    to staging at odd offsets), and a transposed box (a run of strided elements), against numpy: the same bits, no
    byte past staging touched; and their unpack back."""
    rng = np.random.default_rng(lead)
    shape = (300, 2100)
    box = Box((7, 40), (300, 2090))
    order = (1, 0) if transposed else (0, 1)
    n = int(np.prod(shape)) + lead
    _, shard = _guarded(4 * n, rng)
    shard[:] = _f32_bits(rng, n).view(np.uint8)
    pack = _cast_row(shape, box, order, lead, stage, ("float32", "bfloat16"))
    staged = 2 * stage + int(pack[0, kernels.NBYTES])
    assert staged - 2 * stage >= 1 << 20
    got_whole, got = _guarded(staged, rng)
    want_whole = got_whole.copy()
    kernels.pack_cpu(pack, [shard], got)
    kernels._pack_numpy(pack, [shard], want_whole[GUARD : GUARD + staged])
    assert got_whole.tobytes() == want_whole.tobytes()
    unpack = _cast_row(shape, box, order, lead, stage, ("bfloat16", "float32"))
    into_whole, into = _guarded(4 * n, rng)
    ref_whole = into_whole.copy()
    kernels.unpack_cpu(unpack, got, [into])
    kernels._unpack_numpy(unpack, got, [ref_whole[GUARD : GUARD + 4 * n]])
    assert into_whole.tobytes() == ref_whole.tobytes()
