"""The GPU pack/unpack kernel's index math, on CPU.

``cuda_kernels`` turns a descriptor table into a launch table (absolute
addresses, vector widths, tiles). Here the kernel's work is replayed two ways
on CPU and compared with ``kernels.pack_cpu``/``unpack_cpu``/``copy_cpu`` on
random boxes: by :func:`unit_addresses` (the kernel re-expressed in numpy), and,
where a C++ compiler exists, by the CUDA source itself compiled as C++ with
``blockIdx``/``threadIdx`` looped over on the host.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from strategies import byte_shape

from jreshard.cuda import kernels as CK
from jreshard.schedule import kernels as K
from jreshard.sharding.box import Box, intersect

ARENA = 1 << 20


class Arena:
    """One 256-byte-aligned block holding every buffer, so addresses map back to bytes."""

    def __init__(self, rng: np.random.Generator):
        raw = np.zeros(ARENA + 256, np.uint8)
        skip = (-raw.ctypes.data) % 256
        self.mem = raw[skip : skip + ARENA]
        self.base = self.mem.ctypes.data
        self.pos = 0
        self.rng = rng

    def take(self, nbytes: int, misalign: int = 0) -> tuple[int, np.ndarray]:
        self.pos = -(-self.pos // 256) * 256 + misalign
        buf = self.mem[self.pos : self.pos + nbytes]
        self.pos += nbytes
        return self.base + (self.pos - nbytes), buf


def random_case(rng, n_pieces, misalign=False):
    arena = Arena(rng)
    itemsize = int(rng.choice([1, 2, 4, 8]))
    ndim = int(rng.integers(1, 5))
    shapes, ptrs, bufs, pieces, taken = [], [], [], [], []
    for _ in range(int(rng.integers(1, 4))):
        shape = tuple(int(v) for v in rng.integers(1, 9, size=ndim))
        outer = byte_shape(shape, itemsize)
        ptr, buf = arena.take(int(np.prod(outer)), int(rng.integers(0, 16)) if misalign else 0)
        buf[:] = rng.integers(0, 256, size=buf.size, dtype=np.uint8)
        shapes.append(shape)
        ptrs.append(ptr)
        bufs.append(buf)
    for _ in range(n_pieces):
        b = int(rng.integers(0, len(shapes)))
        lo = [int(rng.integers(0, n)) for n in shapes[b]]
        hi = [int(rng.integers(l + 1, n + 1)) for l, n in zip(lo, shapes[b], strict=True)]
        box = Box(tuple(lo), tuple(hi))
        if any(pb == b and intersect(box, other) is not None for pb, other in taken):
            continue  # pieces of one message never overlap (so unpack has one writer per byte)
        taken.append((b, box))
        pieces.append((b, byte_shape(shapes[b], itemsize), K.byte_box(box, itemsize)))
    table = K.build_table(pieces)
    sptr, staging = arena.take(K.table_bytes(table), int(rng.integers(0, 16)) if misalign else 0)
    return arena, table, ptrs, bufs, sptr, staging


def replay(arena: Arena, launch: np.ndarray) -> None:
    """Copy every unit the kernel would copy (numpy re-expression), checking no byte is written twice."""
    s, d, w = CK.unit_addresses(launch)
    assert np.all(s % w == 0) and np.all(d % w == 0)  # vector loads and stores are aligned
    idx = np.repeat(np.arange(len(w)), w)
    within = np.arange(int(w.sum())) - np.repeat(np.cumsum(w) - w, w)
    src = s[idx] - arena.base + within
    dst = d[idx] - arena.base + within
    assert len(np.unique(dst)) == len(dst)
    arena.mem[dst] = arena.mem[src]


@pytest.mark.parametrize("misalign", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_pack_and_unpack_launches_match_numpy(seed, misalign):
    rng = np.random.default_rng(seed)
    arena, table, ptrs, bufs, sptr, staging = random_case(rng, int(rng.integers(1, 6)), misalign)
    check_pack_unpack(rng, table, ptrs, bufs, sptr, staging, lambda launch: replay(arena, launch))


def check_pack_unpack(rng, table, ptrs, bufs, sptr, staging, run) -> None:
    """``run`` the pack launch and compare with numpy's pack; then unpack fresh bytes into
    the shards and compare with numpy's unpack into copies."""
    expected = np.zeros_like(staging)
    K.pack_cpu(table, bufs, expected)
    run(CK.pack_launch(table, ptrs, sptr))
    np.testing.assert_array_equal(staging, expected)
    staging[:] = rng.integers(0, 256, size=staging.size, dtype=np.uint8)
    want = [b.copy() for b in bufs]
    K.unpack_cpu(table, staging, want)
    run(CK.unpack_launch(table, sptr, ptrs))
    for got, exp in zip(bufs, want, strict=True):
        np.testing.assert_array_equal(got, exp)


