"""Refit while serving, in one process: a RefitGroup over NIXL between two threads (the source on two CPU
devices, the destination on two others, every byte a NIXL WRITE of this process's agent to itself), the
destination receiving in the background while its jitted steps keep running, then flipping.

The same paths between programs, with faults injected, are in test_netns_faults.py (background receive
on the destination side); the benchmark is benchmarks/serve_bench.py."""

from __future__ import annotations

import os
import re
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jreshard import Options, PeerError, RefitCancelledError, RefitGroup
from jreshard.refit import ServeReport, Shadow

pytest.importorskip("nixl_cu12", reason="the NIXL tests need nixl-cu12")
pytestmark = pytest.mark.timeout(120)

D = jax.devices()
OPTS = Options(timeout_s=10.0, secret=b"serve-test-key-0123456789abcdef", chunk_bytes=1 << 14, staging_bytes=1 << 16)
SHAPE = (64, 32)
SRC = NamedSharding(Mesh(np.array(D[:2]), ("fsdp",)), P("fsdp"))
DST = NamedSharding(Mesh(np.array(D[2:4]).reshape(1, 2), ("dp", "tp")), P(None, "tp"))
DST_B = NamedSharding(DST.mesh, P())
SRC_LIKE = {k: jax.ShapeDtypeStruct(s, np.float32, sharding=SRC) for k, s in (("w", SHAPE), ("b", (32,)))}
DST_LIKE = {
    "w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=DST),
    "b": jax.ShapeDtypeStruct((32,), np.float32, sharding=DST_B),
}


