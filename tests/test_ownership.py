"""Ownership: transfer never shares memory with a source it does not return whole, transfer_into consumes
only what it owns exclusively, and no array the caller holds ever changes value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard import views

DEVS = np.array(jax.devices())
TRAIN = NamedSharding(Mesh(DEVS[:4], ("fsdp",)), P("fsdp"))
INFER = NamedSharding(Mesh(DEVS[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))


def _host(a):
    return np.asarray(jax.device_get(a))


def _copy(a):
    """The values of ``a`` in host memory of their own (``np.asarray`` of a CPU array is a view)."""
    return np.concatenate([np.array(s.data, copy=True).ravel() for s in a.addressable_shards])


def _deleted(a) -> bool:
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(a)
    return True


def test_readme_loop_with_none_target_never_changes_the_trainer_array():
    """Case 1: a None target returns the trainer's own array; transfer_into must not write through it."""
    params = {"w": jax.device_put(jnp.ones((8, 8)), TRAIN), "step": jax.device_put(jnp.int32(7), DEVS[0])}
    weights = jreshard.transfer(params, {"w": INFER, "step": None})
    assert weights["step"] is params["step"]
    params_next = {"w": jax.device_put(jnp.full((8, 8), 2.0), TRAIN), "step": params["step"] + 7}
    out = jreshard.transfer_into(params_next, weights)
    assert int(out["step"]) == 14 and int(params_next["step"]) == 14
    # The old step array was consumed (weights held it): deleted, never changed to 14.
    assert params["step"].is_deleted() and _deleted(params["step"])


@pytest.mark.parametrize("how", ["transfer", "device_put"])
def test_identical_sharding_pass_through_is_consumed_not_overwritten(how):
    """Cases 2 and 3: w is p itself; transfer_into(p_next, w) consumes p (deleted), never writes 100 into it."""
    p = jax.device_put(jnp.zeros((8, 8)), INFER)
    w = jreshard.transfer(p, INFER) if how == "transfer" else jax.device_put(p, INFER)
    assert w is p
    p_next = jax.device_put(jnp.full((8, 8), 100.0), TRAIN)
    out = jreshard.transfer_into(p_next, w)
    assert _host(out).min() == 100.0
    assert p.is_deleted() and _deleted(p)  # consumed like a donated argument: an error, never a silent change


def test_readme_loop_with_a_donating_train_step():
    """Case 4: the README pattern survives `jax.jit(step, donate_argnums=0)`."""
    step = jax.jit(lambda p: jax.tree.map(lambda v: v + 1, p), donate_argnums=0)
    params = {
        "w": jax.device_put(jnp.ones((8, 8)), TRAIN),
        "step": jax.device_put(jnp.int32(0), TRAIN.update(spec=P())),
    }
    weights = jreshard.transfer(params, {"w": INFER, "step": None})
    for i in range(1, 4):
        params = step(params)
        weights = jreshard.transfer_into(params, weights)
        assert float(_host(weights["w"])[0, 0]) == 1.0 + i and int(weights["step"]) == i


def test_colocated_replicated_result_survives_a_donating_train_step():
    """Case 5: a replicated leaf on colocated meshes comes back in new memory, not the trainer's buffers."""
    rep_train = NamedSharding(Mesh(DEVS[:4], ("fsdp",)), P())
    rep_infer = NamedSharding(Mesh(DEVS[:4].reshape(2, 2), ("dp", "tp")), P())
    params = {"b": jax.device_put(jnp.arange(8.0), rep_train)}
    weights = jreshard.transfer(params, {"b": rep_infer})
    src = {s.data.unsafe_buffer_pointer() for s in params["b"].addressable_shards}
    assert not src & {s.data.unsafe_buffer_pointer() for s in weights["b"].addressable_shards}
    jax.jit(lambda p: jax.tree.map(lambda v: v * 2, p), donate_argnums=0)(params)
    np.testing.assert_array_equal(_host(weights["b"]), np.arange(8.0))