@pytest.mark.parametrize("seed", range(20))
def test_copy_launch_matches_numpy(seed):
    rng = np.random.default_rng(100 + seed)
    arena = Arena(rng)
    itemsize = int(rng.choice([2, 4]))
    shape_a, shape_b = (8, 6, 4), (4, 12, 8)
    pa, a = arena.take(int(np.prod(byte_shape(shape_a, itemsize))))
    pb, b = arena.take(int(np.prod(byte_shape(shape_b, itemsize))))
    a[:] = rng.integers(0, 256, size=a.size, dtype=np.uint8)
    ext = [int(rng.integers(1, 5)) for _ in range(3)]
    lo_a = [int(rng.integers(0, n - e + 1)) for n, e in zip(shape_a, ext, strict=True)]
    lo_b = [int(rng.integers(0, n - e + 1)) for n, e in zip(shape_b, ext, strict=True)]
    box_a = Box(tuple(lo_a), tuple(x + e for x, e in zip(lo_a, ext, strict=True)))
    box_b = Box(tuple(lo_b), tuple(x + e for x, e in zip(lo_b, ext, strict=True)))
    st, dt = K.build_copy_tables(
        [
            (
                0,
                byte_shape(shape_a, itemsize),
                K.byte_box(box_a, itemsize),
                0,
                byte_shape(shape_b, itemsize),
                K.byte_box(box_b, itemsize),
            )
        ]
    )
    want = b.copy()
    K.copy_cpu(st, [a], dt, [want])
    replay(arena, CK.copy_launch(st, [pa], dt, [pb]))
    np.testing.assert_array_equal(b, want)


def test_vector_width_and_tiles():
    # A (64, 4096)-byte shard; rows 1..3, bytes 1024..3072: 16-byte units, 128 per run.
    t = K.build_table([(0, (64, 4096), Box((1, 1024), (3, 3072))), (0, (64, 4096), Box((5, 3), (6, 8)))])
    lt = CK.pack_launch(t, [1 << 20], 1 << 24)
    assert lt[0, CK.WIDTH] == 16 and lt[0, CK.UNITS] == 256 and lt[0, CK.LUNITS] == 128
    assert lt[1, CK.WIDTH] == 1 and lt[1, CK.UNITS] == 5  # odd offset: byte units
    assert lt[0, CK.TILE] == 0 and lt[1, CK.TILE] == 1 and CK.grid_size(lt) == 2
    big = K.build_table([(0, (1 << 20,), Box((0,), (1 << 20,)))])
    assert CK.grid_size(CK.pack_launch(big, [0], 0)) == (1 << 20) // 16 // CK.TILE_UNITS
    assert CK.pack_launch(K.build_table([]), [], 0).shape == (0, CK.LAUNCH_COLUMNS)
    assert CK.grid_size(CK.pack_launch(K.build_table([]), [], 0)) == 0


def test_a_launch_over_the_cuda_grid_asks_for_smaller_chunks():
    t = np.zeros((1, K.COLUMNS), np.int64)
    n = CK.MAX_BLOCKS * CK.TILE_UNITS + 1  # one unit more than the grid can hold, at 1 byte per unit
    t[0, K.NBYTES], t[0, K.NDIM], t[0, K.SHAPE0] = n, 1, n
    with pytest.raises(ValueError, match="chunk_bytes"):
        CK.pack_launch(t, [1], 0)


# ---- the CUDA source itself, compiled as C++ on the host -------------------

SHIM = r"""
#include <cstdint>
struct jr_dim3 { unsigned int x; };
static jr_dim3 blockIdx, threadIdx;
struct uint4 { unsigned int x, y, z, w; };
struct uint2 { unsigned int x, y; };
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
#define __syncthreads() ((void)0)
#define __launch_bounds__(threads, blocks)
"""
DRIVER = r"""
extern "C" void run(const long long* table, int nrows, unsigned int blocks) {
  for (unsigned int b = 0; b < blocks; ++b)
    for (unsigned int t = 0; t < JR_THREADS; ++t) { blockIdx.x = b; threadIdx.x = t; jreshard_copy(table, nrows); }
}
extern "C" void run_block(const long long* table, int nrows, unsigned int b) {
  for (unsigned int t = 0; t < JR_THREADS; ++t) { blockIdx.x = b; threadIdx.x = t; jreshard_copy(table, nrows); }
}
"""


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler: the CUDA source is checked on CPU only where one exists")
    d = tmp_path_factory.mktemp("kernel")
    (d / "k.cpp").write_text(SHIM + CK.CUDA_SOURCE + DRIVER)
    subprocess.run([cxx, "-O1", "-w", "-shared", "-fPIC", "-o", str(d / "k.so"), str(d / "k.cpp")], check=True)
    lib = ctypes.CDLL(str(d / "k.so"))
    lib.run.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint)
    lib.run_block.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint)
    return lib


