"""NIXL prepared groups (jreshard/nixl/prepared.py) between two processes: bit-identical to the per-operation path
step after step, receive buffers that move are posted again, and a peer SIGKILLed mid-replay is reported within
the timeout."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import pytest

from jreshard.engine import replay

pytest.importorskip("nixl_cu12", reason="the NIXL tests need nixl-cu12 (pip install --no-deps nixl-cu12)")

ROOT = Path(__file__).parent.parent
BODY = ROOT / "tests" / "nixl_bodies" / "prepared_pair.py"
KEY = "prepared-nixl-test-key-0123456789"
pytestmark = pytest.mark.timeout(120)


def run_pair(tmp_path, mode: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env |= {"PYTHONPATH": str(ROOT), "JRESHARD_SECRET": KEY, "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
    address = str(tmp_path / "address")
    procs = [
        subprocess.Popen(
            [sys.executable, str(BODY), str(p), address, mode],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for p in (0, 1)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90)[0])
        finally:
            if p.poll() is None:
                p.kill()
    return [
        {"rc": p.returncode, **json.loads(next((ln for ln in out.splitlines() if ln.startswith("{")), '{"out": 0}'))}
        | {"output": out[-3000:]}
        for p, out in zip(procs, outs, strict=True)
    ]


def test_prepared_and_per_op_refits_are_bit_identical_step_after_step_and_moved_buffers_are_posted_again(tmp_path):
    got = run_pair(tmp_path, "steps")
    assert [g["rc"] for g in got] == [0, 0], [g["output"] for g in got]
    for g in got:
        prepared, per_op = g["prepared"], g["per_op"]
        assert [r["digest"] for r in prepared] == [r["digest"] for r in per_op]  # bit-identical, every step
        assert len({r["digest"] for r in prepared}) == len(prepared) == 6  # new bytes every step (no stale data)
        assert all(r["checked"] == prepared[0]["checked"] > 0 for r in prepared + per_op)
        assert all(r["counters"] == [] for r in per_op)  # per operation: nothing prepared
        # prepared: the packs and unpacks of every step compiled, the groups from Python (NIXL has no compiled loop)
        assert g["prepared_rows_steps"] == (6 if replay.compiled_replay() else 0) and g["per_op_rows_steps"] == 0
        counters = [r["counters"][0][:2] for r in prepared]  # (descriptor lists posted, WRITE handles made)
        assert counters[0][0] > 0 and counters[0][1] > 0  # the first step posted the descriptors, made the handles
        # steps 2 and 3 keep the destination arrays; the staging arenas of two ranks of the same size trade places
        # (the pool's last-in-first-out blocks), so step 3 is back at step 1's addresses: no handle made again
        assert counters[2][1] == counters[1][1]
        posts = [c[0] for c in counters[3:]]  # steps 4-6: fresh destination arrays, each step posted again
        assert posts[0] > counters[2][0] and posts[1] > posts[0] and posts[2] > posts[1]


def test_a_peer_sigkilled_mid_replay_is_reported_within_the_timeout(tmp_path):
    survivor, victim = run_pair(tmp_path, "kill")
    assert victim["rc"] == -9, victim["output"]
    assert survivor["rc"] == 0, survivor["output"]
    assert survivor["checked"] > 0  # the first step went through
    assert survivor["error"] is not None and survivor["error"].startswith("PeerError"), survivor
    assert "process 1" in survivor["error"], survivor
    assert survivor["seconds"] < 10.0  # the 20 s timeout: seen from the closed connection (1 s grace), with slack
    assert survivor["broken"] and "broken since an earlier failure" in survivor["after"]


@pytest.mark.parametrize("prepared", ["1", "0"])
def test_refit_group_over_nixl_is_bit_exact_prepared_and_per_op(tmp_path, prepared):
    """Five versioned refits between two launches (tests/nixl_bodies/refit_pair.py), each checked bit for bit:
    with prepared groups and per operation (``JRESHARD_NIXL_PREPARED=0``) alike."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_FLAGS"))}
    env |= {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2", "OMP_NUM_THREADS": "1"}
    env |= {"JRESHARD_SECRET": KEY, "JRESHARD_NIXL_PREPARED": prepared}
    body, address = ROOT / "tests" / "nixl_bodies" / "refit_pair.py", str(tmp_path / "address")
    procs = [
        subprocess.Popen([sys.executable, str(body), role, address, mode], env=env, stdout=subprocess.PIPE, text=True)
        for role, mode in (("source", "five"), ("destination", "ok"))
    ]
    outs = [p.communicate(timeout=90)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    got = [json.loads(ln) for ln in outs[1].splitlines() if ln.startswith("{")]
    assert got[-1]["checked"] == [1, 2, 3, 4, 5] and got[-1]["bad"] == [], got


def test_elastic_refits_are_bit_identical_prepared_and_per_op(monkeypatch):
    """An elastic trainer and replica in one process (each refit a new NixlComm, so each step prepares): the
    versions pulled with prepared groups and per operation are the same bytes."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard import Options
    from jreshard.elastic import ElasticReplica, ElasticTrainer
    from jreshard.nixl import NixlComm

    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 CPU devices (conftest sets them)")
    # delta="off": the prepared groups run the full refits (a delta refit's rounds post each group afresh)
    opts = Options(timeout_s=10.0, chunk_bytes=64, staging_bytes=1024, secret=KEY.encode(), delta="off")
    shapes = {"a": (16, 8), "b": (8,)}
    src_mesh = Mesh(np.array(devices[:2]), ("fsdp",))
    dst_mesh = Mesh(np.array(devices[2:4]).reshape(1, 2), ("dp", "tp"))

    def params(v: int) -> dict:
        return {
            k: jax.device_put(
                (np.arange(np.prod(s), dtype=np.float32).reshape(s) * 7.5 + v) % 97, NamedSharding(src_mesh, P("fsdp"))
            )
            for k, s in shapes.items()
        }

    like = {
        k: jax.ShapeDtypeStruct(s, np.float32, sharding=NamedSharding(dst_mesh, P(None, "tp") if len(s) == 2 else P()))
        for k, s in shapes.items()
    }
    pulled: dict[bool, list] = {}
    made: list[Any] = []  # a weak reference to each prepared groups made, or None where prepare made none
    real_prepare = NixlComm.prepare

    def prepare(self, groups):
        p = real_prepare(self, groups)
        made.append(None if p is None else weakref.ref(p))
        return p

    monkeypatch.setattr(NixlComm, "prepare", prepare)
    for prepares in (True, False):
        monkeypatch.setattr(NixlComm, "prepares", prepares)
        made.clear()
        trainer = ElasticTrainer(params(0), devices=list(devices[:2]), options=opts)
        r = ElasticReplica(like, trainer.address, name="r1", devices=list(devices[2:4]), options=opts)
        try:
            got = []
            for v in (1, 2, 3):
                assert trainer.push(params(v), version=v).committed == ("r1",)
                tree, version = r.pull(newer_than=v - 1, timeout_s=10.0)
                assert version == v
                got.append({k: np.asarray(tree[k]).tobytes() for k in shapes})
                want = params(v)
                assert all(np.array_equal(np.asarray(tree[k]), np.asarray(want[k])) for k in shapes)
            pulled[prepares] = got
            assert made and all((p is not None) == prepares for p in made)  # each refit prepared, or none did
            gc.collect()
            assert all(p is None or p() is None for p in made)  # a refit's communicator and what it prepared go
        finally:
            r.leave()
            trainer.close()
    assert pulled[True] == pulled[False]


@pytest.mark.parametrize("a_prepares", [True, False])
def test_a_peers_prepared_descriptors_arriving_during_a_per_op_exchange_wait_for_this_sides_schedule(a_prepares):
    """Process b starts its prepared schedule (posting its receives' descriptors, ``nixl.pdesc``) while process a
    still runs a per-operation exchange with it (the scheduling mail comes before the schedule, and the two sides
    end it at different moments). Where a prepares too, the descriptors wait for a's own schedule and the exchange
    completes (they failed it as "prepared its groups and this side did not": the elastic test of a two-process
    replica serving a joiner timed out about 1 run in 2 with prepared groups on); where a never prepares, they are
    the mismatch they look like, said at once."""
    import threading

    import numpy as np
    from _loopback import channel_pair

    from jreshard.engine.comm import RecvOp, SendOp
    from jreshard.errors import PeerError
    from jreshard.nixl import NixlAgent, NixlComm

    ch_a, ch_b = channel_pair(KEY.encode())
    agents = NixlAgent(name="pdesc-a", host="127.0.0.1"), NixlAgent(name="pdesc-b", host="127.0.0.1")
    comms: dict = {}
    t = threading.Thread(target=lambda: comms.setdefault("b", NixlComm(agents[1], [1], {0: ch_b}, timeout_s=10)))
    t.start()
    comms["a"] = NixlComm(agents[0], [0], {1: ch_a}, timeout_s=10)
    t.join(10)
    a, b = comms["a"], comms["b"]
    a.prepares, b.prepares = a_prepares, True
    try:
        landing = np.zeros(64, np.uint8)
        prepared = b.prepare([([], [(0, 1, 5, 0, 0, 64)])])  # b receives 64 bytes from a in its one group
        assert prepared is not None
        prepared.bind(np.array([landing.ctypes.data]), np.array([64]), [landing])  # posts nixl.pdesc to a
        mail, got = np.arange(16, dtype=np.uint8), np.zeros(16, np.uint8)
        failed: list[Exception] = []

        def send() -> None:
            try:
                b.exchange([SendOp(1, 0, 9, mail)], [], timeout_s=10)
            except PeerError as err:  # a refused the exchange, and said so
                failed.append(err)

        sent = threading.Thread(target=send)
        sent.start()
        deadline = time.monotonic() + 10  # the descriptors are in a's inbox before its exchange reads it
        while not any(m.get("op") == "nixl.pdesc" for m in ch_a.inbox) and time.monotonic() < deadline:
            ch_a.pump()
            time.sleep(0.001)
        if a_prepares:
            a.exchange([], [RecvOp(1, 0, 9, got)], timeout_s=10)
            assert np.array_equal(got, mail)
            assert [m["op"] for m in ch_a.inbox] == ["nixl.pdesc"]  # left for a's schedule
        else:
            with pytest.raises(PeerError, match="prepared its groups and this side did not"):
                a.exchange([], [RecvOp(1, 0, 9, got)], timeout_s=10)
        sent.join(15)
        assert not sent.is_alive() and len(failed) == (0 if a_prepares else 1), failed
        prepared.release()
        deadline = time.monotonic() + 10
        while agents[1].unfinished and time.monotonic() < deadline:  # a WRITE b gave up lands (a makes progress)
            agents[0].arrived(set())
    finally:
        for x in (*agents, ch_a, ch_b):
            x.close()
