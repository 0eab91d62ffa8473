"""The GPU cast kernel on CPU: its conversions bit for bit, and its launch's index math.

``casts.CAST_SOURCE`` is compiled as plain C++ (``blockIdx``/``threadIdx`` looped over on
the host) and its conversions compared with :func:`jreshard.views.casts.cast` (itself checked
against ``jnp.astype``) for every ordered pair of ``CAST_DTYPES`` and some longer chains: every
bit pattern of the 8- and 16-bit dtypes, and for float32 random bit patterns, the special values,
and every rounding tie of each narrower dtype with its float32 neighbours. The cast launch is then
run two ways, by its numpy re-expression (``element_addresses``) and by the compiled kernel, on
random strided (and transposed) boxes with cast rows, against ``kernels.pack_cpu``/``unpack_cpu``/
``copy_cpu``.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import shutil
import subprocess

import numpy as np
import pytest

from jreshard.cuda import casts as CC
from jreshard.cuda import kernels as CK
from jreshard.schedule import kernels as K
from jreshard.sharding.dtypes import numpy_dtype
from jreshard.views.casts import CAST_DTYPES, cast_chain

SHIM = r"""
#include <cstdint>
struct jr_dim3 { unsigned int x; };
static jr_dim3 blockIdx, threadIdx;
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
#define __syncthreads() ((void)0)
#define __launch_bounds__(...)
"""
DRIVER = r"""
extern "C" void cast_bits(const unsigned int* in, unsigned int* out, long long n, long long chain) {
  for (long long i = 0; i < n; ++i) out[i] = jr_cast_chain(chain, in[i]);
}
extern "C" void run(const long long* table, int nrows, unsigned int blocks) {
  for (unsigned int b = 0; b < blocks; ++b)
    for (unsigned int t = 0; t < JR_THREADS; ++t) { blockIdx.x = b; threadIdx.x = t; jreshard_cast(table, nrows); }
}
"""


@pytest.fixture(scope="module")
def host_casts(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler: the CUDA cast source is checked on CPU only where one exists")
    d = tmp_path_factory.mktemp("casts")
    (d / "c.cpp").write_text(SHIM + CC.CAST_SOURCE + DRIVER)
    flags = ["-O2", "-std=c++14", "-Wall", "-Werror", "-Wno-unused-function", "-shared", "-fPIC"]
    subprocess.run([cxx, *flags, "-o", str(d / "c.so"), str(d / "c.cpp")], check=True)
    lib = ctypes.CDLL(str(d / "c.so"))
    lib.cast_bits.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong)
    lib.run.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint)
    return lib


def _uint(dtype: str) -> np.dtype:
    return np.dtype(f"uint{8 * numpy_dtype(dtype).itemsize}")


def _f32_specials() -> np.ndarray:
    nan_payloads = [0x7F800001, 0x7FC00000, 0x7FA00000, 0x7F802000, 0x7F801FFF, 0x7FFFFFFF, 0x7FC00001, 0x7F9FE000]
    base = [0, 0x7F800000, 0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x3F800000, *nan_payloads]
    floats = [448.0, 464.0, 480.0, 57344.0, 61440.0, 65504.0, 65520.0, 127.0, 127.5, 128.0, -128.0, 128.5, 0.5, 1.5]
    floats += [2.0**-126, 2.0**-133, 2.0**-134, 2.0**-24, 2.0**-25, 2.0**-9, 2.0**-10, 2.0**-16, 2.0**-17, 1e30]
    more = np.array(floats, np.float32).view(np.uint32)
    out = np.concatenate([np.array(base, np.uint32), more])
    near = np.concatenate([out, out + 1, out - 1])
    return np.concatenate([near, near | np.uint32(0x80000000)])


def _ties() -> np.ndarray:
    """float32 bits of every midpoint between adjacent finite values of each narrower float dtype, and
    their float32 neighbours: the round-to-nearest-even cases (all exact in float32)."""
    out = []
    for d in ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"):
        with np.errstate(invalid="ignore"):
            v = np.arange(2 ** (8 * numpy_dtype(d).itemsize), dtype=_uint(d)).view(numpy_dtype(d)).astype(np.float64)
        v = np.unique(v[np.isfinite(v)])
        mids = ((v[1:] + v[:-1]) / 2).astype(np.float32)
        assert np.all(mids.astype(np.float64) == (v[1:] + v[:-1]) / 2)
        m = mids.view(np.uint32)
        out += [m, m + 1, m - 1]
    # the largest values: halfway to the next power of the exponent (overflow or not)
    top = np.array([448.0 + 16, 57344.0 + 4096, 65504.0 + 16, 3.3895314e38], np.float32).view(np.uint32)
    out.append(np.concatenate([top, top - 1, top + 1]))
    return np.unique(np.concatenate(out))


@functools.cache
def patterns(dtype: str) -> np.ndarray:
    """Bit patterns of ``dtype`` as uint32: all of them below 32 bits; for float32 random ones, the
    special values and the ties."""
    if numpy_dtype(dtype).itemsize < 4:
        return np.arange(2 ** (8 * numpy_dtype(dtype).itemsize), dtype=np.uint32)
    rng = np.random.default_rng(0)
    rand = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([rand, _f32_specials(), _ties()])


def run_chain(lib, bits: np.ndarray, chain: tuple[str, ...]) -> np.ndarray:
    bits = np.ascontiguousarray(bits, np.uint32)
    out = np.zeros_like(bits)
    lib.cast_bits(bits.ctypes.data, out.ctypes.data, len(bits), K.chain_code(chain))
    return out


def oracle(bits: np.ndarray, chain: tuple[str, ...]) -> np.ndarray:
    x = bits.astype(_uint(chain[0])).view(numpy_dtype(chain[0]))
    y = cast_chain(x, chain[1:])
    return np.ascontiguousarray(y).view(_uint(chain[-1])).astype(np.uint32)


def _compare(lib, chain: tuple[str, ...]) -> int:
    bits = patterns(chain[0])
    got, want = run_chain(lib, bits, chain), oracle(bits, chain)
    bad = np.nonzero(got != want)[0]
    if len(bad):
        shown = [(hex(int(bits[i])), hex(int(got[i])), hex(int(want[i]))) for i in bad[:8]]
        pytest.fail(f"{' -> '.join(chain)}: {len(bad)} of {len(bits)} differ (input, kernel, oracle): {shown}")
    return len(bits)


@pytest.mark.parametrize("src,dst", list(itertools.product(CAST_DTYPES, CAST_DTYPES)))
def test_every_ordered_pair_bit_for_bit(host_casts, src, dst):
    n = _compare(host_casts, (src, dst))
    assert n >= (200_000 if src == "float32" else 256)


CHAINS = [
    ("float32", "bfloat16", "float16"),
    ("float32", "float16", "float8_e4m3fn"),
    ("float16", "float32", "int8"),
    ("float8_e5m2", "bfloat16", "float8_e4m3fn"),
    ("bfloat16", "float8_e4m3fn", "float32"),
    ("int8", "float8_e4m3fn", "float16"),
    ("float32", "float8_e5m2", "float8_e4m3fn"),
    ("bfloat16", "float16", "bfloat16"),
    ("float16", "int8", "float8_e5m2", "float32"),
]


@pytest.mark.parametrize("chain", CHAINS, ids="->".join)
def test_chains_bit_for_bit(host_casts, chain):
    _compare(host_casts, chain)


def test_the_specials_are_what_xla_gives(host_casts):
    """A few hand-checked values, so the comparison is not only kernel-against-oracle."""
    f32 = np.array([np.nan, np.inf, -np.inf, 500.0, -1000.0, 464.0, 465.0, -0.0], np.float32).view(np.uint32)
    assert run_chain(host_casts, f32, ("float32", "float8_e4m3fn")).tolist() == [
        0x7F,
        0x7F,
        0xFF,
        0x7F,
        0xFF,
        0x7E,
        0x7F,
        0x80,
    ]
    assert run_chain(host_casts, f32, ("float32", "int8")).tolist() == [0, 127, 128, 127, 128, 127, 127, 0]
    assert run_chain(host_casts, np.array([0x7F812345], np.uint32), ("float32", "float16")).tolist() == [0x7E09]


# ---- the launch: addresses and strides of cast rows --------------------------------------------


class Arena:
    """One block holding every buffer, so the kernel's addresses map back to bytes."""

    def __init__(self, nbytes: int = 1 << 18):
        raw = np.zeros(nbytes + 256, np.uint8)
        skip = (-raw.ctypes.data) % 256
        self.mem = raw[skip : skip + nbytes]
        self.base = self.mem.ctypes.data
        self.pos = 0

    def take(self, nbytes: int) -> tuple[int, np.ndarray]:
        self.pos = -(-self.pos // 256) * 256
        buf = self.mem[self.pos : self.pos + nbytes]
        self.pos += nbytes
        return self.base + self.pos - nbytes, buf


def replay(arena: Arena, launch: np.ndarray) -> None:
    """The numpy re-expression: every element the kernel casts, read at its address, cast by the oracle."""
    s, d, r = CC.element_addresses(launch)
    assert len(np.unique(d)) == len(d)  # one writer per element
    for code in np.unique(launch[:, CC.CHAIN]):
        chain = K.chain_of(code)
        sel = launch[r, CC.CHAIN] == code
        a, b = numpy_dtype(chain[0]).itemsize, numpy_dtype(chain[-1]).itemsize
        raw = arena.mem[(s[sel] - arena.base)[:, None] + np.arange(a)]
        out = cast_chain(np.ascontiguousarray(raw).view(numpy_dtype(chain[0])).reshape(-1), chain[1:])
        dst = (d[sel] - arena.base)[:, None] + np.arange(b)
        arena.mem[dst] = np.ascontiguousarray(out).view(np.uint8).reshape(-1, b)


def _random_bits(rng, nbytes: int) -> np.ndarray:
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8)


