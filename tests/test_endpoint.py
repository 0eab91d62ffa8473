"""The receiving endpoint without jax: its declaration and buffers checked before anything moves, its
module importable with jax blocked, and a refit from a JAX trainer into numpy buffers of a process
that never imports jax (two programs under one MPMD mpiexec)."""

from __future__ import annotations

import subprocess
import sys
import types

import ml_dtypes
import numpy as np
import pytest

from jreshard.errors import LayoutError
from jreshard.options import Options
from jreshard.refit.endpoint import Declaration, Endpoint, RawMemory, Tensor, byte_view
from jreshard.sharding.box import Box

W = Tensor(name="['w']", shape=(8, 6), dtype="float32", boxes=((0, Box((0, 0), (8, 3))), (1, Box((0, 3), (8, 6)))))


def test_the_endpoint_module_imports_and_declares_without_jax():
    code = (
        "import sys; sys.modules['jax'] = None\n"
        "from jreshard.refit.endpoint import Declaration, Endpoint, Tensor\n"
        "from jreshard.sharding.box import Box\n"
        "t = Tensor(name='w', shape=(4,), dtype='bfloat16', boxes=((0, Box((0,), (4,))),))\n"
        "print(Declaration(tensors=(t,), slots=1).message()['params'], t.nbytes(0))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('jax.', 'jaxlib'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.splitlines() == ["[['w', [4], 'bfloat16', [[0, [0], [4]]]]] 8", "[]"]


def test_a_declaration_is_checked_when_made():
    assert Declaration(tensors=(W,), slots=2).message()["ndev"] == 2
    assert W.nbytes(0) == 8 * 3 * 4
    with pytest.raises(LayoutError, match="slots \\[1\\]"):
        Declaration(tensors=(W,), slots=1)
    with pytest.raises(LayoutError, match="names repeat"):
        Declaration(tensors=(W, W), slots=2)
    with pytest.raises(LayoutError, match="not inside shape"):
        Tensor(name="w", shape=(4,), dtype="float32", boxes=((0, Box((0,), (5,))),))
    with pytest.raises(LayoutError, match="two boxes"):
        Tensor(name="w", shape=(4,), dtype="float32", boxes=((0, Box((0,), (2,))), (0, Box((2,), (4,)))))
    with pytest.raises(TypeError):
        Tensor(name="w", shape=(4,), dtype="no-such-dtype", boxes=())
    for packed in ("int4", "uint2", "float4_e2m1fn"):  # held several values a byte: a refit moves whole bytes
        with pytest.raises(LayoutError, match=f"Tensor w: dtype {packed} is held .* declare it uint8"):
            Tensor(name="w", shape=(4,), dtype=packed, boxes=((0, Box((0,), (4,))),))


def test_buffers_are_viewed_in_place_and_refused_by_name():
    a = np.zeros((8, 3), np.float32)
    v = byte_view(a, a.nbytes, "w")
    v[:4] = 255
    assert a.view(np.uint8).ravel()[:4].tolist() == [255] * 4  # the same memory
    raw = bytearray(6)
    byte_view(raw, 6, "raw")[:] = 7
    assert raw == bytearray([7] * 6)
    bf = np.zeros(3, ml_dtypes.bfloat16)
    region = byte_view(RawMemory(bf.ctypes.data, bf.nbytes), 6, "region")
    region[:] = 1
    assert bf.view(np.uint16).tolist() == [0x0101] * 3
    with pytest.raises(LayoutError, match="w holds 96 bytes, but its box takes 100"):
        byte_view(a, 100, "w")
    ro = np.zeros(4, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(LayoutError, match="read-only"):
        byte_view(ro, 4, "ro")
    with pytest.raises(LayoutError, match="C-contiguous"):
        byte_view(np.zeros((4, 4), np.float32)[:, :2], 32, "cut")
    with pytest.raises(LayoutError, match="read-only"):
        byte_view(b"abcd", 4, "bytes")
    with pytest.raises(LayoutError, match="expected a numpy array"):
        byte_view(object(), 4, "obj")


def test_a_pull_whose_wait_bounds_nothing_is_refused_before_it_votes():
    """Endpoint.pull checks ``timeout_s`` first (an endpoint made without connecting: only its options are read)."""
    ep = Endpoint.__new__(Endpoint)
    ep._group = types.SimpleNamespace(options=Options())  # type: ignore[attr-defined]
    for bad in (float("inf"), float("nan"), -0.5, "1"):
        with pytest.raises(ValueError, match=r"Endpoint\.pull: timeout_s=.* must be None or a finite number"):
            ep.pull({}, timeout_s=bad)


def test_a_jax_trainer_refits_numpy_buffers_of_a_receiver_without_jax(tmp_path):
    from mpi_launch import launch, need_mpi, program, results

    need_mpi()
    launch(
        [program(1, "endpoint_body.py", "source"), program(1, "endpoint_body.py", "destination")],
        tmp_path,
        devices=2,
        timeout_s=120,
    )
    src, dst = results(tmp_path, "endpoint-source"), results(tmp_path, "endpoint-destination")
    assert len(src) == 1 and len(dst) == 1, (src, dst)
    (s,), (d,) = src.values(), dst.values()
    assert "error" not in s and "error" not in d, (s, d)
    assert "missing [(\"['b']\", 1)]" in d["refused"] and "refit not started" in s["refused"]
    assert d["exact"] == [True, True] and d["version"] == s["version"] == 2
    assert d["jax_blocked"] and d["loaded"] == []
