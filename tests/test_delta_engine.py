"""Delta refits through the engine's rounds, against numpy: after any sequence of delta and full refits of
random layouts (processes joining late, missing versions, a refit failing midway), every destination shard
holds ``global[box]`` of the version just sent, bit for bit, and a delta never sends more than a full refit
plus its headers.

Each simulated process runs its ranks in its own thread over a shared mailbox, with its own
:class:`DeltaBases`, as separate programs would; ``peer_base`` is what each process reported before the
refit (the group's begin vote)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from schedule_oracle import build_schedule

from jreshard.engine.comm import Communicator, RecvOp, SendOp
from jreshard.engine.deltarounds import HEADER, DeltaBases, DeltaRefit
from jreshard.engine.rounds import Shards, execute
from jreshard.errors import PeerError, TransferTimeoutError
from jreshard.options import Options
from jreshard.sharding.box import Box
from jreshard.sharding.layout import Layout
from jreshard.sharding.planner import plan_layouts
from tests.strategies import plan_case

SENTINEL = 0xA5


class _Mailbox:
    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.box: dict[tuple[int, int, int], list[bytes]] = {}
        self.count = 0
        self.fail_at: int | None = None
        self.failed = False


class _ThreadComm(Communicator):
    """One simulated process's ranks; messages go through the mailbox; an injected failure reaches all.

    With ``one_group``, :meth:`exchange_sized` carries each message's length with it (as NIXL and MPI do);
    without, it is the Communicator's default (the lengths first, then the messages)."""

    def __init__(self, ranks: Sequence[int], mail: _Mailbox, one_group: bool = False):
        self._ranks, self._mail, self._one_group = tuple(ranks), mail, one_group

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self._ranks

    def exchange(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> None:
        self._move(sends, recvs, timeout_s, bounded=False)

    def exchange_sized(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> list[int]:
        if not self._one_group:
            return super().exchange_sized(sends, recvs, timeout_s=timeout_s)
        return self._move(sends, recvs, timeout_s, bounded=True)

    def _move(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], timeout_s: float, bounded: bool) -> list[int]:
        m = self._mail
        with m.cv:
            m.count += 1
            if m.fail_at is not None and m.count >= m.fail_at:
                m.failed = True
                m.cv.notify_all()
            if m.failed:
                raise PeerError("injected failure midway")
            for s in sends:
                m.box.setdefault((s.src, s.dst, s.tag), []).append(bytes(s.buffer))
            m.cv.notify_all()
        deadline = time.monotonic() + timeout_s
        sizes: list[int] = []
        for r in recvs:
            with m.cv:
                key = (r.src, r.dst, r.tag)
                while not m.box.get(key):
                    if m.failed:
                        raise PeerError("injected failure midway")
                    if time.monotonic() > deadline:
                        raise TransferTimeoutError(f"no message {key}")
                    m.cv.wait(0.02)
                data = m.box[key].pop(0)
            if len(data) != len(r.buffer) and not (bounded and len(data) < len(r.buffer)):
                raise PeerError(f"{key}: {len(data)} bytes for a receive of {len(r.buffer)}")
            r.buffer[: len(data)] = np.frombuffer(data, np.uint8)
            sizes.append(len(data))
        return sizes


def _mutate(rng: np.random.Generator, g: np.ndarray, pattern: str) -> np.ndarray:
    raw = g.reshape(-1).view(np.uint8).copy()
    n = len(raw)
    if n == 0 or pattern == "none":
        pass
    elif pattern == "one":
        raw[int(rng.integers(n))] ^= np.uint8(1)
    elif pattern == "sparse":
        raw[rng.choice(n, max(1, n // 40), replace=False)] ^= np.uint8(0x10)
    elif pattern == "dense":
        raw[rng.random(n) < 0.7] ^= np.uint8(0x81)
    elif pattern == "all":
        raw ^= np.uint8(0xFF)
    elif pattern == "edges":
        raw[0] ^= np.uint8(1)
        raw[-1] ^= np.uint8(0x80)
    elif pattern == "signs":  # the sign bit of every 4th byte: -0.0 <-> 0.0 and NaN payload flips alike
        raw[3::4] ^= np.uint8(0x80)
    return raw.view(g.dtype).reshape(g.shape)


def _widen(lay: Layout, k: int) -> Layout:
    """``lay`` with a trailing unsplit dimension of ``k``."""
    boxes = tuple(Box((*b.lo, 0), (*b.hi, k)) for b in lay.boxes)
    return Layout(shape=(*lay.shape, k), dtype=lay.dtype, ranks=lay.ranks, boxes=boxes)


def _run_step(pairs, procs, sched, globals_, refits, options, mail, one_group=False) -> list[BaseException]:
    """Every process's ranks of one refit in threads: the errors raised (empty: it ran), dst shards filled."""
    errors: list[BaseException] = []
    outs: dict = {}

    def one(p: int, ranks: list[int]) -> None:
        src, dst = {}, {}
        for t, ((s, d), g) in enumerate(zip(pairs, globals_, strict=True)):
            for r, b in zip(s.ranks, s.boxes, strict=True):
                if r in ranks:
                    src[(t, r)] = np.ascontiguousarray(g[b.slices()]).reshape(-1).view(np.uint8)
            for r, b in zip(d.ranks, d.boxes, strict=True):
                if r in ranks:
                    dst[(t, r)] = np.full(b.volume * d.itemsize, SENTINEL, np.uint8)
        outs[p] = dst
        try:
            comm = _ThreadComm(ranks, mail, one_group)
            execute(sched, comm, Shards(src=src, dst=dst), options=options, delta=refits[p])
        except BaseException as e:  # collected and asserted on by the caller
            errors.append(e)
            with mail.cv:
                mail.failed = True
                mail.cv.notify_all()

    threads = [threading.Thread(target=one, args=(p, rs)) for p, rs in procs.items()]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    _run_step.outs = outs  # type: ignore[attr-defined]
    return errors


@settings(max_examples=25, deadline=None)
@given(
    case=plan_case(max_ranks=8),
    per_proc=st.integers(1, 4),
    width=st.sampled_from([1, 7, 300]),
    chunk=st.sampled_from([64, 256, 4096]),
    events=st.lists(
        st.tuples(
            st.sampled_from(["delta", "delta", "delta", "full", "late", "miss", "fail"]),
            st.sampled_from(["none", "one", "sparse", "dense", "all", "edges", "signs"]),
        ),
        min_size=2,
        max_size=6,
    ),
    seed=st.integers(0, 2**31),
    one_group=st.booleans(),
)
def test_any_sequence_is_bit_exact(case, per_proc, width, chunk, events, seed, one_group) -> None:
    src, dst, topo, opts = case
    src, dst = _widen(src, width), _widen(dst, width)  # chunks long enough for every encoding
    rng = np.random.default_rng(seed)
    options = Options(chunk_bytes=chunk, staging_bytes=1 << 20, timeout_s=20.0, **opts)
    pairs = [(src, dst)]
    plan = plan_layouts(pairs, topo, options, ["w"])
    sched = build_schedule(plan, options)
    ranks = sorted(set(src.ranks) | set(dst.ranks))
    device = dict(zip(topo.ranks, topo.devices, strict=True))  # ranks on one device: one process (same-device copies)
    order = sorted(set(device[r] for r in ranks))
    proc_of = {r: order.index(device[r]) // per_proc for r in ranks}
    procs: dict[int, list[int]] = {}
    for r in ranks:
        procs.setdefault(proc_of[r], []).append(r)
    bases = {p: DeltaBases(1 << 30) for p in procs}
    raw = rng.integers(0, 256, src.nbytes, dtype=np.uint8)
    g = raw.view(src.np_dtype).reshape(src.shape) if src.nbytes else np.zeros(src.shape, src.np_dtype)
    version = 0
    saved: dict[int, tuple] = {}
    for what, pattern in events:
        version += 1
        g = _mutate(rng, g, pattern)
        if what == "late":  # a process that joins now holds nothing
            bases[int(rng.choice(list(procs)))].clear()
        if what == "miss":  # a process that missed versions: back to bases it kept earlier
            p = int(rng.choice(list(procs)))
            if p in saved:
                b = bases[p]
                sent, recv, v = saved[p]  # copies: a commit writes the kept copies in place (its patches)
                b.sent, b.recv, b.version = (
                    {k: a.copy() for k, a in sent.items()},
                    {k: a.copy() for k, a in recv.items()},
                    v,
                )
        reported = {p: (None if what == "full" else b.version) for p, b in bases.items()}
        refits = {
            p: DeltaRefit(bases=bases[p], peer_base=lambda r, rep=reported: rep[proc_of[r]], unit=2) for p in procs
        }
        mail = _Mailbox()
        if what == "fail":
            mail.fail_at = int(rng.integers(1, 4))
        errors = _run_step(pairs, procs, sched, [g], refits, options, mail, one_group)
        if errors:
            assert what == "fail", errors
            for b in bases.values():
                b.abort()
            continue
        for p, b in bases.items():
            saved.setdefault(
                p, ({k: a.copy() for k, a in b.sent.items()}, {k: a.copy() for k, a in b.recv.items()}, b.version)
            )
            b.commit(version)
        outs = _run_step.outs  # type: ignore[attr-defined]
        for r, box in zip(dst.ranks, dst.boxes, strict=True):
            got = outs[proc_of[r]][(0, r)]
            want = np.ascontiguousarray(g[box.slices()]).reshape(-1).view(np.uint8)
            assert got.tobytes() == want.tobytes(), (what, pattern, r)
        for rf in refits.values():
            st_ = rf.stats
            assert st_.sent_bytes <= st_.full_bytes + (HEADER + 8) * st_.chunks
            if what == "full" or pattern == "all":
                assert st_.delta_chunks == 0 or pattern == "all"
            if pattern == "none" and all(v == version - 1 for v in reported.values()) and what == "delta":
                assert st_.sent_bytes == (HEADER + 8) * st_.chunks  # nothing changed: headers only


def test_sparse_change_sends_little() -> None:
    """One changed element of a 64 KiB tensor: the second refit sends a few hundred bytes, not 64 KiB."""
    import jax.numpy as jnp  # noqa: F401 - dtypes registered

    src = Layout.from_mesh(np.array([0, 1]), ("a",), ("a",), (16384,), "float32")
    dst = Layout.from_mesh(np.array([2, 3]), ("b",), (None,), (16384,), "float32")
    from jreshard.sharding.topology import Topology

    topo = Topology.from_domains({0: 0, 1: 0, 2: 1, 3: 1})
    options = Options(chunk_bytes=8192, timeout_s=20.0)
    plan = plan_layouts([(src, dst)], topo, options, ["w"])
    sched = build_schedule(plan, options)
    procs = {0: [0, 1], 1: [2, 3]}
    proc_of = {0: 0, 1: 0, 2: 1, 3: 1}
    bases = {p: DeltaBases(1 << 30) for p in procs}
    g = np.arange(16384, dtype=np.float32)
    stats = {}
    for version in (1, 2, 3):  # 3: nothing changed since 2 (the kept copies were patched to version 2)
        if version == 2:
            g = g.copy()
            g[5000] = -0.0 if g[5000] else 0.5
        reported = {p: b.version for p, b in bases.items()}
        refits = {
            p: DeltaRefit(bases=bases[p], peer_base=lambda r, rep=reported: rep[proc_of[r]], unit=4) for p in procs
        }
        assert not _run_step([(src, dst)], procs, sched, [g], refits, options, _Mailbox())
        for b in bases.values():
            b.commit(version)
        outs = _run_step.outs  # type: ignore[attr-defined]
        for r in (2, 3):
            assert outs[1][(0, r)].view(np.float32).tobytes() == g.tobytes()
        stats[version] = refits[0].stats
    assert stats[3].changed_units == 0 and stats[3].sent_bytes == (HEADER + 8) * stats[3].chunks, stats[3]
    st_ = stats[2]
    assert st_.full_bytes == g.nbytes and st_.changed_units == 1  # into the domain once (then its fan-out)
    assert st_.sent_bytes < 300, st_
    fan = refits[1].stats  # the destination's fan-out to its replica (version 3): a delta too
    assert fan.changed_units <= 1 and fan.sent_bytes < 300 + fan.full_bytes // 100, fan


def test_options_delta_is_validated_before_anything_moves() -> None:
    from jreshard.options import Delta

    assert Options().delta is Delta.AUTO and Options(delta="ON").delta is Delta.ON
    assert Options(delta=Delta.OFF).delta is Delta.OFF
    with pytest.raises(ValueError, match=r"delta='sometimes'.*'off', 'on', 'auto'"):
        Options(delta="sometimes")
    with pytest.raises(ValueError, match="delta_bytes=-1"):
        Options(delta_bytes=-1)
    with pytest.raises(ValueError, match="delta_bytes=True"):
        Options(delta_bytes=True)
    with pytest.raises(ValueError, match="limit"):
        DeltaBases(-5)


def test_group_reports_why_a_refit_is_full() -> None:
    """GroupDelta decides from the begin votes: who holds which base, and who has deltas off."""
    from jreshard.refit.delta import GroupDelta

    names = {0: "process 0 (source)", 1: "process 1 (destination)"}
    gd = GroupDelta(Options(delta="on"), 2, {0: 0, 1: 1}, names.__getitem__)
    votes = {0: {"delta": True, "delta_base": None}, 1: {"delta": True, "delta_base": None}}
    rf = gd.start(votes, 0)
    assert rf is not None and rf.peer_base(1) is None
    gd.bases.begin()
    gd.commit(1, 0)
    assert gd.report is not None and gd.report.mode == "full" and "first refit" in gd.report.reasons[0]
    votes = {0: {"delta": True, "delta_base": 1}, 1: {"delta": True, "delta_base": 0}}  # it missed version 1
    assert gd.start(votes, 0) is not None
    gd.bases.begin()
    gd.commit(2, 0)
    assert "process 1 (destination) holds version 0, this process's bases are 1" in gd.report.reasons
    votes = {0: {"delta": True, "delta_base": 2}, 1: {"delta": False, "delta_base": None}}
    assert gd.start(votes, 0) is None and gd.bases.version is None  # a full refit everywhere; bases dropped
    gd.commit(3, 1234)
    assert gd.report.mode == "off" and gd.report.sent_bytes == 1234 and "has delta off" in gd.report.reasons[0]


def test_exchange_sized_lands_a_prefix_and_refuses_a_message_past_its_receive() -> None:
    """Communicator.exchange_sized: a receive's buffer is the most its message may hold. In one process the
    message is copied into its first bytes; the default (two groups: the lengths, then the messages) refuses a
    length past the receive before it receives the message."""
    from jreshard.engine.loopback import LocalComm

    comm = LocalComm([0, 1])
    a, b = np.arange(5, dtype=np.uint8), np.full(8, 0xEE, np.uint8)
    assert comm.exchange_sized([SendOp(0, 1, 7, a)], [RecvOp(0, 1, 7, b)], timeout_s=1.0) == [5]
    assert b[:5].tolist() == [0, 1, 2, 3, 4] and (b[5:] == 0xEE).all()
    with pytest.raises(PeerError, match="has 9 B but its receive expects 8 B"):
        comm.exchange_sized([SendOp(0, 1, 7, np.zeros(9, np.uint8))], [RecvOp(0, 1, 7, b)], timeout_s=1.0)

    mail = _Mailbox()
    got = np.full(8, 0xEE, np.uint8)
    sizes: dict = {}
    sender = threading.Thread(
        target=lambda: sizes.setdefault(
            "sender", _ThreadComm([0], mail).exchange_sized([SendOp(0, 1, 3, a)], [], timeout_s=5.0)
        )
    )
    sender.start()
    assert _ThreadComm([1], mail).exchange_sized([], [RecvOp(0, 1, 3, got)], timeout_s=5.0) == [5]
    sender.join(5)
    assert sizes["sender"] == [] and got[:5].tolist() == [0, 1, 2, 3, 4] and (got[5:] == 0xEE).all()
    sender = threading.Thread(
        target=lambda: _ThreadComm([0], mail).exchange_sized(
            [SendOp(0, 1, 4, np.zeros(9, np.uint8))], [], timeout_s=5.0
        )
    )
    sender.start()
    got[:] = 0xEE
    with pytest.raises(
        PeerError, match="announced a message of 9 bytes to rank 1 under tag 4; its receive holds at most 8"
    ):
        _ThreadComm([1], mail).exchange_sized([], [RecvOp(0, 1, 4, got)], timeout_s=5.0)
    assert (got == 0xEE).all()
    sender.join(5)


def test_a_delta_chunk_is_kept_by_patching_its_base_at_commit() -> None:
    """DeltaBases.patch: the kept copy becomes the new version at commit (its body applied in place, the copy
    not handed out for reuse); an aborted refit leaves it as it was."""
    from jreshard.engine import delta as codec

    held = DeltaBases(1 << 20)
    old = np.arange(4096, dtype=np.uint8)
    held.begin()[0][(0, 1, 0)] = old.copy()
    held.commit(1)
    base = held.sent[(0, 1, 0)]
    new = old.copy()
    new[[7, 900, 4000]] ^= 0x40
    body = np.empty(4096, np.uint8)
    for outcome in ("abort", "commit"):
        sent, _ = held.begin()
        kind, size, _ = codec.encode(new, base, body, 2)
        assert kind == codec.KIND_GAPS
        sent[(0, 1, 0)] = held.patch(base, kind, body[:size], 2)
        body[:] = 0  # the patch holds its own copy of the body
        if outcome == "abort":
            held.abort()
            assert held.sent[(0, 1, 0)].tobytes() == old.tobytes() and held.version == 1
        else:
            held.commit(2)
    assert held.sent[(0, 1, 0)] is base and base.tobytes() == new.tobytes() and held.version == 2
    assert held.copy_of("sent", (0, 1, 0), new) is not base  # a patched copy is kept, never reused as a spare


def _one_refit(gd, votes: dict, version: int, changed: float | None) -> object:
    """Run GroupDelta through one refit of process 0 (the sender): ``changed`` is the fraction of the
    elements its deltas found changed (``None``: the refit ran whole, or its chunks went whole for want
    of bases)."""
    rf = gd.start(votes, 0)
    if rf is not None:
        gd.bases.begin()
        st = rf.stats
        st.chunks, st.full_bytes, st.units = 4, 4000, 1000
        if changed is not None and not gd._reasons:  # tiny chunks: the headers outweigh what changed
            st.delta_chunks, st.changed_units, st.sent_bytes = 4, int(1000 * changed), 9000
        else:
            st.changed_units, st.sent_bytes = 1000, 4000 + 4 * HEADER
    gd.commit(version, 4000)
    return rf


def test_auto_backs_off_from_deltas_that_do_not_pay_and_tries_again() -> None:
    """delta='auto': deltas that find over DENSE_CHANGED of the elements changed make the sender vote whole refits for
    1, 2, 4, ... refits (its report and the others' say why), then lay the bases and look again; deltas
    that pay end it. delta='on' never backs off."""
    from jreshard.refit.delta import DENSE_CHANGED, MAX_BACKOFF, GroupDelta

    names = {0: "process 0 (source)", 1: "process 1 (destination)"}
    dense = min(1.0, DENSE_CHANGED + 0.05)
    for mode in ("auto", "on"):
        gd = GroupDelta(Options(delta=mode), 2, {0: 0, 1: 1}, names.__getitem__)
        peer_base = None  # the destination's base: the version it last committed with deltas running
        whole: list[bool] = []  # per refit: whether this process voted it whole
        for version in range(1, 41):
            mine = gd.vote()
            votes = {0: mine, 1: {"delta": True, "delta_base": peer_base}}
            rf = _one_refit(gd, votes, version, dense)
            peer_base = version if rf is not None else None
            whole.append(not mine["delta"])
            if whole[-1]:
                assert rf is None and gd.report.mode == "off" and gd.bases.version is None
                assert "sends whole for now (delta='auto': 92% of the elements of its last" in gd.report.reasons[0]
        whole_runs = [len(list(run)) for off, run in itertools.groupby(whole) if off]
        if mode == "on":
            assert whole_runs == []
            continue
        assert whole_runs[:4] == [1, 2, 4, 8], whole_runs  # each stretch doubles, two refits between
        assert max(whole_runs) <= MAX_BACKOFF
        # the peer sees the same reason in the begin vote
        other = GroupDelta(Options(delta="auto"), 2, {0: 0, 1: 1}, names.__getitem__)
        gd.backoff._skip, gd.backoff._dense = 3, 0.97
        assert other.start({0: gd.vote(), 1: other.vote()}, 1) is None
        other.commit(version + 1, 0)
        assert "process 0 (source) sends whole for now" in other.report.reasons[0]
        assert (
            "97% of the elements of its last deltas had changed; it tries deltas again after 3 more refits"
            in (other.report.reasons[0])
        )
    # deltas that pay: no back-off, and one that pays after a dense one ends the doubling
    gd = GroupDelta(Options(delta="auto"), 2, {0: 0, 1: 1}, names.__getitem__)
    for version, changed in enumerate((None, 0.1, 0.5, DENSE_CHANGED), start=1):  # the first lays the bases
        assert gd.vote()["delta"]
        _one_refit(gd, {0: gd.vote(), 1: {"delta": True, "delta_base": version - 1 or None}}, version, changed)
    assert not gd.backoff.whole and gd.vote()["delta"]
    _one_refit(gd, {0: gd.vote(), 1: {"delta": True, "delta_base": 4}}, 5, dense)
    assert gd.backoff._backoff == 1 and not gd.vote()["delta"]
