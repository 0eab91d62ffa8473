"""Verified boxes: every message crossing programs digested on both sides and compared before a version is
published (jreshard.engine.digest, jreshard.refit.boxes). The machinery against a numpy oracle; then a byte
flipped in flight (tests/_faulty_comm.py) refused on both sides over MPI (Options(verify=True)) and over NIXL
(keyed MACs), the previous version kept and the next clean refit whole; and no digest cost when neither is on."""

from __future__ import annotations

import hashlib
import sys

import numpy as np
import pytest
from mpi_launch import MPIEXEC, launch, need_mpi, program, results, start_and_wait

from jreshard import IntegrityError, Options
from jreshard.engine import replay
from jreshard.engine.comm import Communicator
from jreshard.engine.digest import DigestComm, Digests, mismatches, plain, stream_key
from jreshard.errors import BackendUnavailableError
from jreshard.refit import boxes

pytestmark = pytest.mark.timeout(120)
BODY = "refit_verify_body.py"


def _messages(seed: int, n: int) -> list[tuple[int, int, int, np.ndarray]]:
    """``n`` random messages from ranks 0-1 to ranks 2-3, under tags 0-3, of 0 to 299 bytes."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        src, dst, tag = int(rng.integers(0, 2)), 2 + int(rng.integers(0, 2)), int(rng.integers(0, 4))
        out.append((src, dst, tag, rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_stream_digests_agree_exactly_when_the_bytes_do(seed):
    """Sender (ranks 0, 1) and receiver (ranks 2, 3) digest the same messages; the receiver sees them in
    another order across streams (as rounds interleave): equal. One byte flipped in one message: exactly
    that message's stream differs (the oracle: the streams whose bytes differ)."""
    msgs = _messages(seed, 30)
    src, dst = Digests((0, 1), plain(), "hash"), Digests((2, 3), plain(), "hash")
    for m in msgs:
        src.add(*m)
    by_stream: dict = {}
    for m in msgs:
        by_stream.setdefault((m[0], m[1]), []).append(m)
    for stream in sorted(by_stream, reverse=True):  # streams in another order, each in its own order
        for s, d, t, b in by_stream[stream]:
            dst.add(s, d, t, b.copy())
    assert mismatches(src.streams()["sent"], dst.streams()["landed"]) == []
    assert src.streams()["landed"] == {} and dst.streams()["sent"] == {}
    k = next(i for i, m in enumerate(msgs) if m[3].nbytes)
    flipped = Digests((2, 3), plain(), "hash")
    for i, (s, d, t, b) in enumerate(msgs):
        b = b.copy()
        if i == k:
            b[seed % b.nbytes] ^= 1
        flipped.add(s, d, t, b)
    assert mismatches(src.streams()["sent"], flipped.streams()["landed"]) == [(msgs[k][0], msgs[k][1], "differ")]
    assert dst.nbytes == src.nbytes == sum(m[3].nbytes for m in msgs) and dst.messages == len(msgs)


def test_a_lost_or_extra_message_and_a_stream_seen_by_one_side_differ():
    a, b = Digests((0,), plain(), "hash"), Digests((1,), plain(), "hash")
    for tag in range(3):
        a.add(0, 1, tag, np.full(8, tag, np.uint8))
    for tag in range(2):  # the last one never landed
        b.add(0, 1, tag, np.full(8, tag, np.uint8))
    assert mismatches(a.streams()["sent"], b.streams()["landed"]) == [(0, 1, "differ")]
    assert mismatches({stream_key(0, 1): "x"}, {}) == [(0, 1, "not received")]
    assert mismatches({}, {stream_key(0, 1): "x"}) == [(0, 1, "not sent")]
    with pytest.raises(ValueError, match="not a stream name"):
        mismatches({"zero to one": "x"}, {})