def random_rows(rng, arena: Arena, unpack: bool):
    """Shards of random dtypes and shapes, and a table of rows over random boxes of them, some cast
    (chains of 2 or 3 dtypes), some transposed, some byte rows; staged back to back."""
    shards, ptrs, bufs = [], [], []
    for _ in range(int(rng.integers(1, 4))):
        dtype = str(rng.choice(CAST_DTYPES))
        shape = tuple(int(v) for v in rng.integers(1, 7, size=int(rng.integers(1, 4))))
        ptr, buf = arena.take(int(np.prod(shape)) * numpy_dtype(dtype).itemsize)
        buf[:] = _random_bits(rng, buf.size)
        shards.append((dtype, shape))
        ptrs.append(ptr)
        bufs.append(buf)
    rows, pos, taken = [], 0, set()
    for _ in range(int(rng.integers(1, 6))):
        b = int(rng.integers(0, len(shards)))
        dtype, shape = shards[b]
        item = numpy_dtype(dtype).itemsize
        lo = [int(rng.integers(0, n)) for n in shape]
        hi = [int(rng.integers(x + 1, n + 1)) for x, n in zip(lo, shape, strict=True)]
        cells = set(itertools.product(*(range(x, y) for x, y in zip(lo, hi, strict=True))))
        if unpack and any((b, c) in taken for c in cells):
            continue  # an unpack writes each element once
        taken |= {(b, c) for c in cells}
        st = [item * int(np.prod(shape[d + 1 :])) for d in range(len(shape))]
        order = rng.permutation(len(shape)) if rng.random() < 0.4 else np.arange(len(shape))
        ext = tuple(hi[a] - lo[a] for a in order)
        off = sum(x * s for x, s in zip(lo, st, strict=True))
        other = tuple(str(d) for d in rng.choice(CAST_DTYPES, size=int(rng.integers(1, 3))))
        if rng.random() < 0.25:
            chain: tuple[str, ...] = ()  # a byte row among the cast rows
            staged = item
        else:
            chain = (*other, dtype) if unpack else (dtype, *other)
            staged = numpy_dtype(chain[0] if unpack else chain[-1]).itemsize
        (row,) = K.element_rows(
            [(b, off, tuple(st[a] for a in order), item)], ext, chain, stage=pos, staged_itemsize=staged
        )
        rows.append(row)
        pos += int(np.prod(ext)) * staged
    table = np.concatenate(rows) if rows else np.zeros((0, K.COLUMNS), np.int64)
    return table, ptrs, bufs


