"""Under jax.transfer_guard, a device-to-device transfer in one process runs wherever jax.device_put between
the same shardings does (results are made from memory the devices hold, never put from the host), and a
failure while making them is raised, never answered by switching the fast path off."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _device_put_oracle import assert_same_as_device_put
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard.engine import arrays, put

DEVS = np.array(jax.devices())
A4 = Mesh(DEVS[:4], ("x",))
B4 = Mesh(DEVS[4:], ("y",))
B22 = Mesh(DEVS[4:].reshape(2, 2), ("dp", "tp"))
ALL = Mesh(DEVS.reshape(2, 4), ("a", "b"))

PAIRS = {
    "other_devices": (NamedSharding(A4, P("x")), NamedSharding(B4, P(None, "y"))),
    "same_devices_other_spec": (NamedSharding(A4, P("x")), NamedSharding(A4, P(None, "x"))),
    "same_spec_other_devices": (NamedSharding(A4, P("x")), NamedSharding(B4, P("y"))),
    "replicated_to_2d": (NamedSharding(A4, P()), NamedSharding(B22, P("dp", "tp"))),
    "overlapping_meshes": (NamedSharding(ALL, P("a", "b")), NamedSharding(B22, P("tp"))),
    "same_sharding": (NamedSharding(A4, P("x")), NamedSharding(A4, P("x"))),
}


def _guards():
    return {
        "disallow": lambda: jax.transfer_guard("disallow"),
        "disallow_explicit": lambda: jax.transfer_guard("disallow_explicit"),
        # What Tunix's RLCluster.sync_weights sets on CPU.
        "tunix_sync_weights": lambda: _both(
            jax.transfer_guard_host_to_device("disallow_explicit"),
            jax.transfer_guard_device_to_host("disallow_explicit"),
        ),
    }


@contextlib.contextmanager
def _both(a, b):
    with a, b:
        yield


@pytest.mark.parametrize("guard", list(_guards()))
@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e5m2, jnp.int8, jnp.bool_])
def test_transfer_runs_wherever_device_put_does(guard, pair, dtype):
    src, dst = PAIRS[pair]
    x = jax.device_put((jnp.arange(64) % 7).reshape(8, 8).astype(dtype), src)
    want = jax.device_put(x, dst)  # outside the guard: the oracle
    jax.block_until_ready(want)
    with _guards()[guard]():
        try:
            jax.block_until_ready(jax.device_put(x, dst))
            device_put_ran = True
        except jax.errors.JaxRuntimeError as err:
            assert "Disallowed" in str(err)
            device_put_ran = False
        got = jax.block_until_ready(jreshard.transfer(x, dst))  # must run whenever device_put did, and runs always
    if not device_put_ran:  # on CPU, device_put between shardings of different devices goes through the host
        assert guard != "disallow"
    assert_same_as_device_put(got, want)


@pytest.mark.parametrize("guard", list(_guards()))
def test_pytrees_views_and_transfer_into_run_under_the_guard(guard):
    src, dst = PAIRS["other_devices"]
    x = {
        "w": jax.device_put(jnp.arange(64.0).reshape(8, 8), src),
        "e": jax.device_put(jnp.zeros((0, 8)), NamedSharding(A4, P(None, "x"))),
        "s": jax.device_put(jnp.float32(3.0), NamedSharding(A4, P())),
    }
    targets = {"w": dst, "e": NamedSharding(B4, P(None, "y")), "s": NamedSharding(B4, P())}
    want = jax.device_put(x, targets)
    into = jax.device_put(jax.tree.map(jnp.zeros_like, x), targets)
    cast_want = jax.device_put(x["w"].astype(jnp.bfloat16), dst)
    jax.block_until_ready((want, into, cast_want))
    with _guards()[guard]():
        got = jax.block_until_ready(jreshard.transfer(x, targets))
        written = jax.block_until_ready(jreshard.transfer_into(x, into))
        viewed = jax.block_until_ready(jreshard.transfer(jreshard.views.astype(x["w"], jnp.bfloat16), dst))
        cast = jax.block_until_ready(
            jreshard.transfer(x["w"], jax.ShapeDtypeStruct((8, 8), jnp.bfloat16, sharding=dst))
        )
    assert_same_as_device_put(got, want)
    assert_same_as_device_put(written, want)
    assert_same_as_device_put(viewed, cast_want)
    assert_same_as_device_put(cast, cast_want)


@pytest.mark.parametrize("guard", list(_guards()))
def test_backend_xla_runs_under_the_guard(guard):
    """The XLA computation's inputs include blocks for devices that hold none of a leaf; they are made by a
    computation on those devices, not put from the host (which the guards refuse)."""
    src, dst = PAIRS["other_devices"]
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), src)
    into = jax.device_put(jnp.zeros((8, 8)), dst)
    want = jax.block_until_ready(jax.device_put(x, dst))
    xla = jreshard.Options(backend="xla")
    with _guards()[guard]():
        got = jax.block_until_ready(jreshard.transfer(x, dst, options=xla))
        written = jax.block_until_ready(jreshard.transfer_into(x, into, options=xla))
    assert_same_as_device_put(got, want)
    assert_same_as_device_put(written, want)


def test_host_sources_obey_the_host_to_device_guard_as_device_put_does():
    dst = PAIRS["other_devices"][1]
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        with pytest.raises(jax.errors.JaxRuntimeError, match="Disallowed host-to-device"):
            jax.device_put(np.ones((8, 8), np.float32), dst)
        with pytest.raises(jax.errors.JaxRuntimeError, match="Disallowed host-to-device"):
            jreshard.transfer(np.ones((8, 8), np.float32), dst)


def test_a_failure_making_results_is_raised_and_the_fast_path_stays_on(monkeypatch):
    src, dst = PAIRS["other_devices"]
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), src)
    real, calls = arrays._IMPORT, []

    def flaky(view, device):
        calls.append(device)
        if len(calls) == 1:
            raise RuntimeError("injected import failure")
        return real(view, device)

    monkeypatch.setattr(arrays, "_IMPORT", flaky)
    monkeypatch.setattr(put, "_PUT", None)  # the DLPack path, as under a guard that refuses host puts
    with pytest.raises(RuntimeError, match="injected import failure"):
        jreshard.transfer(x, dst)
    assert arrays._IMPORT is flaky
    before = len(calls)
    assert_same_as_device_put(jreshard.transfer(x, dst), jax.device_put(x, dst))
    assert len(calls) == before + len(dst.device_set)  # the same import made every shard of the second call