def test_keyed_macs_need_the_session_and_the_nonce():
    from jreshard.net import auth

    ns, nc = bytes(32), bytes(range(32))
    a = auth.Session(b"k" * 16, ns, nc, client=True)
    b = auth.Session(b"k" * 16, ns, nc, client=False)
    other = auth.Session(b"j" * 16, ns, nc, client=False)
    n1, n2 = boxes.new_nonce(), boxes.new_nonce()
    data = np.arange(64, dtype=np.uint8)
    tag = boxes.keyed(a, n1)(b"m", data)
    assert tag == boxes.keyed(b, n1)(b"m", data)  # both ends of the connection agree
    assert tag != boxes.keyed(b, n2)(b"m", data)  # another refit: another one-time key
    assert tag != boxes.keyed(other, n1)(b"m", data)  # without the secret
    assert tag != boxes.keyed(a, n1)(b"n", data)
    with pytest.raises(Exception, match="nonce"):
        boxes.keyed(a, "not hex")


def test_verify_is_validated_and_needs_xxhash(monkeypatch):
    with pytest.raises(TypeError, match="verify=1 must be True or False"):
        Options(verify=1)
    assert Options(verify=True).verify and not Options().verify
    monkeypatch.setitem(sys.modules, "xxhash", None)
    with pytest.raises(BackendUnavailableError, match="jreshard\\[verify\\]"):
        plain()


def test_the_mode_of_a_group():
    sealed = [object(), object()]  # a session on every connection
    assert boxes.mode(Options(), None) is None  # one MPI universe, nothing asked: nothing digested
    assert boxes.mode(Options(verify=True), None) == "hash"
    assert boxes.mode(Options(), sealed, always=True) == "mac"  # NIXL between programs: always
    assert boxes.mode(Options(), sealed) is None  # two MPI launches: MPI is trusted unless asked
    assert boxes.mode(Options(verify=True), sealed) == "mac"
    assert boxes.mode(Options(verify=True), [object(), None], always=True) == "hash"


def test_a_mismatch_names_the_streams_ranks_and_boxes():
    with pytest.raises(IntegrityError, match=r"rank 2 \(p1\) received from rank 0 \(p0\) differ.*boxes: w") as e:
        boxes.check(
            {"0>2": "aa", "1>2": "bb"},
            {"0>2": "ab", "1>2": "bb"},
            describe=lambda r: f"rank {r} (p{r // 2})",
            boxes=lambda s, d: "w Box(...)",
            kind="hash",
        )
    assert e.value.streams == ((0, 2),) and e.value.destination_intact


@pytest.mark.parametrize(
    ("verify", "path"),
    [("on", "posted"), ("on", "prepared"), ("off", "posted"), ("connect", "posted"), ("connect", "prepared")],
)
def test_a_byte_flipped_in_flight_over_mpi_is_refused_on_both_sides(tmp_path, verify, path):
    """One source and one destination process over MPI, in one universe (``on``: hashes; ``off``) or as two
    launches (``connect``: keyed MACs): with verify on, version 2's flipped byte is refused by both, the
    destination holds version 1 whole, and version 3 lands whole; with verify off nothing is digested (no
    cost reported) and every version lands. The byte flips where every group is posted afresh (``posted``) or
    in the prepared groups (``prepared``), which a digested refit replays in the compiled loop where it is
    built, like a refit digesting nothing."""
    need_mpi()
    if verify == "connect":
        env = {"JRESHARD_ADDRESS": str(tmp_path / "address")}
        cmds = [[str(MPIEXEC), *program(1, BODY, role, verify, path)] for role in ("source", "destination")]
        start_and_wait(cmds, tmp_path, devices=1, timeout_s=120, env=env)
    else:
        launch(
            [program(1, BODY, "source", verify, path), program(1, BODY, "destination", verify, path)],
            tmp_path,
            devices=1,
            timeout_s=120,
        )
    src, dst = results(tmp_path, "verify-source"), results(tmp_path, "verify-destination")
    assert len(src) == len(dst) == 1, (src, dst)
    src, dst = next(iter(src.values())), next(iter(dst.values()))
    assert "error" not in src and "error" not in dst, (src, dst)
    if verify == "off":
        assert [s[:2] for s in src["seen"]] == [[1, "ok"], [2, "ok"], [3, "ok"]]
        assert [s[:2] for s in dst["seen"]] == [[1, "ok"], [2, "ok"], [3, "ok"]]
        assert src["costs"] == dst["costs"] == [None, None, None]
        return
    assert [s[:2] for s in src["seen"]] == [[1, "ok"], [2, "refused"], [3, "ok"]]
    assert [s[:2] for s in dst["seen"]] == [[1, "ok"], [2, "refused"], [3, "ok"]]
    kind = "mac" if verify == "connect" else "hash"
    for side in (src, dst):
        why = side["seen"][1][2]
        assert "rank 1 of process 1 (destination) received from rank 0 of process 0 (source) differ" in why
        assert ("AES-GMAC" if kind == "mac" else "XXH3") in why and "['w'] Box" in why
    assert dst["seen"][1][3] == {"holds": 1, "whole": True}  # refused: the previous version, whole
    assert dst["seen"][2][2] == {"holds": 3, "whole": True} and dst["version"] == src["version"] == 3
    nbytes = 4 * (64 * 32 + 32)
    for side in (src, dst):
        kinds = {c[0] for c in side["costs"]}
        assert kinds == {kind} and all(c[1] == nbytes and c[2] > 2 and c[3] > 0 for c in side["costs"]), side["costs"]
    if replay.compiled_replay():  # every digested refit ran in the compiled loop, but where the flip posts afresh
        assert src["native"][0] > 0 and src["native"][0] < src["native"][1] < src["native"][2], src["native"]
        assert dst["native"][0] > 0 and dst["native"][2] > 0, dst["native"]
        assert (dst["native"][1] > 0) == (path == "prepared"), dst["native"]