def run_split(arena, lib, kind, table, ptrs, sptr):
    """As ``CupyBuffers`` does: the byte rows through the byte kernel, the cast rows through the cast kernel."""
    byte, cast_rows = CC.split(table)
    if kind == "pack":
        lt_b, lt_c = CK.pack_launch(byte, ptrs, sptr), CC.pack_launch(cast_rows, ptrs, sptr)
    else:
        lt_b, lt_c = CK.unpack_launch(byte, sptr, ptrs), CC.unpack_launch(cast_rows, sptr, ptrs)
    s, d, w = CK.unit_addresses(lt_b)
    for a, z, n in zip(s, d, w, strict=True):
        arena.mem[z - arena.base : z - arena.base + n] = arena.mem[a - arena.base : a - arena.base + n]
    if lib is None:
        replay(arena, lt_c)
    else:
        lt = np.ascontiguousarray(lt_c)
        lib.run(lt.ctypes.data, len(lt), CC.grid_size(lt))


@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "compiled"])
@pytest.mark.parametrize("seed", range(30))
def test_pack_and_unpack_with_cast_rows_match_numpy(host_casts, seed, compiled):
    lib = host_casts if compiled else None
    for unpack in (False, True):
        rng = np.random.default_rng(1000 * unpack + seed)
        arena = Arena()
        table, ptrs, bufs = random_rows(rng, arena, unpack)
        if not len(table) or not table[:, K.CAST].any():
            continue
        nbytes = int(table[-1, K.STAGE]) + int(table[-1, K.NBYTES])
        sptr, staging = arena.take(nbytes)
        if not unpack:
            want = np.zeros_like(staging)
            K.pack_cpu(table, bufs, want)
            run_split(arena, lib, "pack", table, ptrs, sptr)
            np.testing.assert_array_equal(staging, want)
        else:
            staging[:] = _random_bits(rng, staging.size)
            want = [b.copy() for b in bufs]
            K.unpack_cpu(table, staging, want)
            run_split(arena, lib, "unpack", table, ptrs, sptr)
            for got, exp in zip(bufs, want, strict=True):
                np.testing.assert_array_equal(got, exp)


