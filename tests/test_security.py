"""Past the handshake, as an attacker without the secret on loopback: a reader of the control channel, a
relay that alters, drops, replays or reorders one frame, a stranger NIXL agent that forges notifications,
bytes altered on their way, and hundreds of silent connections. The trainer and replicas run in this
process (8 CPU devices), every connection real TCP on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jreshard import Options, PeerError, TransferTimeoutError
from jreshard.elastic import ElasticReplica, ElasticTrainer
from jreshard.engine.comm import RecvOp
from jreshard.errors import AuthenticationError
from jreshard.net import auth
from jreshard.net.channel import Channel, connect, listen, parse_address
from jreshard.nixl import NixlAgent, NixlComm
from jreshard.nixl import agent as agent_module
from jreshard.nixl.group import ProcessGroup

pytestmark = pytest.mark.timeout(120)
D = jax.devices()
SHAPES = {"a": (16, 8), "b": (8,)}
KEY = b"security-test-key-0123456789"
OPTS = Options(timeout_s=5.0, chunk_bytes=64, staging_bytes=1024, secret=KEY)


def params(v: int) -> dict:
    mesh = Mesh(np.array(D[:2]), ("fsdp",))
    return {
        k: jax.device_put(np.arange(np.prod(s), dtype=np.float32).reshape(s) + 100 * v, NamedSharding(mesh, P("fsdp")))
        for k, s in SHAPES.items()
    }


def like(i: int) -> dict:
    mesh = Mesh(np.array(D[2 * i : 2 * i + 2]).reshape(1, 2), ("dp", "tp"))
    return {
        k: jax.ShapeDtypeStruct(s, np.float32, sharding=NamedSharding(mesh, P(None, "tp") if len(s) == 2 else P()))
        for k, s in SHAPES.items()
    }


def exact(tree: dict, v: int) -> bool:
    want = params(v)
    return all(np.array_equal(np.asarray(tree[k]), np.asarray(want[k])) for k in SHAPES)


class Relay:
    """A man in the middle: forwards one client's connection to ``target``, records every byte, and once
    armed changes the first frame(s) of one direction after the handshake: ``alter`` flips a byte of one
    frame, ``drop`` swallows it, ``replay`` sends it twice, ``reorder`` swaps it with the next."""

    def __init__(self, target: tuple[str, int], mode: str = "", downstream: bool = True):
        self.target, self.mode, self.downstream = target, mode, downstream
        self.listener = listen("127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.seen = {True: bytearray(), False: bytearray()}  # downstream (server -> client), upstream
        self.armed = False
        self.done = False
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop and not select.select([self.listener], [], [], 0.05)[0]:
            pass
        if self.stop:
            return
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target)
        # bytes of handshake in each direction, then frames (9-byte header + body)
        skip = {True: auth.CHALLENGE_BYTES + auth.PROOF_BYTES, False: auth.ANSWER_BYTES}
        buf = {True: bytearray(), False: bytearray()}
        held: list[bytes] = []
        ends = {server: (True, client), client: (False, server)}
        try:
            while not self.stop:
                ready, _, _ = select.select([server, client], [], [], 0.05)
                for s in ready:
                    down, to = ends[s]
                    try:
                        data = s.recv(1 << 16)
                    except OSError:  # an end reset the connection: the relay ends with it
                        return
                    if not data:
                        return
                    self.seen[down] += data
                    buf[down] += data
                    out = bytearray()
                    n = min(skip[down], len(buf[down]))
                    out += buf[down][:n]
                    del buf[down][:n]
                    skip[down] -= n
                    while skip[down] == 0 and len(buf[down]) >= 9:
                        size = 9 + int.from_bytes(buf[down][1:9], "big")
                        if len(buf[down]) < size:
                            break
                        frame = bytes(buf[down][:size])
                        del buf[down][:size]
                        out += self._tamper(frame, held) if down == self.downstream else frame
                    try:
                        to.sendall(out)
                    except OSError:  # the other end closed (it refused what it got, as it should): the relay ends
                        return
        finally:
            client.close()
            server.close()

    def _tamper(self, frame: bytes, held: list[bytes]) -> bytes:
        if not self.armed or self.done:
            return frame
        if self.mode == "alter":
            self.done = True
            return frame[:-1] + bytes([frame[-1] ^ 1])
        if self.mode == "drop":
            self.done = True
            return b""
        if self.mode == "replay":
            self.done = True
            return frame + frame
        if not held:  # reorder: hold this one, send it after the next
            held.append(frame)
            return b""
        self.done = True
        return frame + held.pop()

    def close(self) -> None:
        self.stop = True
        self.thread.join(5)
        self.listener.close()


@pytest.fixture
def trainer():
    tr = ElasticTrainer(params(0), devices=list(D[:2]), options=OPTS)
    yield tr
    tr.close()


def _where(tr: ElasticTrainer) -> tuple[str, int]:
    return parse_address(tr.address, timeout_s=1.0)


def test_a_reader_of_the_control_channel_sees_no_message_descriptor_or_agent(trainer):
    relay = Relay(_where(trainer))
    r = ElasticReplica(like(1), relay.address, name="replica-under-watch", devices=list(D[2:4]), options=OPTS)
    try:
        report = trainer.push(params(1), version=1)
        assert report.committed == ("replica-under-watch",) and exact(r.pull()[0], 1)
        seen = bytes(relay.seen[True] + relay.seen[False])
        assert len(seen) > 1000  # welcome, declarations, the NIXL introduction, posts, tags, versions
        agent = NixlAgent.shared().name.encode()
        for plain in (b'"op"', b"welcome", b"nixl", b"version", b"decl", b"DRAM", b"replica-under-watch", agent):
            assert plain not in seen, plain
    finally:
        r.leave()
        relay.close()


@pytest.mark.parametrize(
    "mode,downstream", [("alter", True), ("drop", True), ("replay", True), ("reorder", True), ("alter", False)]
)
def test_a_relay_that_changes_one_frame_is_detected_and_the_replica_keeps_its_version(trainer, mode, downstream):
    relay = Relay(_where(trainer), mode, downstream)
    r = ElasticReplica(like(1), relay.address, name="r1", devices=list(D[2:4]), options=OPTS)
    try:
        assert trainer.push(params(1), version=1).committed == ("r1",)
        assert r.pull(newer_than=0, timeout_s=5.0)[1] == 1
        relay.armed = True  # the next frame: the trainer's refit to version 2 (or the replica's next word)
        report = trainer.push(params(2), version=2)
        assert relay.done and report.committed == () and list(report.lost) == ["r1"]
        tree, version = r.pull(allow_stale=True)  # dropped: stale, handed out only when asked
        assert version == 1 and exact(tree, 1)  # the previous version, whole
        if downstream:  # the replica saw it and says why
            with pytest.raises(PeerError, match="failed its integrity check"):
                r.pull(newer_than=1, timeout_s=5.0)
        assert r.version == 1
    finally:
        r.leave()
        relay.close()


def test_bytes_altered_on_the_way_fail_the_refit_and_every_replica_keeps_its_version(trainer, monkeypatch):
    # delta="off": the bit is flipped in a full refit's weights (a delta refit's flipped encoding can fail to decode
    # before the MACs are compared)
    off = dataclasses.replace(OPTS, delta="off")
    r = ElasticReplica(like(1), trainer.address, name="r1", devices=list(D[2:4]), options=off)
    try:
        assert trainer.push(params(1), version=1).committed == ("r1",)
        assert r.pull(newer_than=0, timeout_s=5.0)[1] == 1
        flipped = []
        real = NixlComm.exchange

        def altered(self, sends, recvs, *, timeout_s):  # one bit of the first weights the replica gets flipped
            real(self, sends, recvs, timeout_s=timeout_s)
            for recv in recvs:
                weights = recv.dst >= 2 and recv.tag < 1 << 30  # the replica's ranks; not the schedule's mail
                if weights and recv.src not in self.local_ranks and recv.buffer.nbytes and not flipped:
                    recv.buffer[0] ^= 1
                    flipped.append(recv)

        monkeypatch.setattr(NixlComm, "exchange", altered)
        monkeypatch.setattr(NixlComm, "prepares", False)  # the bit is flipped on the per-operation path
        report = trainer.push(params(2), version=2)
        assert len(flipped) == 1 and list(report.lost) == ["r1"]
        assert "refit refused: the keyed MACs (AES-GMAC) of 1 stream(s) do not match" in report.lost["r1"]
        tree, version = r.pull(allow_stale=True)  # dropped: stale, handed out only when asked
        assert version == 1 and exact(tree, 1)
        with pytest.raises(PeerError, match=r"do not match .* every destination keeps its previous version"):
            r.pull(newer_than=1, timeout_s=5.0)
    finally:
        r.leave()


def test_every_byte_of_a_refit_is_maced_on_both_sides(trainer):
    r = ElasticReplica(like(1), trainer.address, name="r1", devices=list(D[2:4]), options=OPTS)
    try:
        assert trainer.push(params(1), version=1).committed == ("r1",)
        assert exact(r.pull(newer_than=0, timeout_s=5.0)[0], 1)
        cost = r.arrivals[-1].digest
        assert cost is not None and cost.kind == "mac" and cost.seconds > 0
        assert cost.nbytes >= sum(4 * np.prod(s) for s in SHAPES.values())  # every byte of the version
    finally:
        r.leave()


def test_forged_notifications_from_a_stranger_agent_are_ignored():
    a, b = socket.socketpair()
    left, right = Channel(a, "peer 'right'"), Channel(b, "peer 'left'")
    agent = NixlAgent.shared()
    threading.Thread(target=lambda: NixlComm(agent, [0], {1: left}, timeout_s=5.0), daemon=True).start()
    rx = NixlComm(agent, [1], {0: right}, timeout_s=5.0)
    stranger = NixlAgent(name="stranger")
    try:
        # the worst case: the stranger holds the receiver's metadata (it never travels in the clear)
        stranger.nixl.add_remote_agent(agent.nixl.get_agent_metadata())
        ignored = agent.ignored

        def forge():
            deadline = time.monotonic() + 0.8
            while time.monotonic() < deadline:
                for i in [*agent._expected, *range(1, 4)]:  # the ids it waits on (read from inside: a stranger
                    stranger.nixl.send_notif(agent.name, b"jreshard:" + str(i).encode())  # cannot), and small ones
                stranger.nixl.get_new_notifs()  # its own progress: the notifications leave
                time.sleep(0.05)

        forger = threading.Thread(target=forge, daemon=True)
        forger.start()
        got = np.zeros(8, np.uint8)
        with pytest.raises(TransferTimeoutError, match=r"ranks \[0\] did not send"):
            rx.exchange([], [RecvOp(0, 1, 3, got)], timeout_s=1.5)
        forger.join()
        deadline = time.monotonic() + 5.0
        while agent.ignored == ignored and time.monotonic() < deadline:
            stranger.nixl.get_new_notifs()
            agent.arrived(set())
            time.sleep(0.01)
        assert agent.ignored > ignored and not got.any()
    finally:
        stranger.close()
        left.close()
        right.close()


def _flood(where: tuple[str, int], n: int) -> list[socket.socket]:
    return [socket.create_connection(where, timeout=5.0) for _ in range(n)]


def _dropped(silent: list[socket.socket]) -> int:
    """How many of ``silent`` were told they were displaced (challenge, then the CROWDED code, then EOF)."""
    n = 0
    for s in silent:
        s.setblocking(False)
        try:
            data = s.recv(4096)
        except BlockingIOError:
            continue
        n += b"JRSH:CROWDED" in data
    return n


def test_300_silent_connections_do_not_delay_a_join(trainer):
    silent = _flood(_where(trainer), 300)
    try:
        time.sleep(0.5)  # the trainer accepts them all
        t0 = time.monotonic()
        r = ElasticReplica(like(1), trainer.address, name="r1", devices=list(D[2:4]), options=OPTS)
        joined = time.monotonic() - t0
        r.leave()
        assert joined < 2.0, joined
        time.sleep(0.2)
        assert _dropped(silent) >= 300 - 32  # displaced and told why; at most 32 from one address stay
    finally:
        for s in silent:
            s.close()


def _coordinator(address: str) -> tuple[threading.Thread, dict]:
    """Process 0 of a one-source, one-destination ProcessGroup at ``address``, joining in a thread; ``made["0"]`` is
    its group once formed."""
    made: dict = {}

    def coordinate():
        made["0"] = ProcessGroup.join("source", address, index=0, count=1, key=KEY, timeout_s=30)

    zero = threading.Thread(target=coordinate)
    zero.start()
    return zero, made


def test_300_silent_connections_do_not_delay_a_refit_groups_rendezvous(tmp_path):
    address = str(tmp_path / "group")
    zero, made = _coordinator(address)
    silent = _flood(parse_address(address, timeout_s=10.0), 300)
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        dst = ProcessGroup.join("destination", address, index=0, count=1, key=KEY, timeout_s=30)
        joined = time.monotonic() - t0
        zero.join(10)
        assert joined < 2.0, joined
        assert dst.rank == 1 and made["0"].rank == 0
        dst.close()
        made["0"].close()
    finally:
        for s in silent:
            s.close()


def test_a_connection_too_slow_to_authenticate_is_dropped_and_told_why():
    listener = listen("127.0.0.1", 0)
    client = socket.create_connection(listener.getsockname()[:2])
    try:
        select.select([listener], [], [], 5.0)
        sock, _ = listener.accept()
        ch = Channel.server(sock, "a slow client", key=KEY, handshake_s=0.2)
        ch.pump()
        time.sleep(0.3)
        with pytest.raises(AuthenticationError, match="did not complete the handshake within its deadline"):
            ch.pump()
        client.settimeout(5.0)
        got = b""
        while len(got) < auth.CHALLENGE_BYTES + auth.PROOF_BYTES:
            chunk = client.recv(4096)
            if not chunk:
                break
            got += chunk
        assert got[auth.CHALLENGE_BYTES :].startswith(b"JRSH:TOO-SLOW")
    finally:
        client.close()
        listener.close()


def _accepted(listener: socket.socket, key: bytes) -> Channel:
    select.select([listener], [], [], 5.0)
    sock, _ = listener.accept()
    return Channel.server(sock, "a client", key=key)


def test_past_the_limit_the_oldest_silent_connection_is_displaced_and_told_why(monkeypatch):
    from jreshard.net import channel as channel_module

    monkeypatch.setattr(channel_module, "MAX_UNAUTHENTICATED_PER_HOST", 1)
    listener = listen("127.0.0.1", 0)
    where = listener.getsockname()[:2]
    silent = socket.create_connection(where)
    first = _accepted(listener, KEY)
    late = socket.create_connection(where)
    second = _accepted(listener, KEY)
    try:
        assert channel_module.make_room([first], second) is first and first.eof
        silent.settimeout(5.0)
        got = b""
        while chunk := silent.recv(4096):
            got += chunk
        assert got[auth.CHALLENGE_BYTES :] == b"JRSH:CROWDED".ljust(auth.PROOF_BYTES, b"\0")
    finally:
        for c in (first, second):
            c.close()
        for s in (silent, late):
            s.close()
        listener.close()


def test_a_connection_that_answered_is_not_displaced(monkeypatch):
    from jreshard.net import channel as channel_module

    monkeypatch.setattr(channel_module, "MAX_UNAUTHENTICATED_PER_HOST", 1)
    listener = listen("127.0.0.1", 0)
    where = listener.getsockname()[:2]
    made: dict = {}
    client = threading.Thread(target=lambda: made.setdefault("c", connect(where, "the server", key=KEY, timeout_s=5)))
    client.start()
    first = _accepted(listener, KEY)  # its answer is on the way, not read yet
    time.sleep(0.2)
    late = socket.create_connection(where)
    second = _accepted(listener, KEY)
    try:
        assert channel_module.make_room([first], second) is None and first.authenticated
        client.join(5)
        assert isinstance(made["c"], Channel)
    finally:
        for c in (first, second, made.get("c")):
            if c is not None:
                c.close()
        late.close()
        listener.close()


def test_a_client_that_was_displaced_is_told_the_true_reason():
    listener = listen("127.0.0.1", 0)
    errors: list[str] = []

    def client():
        try:
            connect(listener.getsockname()[:2], "the server", key=KEY, timeout_s=5.0)
        except AuthenticationError as err:
            errors.append(str(err))

    t = threading.Thread(target=client)
    t.start()
    select.select([listener], [], [], 5.0)
    sock, _ = listener.accept()
    sock.sendall(auth.challenge()[0])
    ch = Channel(sock, "a client")  # a server end that drops it, as make_room does, once it has answered
    time.sleep(0.2)
    ch.drop(b"JRSH:CROWDED")
    t.join(10)
    assert errors and "dropped this connection before authenticating it: too many connections" in errors[0]
    listener.close()


def test_a_frame_of_a_sealed_channel_names_its_failure_and_a_plain_frame_is_refused():
    a, b = socket.socketpair()
    ns, nc = bytes(32), bytes(range(32))
    x = Channel(a, "x", session=auth.Session(KEY, ns, nc, client=True))
    y = Channel(b, "y", session=auth.Session(KEY, ns, nc, client=False))
    x.send_control({"op": "hello"}, timeout_s=1.0)
    assert y.recv_control(timeout_s=1.0) == {"op": "hello"}
    a.sendall(b"\x01" + (2).to_bytes(8, "big") + b"{}")  # a plain frame on a sealed channel: a downgrade
    with pytest.raises(PeerError, match="unknown kind 1"):
        y.recv_control(timeout_s=1.0)
    x.close()
    a, b = socket.socketpair()
    y = Channel(b, "y", session=auth.Session(KEY, ns, nc, client=False))
    wrong = auth.Session(b"another-key-0123456789", ns, nc, client=True)  # someone without the key
    header = (2).to_bytes(1, "big") + (20).to_bytes(8, "big")
    a.sendall(header + wrong.seal(header, b"{}" + b" " * 2))
    with pytest.raises(AuthenticationError, match="control frame 0 failed its integrity check"):
        y.recv_control(timeout_s=1.0)
    a.close()


def test_the_session_keys_differ_per_connection_and_per_direction():
    ns, nc = bytes(32), bytes(range(32))
    c = auth.Session(KEY, ns, nc, client=True)
    s = auth.Session(KEY, ns, nc, client=False)
    other = auth.Session(KEY, ns, bytes(reversed(range(32))), client=False)
    sealed = c.seal(b"h", b"same words")
    assert other.open(b"h", sealed) is None  # another connection's keys do not open it
    assert c.seal(b"h", b"same words") != sealed  # the next frame: another nonce
    echo = auth.Session(KEY, ns, nc, client=True)
    assert echo.open(b"h", sealed) is None  # reflected back to its sender: not its receiving key
    assert s.open(b"h", sealed) == b"same words"
    assert agent_module.label(1, 0, 1, 2) != agent_module.label(1, 0, 1, 3)


_PROBE = """
import json, os, subprocess
from jreshard.nixl import NixlAgent
agent = NixlAgent(host={host!r})
table = subprocess.run(["ss", "-ltnH", "-p"], capture_output=True, text=True, timeout=30).stdout
print(json.dumps([agent.interface, [r.split()[3] for r in table.splitlines() if f"pid={{os.getpid()}}," in r]]))
"""


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def namespace():
    """A network namespace of its own with three interfaces, loopback and a veth pair (10.78.N.1 and
    10.79.N.1): ``(name, the first veth's address)``. Deleting the namespace deletes the pair."""
    n = os.getpid() % 200 + 10
    ns = f"jrs{os.getpid()}"
    if shutil.which("ip") is None or _ip("netns", "add", ns).returncode != 0:
        pytest.skip("ip netns cannot run here (needs root and network namespaces)")
    try:
        for step in (
            ("-n", ns, "link", "add", "jrsec0", "type", "veth", "peer", "name", "jrsec1"),
            ("-n", ns, "addr", "add", f"10.78.{n}.1/24", "dev", "jrsec0"),
            ("-n", ns, "addr", "add", f"10.79.{n}.1/24", "dev", "jrsec1"),
            ("-n", ns, "link", "set", "jrsec0", "up"),
            ("-n", ns, "link", "set", "jrsec1", "up"),
            ("-n", ns, "link", "set", "lo", "up"),
        ):
            done = _ip(*step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr}"
        yield ns, f"10.78.{n}.1"
    finally:
        _ip("netns", "del", ns)


def _listening(host: str, prefix: tuple[str, ...] = ()) -> tuple[str, list[str]]:
    """Make a NIXL agent for ``host`` in a fresh process: ``(its interface, the addresses it listens on)``."""
    out = subprocess.run(
        [*prefix, sys.executable, "-c", _PROBE.format(host=host)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    interface, listening = json.loads(out.stdout.strip().splitlines()[-1])
    return interface, listening


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to list listening sockets")
def test_ucx_listens_only_on_the_interface_asked_for():
    interface, listening = _listening("127.0.0.1")
    assert interface == "lo" and listening  # UCX's TCP transport listens, on loopback only
    assert all(a.startswith(("127.", "[::1]")) for a in listening), listening


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to list listening sockets")
def test_ucx_listens_only_on_the_interface_asked_for_among_three(namespace):
    ns, address = namespace
    interface, listening = _listening(address, ("ip", "netns", "exec", ns))
    assert interface == "jrsec0" and listening, listening
    assert all(a.startswith(address + ":") for a in listening), listening  # not loopback, not any other


# ---- Options(encrypt=True) ----------------------------------------------------------------------
SEALED = Options(timeout_s=5.0, chunk_bytes=64, staging_bytes=1024, secret=KEY, encrypt=True)


def test_an_encrypted_refit_is_bit_exact_and_every_message_is_opened(monkeypatch):
    opened = []
    real = NixlComm._check

    def check(self, i, r):
        opened.append(i in self._landing)
        return real(self, i, r)

    monkeypatch.setattr(NixlComm, "_check", check)
    tr = ElasticTrainer(params(0), devices=list(D[:2]), options=SEALED)
    r = ElasticReplica(like(1), tr.address, name="r1", devices=list(D[2:4]), options=SEALED)
    try:
        assert tr.push(params(1), version=1).committed == ("r1",)
        assert exact(r.pull(newer_than=0, timeout_s=5.0)[0], 1)
        assert tr.push(params(2), version=2).committed == ("r1",)
        assert exact(r.pull(newer_than=1, timeout_s=5.0)[0], 2)
        assert opened and all(opened)  # every message landed encrypted and was opened
    finally:
        r.leave()
        tr.close()


def test_an_encrypted_message_altered_on_the_way_keeps_the_previous_version(monkeypatch):
    tr = ElasticTrainer(params(0), devices=list(D[:2]), options=SEALED)
    r = ElasticReplica(like(1), tr.address, name="r1", devices=list(D[2:4]), options=SEALED)
    try:
        assert tr.push(params(1), version=1).committed == ("r1",)
        assert r.pull(newer_than=0, timeout_s=5.0)[1] == 1
        real = NixlComm._check

        def altered(self, i, recv):
            self._landing[i][0] ^= 1  # one bit of the ciphertext that landed
            return real(self, i, recv)

        monkeypatch.setattr(NixlComm, "_check", altered)
        assert list(tr.push(params(2), version=2).lost) == ["r1"]
        tree, version = r.pull(allow_stale=True)  # dropped: stale, handed out only when asked
        assert version == 1 and exact(tree, 1)
        with pytest.raises(PeerError, match="does not open"):
            r.pull(newer_than=1, timeout_s=5.0)
    finally:
        r.leave()
        tr.close()


def test_a_sender_with_encrypt_refuses_a_receiver_without():
    tr = ElasticTrainer(params(0), devices=list(D[:2]), options=SEALED)
    r = ElasticReplica(like(1), tr.address, name="r1", devices=list(D[2:4]), options=OPTS)
    try:
        report = tr.push(params(1), version=1)
        assert list(report.lost) == ["r1"] and "set encrypt=True on both sides" in report.lost["r1"]
        assert r.version is None
    finally:
        r.leave()
        tr.close()


_PATTERN = b"jreshard weights"  # 16 bytes, repeated through the buffer sent
_TWO_AGENTS = """
import socket, sys, threading
import numpy as np
from jreshard.net.channel import Channel, connect, listen
from jreshard.engine.comm import RecvOp, SendOp
from jreshard.nixl import NixlAgent, NixlComm

key, encrypt = b"security-test-key-0123456789", sys.argv[1] == "1"
listener = listen("127.0.0.1", 0)
made = {}
where = listener.getsockname()[:2]
client = threading.Thread(target=lambda: made.setdefault("c", connect(where, "b", key=key, timeout_s=10)))
client.start()
socket.socket.setblocking(listener, True)
sock, _ = listener.accept()
server = Channel.server(sock, "a", key=key)
while not server.authenticated:
    server.pump()
client.join()
a, b = NixlAgent(name="sender", host="127.0.0.1"), NixlAgent(name="receiver", host="127.0.0.1")
comms = {}
def make_tx():
    comms["tx"] = NixlComm(a, [0], {1: server}, timeout_s=10, encrypt=encrypt)
t = threading.Thread(target=make_tx)
t.start()
rx = NixlComm(b, [1], {0: made["c"]}, timeout_s=10, encrypt=encrypt)
t.join()
data = np.frombuffer(%r * (1 << 16), np.uint8)
got = np.zeros_like(data)
t = threading.Thread(target=lambda: comms["tx"].exchange([SendOp(0, 1, 7, data)], [], timeout_s=10))
t.start()
rx.exchange([], [RecvOp(0, 1, 7, got)], timeout_s=10)
t.join()
print("exact" if np.array_equal(got, data) else "differs", flush=True)
"""


def _capture(stop: threading.Event, into: list[bytes]) -> threading.Thread:
    """Every packet on loopback, while ``stop`` is not set (a raw AF_PACKET socket: needs root)."""
    raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    raw.bind(("lo", 0))
    raw.settimeout(0.05)

    def run():
        try:
            while not stop.is_set():
                try:
                    into.append(raw.recv(1 << 17))
                except TimeoutError:
                    pass
        finally:
            raw.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.skipif(not hasattr(socket, "AF_PACKET") or os.geteuid() != 0, reason="needs root for a packet capture")
@pytest.mark.parametrize("encrypt", [False, True])
def test_a_capture_of_a_refit_over_ucx_tcp_holds_no_weight_bytes_with_encrypt(encrypt):
    packets: list[bytes] = []
    stop = threading.Event()
    sniffer = _capture(stop, packets)
    env = dict(os.environ, UCX_TLS="tcp", JAX_PLATFORMS="cpu")  # the bytes cross loopback TCP, not shared memory
    try:
        out = subprocess.run(
            [sys.executable, "-c", _TWO_AGENTS % _PATTERN, "1" if encrypt else "0"],
            capture_output=True,
            text=True,
            timeout=90,
            env=env,
        )
    finally:
        time.sleep(0.2)
        stop.set()
        sniffer.join(5)
    assert out.returncode == 0 and out.stdout.strip().endswith("exact"), out.stderr[-3000:]
    found = b"".join(packets).count(_PATTERN)
    if encrypt:
        assert found == 0  # 1 MiB of the pattern crossed the wire, and none of it is readable
    else:
        assert found > 1000  # the capture sees the weights in the clear: the check above can fail


def test_encrypt_must_be_a_bool():
    with pytest.raises(TypeError, match="encrypt='yes' must be True or False"):
        Options(encrypt="yes")
    assert Options(encrypt=True).plan_key() == Options().plan_key()  # how bytes travel, not the plan


@pytest.mark.parametrize(
    "join",
    [
        {"role": "destination", "index": 0, "count": 10**9},  # the coordinator would wait for 10**9 processes
        {"role": "destination", "index": 0, "count": 0},  # would form the group with no destination
        {"role": "destination", "index": 5, "count": 2},
        {"role": "source", "index": 0, "count": 1},  # process 0 is the coordinator itself
        {"role": "destination", "index": True, "count": 1},
        {"role": "root", "index": 0, "count": 1},
    ],
    ids=["count-1e9", "count-0", "index-past-count", "source-0", "index-bool", "role"],
)
def test_a_join_no_process_of_the_group_sends_is_dropped_and_the_group_forms(tmp_path, join):
    """A process with the key that joins a RefitGroup's rendezvous with a role, index or count that no process of
    the group has is dropped; the group forms with its real processes."""
    address = str(tmp_path / "group")
    zero, made = _coordinator(address)
    bad = connect(parse_address(address, timeout_s=10.0), "process 0", key=KEY, timeout_s=5.0)
    bad.send_control({"op": "join", "at": ["127.0.0.1", 1]} | join, timeout_s=5.0)
    deadline = time.monotonic() + 5.0
    while not bad.eof and time.monotonic() < deadline:  # dropped
        bad.pump()
        time.sleep(0.01)
    assert bad.eof
    bad.close()
    dst = ProcessGroup.join("destination", address, index=0, count=1, key=KEY, timeout_s=30)
    zero.join(10)
    assert dst.rank == 1 and made["0"].rank == 0 and made["0"].roles == {0: "source", 1: "destination"}
    dst.close()
    made["0"].close()


def test_accept_one_returns_an_authenticated_channel_and_refuses_a_wrong_key_or_nobody():
    """``accept_one``: the peer that proves the key gets an authenticated channel; a wrong key is refused; a listener
    nobody connects to is a timeout, not a wait without end."""
    from jreshard.errors import JReshardError
    from jreshard.net.channel import accept_one

    def client(where, key, out):
        try:
            out.append(connect(where, "the server", key=key, timeout_s=5.0))
        except JReshardError as err:
            out.append(err)

    for key, want in ((KEY, None), (b"another-key-0123456789abcdef", AuthenticationError)):
        listener = listen("127.0.0.1", 0)
        got: list = []
        t = threading.Thread(target=client, args=(listener.getsockname()[:2], key, got))
        t.start()
        if want is None:
            ch = accept_one(listener, "the client", key=KEY, timeout_s=5.0)
            assert ch.authenticated
            t.join(5)
            ch.send_control({"op": "x"}, timeout_s=1.0)
            assert got[0].recv_control(timeout_s=1.0) == {"op": "x"}
            got[0].close()
            ch.close()
        else:
            with pytest.raises(want):
                accept_one(listener, "the client", key=KEY, timeout_s=5.0)
            t.join(5)
        listener.close()
    listener = listen("127.0.0.1", 0)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="nobody connected"):
        accept_one(listener, "the client", key=KEY, timeout_s=0.2)
    assert time.monotonic() - t0 < 2.0
    listener.close()