def value(v: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(v)
    return {"w": rng.standard_normal(SHAPE, np.float32), "b": rng.standard_normal(32, np.float32)}


def holds(tree: dict, v: int) -> bool:
    return all(np.array_equal(np.asarray(tree[k]), x) for k, x in value(v).items())


class Source:
    """The trainer in a thread: forms the group, then pushes each version handed to it; records errors."""

    def __init__(self, address: str):
        self.todo: list[tuple[int, object]] = []  # (the value's seed, the version it is pushed as)
        self.errors: list[BaseException] = []
        self.pushed: list[int] = []
        self.cv = threading.Condition()
        self.thread = threading.Thread(target=self.run, args=(address,), daemon=True)
        self.thread.start()

    def run(self, address: str) -> None:
        g = RefitGroup.connect("source", SRC_LIKE, address=address, transport="nixl", devices=D[:2], options=OPTS)
        try:
            while True:
                with self.cv:
                    self.cv.wait_for(lambda: bool(self.todo))
                    v, label = self.todo.pop(0)
                if v < 0:
                    return
                try:
                    g.push({k: jax.device_put(x, SRC) for k, x in value(v).items()}, version=label)  # type: ignore[arg-type]
                    self.pushed.append(v)
                except PeerError as err:
                    self.errors.append(err)
                    if "not started" not in str(err):
                        return
        finally:
            g.close()

    def push(self, v: int, version: object = None) -> None:
        with self.cv:
            self.todo.append((v, v if version is None else version))
            self.cv.notify_all()


@pytest.fixture
def pair(tmp_path):
    src = Source(str(tmp_path / "address"))
    dst = RefitGroup.connect(
        "destination", DST_LIKE, address=str(tmp_path / "address"), transport="nixl", devices=D[2:4], options=OPTS
    )
    src.push(1)
    tree, v = dst.pull(like=DST_LIKE)
    assert v == 1 and holds(tree, 1)
    yield src, dst, tree
    src.push(-1)
    src.thread.join(20)
    dst.close()


def _gate(group: RefitGroup) -> threading.Event:
    """Hold the destination's data phase until the returned event is set (the refit stays in flight)."""
    gate, run = threading.Event(), group._run

    def held(sources, targets, **kw):
        assert gate.wait(20)
        return run(sources, targets, **kw)

    group._run = held  # type: ignore[method-assign]
    return gate


@jax.jit
def step(params, x):
    return jnp.tanh(x @ params["w"].T + params["b"].sum())


def test_the_server_steps_on_its_version_while_the_next_arrives_then_flips(pair):
    src, dst, tree = pair
    gate = _gate(dst)
    h = dst.pull_async(into=tree)
    src.push(2)
    x = jnp.ones((4, 32), np.float32)
    before = np.asarray(step(tree, x))
    steps = 0
    while steps < 20:  # the refit is held in flight: every one of these steps runs on version 1
        assert not h.ready()
        np.testing.assert_array_equal(np.asarray(step(tree, x)), before)
        steps += 1
    with pytest.raises(ValueError, match="still running"):
        h.flip()
    gate.set()
    new, v = h.result(timeout_s=10)
    assert v == 2 and holds(new, 2) and holds(tree, 1)  # the old tree kept (Shadow.KEEP) and untouched
    assert h.flip()[1] == 2 and h.cancel() is False  # a second flip: the same tree; too late to cancel
    r = h.report
    assert isinstance(r, ServeReport) and r.version == 2
    assert r.shadow_bytes == 4 * (64 * 32 + 32 * 2)  # two devices: half of w each, the whole of b each
    assert r.wire_s > 0 and r.processing_s > 0 and 0 <= r.pause_s < r.wire_s
    assert not np.array_equal(np.asarray(step(new, x)), before)


def test_release_deletes_the_old_version_at_the_flip_and_the_shadow_is_bounded(pair):
    src, dst, tree = pair
    need = 4 * (64 * 32 + 32 * 2)
    with pytest.raises(ValueError, match=f"needs {need} bytes on this process, over max_shadow_bytes={need - 1}"):
        dst.pull_async(into=tree, max_shadow_bytes=need - 1)
    with pytest.raises(ValueError, match="shadow='bogus'"):
        dst.pull_async(into=tree, shadow="bogus")
    with pytest.raises(ValueError, match=r"release.*pass into="):
        dst.pull_async(like=DST_LIKE, shadow=Shadow.RELEASE)
    with pytest.raises(ValueError, match=r"max_shadow_bytes=True: a byte count >= 0"):
        dst.pull_async(into=tree, max_shadow_bytes=True)
    h = dst.pull_async(into=tree, shadow="release", max_shadow_bytes=np.int64(need))
    with pytest.raises(ValueError, match="in flight"):
        dst.pull(into=tree)
    with pytest.raises(ValueError, match="in flight"):
        dst.pull_async(into=tree)
    src.push(2)
    new, v = h.result()
    assert v == 2 and holds(new, 2) and all(a.is_deleted() for a in tree.values())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a per-thread nice value is Linux's")
def test_the_receive_thread_runs_at_the_nice_asked_for_and_the_callers_priority_is_untouched(pair):
    src, dst, tree = pair
    for bad in (-1, 20, True, 2.5):
        with pytest.raises(ValueError, match=f"nice={bad!r}; expected an int in 0..19"):
            dst.pull_async(into=tree, nice=bad)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[int] = []
    run = dst._run

    def observed(sources, targets, **kw):  # runs on the receive thread
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return run(sources, targets, **kw)

    dst._run = observed  # type: ignore[method-assign]
    for nice, version in ((np.int64(7), 2), (0, 3)):  # numpy's integers are ints
        h = dst.pull_async(into=tree, nice=nice)
        src.push(version)
        tree, v = h.result(timeout_s=10)
        assert v == version and holds(tree, version)
    assert seen == [min(19, mine + 7), mine]  # a fresh thread each pull; nice=0 keeps the caller's
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="per-thread cores are Linux's")
def test_the_receive_thread_runs_on_the_cores_asked_for_and_the_callers_are_untouched(pair):
    src, dst, tree = pair
    mine = os.sched_getaffinity(0)
    for bad in (set(), [0, -1], [True], [0, True], np.array([True]), "0", 2.5, [1.0], np.array([0.0])):
        with pytest.raises(ValueError, match=r"cpus=.*expected a non-empty set of core numbers"):
            dst.pull_async(into=tree, cpus=bad)
    for far in (4096, 1 << 40, 1 << 70):
        with pytest.raises(ValueError, match=rf"cpus=\[{far}\]: the OS refuses them"):
            dst.pull_async(into=tree, cpus=[far])
    assert os.sched_getaffinity(0) == mine and dst._background is None
    seen: list[set[int]] = []
    run = dst._run

    def observed(sources, targets, **kw):  # runs on the receive thread
        seen.append(os.sched_getaffinity(0))
        return run(sources, targets, **kw)

    dst._run = observed  # type: ignore[method-assign]
    last = max(mine)
    for cpus, version in (({last}, 2), (None, 3), (np.array([last]), 4), ((c for c in [last]), 5)):
        h = dst.pull_async(into=tree, cpus=cpus)
        assert os.sched_getaffinity(0) == mine  # the caller's own, back at once
        src.push(version)
        tree, v = h.result(timeout_s=10)
        assert v == version and holds(tree, version)
    assert seen == [{last}, mine, {last}, {last}]  # a fresh thread each pull; None keeps the caller's
    assert os.sched_getaffinity(0) == mine