@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "compiled"])
@pytest.mark.parametrize("seed", range(12))
def test_copy_with_casts_matches_numpy(host_casts, seed, compiled):
    rng = np.random.default_rng(500 + seed)
    arena = Arena()
    a_dtype, b_dtype = (str(d) for d in rng.choice(CAST_DTYPES, size=2, replace=False))
    sa, sb = (6, 5, 4), (4, 7, 6)
    pa, a = arena.take(int(np.prod(sa)) * numpy_dtype(a_dtype).itemsize)
    pb, b = arena.take(int(np.prod(sb)) * numpy_dtype(b_dtype).itemsize)
    a[:] = _random_bits(rng, a.size)
    b[:] = _random_bits(rng, b.size)
    ia, ib = numpy_dtype(a_dtype).itemsize, numpy_dtype(b_dtype).itemsize
    ext = tuple(int(rng.integers(1, 5)) for _ in range(3))
    order = rng.permutation(3)  # read ``a`` transposed
    lo_a = [int(rng.integers(0, n - ext[list(order).index(d)] + 1)) for d, n in enumerate(sa)]
    lo_b = [int(rng.integers(0, n - e + 1)) for n, e in zip(sb, ext, strict=True)]
    st_a = [ia * int(np.prod(sa[d + 1 :])) for d in range(3)]
    st_b = [ib * int(np.prod(sb[d + 1 :])) for d in range(3)]
    src, dst = K.element_rows(
        [
            (0, sum(x * s for x, s in zip(lo_a, st_a, strict=True)), tuple(st_a[d] for d in order), ia),
            (0, sum(x * s for x, s in zip(lo_b, st_b, strict=True)), tuple(st_b), ib),
        ],
        ext,
        (a_dtype, b_dtype),
    )
    want = b.copy()
    K.copy_cpu(src, [a], dst, [want])
    lt = np.ascontiguousarray(CC.copy_launch(src, [pa], dst, [pb]))
    if compiled:
        host_casts.run(lt.ctypes.data, len(lt), CC.grid_size(lt))
    else:
        replay(arena, lt)
    np.testing.assert_array_equal(b, want)


def test_many_tiles_in_one_row(host_casts):
    """A row of several tiles (and a partial last one) and a second row: blocks find their row."""
    arena = Arena(1 << 20)
    rng = np.random.default_rng(3)
    n = 3 * CK.TILE_UNITS + 17
    pa, a = arena.take(4 * n)
    a[:] = _random_bits(rng, a.size)
    rows = [
        K.element_rows([(0, 0, (4,), 4)], (n,), ("float32", "bfloat16"), stage=0, staged_itemsize=2)[0],
        K.element_rows([(0, 4, (8,), 4)], (100,), ("float32", "int8"), stage=2 * n, staged_itemsize=1)[0],
    ]
    table = np.concatenate(rows)
    lt = CC.pack_launch(table, [pa], 0)
    assert CC.grid_size(lt) == 4 + 1 and lt[1, CK.TILE] == 4
    sptr, staging = arena.take(2 * n + 100)
    want = np.zeros_like(staging)
    K.pack_cpu(table, [a], want)
    lt = np.ascontiguousarray(CC.pack_launch(table, [pa], sptr))
    host_casts.run(lt.ctypes.data, len(lt), CC.grid_size(lt))
    np.testing.assert_array_equal(staging, want)
    staging[:] = 0
    replay(arena, lt)
    np.testing.assert_array_equal(staging, want)


def test_a_byte_row_is_refused_by_the_cast_launch():
    (row,) = K.element_rows([(0, 0, (4,), 4)], (3,))
    with pytest.raises(ValueError, match="split the table"):
        CC.pack_launch(row, [0], 0)
