"""The plain path of ``transfer`` and ``transfer_into``: a call of live, row-major jax arrays to ``NamedSharding``
targets or into live arrays, in this process on CPU devices, is checked, routed and planned from its key in one
pass over its leaves (``jreshard.api._plain``). It must answer exactly as the full path does, every other call
must take the full path, and what the one pass cannot see (a key that fails its checks, a leaf deleted since,
a column-major array) must still be refused by name, before any byte is written."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from parity_cases import _gspmd_like
from random_trees import REFIT_DTYPES, sharding, values

import jreshard
import jreshard.api as api
from jreshard.call.front import Mode, flatten, plain_key
from jreshard.options import Options
from jreshard.report import NotInPlace

DEVS = np.array(jax.devices())
FSDP = NamedSharding(Mesh(DEVS[:4], ("fsdp",)), P("fsdp"))
TP = NamedSharding(Mesh(DEVS[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))


def _tree(seed: int) -> tuple[dict, dict]:
    """A random tree (every dtype the refits move, int4 and sizes of 0 among them, random shardings both sides,
    some leaves kept) and its targets (NamedShardings and SingleDeviceShardings, a few None)."""
    r = random.Random(seed)
    x, targets = {}, {}
    for k in range(r.randint(1, 12)):
        shape = tuple(r.choice([0, 1, 2, 3, 4, 8]) for _ in range(r.randint(0, 3)))
        name = r.choice([*REFIT_DTYPES, "int4"])
        src = sharding(r, DEVS, shape)
        host = values(f"l{k}", shape, "int8" if name == "int4" else name, seed)
        if name == "int4":
            host = host.astype(jnp.int4)
        x[f"l{k}"] = jax.device_put(host, src)
        dst = sharding(r, DEVS, shape)
        if r.random() < 0.15:
            dst = src  # kept, as jax.device_put keeps it
        targets[f"l{k}"] = None if r.random() < 0.1 else dst
    return x, targets


def _bits(a) -> list[tuple[str, bytes]]:
    return [(str(s.device), np.asarray(s.data).tobytes()) for s in a.addressable_shards]


def _same(got: dict, want: dict) -> list[str]:
    bad = []
    for k in want:
        a, b = got[k], want[k]
        if (a.dtype, a.shape, a.weak_type, a.sharding) != (b.dtype, b.shape, b.weak_type, b.sharding):
            bad.append(f"{k}: {a.dtype}{a.shape} {a.sharding} against {b.dtype}{b.shape} {b.sharding}")
        elif _bits(a) != _bits(b):
            bad.append(f"{k}: other bytes")
    return bad


def _report(rep) -> tuple:
    """What a report says that depends on the call alone (whether jax hands a donated buffer over or copies it,
    ``NOT_HANDED_OVER``, varies from one array to the next, on either path)."""
    kept = [(i, why) for i, why in rep.not_in_place if why is not NotInPlace.NOT_HANDED_OVER]
    return (rep.backend, rep.moved_bytes, sorted(rep.bytes_by_link().items()), kept)


@pytest.fixture
def taken(monkeypatch):
    """The calls the plain path took (``True``) or left to the full path (``False``), in order."""
    seen: list[bool] = []
    plain = api._plain

    def counted(*args):
        out = plain(*args)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(api, "_plain", counted)
    return seen


def _full(monkeypatch):
    monkeypatch.setattr(api, "_plain", lambda *args: None)


@pytest.mark.parametrize("seed", range(12))
def test_plain_and_full_paths_give_the_same_arrays_and_reports(seed, taken, monkeypatch):
    x, targets = _tree(seed)
    out, rep = jreshard.transfer(x, targets, report=True)
    into = {k: jax.device_put(jnp.zeros_like(x[k]), targets[k] or x[k].sharding) for k in x}
    ptrs = {k: [s.data.unsafe_buffer_pointer() for s in into[k].addressable_shards if s.data.size] for k in x}
    got, rep_into = jreshard.transfer_into(x, into, report=True)
    plain = list(taken)
    _full(monkeypatch)
    want, want_rep = jreshard.transfer(x, targets, report=True)
    into2 = {k: jax.device_put(jnp.zeros_like(x[k]), targets[k] or x[k].sharding) for k in x}
    want_into, want_rep_into = jreshard.transfer_into(x, into2, report=True)
    assert _same(out, want) == [] and _same(got, want_into) == []
    assert all(np.asarray(got[k]).tobytes() == np.asarray(x[k]).tobytes() for k in x)
    assert _report(rep) == _report(want_rep) and _report(rep_into) == _report(want_rep_into)
    fresh = {sorted(x)[i] for i, _ in rep_into.not_in_place}
    for k in x:  # in place, as on the full path (where the report does not say otherwise)
        if ptrs[k] and k not in fresh:
            assert [s.data.unsafe_buffer_pointer() for s in got[k].addressable_shards if s.data.size] == ptrs[k]
    int4 = any(a.dtype == jnp.int4 for a in x.values())
    assert plain == [not int4, not int4]  # (int4 leaves are repacked: the full path)


def _into(a, sh=TP):
    return jax.device_put(jnp.zeros_like(a), sh)


def _calls():
    a = jax.device_put(jnp.arange(32.0).reshape(4, 8), FSDP)
    key = jax.random.key(0)
    return {
        "arrays to NamedShardings": (True, lambda: jreshard.transfer({"a": a, "b": a + 1}, TP)),
        "into live arrays": (True, lambda: jreshard.transfer_into({"a": a}, {"a": _into(a)})),
        "a numpy leaf": (False, lambda: jreshard.transfer(np.ones((4, 8)), TP)),
        "a ShapeDtypeStruct target": (
            False,
            lambda: jreshard.transfer(a, jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=TP)),
        ),
        "a SingleDeviceSharding target": (True, lambda: jreshard.transfer(a, SingleDeviceSharding(DEVS[5]))),
        "a GSPMDSharding target": (False, lambda: jreshard.transfer(a, _gspmd_like(TP, 2))),
        "a cast": (False, lambda: jreshard.transfer(a, jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=TP))),
        "an int4 leaf": (False, lambda: jreshard.transfer(a.astype(jnp.int4), TP)),
        "a key array": (False, lambda: jreshard.transfer(key, SingleDeviceSharding(DEVS[1]))),
        "a pinned_host target": (False, lambda: jreshard.transfer(a, TP.with_memory_kind("pinned_host"))),
        "an into leaf deleted": (False, lambda: jreshard.transfer_into(a, _deleted(_into(a)))),
        "the xla backend": (False, lambda: jreshard.transfer(a, TP, options=jreshard.Options(backend="xla"))),
    }


def _deleted(b):
    b.delete()
    return b


@pytest.mark.parametrize("name", list(_calls()))
def test_only_plain_calls_take_the_plain_path(name, taken):
    plain, call = _calls()[name]
    call()
    assert taken == [plain]


def test_the_key_of_a_plain_call_is_the_one_the_full_checks_compute():
    """Read in one pass, the key is the one :func:`prepare` caches the call's plan under."""
    from jreshard.call import front

    a = jax.device_put(jnp.arange(32.0).reshape(4, 8), FSDP)
    x, into = {"a": a, "b": [a + 1]}, {"a": _into(a), "b": [_into(a)]}
    options = Options.of(None)
    for mode, target in ((Mode.TRANSFER, {"a": TP, "b": [None]}), (Mode.INTO, into)):
        leaves, treedef, targets = flatten(x, target, mode.value if mode is Mode.INTO else "target")
        key = plain_key(leaves, treedef, targets, mode, None, options)
        front._shape.cache_clear()
        front.prepare(leaves, treedef, targets, mode, None, options, x)
        assert front._shape.cache_info().currsize == 1
        front._shape(key)
        assert front._shape.cache_info().hits == 1  # the same key