def test_same_into_array_twice_and_into_naming_a_source_leaf():
    """Case 6: each result holds its own leaf's values; the source leaf named by into never changes."""
    x = {"a": jax.device_put(jnp.full((8, 8), 1.0), TRAIN), "b": jax.device_put(jnp.full((8, 8), 2.0), TRAIN)}
    w = jax.device_put(jnp.zeros((8, 8)), INFER)
    out, rep = jreshard.transfer_into(x, {"a": w, "b": w}, report=True)
    assert _host(out["a"]).max() == 1.0 and _host(out["b"]).min() == 2.0
    assert rep.not_in_place_bytes == 8 * 8 * 4 * 2  # b's two replicas went to fresh memory
    z = jax.device_put(jnp.zeros((8, 8)), TRAIN)
    out = jreshard.transfer_into(x, {"a": x["b"], "b": z})
    assert _host(out["a"]).max() == 1.0 and _host(out["b"]).min() == 2.0
    assert _host(x["b"]).min() == 2.0 and not x["b"].is_deleted()  # a source: never written, never consumed


def test_same_boxes_renamed_axes_result_owns_new_memory():
    """Case 7: same boxes under another axis name: new memory, so a later transfer_into leaves x alone."""
    x = jax.device_put(jnp.arange(16.0), NamedSharding(Mesh(DEVS[:4], ("x",)), P("x")))
    w = jreshard.transfer(x, NamedSharding(Mesh(DEVS[:4], ("tp",)), P("tp")))
    jreshard.transfer_into(jax.device_put(jnp.full(16, 5.0), TRAIN), w)
    np.testing.assert_array_equal(_host(x), np.arange(16.0))


def test_zero_size_jit_array_to_the_same_boxes():
    """Case 10: shards of shape (2, 0) from jit."""
    s = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x"))
    x = jax.jit(lambda: jnp.zeros((8, 0)), out_shardings=s)()
    for t in (NamedSharding(Mesh(DEVS[:4], ("y",)), P("y")), INFER):
        out = jreshard.transfer(x, t)
        assert out.shape == (8, 0) and out.sharding == t
    into = jax.jit(lambda: jnp.ones((8, 0)), out_shardings=INFER)()
    assert jreshard.transfer_into(x, into).shape == (8, 0)


def test_non_default_memory_layout_is_refused_before_any_write(column_major):
    """Case 11: a column-major destination would get row-major bytes: refused, into untouched."""
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), TRAIN)
    into = column_major(jnp.zeros((8, 8)), INFER)
    with pytest.raises(jreshard.LayoutError, match=r"major_to_minor=\(1, 0\)"):
        jreshard.transfer_into(x, into)
    assert not into.is_deleted() and _host(into).max() == 0.0


def _gspmd(s: NamedSharding):
    from jax._src.sharding_impls import GSPMDSharding  # no public constructor in jax 0.10

    return GSPMDSharding(list(s.mesh.devices.flat), s._to_xla_hlo_sharding(2))


# Device sets and sharding kinds an into leaf may have, mixed within one pytree.
_INTO_SHARDINGS = [
    TRAIN,
    INFER,
    _gspmd(INFER),
    SingleDeviceSharding(DEVS[5]),
    NamedSharding(Mesh(DEVS[::-1][:4], ("r",)), P(None, "r")),
    NamedSharding(Mesh(DEVS[2:6], ("o",)), P("o")),
]


@st.composite
def _aliasing(draw):
    n = draw(st.integers(1, 4))
    kinds = [draw(st.sampled_from(["fresh", "same_as_x", "dup", "third", "deleted"])) for _ in range(n)]
    where = [draw(st.integers(0, len(_INTO_SHARDINGS) - 1)) for _ in range(n)]
    return n, kinds, where


