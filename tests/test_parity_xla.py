"""The parity suite's sharding pairs and dtypes with ``Options(backend="xla")``: the plan compiled into one
XLA computation gives what ``jax.device_put`` gives, as the direct copies do (tests/test_parity.py).

Leaves in or to host memory kinds move through device memory (``jax.device_put`` places them, or a
jitted ``device_put`` into the ``into`` array), whatever the backend.
"""

from __future__ import annotations

import jax
import pytest
from parity_cases import DTYPE_PAIRS, DTYPES, PAIRS, sharding
from test_parity import assert_parity, fresh, pointers, source

import jreshard

XLA = jreshard.Options(backend="xla")


def _host_memory(*names: str) -> bool:
    return any(sharding(n).memory_kind not in (None, "device") for n in names)


@pytest.mark.parametrize("src,dst,origin", PAIRS, ids=[f"{s}->{d}" for s, d, _ in PAIRS])
def test_transfer_pair(src: str, dst: str, origin: str) -> None:
    x = source(src)
    out, rep = jreshard.transfer(x, sharding(dst), options=XLA, report=True)
    if not _host_memory(src, dst):  # (host memory is jax.device_put's, whatever the backend)
        assert rep.backend is jreshard.Backend.XLA or out is x
    assert_parity(out, jax.device_put(x, sharding(dst)), x, target=sharding(dst))


@pytest.mark.parametrize("src,dst,origin", PAIRS, ids=[f"{s}->{d}" for s, d, _ in PAIRS])
def test_transfer_into_pair(src: str, dst: str, origin: str) -> None:
    x = source(src)
    into = fresh(dst)
    target = into.sharding
    ref = jax.device_put(x, target)
    before = pointers(into)
    out = jreshard.transfer_into(x, into, options=XLA)
    assert_parity(out, ref, identity=False, target=target)
    assert pointers(out) == before or not out.size, "not over into's buffers"


@pytest.mark.parametrize("dtype", DTYPES)
def test_transfer_dtype(dtype: str) -> None:
    src, dst = DTYPE_PAIRS[0]
    x = source(src, dtype)
    assert_parity(
        jreshard.transfer(x, sharding(dst), options=XLA), jax.device_put(x, sharding(dst)), x, target=sharding(dst)
    )