def test_a_cancel_while_waiting_for_the_source_fails_that_refit_and_a_new_group_refits(pair, tmp_path):
    src, dst, tree = pair
    h = dst.pull_async(into=tree)
    time.sleep(0.05)  # the begin vote is out: the cancel is carried by the commit vote
    assert h.cancel() is True and h.cancel() is True
    src.push(2)
    with pytest.raises(RefitCancelledError, match="cancelled"):
        h.result()
    deadline = time.monotonic() + 10
    while not src.errors and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "cancelled" in str(src.errors[0]) and src.pushed == [1]
    assert dst.version == 1 and holds(tree, 1)
    src.thread.join(20)
    dst.close()
    again = Source(str(tmp_path / "again"))  # both sides form a new group and refit
    dst2 = RefitGroup.connect(
        "destination", DST_LIKE, address=str(tmp_path / "again"), transport="nixl", devices=D[2:4], options=OPTS
    )
    again.push(2)
    new, v = dst2.pull_async(into=tree).result()
    assert v == 2 and holds(new, 2)
    again.push(-1)
    again.thread.join(20)
    dst2.close()


def test_a_cancel_after_the_data_moved_fails_the_refit_on_both_sides_and_keeps_the_old_version(pair):
    src, dst, tree = pair
    gate = _gate(dst)
    h = dst.pull_async(into=tree)
    src.push(2)
    deadline = time.monotonic() + 10
    while "begun" not in h._phases and time.monotonic() < deadline:
        time.sleep(0.005)
    assert h.cancel() is True  # the data phase is held: the commit vote is still ahead
    gate.set()
    with pytest.raises(RefitCancelledError) as caught:
        h.result()
    assert isinstance(caught.value.__cause__, PeerError) and "keeps its previous version" in str(caught.value.__cause__)
    while not src.errors and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "cancelled" in str(src.errors[0]) and src.pushed == [1]
    assert dst.version == 1 and holds(tree, 1)
    with pytest.raises(PeerError, match="broken"):  # fail-stop, as after any failure after data moved
        dst.pull_async(into=tree)


def test_a_source_that_leaves_mid_background_pull_leaves_the_server_on_its_version(pair):
    src, dst, tree = pair
    h = dst.pull_async(into=tree)
    src.push(-1)  # the source closes instead of pushing
    with pytest.raises(PeerError, match="closed"):
        h.result()
    assert dst.version == 1 and holds(tree, 1)


def test_a_timeout_that_bounds_nothing_is_refused_before_anything_moves(pair):
    src, dst, tree = pair
    for bad in (float("inf"), float("nan"), -1.0, True, "5"):
        with pytest.raises(ValueError, match=r"RefitGroup\.pull: timeout_s=.* must be None or a finite number"):
            dst.pull(into=tree, timeout_s=bad)
        with pytest.raises(ValueError, match=r"RefitGroup\.pull_async: timeout_s=.* must be None or a finite"):
            dst.pull_async(into=tree, timeout_s=bad)
    assert dst._background is None and dst.version == 1
    h = dst.pull_async(into=tree, timeout_s=np.float32(10))  # numpy's numbers are numbers
    with pytest.raises(ValueError, match=r"PullHandle\.result: timeout_s=inf must be None or a finite number"):
        h.result(timeout_s=float("inf"))
    src.push(2)
    tree, v = h.result(timeout_s=np.float64(10))
    assert v == 2 and holds(tree, 2)


def test_a_version_that_is_not_an_int_is_refused_on_both_sides_and_the_next_refit_goes_through(pair):
    src, dst, tree = pair
    for bad in (2.5, True, "2"):
        src.push(2, version=bad)
        with pytest.raises(PeerError, match=rf"(?s)refit not started.*version={re.escape(repr(bad))} is not an int"):
            dst.pull(into=tree)
        assert dst.version == 1
    src.push(2, version=np.int64(2))  # numpy's integers are ints
    tree, v = dst.pull(into=tree)
    assert v == 2 and type(v) is int and holds(tree, 2)
    assert len(src.errors) == 3 and all("is not an int" in str(e) for e in src.errors)