@settings(max_examples=25, deadline=None)
@given(_aliasing(), st.integers(0, 1000), st.booleans())
def test_random_aliasing_never_changes_a_live_array(case, seed, as_views):
    """Random pytrees with random aliasing between x, into and third arrays: every live array that is
    not a returned leaf holds exactly its old bytes afterwards (x given as arrays, or as views of them)."""
    n, kinds, where = case
    rng = np.random.default_rng(seed)
    x = [jax.device_put(jnp.asarray(rng.integers(0, 99, (8, 8)), jnp.float32), TRAIN) for _ in range(n)]
    third = jax.device_put(jnp.full((8, 8), -1.0), _INTO_SHARDINGS[where[0]])
    into = []
    for i, k in enumerate(kinds):
        sh = _INTO_SHARDINGS[where[i]]
        if k == "same_as_x":
            into.append(x[(i + 1) % n] if sh == TRAIN else jax.device_put(jnp.zeros((8, 8)), sh))
        elif k == "dup" and into:
            into.append(into[-1])
        elif k == "third":
            into.append(third)
        elif k == "deleted":
            a = jax.device_put(jnp.zeros((8, 8)), sh)
            a.delete()
            into.append(a)
        else:
            into.append(jax.device_put(jnp.zeros((8, 8)), sh))
    live = [a for a in (*x, third, *into) if not a.is_deleted()]
    before = {id(a): _copy(a) for a in live}  # copies: a NumPy view would keep jax from handing memory over
    ptrs = [None if a.is_deleted() else [s.data.unsafe_buffer_pointer() for s in a.addressable_shards] for a in into]
    exclusive = [k == "fresh" for k in kinds]  # held by this list alone: must be written in place
    out = jreshard.transfer_into([views.as_view(a) for a in x] if as_views else x, into)
    for o, a, t in zip(out, x, into, strict=True):
        np.testing.assert_array_equal(_host(o), _host(a))
        assert o.sharding == t.sharding
    for o, p, ex in zip(out, ptrs, exclusive, strict=True):
        if ex:
            assert [s.data.unsafe_buffer_pointer() for s in o.addressable_shards] == p
    returned = {id(o) for o in out}
    for a in live:
        if id(a) in returned or a.is_deleted():  # consumed: raises on use, never a silent change
            continue
        np.testing.assert_array_equal(_copy(a), before[id(a)])


def test_transfer_into_says_which_leaves_were_not_in_place_and_why():
    from jreshard.report import NotInPlace

    devs = np.array(jax.devices())
    a = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
    b = NamedSharding(Mesh(devs[4:], ("y",)), P("y"))
    x = {"p": jax.device_put(jnp.arange(8.0), a), "q": jax.device_put(jnp.arange(8.0) + 1, a)}
    fresh = jreshard.transfer(x["q"], b)  # memory from jreshard's pool: jax cannot take it over
    into = {"p": jax.device_put(jnp.zeros(8), b), "q": fresh}
    before = [s.data.unsafe_buffer_pointer() for s in into["p"].addressable_shards]
    out, rep = jreshard.transfer_into(x, into, report=True)
    assert [s.data.unsafe_buffer_pointer() for s in out["p"].addressable_shards] == before  # held once: in place
    assert rep.not_in_place == ((1, NotInPlace.NOT_HANDED_OVER),) and rep.not_in_place_bytes == 32
    again, rep2 = jreshard.transfer_into(x, out, report=True)  # the refit loop's steady state
    assert rep2.not_in_place == () and rep2.not_in_place_bytes == 0
    shared = jreshard.transfer_into({"p": x["p"], "q": x["q"]}, {"p": x["q"], "q": again["q"]}, report=True)[1]
    assert shared.not_in_place == ((0, NotInPlace.SHARES_A_SOURCE),)


def test_a_repacked_leaf_whose_decode_did_not_reuse_into_is_counted(monkeypatch):
    """Sub-byte leaves are decoded over their donated ``into`` (call/repack.py); where XLA answers the donation
    with new memory (simulated: the decode's result copied), the report says so for that leaf."""
    from jreshard.call import repack
    from jreshard.report import NotInPlace

    devs = np.array(jax.devices())
    a = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
    b = NamedSharding(Mesh(devs[4:], ("y",)), P("y"))
    x = {"q": jax.device_put(jnp.arange(64, dtype=jnp.int4) % 7, a), "f": jax.device_put(jnp.arange(64.0), a)}
    into = {"q": jax.device_put(jnp.zeros(64, jnp.int4), b), "f": jax.device_put(jnp.zeros(64), b)}
    out, rep = jreshard.transfer_into(x, into, report=True)
    assert rep.not_in_place == ()  # decoded in place
    real = repack.decode
    monkeypatch.setattr(repack, "decode", lambda *args: jax.jit(lambda v: v + 0, out_shardings=b)(real(*args)))
    again, rep = jreshard.transfer_into(x, out, report=True)
    np.testing.assert_array_equal(np.asarray(again["q"]), np.asarray(x["q"]))
    assert rep.not_in_place == ((1, NotInPlace.NOT_HANDED_OVER),) and rep.not_in_place_bytes == 32
