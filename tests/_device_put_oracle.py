"""The oracle of the device_put-parity and Tunix tests: a result equals ``jax.device_put``'s, leaf by leaf."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _bytes(a: Any) -> np.ndarray:
    """The bytes of a single-device array (bitwise: NaNs and signed zeros compare as stored; a typed PRNG
    key array: its key data)."""
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    host = np.asarray(a)
    return host.reshape(-1).view(np.uint8) if host.dtype.itemsize else host.reshape(-1)


def assert_same_as_device_put(got: Any, want: Any) -> None:
    """``got`` has ``want``'s tree structure and, per leaf, its type, shape, dtype, weak type, sharding,
    memory kind and, shard by shard (same device, same index), the same bytes.

    Call it outside any transfer guard: reading the shards is a device-to-host transfer.
    """
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree, f"structure {got_tree} != {want_tree}"
    for path, g, w in zip(
        (jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]),
        got_leaves,
        want_leaves,
        strict=True,
    ):
        assert isinstance(g, jax.Array), f"{path}: {type(g).__name__}, not a jax.Array"
        assert (g.shape, g.dtype) == (w.shape, w.dtype), f"{path}: {g.dtype}{g.shape} != {w.dtype}{w.shape}"
        assert jax.typeof(g).weak_type == jax.typeof(w).weak_type, f"{path}: weak_type differs"
        assert g.sharding == w.sharding, f"{path}: {g.sharding} != {w.sharding}"
        assert g.sharding.memory_kind == w.sharding.memory_kind, path
        assert g.committed == w.committed, f"{path}: committed {g.committed} != {w.committed}"
        theirs = {s.device: s for s in w.addressable_shards}
        assert {s.device for s in g.addressable_shards} == set(theirs), path
        for s in g.addressable_shards:
            t = theirs[s.device]
            assert s.index == t.index, f"{path} on {s.device}: index {s.index} != {t.index}"
            np.testing.assert_array_equal(_bytes(s.data), _bytes(t.data), err_msg=f"{path} on {s.device}")