def run_host(lib, launch):
    lt = np.ascontiguousarray(launch)
    lib.run(lt.ctypes.data, len(lt), CK.grid_size(lt))


@pytest.mark.parametrize("seed", range(12))
def test_cuda_source_compiled_for_the_host_matches_numpy(host_kernel, seed):
    rng = np.random.default_rng(200 + seed)
    _, table, ptrs, bufs, sptr, staging = random_case(rng, int(rng.integers(1, 6)), misalign=bool(seed % 2))
    check_pack_unpack(rng, table, ptrs, bufs, sptr, staging, lambda launch: run_host(host_kernel, launch))


def test_many_tiles_and_widths_through_both_replays(host_kernel):
    rng = np.random.default_rng(7)
    arena = Arena(rng)
    p0, b0 = arena.take(64 * 4096)
    b0[:] = rng.integers(0, 256, size=b0.size, dtype=np.uint8)
    pieces = [
        (0, (64, 4096), Box((1, 16), (40, 4000))),  # 16-byte units, several tiles
        (0, (64, 4096), Box((40, 2), (41, 4094))),  # 2-byte units
        (0, (64, 4096), Box((41, 0), (60, 4096))),  # contiguous: one run
        (0, (16, 16, 1024), Box((3, 2, 8), (9, 15, 1000))),  # 3 strided dims over the same bytes
    ]
    table = K.build_table(pieces)
    sptr, staging = arena.take(K.table_bytes(table))
    launch = CK.pack_launch(table, [p0], sptr)
    assert {2, 16} < set(launch[:, CK.WIDTH].tolist()) and CK.grid_size(launch) > 10
    expected = np.zeros_like(staging)
    K.pack_cpu(table, [b0], expected)
    replay(arena, launch)
    np.testing.assert_array_equal(staging, expected)
    staging[:] = 0
    run_host(host_kernel, launch)
    np.testing.assert_array_equal(staging, expected)


@pytest.mark.parametrize("ndim", [1, 2])
def test_units_past_two_to_the_32_in_one_piece(host_kernel, ndim):
    """A piece of more than 2**32 one-byte units: the last tile's units lie past 2**32, where
    32-bit counters would wrap. Only that tile runs, with the piece's base addresses placed
    so its 1024 units land in two small real buffers."""
    rng = np.random.default_rng(11)
    arena = Arena(rng)
    pa, a = arena.take(CK.TILE_UNITS + 64, misalign=1)  # odd addresses: 1-byte units
    pb, b = arena.take(CK.TILE_UNITS + 64)
    a[:] = rng.integers(0, 256, size=a.size, dtype=np.uint8)
    if ndim == 1:
        n = (1 << 32) + 1000
        t = K.build_table([(0, (n,), Box((0,), (n,)))])
        last = n - ((n - 1) // CK.TILE_UNITS) * CK.TILE_UNITS  # units in the last tile
        src = pa - (n - last)  # unit u reads src + u: the last tile reads a[0:last]
    else:
        rows, run, pitch = (1 << 12) + 1, 1 << 20, (1 << 20) + 17
        t = K.build_table([(0, (rows, pitch), Box((0, 1), (rows, run + 1)))])
        last = CK.TILE_UNITS  # rows * run is a whole number of tiles
        # unit u = r * run + p reads src + 1 + r * pitch + p; the last tile is r = rows - 1, p >= run - last
        src = pa - 1 - (rows - 1) * pitch - (run - last)
        n = rows * run
    assert n > 1 << 32
    launch = CK.pack_launch(t, [src], pb - (n - last))  # staging: unit u writes staging + u
    assert launch[0, CK.UNITS] == n and launch[0, CK.WIDTH] == 1 and launch[0, CK.NDIM] == ndim
    host_kernel.run_block(np.ascontiguousarray(launch).ctypes.data, 1, CK.grid_size(launch) - 1)
    np.testing.assert_array_equal(b[:last], a[:last])
    assert not b[last:].any()  # nothing past the piece's end