def _nixl_pair(tmp_path, opts: Options, versions, flip_at: int | None, prepared: bool = False):
    """A RefitGroup over NIXL between two threads of this process (devices 0-1 the source's, 2-3 the
    destination's): the source pushes each of ``versions``; at version ``flip_at`` the destination's second
    message from the source has one byte flipped in flight (in NIXL's prepared groups where ``prepared``).
    Per version, what each side saw."""
    import threading

    import jax
    from _faulty_comm import plant, unplant
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard import RefitGroup

    d = jax.devices()
    shapes = {"w": (32, 16), "b": (16,)}
    src_mesh, dst_mesh = Mesh(np.array(d[:2]), ("fsdp",)), Mesh(np.array(d[2:4]).reshape(1, 2), ("dp", "tp"))
    src_spec = {k: NamedSharding(src_mesh, P("fsdp")) for k in shapes}
    dst_spec = {k: NamedSharding(dst_mesh, P(None, "tp") if len(s) == 2 else P()) for k, s in shapes.items()}
    src_like = {k: jax.ShapeDtypeStruct(s, np.float32, sharding=src_spec[k]) for k, s in shapes.items()}
    dst_like = {k: jax.ShapeDtypeStruct(s, np.float32, sharding=dst_spec[k]) for k, s in shapes.items()}

    def value(v, s):
        return (np.arange(np.prod(s), dtype=np.float32) + 1000 * v).reshape(s)

    address = str(tmp_path / "address")
    seen: dict = {"source": [], "destination": [], "cost": {}}

    def side(role):
        try:
            like, devs = (src_like, d[:2]) if role == "source" else (dst_like, d[2:4])
            g = RefitGroup.connect(role, like, address=address, transport="nixl", devices=devs, options=opts)
            held = None
            for v in versions:
                flip = plant(g, nth=2, prepared=prepared) if role == "destination" and v == flip_at else None
                try:
                    if role == "source":
                        g.push({k: jax.device_put(value(v, s), like[k].sharding) for k, s in shapes.items()}, version=v)
                        seen[role].append((v, "ok"))
                    else:
                        tree, got = g.pull(like=like)
                        held = (tree, got)
                        seen[role].append((got, "ok"))
                except IntegrityError as err:
                    seen[role].append((v, str(err)))
                finally:
                    if flip is not None:
                        unplant(g, flip)
                        seen["flipped"] = flip.flipped
                seen["cost"].setdefault(role, []).append(g.digest_cost)
                if held is not None:
                    tree, got = held
                    seen.setdefault("holds", []).append(
                        (got, all(np.array_equal(np.asarray(tree[k]), value(got, s)) for k, s in shapes.items()))
                    )
            g.close()
        except BaseException as err:  # the test reads it
            seen[role].append(("error", repr(err)))

    threads = [threading.Thread(target=side, args=(r,)) for r in ("source", "destination")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return seen


KEY = b"box-digest-test-key-0123456789"


@pytest.mark.parametrize("path", ["posted", "prepared"])
def test_a_byte_flipped_in_flight_over_nixl_is_refused_on_both_sides(tmp_path, monkeypatch, path):
    """Keyed MACs (the group shares a secret): version 2's flipped byte is refused by both sides, the destination
    keeps version 1 whole, and version 3 lands whole; the byte flipped on the per-operation path (``posted``)
    or in NIXL's prepared groups."""
    pytest.importorskip("nixl_cu12")
    from jreshard.nixl import NixlComm

    if path == "posted":
        monkeypatch.setattr(NixlComm, "prepares", False)  # the byte is flipped on the per-operation path
    # delta="off": a full refit's message (a flipped delta encoding can fail to decode before the MACs compare)
    opts = Options(timeout_s=10.0, chunk_bytes=256, staging_bytes=2048, secret=KEY, delta="off")
    seen = _nixl_pair(tmp_path, opts, (1, 2, 3), flip_at=2, prepared=path == "prepared")
    assert seen.get("flipped") == 1, seen
    for role in ("source", "destination"):
        got = seen[role]
        assert [g[0] for g in got] == [1, 2, 3] and got[0][1] == got[2][1] == "ok", got
        assert "keyed MACs (AES-GMAC)" in got[1][1] and "do not match" in got[1][1], got
        assert "received from rank 0 of process 0 (source)" in got[1][1] or "from rank 1 of process 0" in got[1][1]
    assert seen["holds"] == [(1, True), (1, True), (3, True)]  # the refused version left version 1 whole
    nbytes = 4 * (32 * 16 + 16)  # w and b cross once (b's second destination copy is a local fan-out)
    dst = seen["cost"]["destination"]
    assert all(c.kind == "mac" and c.nbytes == nbytes and c.seconds > 0 for c in dst), dst
    src = seen["cost"]["source"]
    assert all(c.kind == "mac" and c.nbytes == nbytes for c in src), src


def test_a_box_mac_past_the_librarys_limit_is_tagged_in_pieces(monkeypatch):
    """AES-GCM takes under 2**31 bytes a call: a longer buffer is tagged in pieces (made small here), each piece
    under its own nonce, so a byte flipped in any piece, or two pieces swapped, changes the tag."""
    from jreshard.net import auth

    s = auth.Session(b"k" * 16, bytes(32), bytes(32), client=True)
    monkeypatch.setattr(auth, "_GMAC_SPAN", 16)
    mac = s.box_macs(b"refit")
    data = np.arange(40, dtype=np.uint8)
    tag = mac(b"m", data)
    assert len(tag) == 3 * 16 and tag == mac(b"m", data.copy())
    for i in (0, 17, 39):
        other = data.copy()
        other[i] ^= 1
        assert mac(b"m", other) != tag
    swapped = np.concatenate([data[16:32], data[:16], data[32:]])
    assert mac(b"m", swapped) != tag
    assert len(mac(b"m", np.zeros(0, np.uint8))) == 16  # an empty message still has a tag


def test_each_message_of_a_refit_is_tagged_under_its_own_nonce():
    """One key per refit and connection, one GCM nonce per message: the nonces of the labels a refit uses (every
    (src, dst, tag, occurrence) as Digests packs them) and of the spans of a long buffer are all distinct; a tag
    depends on the label, the bytes and the refit; a label past the nonce's room is refused."""
    import struct

    from jreshard.net import auth

    s = auth.Session(b"k" * 16, bytes(32), bytes(32), client=True)
    labels = [
        struct.pack("!qqqq", src, dst, tag, n)
        for src in range(3)
        for dst in range(3)
        for tag in (0, 7)
        for n in range(3)
    ]
    ivs = {auth._BOX_IV + lab + struct.pack("!I", span) for lab in labels for span in range(3)}
    assert len(ivs) == 3 * len(labels)
    mac = s.box_macs(b"refit 1")
    data = np.arange(64, dtype=np.uint8)
    tags = [mac(lab, data) for lab in labels]
    assert len(set(tags)) == len(tags)  # the same bytes under each label: each its own tag
    assert s.box_macs(b"refit 1")(labels[0], data) == tags[0] != s.box_macs(b"refit 2")(labels[0], data)
    # the same as AES-GCM with that key and nonce, authenticating the bytes and encrypting nothing
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    one = hashlib.blake2b(b"refit 1", key=s._mac_key, digest_size=32, person=b"jreshard gmac/2").digest()
    assert AESGCM(one).encrypt(auth._BOX_IV + labels[0] + bytes(4), b"", data.tobytes()) == tags[0]
    with pytest.raises(ValueError, match="at most 116 bytes"):
        mac(bytes(117), data)


class _Wire(Communicator):
    """Ranks ``local`` of one process; messages to or from other processes go through the shared ``wire``
    dict (a sender's exchange files them, a receiver's takes them), so two of these are two programs."""

    def __init__(self, local, wire, flip=None):
        self._local, self.wire, self.flip = tuple(local), wire, flip

    @property
    def local_ranks(self):
        return self._local

    def exchange(self, sends, recvs, *, timeout_s):
        for s in sends:
            self.wire.setdefault((s.src, s.dst, s.tag), []).append(np.array(s.buffer, copy=True))
        for r in recvs:
            got = self.wire[(r.src, r.dst, r.tag)].pop(0)
            if self.flip is not None and self.flip == (r.src, r.dst, r.tag):
                got[0] ^= 1
            r.buffer[:] = got


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("flip", [None, (0, 2, 5)])
def test_digest_comm_digests_what_crosses_and_only_that(overlap, flip):
    """A sender (ranks 0, 1) and a receiver (ranks 2, 3), each behind a DigestComm, exchange rows through
    exchange_rows and start_rows: every message between them is digested on both sides (the oracle: the
    bytes listed), a message between two ranks of one side is not, the streams agree unless one byte was
    flipped on the wire, and then exactly that stream differs."""
    wire: dict = {}
    a = DigestComm(_Wire((0, 1), wire))
    b = DigestComm(_Wire((2, 3), wire, flip))
    a.overlap = b.overlap = overlap
    da, db = Digests((0, 1), plain(), "hash"), Digests((2, 3), plain(), "hash")
    a.begin(da)
    b.begin(db)
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 256, 64, dtype=np.uint8), np.zeros(0, np.uint8)]
    dst = [np.zeros(64, np.uint8)]
    rows = [(0, 2, 5, 0, 0, 32), (1, 3, 6, 0, 32, 32), (0, 1, 7, 0, 0, 16)]  # the last stays inside the sender
    a.exchange_rows(rows, [], src, timeout_s=1.0)
    b.exchange_rows([], [(0, 2, 5, 0, 0, 32)], dst, timeout_s=1.0)
    b.start_rows([], [(1, 3, 6, 0, 32, 32)], dst, timeout_s=1.0).wait()
    a.finish()
    b.finish()
    assert a.end() is da and b.end() is db and a.digests is None
    assert np.array_equal(dst[0][32:], src[0][32:])
    assert da.messages == db.messages == 2 and da.nbytes == db.nbytes == 64  # not the sender's own copy
    assert set(da.streams()["sent"]) == {stream_key(0, 2), stream_key(1, 3)}
    want = [] if flip is None else [(0, 2, "differ")]
    assert mismatches(da.streams()["sent"], db.streams()["landed"]) == want
    if not overlap:  # inline, every digest is waited for
        assert db.waited >= db.seconds > 0
