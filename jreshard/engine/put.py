"""jax's batched put: one call that makes a global array over per-device host buffers (zero-copy on CPU where the
buffers are aligned), a few microseconds a shard where a DLPack import takes tens.

It is a private signature of jax (``xla_client.batched_device_put``), found once here (``None`` on a jax without
it: the callers then import through DLPack), and a host-to-device put: :func:`put_allowed` says whether
``jax.transfer_guard`` allows it now. Imported by :mod:`jreshard.engine.arrays` (the results of in-process calls)
and, on first use, by :func:`jreshard.engine.buffers.import_shard` (one shard).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jreshard.sharding.caches import cache
from jreshard.types import Device, DType, Sharding

__all__ = ["BatchedPut", "batched_put", "put_allowed", "put_one"]


class BatchedPut:
    """jax's one-call assembly of a global array from per-device host buffers (zero-copy on CPU):
    ``put(shape, dtype, sharding, views, devices, weak)``, or :meth:`raw` with an aval made once
    (by :meth:`aval`) for many arrays of one shape and dtype."""

    __slots__ = ("aval", "raw")

    def __init__(self, raw: Any, aval: Any):
        self.raw, self.aval = raw, aval

    def __call__(
        self, shape: tuple[int, ...], dtype: DType, sharding: Sharding, views: Sequence[Any], devices: Any, weak: bool
    ) -> Any:
        return self.raw(self.aval(shape, dtype, weak), sharding, views, devices, True)


def _find_batched_put() -> BatchedPut | None:
    """:class:`BatchedPut`, or ``None`` where this jax has none of that private signature."""
    try:
        from jax._src import core
        from jax._src.lib import xla_client as xc

        fn = xc.batched_device_put
    except (ImportError, AttributeError):  # pragma: no cover - other jax versions: DLPack import only
        return None
    return BatchedPut(fn, cache(max_size=4096)(core.ShapedArray))


_PUT = _find_batched_put()


def put_allowed() -> bool:
    """Whether :func:`make_array` may make arrays with jax's batched put now (it exists here, and the
    transfer guard allows it)."""
    return _PUT is not None and _host_to_device_allowed()


def _host_to_device_allowed() -> bool:
    """Whether ``jax.transfer_guard`` lets host buffers be put on devices here (its default does)."""
    try:
        from jax._src import config

        return config.transfer_guard_host_to_device.value in (None, "allow")
    except (ImportError, AttributeError):  # pragma: no cover - another jax: the guard-proof path
        return False


def put_one(view: np.ndarray, device: Device) -> Any:
    """A single-device array on CPU ``device`` over the host buffer ``view`` (of its shape and dtype) by jax's
    batched put, zero-copy where jax aliases it (the caller checks); ``None`` where the batched put is not
    available or ``jax.transfer_guard`` forbids it."""
    put = batched_put(put_allowed())
    if put is None:
        return None
    return put.raw(
        put.aval(view.shape, view.dtype, False), jax.sharding.SingleDeviceSharding(device), [view], [device], True
    )


def batched_put(put: bool) -> BatchedPut | None:
    """jax's batched put where ``put`` (:func:`put_allowed`, asked once for a call) allows it and this jax has it,
    else ``None``."""
    return _PUT if put else None
