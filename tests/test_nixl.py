"""The NIXL transport and its authenticated control channel.

The engine runs the MPI test's refit over NixlComm between two separate processes (bit-exact,
bytes counted, a silent peer timed out); the channel refuses wrong keys, garbage and oversized
frames; the agent registers each buffer's allocation once and releases it when it dies.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jreshard.errors import AuthenticationError, PeerError, TransferTimeoutError
from jreshard.net import auth
from jreshard.net.channel import Channel, connect, listen, parse_address

pytest.importorskip("nixl_cu12", reason="the NIXL tests need nixl-cu12 (pip install --no-deps nixl-cu12)")

ROOT = Path(__file__).parent.parent
KEY = b"test-key-0123456789abcdef"
pytestmark = pytest.mark.timeout(60)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return env | {"PYTHONPATH": str(ROOT), "JRESHARD_SECRET": KEY.decode(), "OMP_NUM_THREADS": "1"}


def test_the_engine_runs_the_mpi_refit_over_nixl_between_two_processes(tmp_path):
    body = ROOT / "tests" / "nixl_bodies" / "engine_pair.py"
    address = str(tmp_path / "address")
    procs = [
        subprocess.Popen([sys.executable, str(body), str(p), address], env=_env(), stdout=subprocess.PIPE, text=True)
        for p in (0, 1)
    ]
    outs = [p.communicate(timeout=50)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    got = [json.loads(next(ln for ln in out.splitlines() if ln.startswith("{"))) for out in outs]
    assert all(g["checked"] == got[0]["checked"] > 0 for g in got)
    assert sum(g["sent"]["NETWORK"] for g in got) == got[0]["network"] > 0  # every planned byte, once
    assert sum(g["sent"]["FAST"] for g in got) == got[0]["fast"] > 0
    assert all(g["rounds"] > 1 for g in got)  # chunked and grouped as the MPI test is
    err = got[1]["timed_out"]
    assert err is not None and "timeout_s=1.0" in err and "ranks [0] did not send (process 0)" in err
    assert 1.0 <= got[1]["elapsed"] < 5.0  # the 1 s timeout, with a loaded host's slack


def test_a_write_given_up_keeps_its_memory_until_nixl_is_done_with_it(tmp_path):
    """A receiver SIGSTOPped with a 64 MiB WRITE to it running (UCX over TCP, which cannot cancel a put): the
    sender's exchange times out, its send buffer is dropped and dead registrations are released, then the
    receiver continues. The WRITE given up goes on reading that buffer: the agent keeps it, and its
    registration, until NIXL has finished it (released under it, UCX's heap was corrupted: a crash at the
    next refit, or "double free" at exit)."""
    body = ROOT / "tests" / "nixl_bodies" / "given_up_write.py"
    env = _env() | {"UCX_TLS": "tcp,self", "PYTHONPATH": os.pathsep.join([str(body.parent), str(ROOT)])}
    address = str(tmp_path / "address")
    procs = [
        subprocess.Popen(
            [sys.executable, str(body), str(p), address, "64"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for p in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=50)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    for out in outs:
        assert "UCX  WARN" not in out and "UCX  ERROR" not in out and "free()" not in out, out
    sender, receiver = (json.loads(out.strip().splitlines()[-1]) for out in outs)
    assert sender["error"] == "TransferTimeoutError" and sender["unfinished"] == 1, sender
    assert sender["registered_while_unfinished"] >= 64 << 20, sender  # kept while the WRITE ran
    assert sender["registered_after"] == 0, sender  # released once it finished
    assert receiver["late_write_landed"], receiver  # into the buffer it abandoned, kept alive for it


# ---- authentication -----------------------------------------------------------------------------
def test_the_secret_comes_from_options_the_environment_or_a_file(tmp_path):
    f = tmp_path / "key"
    f.write_bytes(b"from-a-file-0123456789\n")
    assert auth.resolve_secret(KEY, environ={"JRESHARD_SECRET": "other-key-0123456789"}) == KEY
    assert auth.resolve_secret(None, environ={"JRESHARD_SECRET_FILE": str(f)}) == b"from-a-file-0123456789"
    with pytest.raises(ValueError, match="need a shared secret; the fix is"):
        auth.resolve_secret(None, environ={})
    with pytest.raises(ValueError, match="has 5 bytes; it needs at least 16"):
        auth.resolve_secret(None, environ={"JRESHARD_SECRET": "short"})
    with pytest.raises(ValueError, match="cannot be read"):
        auth.resolve_secret(None, environ={"JRESHARD_SECRET_FILE": str(tmp_path / "missing")})
    from jreshard import Options

    with pytest.raises(ValueError, match=r"secret must be None or bytes of length >= 16 \(got 3 bytes\)"):
        Options(secret=b"abc")
    assert "secret" not in repr(Options(secret=KEY)) and KEY.decode() not in repr(Options(secret=KEY))


class _Server:
    """Accepts connections and authenticates each with Channel.server; echoes every message back."""

    def __init__(self, key: bytes = KEY, deadline_s: float = 0.5):
        self.sock = listen("127.0.0.1", 0)
        self.address = self.sock.getsockname()[:2]
        self.key, self.deadline_s = key, deadline_s
        self.refused: list[str] = []
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import select

        pending: list[tuple[Channel, float]] = []
        live: list[Channel] = []
        while not self.stop:
            select.select([self.sock, *(c for c, _ in pending), *live], [], [], 0.01)
            try:
                s, _ = self.sock.accept()
                pending.append((Channel.server(s, "a client", key=self.key), time.monotonic() + self.deadline_s))
            except BlockingIOError:
                pass
            for ch, deadline in list(pending):
                try:
                    ch.pump()
                except PeerError as err:
                    self.refused.append(str(err))
                    pending.remove((ch, deadline))
                    continue
                if ch.authenticated:
                    pending.remove((ch, deadline))
                    live.append(ch)
                elif time.monotonic() > deadline:
                    self.refused.append("silent")
                    pending.remove((ch, deadline))
                    ch.close()
            for ch in list(live):
                try:
                    ch.pump()
                except PeerError as err:
                    self.refused.append(str(err))
                    live.remove(ch)
                    ch.close()
                    continue
                while ch.inbox:
                    ch.send_control(ch.inbox.popleft() | {"echo": True}, timeout_s=1.0)
                if ch.eof:
                    live.remove(ch)
                    ch.close()
        for ch in [c for c, _ in pending] + live:
            ch.close()

    def ask(self) -> dict:
        ch = connect(self.address, "the server", key=KEY, timeout_s=5.0)
        ch.send_control({"op": "ping"}, timeout_s=1.0)
        try:
            return ch.recv_control(timeout_s=5.0)
        finally:
            ch.close()

    def close(self) -> None:
        self.stop = True
        self.thread.join(5)
        self.sock.close()


def test_wrong_keys_garbage_silence_and_huge_frames_are_refused_and_the_server_serves_on(caplog):
    server = _Server()
    try:
        assert server.ask() == {"op": "ping", "echo": True}
        with pytest.raises(AuthenticationError, match="different secrets"):  # a client with a wrong key
            connect(server.address, "the server", key=b"not-the-key-0123456789", timeout_s=5.0)
        raw = socket.create_connection(server.address)  # 64 KiB of random bytes
        raw.sendall(np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes())
        silent = socket.create_connection(server.address)  # a client with no key says nothing
        time.sleep(0.8)
        assert server.ask()["echo"]
        huge = connect(server.address, "the server", key=KEY, timeout_s=5.0)  # a frame claiming 2^60 bytes
        huge.sock.sendall(b"\x01" + (1 << 60).to_bytes(8, "big"))
        time.sleep(0.2)
        assert server.ask()["echo"]
        assert any("wrong or missing key" in r for r in server.refused)
        assert any("garbage" in r for r in server.refused)
        assert "silent" in server.refused
        assert any("claims 1152921504606846976 bytes" in r for r in server.refused)
        assert "refused a connection from 127.0.0.1" in caplog.text
        for s in (raw, silent, huge):
            s.close()
    finally:
        server.close()


def test_a_server_without_the_key_cannot_pose_as_a_peer():
    server = _Server(key=b"impostor-key-0123456789")
    try:
        with pytest.raises(AuthenticationError):
            connect(server.address, "the server", key=KEY, timeout_s=5.0)
    finally:
        server.close()


def test_a_listener_that_says_nothing_times_out_and_a_gone_one_is_refused_at_once():
    quiet = listen("127.0.0.1", 0)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="did not complete authentication"):
        connect(quiet.getsockname()[:2], "the trainer", key=KEY, timeout_s=0.3)
    assert time.monotonic() - t0 < 4.0  # its own 0.3 s (slack for a loaded host)
    address = quiet.getsockname()[:2]
    quiet.close()
    with pytest.raises(PeerError, match="refused the connection"):
        connect(address, "replica 'x'", key=KEY, timeout_s=30.0, retry=False)


def test_addresses_name_any_host_and_listen_binds_what_is_given(tmp_path):
    assert parse_address("10.1.2.3:9", timeout_s=1) == ("10.1.2.3", 9)
    (tmp_path / "a").write_text("host:notaport")
    with pytest.raises(ValueError, match="must be 'HOST:PORT'"):
        parse_address(str(tmp_path / "a"), timeout_s=0.1)
    with pytest.raises(TransferTimeoutError, match="did not appear"):
        parse_address("/nonexistent/address", timeout_s=0.1)
    s = listen("0.0.0.0", 0)
    assert s.getsockname()[0] == "0.0.0.0"
    s.close()
    with pytest.raises(ValueError, match=r"cannot bind 192\.0\.2\.1"):
        listen("192.0.2.1", 0)  # TEST-NET-1: no interface of this machine


# ---- the agent ----------------------------------------------------------------------------------
def test_a_buffer_allocation_is_registered_once_and_released_when_it_dies():
    from jreshard.nixl import NixlAgent

    agent = NixlAgent()
    try:
        block = np.zeros(1 << 16, np.uint8)
        a, b = agent.region(block[:100]), agent.region(block[4096:8192])
        assert a.key == b.key and b.address == block.ctypes.data + 4096 and b.nbytes == 4096
        assert agent.registered_bytes == 1 << 16
        del block, a, b
        assert agent.registered_bytes == 0
        agent.region(np.ones(10, np.uint8))
    finally:
        agent.close()
    assert agent.registered_bytes == 0


def test_a_pools_block_keeps_its_registration_from_one_lease_to_the_next():
    from jreshard.engine.pool import BufferPool
    from jreshard.nixl import NixlAgent

    agent, pool = NixlAgent(), BufferPool()
    try:
        lease = pool.take(1000)
        first = agent.region(lease[64:128])
        addr = lease.ctypes.data
        del lease  # the block goes back to the pool, which keeps it
        again = pool.take(1000)
        assert again.ctypes.data == addr  # the same block, a new lease
        assert agent.region(again).key == first.key and agent.registrations == 1
        del again
        pool.clear()  # the block dies: its registration goes with it
        assert agent.registered_bytes == 0
    finally:
        agent.close()


def test_registrations_never_nest_and_a_write_across_a_view_registered_inside_another_finds_its_memory(caplog):
    """NIXL finds the registration of a range by the nearest one starting at or before it: a registration nested in
    another (a view whose owner is not its ``base``, as a view of jax's memory) hid the larger one from every range
    starting inside it and ending past it (``NIXL_ERR_NOT_FOUND`` at the WRITE's post). Such a view joins the
    registration that holds it."""
    from jreshard.engine.comm import RecvOp, SendOp

    a, b, closing = _nixl_pair(False)
    try:
        agent = a._agent
        block = np.arange(1 << 14, dtype=np.uint32).view(np.uint8)  # 64 KiB
        first = agent.region(block[:10])
        made = agent.registrations
        inner = np.frombuffer((ctypes.c_uint8 * 4096).from_address(block.ctypes.data + 4096), np.uint8)
        assert inner.base is not None and not isinstance(inner.base, np.ndarray)  # its owner is not found from it
        assert agent.region(inner).key == first.key and agent.registrations == made
        shifted = np.frombuffer((ctypes.c_uint8 * 8192).from_address(block.ctypes.data + 8192), np.uint8)
        assert agent.region(shifted).key == first.key  # one that is not at the start either
        msg = block[6000:12000]  # starts inside inner's range, ends past it
        rx = np.zeros(len(msg), np.uint8)
        t = threading.Thread(target=lambda: a.exchange([SendOp(0, 1, 0, msg)], [], timeout_s=10))
        t.start()
        b.exchange([], [RecvOp(0, 1, 0, rx)], timeout_s=10)
        t.join(10)
        assert rx.tobytes() == msg.tobytes()
        del inner, shifted
        assert agent.registered_bytes >= block.nbytes  # the block's registration outlives the views in it
        for _ in range(100):  # views that come and go inside it (a step's views of jax's memory): held, then let go
            view = np.frombuffer((ctypes.c_uint8 * 64).from_address(block.ctypes.data + 64), np.uint8)
            assert agent.region(view).key == first.key
        assert len(agent._regs[first.key].roots) <= 2 and agent.registrations == made
        for _ in range(100):  # one that lives on, seen every step: in it once
            assert agent.region(view).key == first.key
        assert len(agent._regs[first.key].roots) == 2
        # the other way round (a view holding memory registered before it) is registered beside it, and said
        other = np.zeros(1 << 16, np.uint8)
        small = np.frombuffer((ctypes.c_uint8 * 4096).from_address(other.ctypes.data + 4096), np.uint8)
        agent.region(small)
        around = np.frombuffer((ctypes.c_uint8 * (1 << 14)).from_address(other.ctypes.data), np.uint8)
        with caplog.at_level(logging.WARNING, logger="jreshard.nixl"):
            agent.region(around)
        assert "hold or overlap memory registered before them" in caplog.text
    finally:
        for x in closing:
            x.close()


def test_a_registration_made_again_at_the_same_place_is_a_new_one():
    """A root collected and another allocated where it was: a new registration (a new serial), and the agent's
    epoch moves, so whoever kept addresses (prepared groups) binds again rather than trusting them."""
    from jreshard.nixl import NixlAgent

    agent = NixlAgent()
    try:
        a = np.zeros(1 << 20, np.uint8)
        where, first = a.ctypes.data, agent.region(a)
        epoch = agent.epoch
        del a
        gc.collect()
        assert agent.epoch > epoch
        b = np.zeros(1 << 20, np.uint8)
        again = agent.region(b)
        assert again.serial > first.serial and agent.registered_bytes == 1 << 20
        assert b.ctypes.data != where or again.key == first.key  # (the same place, most often: the same key)
    finally:
        agent.close()


def test_a_process_group_forms_past_garbage_gathers_and_sees_a_closed_peer_at_once():
    from jreshard.nixl.group import ProcessGroup

    port = listen("127.0.0.1", 0)
    where = port.getsockname()[:2]
    port.close()
    address = f"{where[0]}:{where[1]}"
    groups: dict = {}

    def join(role: str) -> None:
        groups[role] = ProcessGroup.join(role, address, index=0, count=1, key=KEY, timeout_s=10.0)

    source = threading.Thread(target=join, args=("source",))
    source.start()
    time.sleep(0.2)
    raw = socket.create_connection(where)  # garbage first: refused, the rendezvous goes on
    raw.sendall(b"\x00" * 100)
    join("destination")
    source.join()
    src, dst = groups["source"], groups["destination"]
    assert (src.rank, dst.rank, src.roles) == (0, 1, {0: "source", 1: "destination"})
    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("src", src.allgather({"v": 1}, timeout_s=5.0)))
    t.start()
    assert dst.allgather({"v": 2}, timeout_s=5.0) == {0: {"v": 1}, 1: {"v": 2}}
    t.join()
    assert got["src"] == {0: {"v": 1}, 1: {"v": 2}}
    src.notify_closed()
    src.close()
    t0 = time.monotonic()
    with pytest.raises(PeerError, match=r"process 0 \(source\) closed the group"):
        dst.allgather({"v": 3}, timeout_s=30.0)
    assert time.monotonic() - t0 < 10.0  # at once, not after the 30 s timeout (slack for a loaded host)
    dst.close()
    raw.close()


def _nixl_pair(encrypt: bool):
    """Two NixlComms over loopback in this process: a drives ranks 0 and 2, b drives rank 1."""
    from _loopback import channel_pair

    from jreshard.nixl import NixlAgent, NixlComm

    server, client = channel_pair(KEY)
    agents = NixlAgent(name="sized-a", host="127.0.0.1"), NixlAgent(name="sized-b", host="127.0.0.1")
    comms: dict = {}

    def make_b() -> None:
        comms["b"] = NixlComm(agents[1], [1], {0: client, 2: client}, timeout_s=10, encrypt=encrypt)

    t = threading.Thread(target=make_b)
    t.start()
    comms["a"] = NixlComm(agents[0], [0, 2], {1: server}, timeout_s=10, encrypt=encrypt)
    t.join(10)
    return comms["a"], comms["b"], (*agents, server, client)


@pytest.mark.parametrize("encrypt", [False, True])
def test_sized_messages_land_in_one_group_and_a_count_past_the_receive_is_refused(encrypt, monkeypatch):
    """exchange_sized: each message lands in the first bytes of a receive posted at the most it may hold (the
    rest untouched), the sizes come back in order, local copies too; a message longer than its receive is
    refused by its sender before anything is written; a count past the receive is refused unread."""
    from jreshard.engine.comm import RecvOp, SendOp
    from jreshard.errors import PeerError
    from jreshard.nixl import NixlAgent

    a, b, closing = _nixl_pair(encrypt)
    try:
        msgs = [np.arange(n, dtype=np.uint8) + 1 for n in (0, 5, 100)]
        into = [np.full(100, 0xEE, np.uint8) for _ in msgs]
        local_in = np.full(10, 0xEE, np.uint8)
        sent: dict = {}
        t = threading.Thread(
            target=lambda: sent.setdefault(
                "a",
                a.exchange_sized(
                    [SendOp(0, 1, k, m) for k, m in enumerate(msgs)] + [SendOp(0, 2, 9, msgs[1])],
                    [RecvOp(0, 2, 9, local_in)],
                    timeout_s=10,
                ),
            )
        )
        t.start()
        got = b.exchange_sized([], [RecvOp(0, 1, k, x) for k, x in enumerate(into)], timeout_s=10)
        t.join(10)
        assert got == [0, 5, 100] and sent["a"] == [5]
        for m, x in zip(msgs, into, strict=True):
            assert x[: len(m)].tobytes() == m.tobytes() and (x[len(m) :] == 0xEE).all()
        assert local_in[:5].tobytes() == msgs[1].tobytes() and (local_in[5:] == 0xEE).all()

        failed: dict = {}

        def too_long() -> None:
            try:
                a.exchange_sized([SendOp(0, 1, 3, np.zeros(101, np.uint8))], [], timeout_s=10)
            except PeerError as err:
                failed["a"] = str(err)

        t = threading.Thread(target=too_long)
        t.start()
        rx = np.full(100, 0xEE, np.uint8)
        with pytest.raises(PeerError):
            b.exchange_sized([], [RecvOp(0, 1, 3, rx)], timeout_s=10)
        t.join(10)
        assert "101 bytes under tag 3, but the receive holds at most 100" in failed["a"] and (rx == 0xEE).all()
    finally:
        for x in closing:
            x.close()

    a, b, closing = _nixl_pair(encrypt)  # the broken pair is done; a fresh one meets a count past the receive
    real = NixlAgent.arrived

    def lying(self, ids, sizes=None):
        out = real(self, ids, sizes)
        if sizes is not None:
            for i in sizes:
                sizes[i] += 1000
        return out

    try:
        monkeypatch.setattr(NixlAgent, "arrived", lying)
        t = threading.Thread(target=lambda: a.exchange_sized([SendOp(0, 1, 4, msgs[1])], [], timeout_s=10))
        t.start()
        said = r"says (1005|1021) bytes were written; its receive takes (0 to 100|16 to 116): refused unread"
        with pytest.raises(PeerError, match=said):  # (encrypted: the sealed sizes, 16 bytes more)
            b.exchange_sized([], [RecvOp(0, 1, 4, np.zeros(100, np.uint8))], timeout_s=10)
        t.join(10)
    finally:
        for x in closing:
            x.close()