def test_a_key_that_fails_its_checks_is_refused_by_name_every_time(taken):
    a = jax.device_put(jnp.arange(12.0).reshape(3, 4), SingleDeviceSharding(DEVS[0]))
    rows = NamedSharding(Mesh(DEVS[:2], ("x",)), P("x"))  # 3 rows over 2 devices
    for _ in range(2):
        with pytest.raises(jreshard.IndivisibleError, match=r"leaf \['w'\]"):
            jreshard.transfer({"w": a}, {"w": rows})
    assert taken == [False, False]


def test_a_loop_is_refused_by_name_when_a_source_was_deleted_and_into_stays(taken):
    a = jax.device_put(jnp.arange(32.0).reshape(4, 8), FSDP)
    held = {"p": [_into(a)]}
    for _ in range(3):
        held = jreshard.transfer_into({"p": [a * 2]}, held)
    x = {"p": [a * 3]}
    x["p"][0].delete()
    with pytest.raises(jreshard.LayoutError, match=r"leaf \['p'\]\[0\] of x has been deleted"):
        jreshard.transfer_into(x, held)
    assert not held["p"][0].is_deleted() and np.array_equal(np.asarray(held["p"][0]), np.asarray(a * 2))
    assert taken == [True, True, True, False]


def test_a_loop_whose_into_leaf_was_deleted_writes_that_leaf_into_fresh_memory(taken):
    a = jax.device_put(jnp.arange(32.0).reshape(4, 8), FSDP)
    held = {"p": _into(a), "q": _into(a)}
    for _ in range(2):
        held = jreshard.transfer_into({"p": a, "q": a + 1}, held)
    held["q"].delete()
    out, rep = jreshard.transfer_into({"p": a * 2, "q": a * 3}, held, report=True)
    stored = sum(s.data.nbytes for s in out["q"].addressable_shards)  # (TP's shards: twice over dp)
    assert np.array_equal(np.asarray(out["q"]), np.asarray(a * 3)) and rep.not_in_place_bytes == stored
    assert [reason.name for _, reason in rep.not_in_place] == ["DELETED"]
    assert taken == [True, True, False]


def test_a_column_major_into_after_a_plain_loop_is_refused_before_any_write(taken, column_major):
    a = jax.device_put(jnp.arange(64.0).reshape(8, 8), FSDP)
    held = _into(a)
    held = jreshard.transfer_into(a, held)
    col = column_major(jnp.ones((8, 8)), TP)
    with pytest.raises(jreshard.LayoutError, match=r"major_to_minor=\(1, 0\)"):
        jreshard.transfer_into(a, col)
    assert not col.is_deleted() and np.asarray(col).min() == 1.0
    assert taken == [True, False]
