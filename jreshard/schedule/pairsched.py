"""Pair-paced rounds: the schedule each process builds for the ranks it drives, from their rank plans.

Every message-passing path runs these (``transfer`` across processes, ``RefitGroup``, the
elastic pairs): no process builds the whole plan or every rank's schedule. (The global
schedule of :mod:`jreshard.schedule.steps` places every chunk of every rank by first
fit over all ranks' staging, so every process needs every rank's plan; it stays as the
oracle the tests check against.) Here a process needs only
the rank plans of its own ranks (:func:`jreshard.sharding.planner.rank_plans`) and a
few integers from their peers, exchanged through a ``mail`` function (over the transport:
:func:`jreshard.engine.mail.comm_mail`) under tags of their own (from :data:`MAIL_TAG`):

1. **Peer counts.** For each ordered pair ``a -> b`` that has a message, ``a`` tells
   ``b`` how many ranks it sends to (``n_out(a)``), where ``b`` stands among them and
   how many bytes it sends in all (``B_out(a)``), and ``b`` tells ``a`` how many ranks it
   receives from (``n_in(b)``), where ``a`` stands among them and ``B_in(b)``. Both
   ends know the pair's own bytes ``B(a, b)`` (all stages) from their rank plans.
2. **Pair chunks.** Each end gives each of its peers a share of half its staging:
   half of that half split evenly, half by bytes, ``share(n, B_end) = staging/2 *
   (1/(2n) + B(a, b)/(2 B_end))``, so its shares add up to at most ``staging/2``. The
   pair's chunk size is ``c(a, b) = min(chunk_bytes, share(n_out(a), B_out(a)),
   share(n_in(b), B_in(b)))`` (rounded down to :data:`~jreshard.schedule.steps.STAGE_ALIGN`),
   and a pair moves at most one chunk per round. So in any round a rank stages at most
   ``staging/2`` bytes of sends and ``staging/2`` of receives, whatever rounds the pairs
   pick: no rank can exceed ``staging_bytes``, and no other rank's choices matter. A
   pair that carries most of a rank's bytes gets most of its staging, so the rounds
   needed are about ``4 B / staging_bytes`` for a rank moving ``B`` bytes (or
   ``B(a, b) / chunk_bytes``), not ``B(a, b)`` over an even share.
3. **Rounds, stage by stage.** The sender places chunk ``k`` of its stage-``s``
   message to ``b`` in the first round after chunk ``k - 1`` of the pair and after
   every round in which it received (at a stage ``< s``) bytes this chunk forwards,
   and sends ``b`` the rounds of the message's chunks (one exchange per stage, so a
   forwarding rank knows its own arrival rounds before it places what it forwards).

Both ends then agree on every chunk's round, tag (``tag_of(stage, k)``) and bytes.
The rounds are pairwise matched, so running them in increasing order cannot
deadlock: every operation of round 0 is posted by both of its ends first, so round
0 completes everywhere; then round 1, and so on.

**Exchange groups.** A rank posts up to ``n_out + n_in`` operations in a round. A
chunk's group is keyed by ``(place of b among a's receivers // h, place of a among
b's senders // h)`` with ``h = max_group_ops // 2``: both ends know both places from
step 1, and a rank has at most ``h`` sends and ``h`` receives with one key, so no
group holds more than ``max_group_ops`` of its operations. A round whose operations
here have several keys runs as one group per key, in key order (``Schedule.groups``);
both ends put every chunk in the same group, and the argument above holds for
(round, key) in order. Pair-paced rounds need ``max_group_ops >= 2``.

**Cost.** Chunks, their boxes, rounds and descriptor rows are numpy columns over all
of this process's messages (:mod:`jreshard.schedule.chunktable`,
:mod:`jreshard.schedule.pairtables`, equal to the scalar builder step for step, a tested
property), and each rank's steps are held as tables
(:class:`~jreshard.schedule.ranksteps.RankSteps`): the Python work is per message and per
round read, not per box.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Generator, Hashable, Mapping, Sequence

import numpy as np

from jreshard.options import Options
from jreshard.schedule.chunktable import chunk_boxes, segment_starts
from jreshard.schedule.pairtables import SEND_KIND, after_arrivals, build_steps, message_table, round_groups, spans
from jreshard.schedule.steps import STAGE_ALIGN, TAG_CHUNK_BITS, Schedule, _copy_tables, _Shapes
from jreshard.sharding.caches import register_clear
from jreshard.sharding.plan import RankPlan
from jreshard.sharding.rows import TensorSpec

__all__ = ["MAIL_TAG", "Mail", "pair_chunk_bytes", "pair_paced", "pair_schedule"]

# A mail round: payloads (int64 arrays) keyed by (from rank, to rank, tag) go out; the ones addressed to
# this process's ranks come back. Both ends know every payload's length in advance.
Mail = Callable[[Mapping[tuple[int, int, int], np.ndarray], Mapping[tuple[int, int, int], int]], dict]
Key = tuple[int, int, int]  # (from rank, to rank, tag)
Outgoing = dict[Key, np.ndarray]
Wanted = dict[Key, int]
# Mail travels under tags of its own, above every chunk's (a chunk's tag is tag_of(stage, k), stages are small).
MAIL_TAG = 0x7FFF << TAG_CHUNK_BITS
COUNT_OUT, COUNT_IN = MAIL_TAG, MAIL_TAG + 1  # peer counts: "I send to n ranks", "I receive from n ranks"
ROUNDS = MAIL_TAG + 2  # the rounds of a stage-s message travel with tag ROUNDS + s


def pair_chunk_bytes(
    sender: tuple[int, int], receiver: tuple[int, int], pair_bytes: int, options: Options, widest: int
) -> int:
    """The chunk size of a pair that moves ``pair_bytes``, between a sender and a receiver given as
    ``(peers, bytes)``: how many ranks it sends to (receives from) and how many bytes in all.

    Example:
      >>> o = Options(chunk_bytes=1 << 20, staging_bytes=1 << 20)
      >>> pair_chunk_bytes((4, 400), (2, 200), 100, o, 4)  # an even pair: 1 MiB / (2 * 4)
      131072
      >>> pair_chunk_bytes((4, 400), (2, 200), 0, o, 4)  # no bytes: half of that
      65536

    Raises:
      ValueError: the staging budget cannot give the pair a chunk of one item.
    """
    align = STAGE_ALIGN if options.staging_bytes % STAGE_ALIGN == 0 else 1
    shares = [_share(options.staging_bytes, n, pair_bytes, total) for n, total in (sender, receiver)]
    size = min(options.chunk_bytes, *shares) // align * align
    if size < max(widest, 1):
        raise ValueError(
            f"Options: staging_bytes={options.staging_bytes} gives a pair between ranks with {sender[0]} and "
            f"{receiver[0]} peers only {size} bytes per round, less than an item of {widest} bytes; raise staging_bytes"
        )
    return size


def _share(staging: int, peers: int, pair_bytes: int, total: int) -> int:
    """``staging/2 * (1/(2 peers) + pair_bytes/(2 total))``, rounded down (exact integers): the shares of
    one rank's peers add up to at most ``staging/2``."""
    peers, total = max(peers, 1), max(total, pair_bytes, 1)
    return staging * (total + peers * pair_bytes) // (4 * peers * total)


def pair_paced(
    tensors: Sequence[TensorSpec], rank_plans: Mapping[int, RankPlan], options: Options
) -> Generator[tuple[Outgoing, Wanted], dict[Key, np.ndarray], Schedule]:
    """The schedule of the ranks in ``rank_plans``, as a conversation: each step yields the payloads to
    send and the lengths of those to receive, and is sent back the received payloads; the last
    step's return value (``StopIteration.value``) is the :class:`Schedule` of these ranks.

    Every process runs it for its own ranks; :func:`pair_schedule` drives it over a mail function.
    Chunks, rounds and descriptor tables are numpy columns over all of this process's messages
    (:mod:`jreshard.schedule.pairtables`); the Python work is per message and per step, not per box.
    """
    items = np.array([t.src.itemsize for t in tensors], np.int64)
    widest = int(items.max()) if len(items) else 1
    width = max([1, *(t.src.ndim for t in tensors)])
    mine = sorted(rank_plans)
    msgs = message_table(rank_plans, items, width)
    sends = msgs.kind == SEND_KIND
    n_out = _distinct_peers(msgs.rank[sends], msgs.peer[sends])
    n_in = _distinct_peers(msgs.rank[~sends], msgs.peer[~sends])
    if options.max_group_ops < 2:
        raise ValueError(
            f"pair-paced rounds: max_group_ops={options.max_group_ops}; a rank may send one chunk and receive "
            "another in one exchange group, so pair-paced rounds need max_group_ops >= 2"
        )
    half = options.max_group_ops // 2
    # 1. Peer counts, and where each end ranks the other among its peers (for the exchange groups).
    ranks_l, peers_l, sends_l = msgs.rank.tolist(), msgs.peer.tolist(), sends.tolist()
    place = _peer_places(ranks_l, peers_l, sends_l)
    piece_bytes = np.prod(msgs.hi - msgs.lo, axis=1)
    msg_bytes = np.bincount(msgs.piece_msg, weights=piece_bytes, minlength=len(ranks_l)).astype(np.int64)
    pair_b: dict[tuple[int, int, bool], int] = collections.defaultdict(int)  # all stages of one pair
    total: dict[tuple[int, bool], int] = collections.defaultdict(int)  # all a rank sends (receives)
    for r, peer, is_send, b in zip(ranks_l, peers_l, sends_l, msg_bytes.tolist(), strict=True):
        pair_b[(r, peer, is_send)] += b
        total[(r, is_send)] += b
    out: dict[Key, np.ndarray] = {}
    want: dict[Key, int] = {}
    for r, peer, is_send in zip(ranks_l, peers_l, sends_l, strict=True):
        if is_send:
            out[(r, peer, COUNT_OUT)] = np.array([n_out[r], place[(r, peer, True)], total[(r, True)]], np.int64)
            want[(peer, r, COUNT_IN)] = 3
        else:
            out[(r, peer, COUNT_IN)] = np.array([n_in[r], place[(r, peer, False)], total[(r, False)]], np.int64)
            want[(peer, r, COUNT_OUT)] = 3
    got = yield out, want

    def chunk(r: int, peer: int, is_send: bool) -> int:
        if is_send:
            them = got[(peer, r, COUNT_IN)]
            ends = (n_out[r], total[(r, True)]), (int(them[0]), int(them[2]))
        else:
            them = got[(peer, r, COUNT_OUT)]
            ends = (int(them[0]), int(them[2])), (n_in[r], total[(r, False)])
        return pair_chunk_bytes(*ends, pair_b[(r, peer, is_send)], options, widest)

    size = np.array([chunk(r, p, s) for r, p, s in zip(ranks_l, peers_l, sends_l, strict=True)], np.int64)
    # A message's exchange group: (its place among the sender's receivers, its place among the receiver's
    # senders), each // half. Both ends compute the same key; a rank has at most `half` sends and `half`
    # receives with one key, so at most max_group_ops operations in a group.
    group_key = np.array(
        [
            (place[(r, peer, True)] // half) * _KEY_RADIX + int(got[(peer, r, COUNT_IN)][1]) // half
            if is_send
            else (int(got[(peer, r, COUNT_OUT)][1]) // half) * _KEY_RADIX + place[(r, peer, False)] // half
            for r, peer, is_send in zip(ranks_l, peers_l, sends_l, strict=True)
        ],
        np.int64,
    )
    chunks = chunk_boxes(msgs.lo, msgs.hi, msgs.piece_msg, size, len(msgs.rank))
    # 2. Rounds, stage by stage.
    nch = len(chunks.chunk_msg)
    chunk_round = np.full(nch, -1, np.int64)
    msg_chunks = np.bincount(chunks.chunk_msg, minlength=len(msgs.rank))
    msg_first = segment_starts(msg_chunks)
    # Each sent message's ordered pair, numbered: its next free round carries over the stages.
    code = (msgs.rank * (1 + int(msgs.peer.max(initial=0))) + msgs.peer) * 2 + msgs.kind
    pair_id = np.unique(code, return_inverse=True)[1].reshape(-1)
    next_round = np.zeros(int(pair_id.max(initial=-1)) + 1, np.int64)
    ntens = max(len(tensors), 1)
    box_rank = msgs.rank[chunks.chunk_msg[chunks.chunk]]
    box_key = box_rank * ntens + msgs.tensor[chunks.piece]
    span_lo, span_hi = spans(chunks.lo, chunks.hi, _byte_strides(tensors, width)[msgs.tensor[chunks.piece]])
    arrived = np.zeros(len(box_key), bool)  # boxes received at a stage below the current one
    for s in np.unique(msgs.stage).tolist():
        at = msgs.stage == s
        send_msgs = np.flatnonzero(at & sends)
        after = np.zeros(nch, np.int64)
        if s > 0 and arrived.any():
            got_boxes = np.flatnonzero(arrived)
            in_send = np.flatnonzero(np.isin(chunks.chunk_msg[chunks.chunk], send_msgs))
            box_after = after_arrivals(
                (
                    box_key[got_boxes],
                    chunks.lo[got_boxes],
                    chunks.hi[got_boxes],
                    chunk_round[chunks.chunk[got_boxes]],
                    span_lo[got_boxes],
                    span_hi[got_boxes],
                ),
                (box_key[in_send], chunks.lo[in_send], chunks.hi[in_send], span_lo[in_send], span_hi[in_send]),
            )
            np.maximum.at(after, chunks.chunk[in_send], box_after)
        out, want = {}, {}
        for m in send_msgs.tolist():
            a, b = int(msg_first[m]), int(msg_first[m] + msg_chunks[m])
            k = np.arange(b - a)
            lb = after[a:b].copy()
            pid = pair_id[m]
            if b > a:
                lb[0] = max(lb[0], next_round[pid])
                placed = k + np.maximum.accumulate(lb - k)
                chunk_round[a:b] = placed
                next_round[pid] = placed[-1] + 1
            out[(ranks_l[m], peers_l[m], ROUNDS + s)] = chunk_round[a:b].copy()
        recv_msgs = np.flatnonzero(at & ~sends).tolist()
        for m in recv_msgs:
            want[(peers_l[m], ranks_l[m], ROUNDS + s)] = int(msg_chunks[m])
        got = yield out, want
        for m in recv_msgs:
            a = int(msg_first[m])
            chunk_round[a : a + int(msg_chunks[m])] = got[(peers_l[m], ranks_l[m], ROUNDS + s)]
        recv_box = ~sends[chunks.chunk_msg[chunks.chunk]] & at[chunks.chunk_msg[chunks.chunk]]
        arrived |= recv_box
    align = STAGE_ALIGN if options.staging_bytes % STAGE_ALIGN == 0 else 1
    steps, staging = build_steps(chunks, msgs, chunk_round, tensors, width, align)
    groups = round_groups(chunks, msgs, chunk_round, group_key)
    with_copies = [r for r in mine if rank_plans[r].copies]
    shapes = _Shapes(tensors) if with_copies else None
    copies = {r: _copy_tables(rank_plans[r], shapes) for r in with_copies if shapes is not None}
    rounds = 1 + max((rnd for by in steps.values() for rnd in by), default=-1)
    return Schedule(rounds=rounds, steps=steps, copies=copies, staging=staging, ntensors=len(tensors), groups=groups)


def _byte_strides(tensors: Sequence[TensorSpec], width: int) -> np.ndarray:
    """Per tensor, the C-order strides of its global bytes, left-padded to ``width`` dimensions."""
    shape = np.ones((len(tensors), width), np.int64)
    for t, spec in enumerate(tensors):
        lay = spec.src
        if lay.ndim:
            shape[t, width - lay.ndim :] = lay.shape
        shape[t, -1] *= lay.itemsize
    st = np.ones_like(shape)
    for d in range(width - 2, -1, -1):
        st[:, d] = st[:, d + 1] * shape[:, d + 1]
    return st


_KEY_RADIX = 1 << 31  # group keys: (sender-side block) * _KEY_RADIX + (receiver-side block)


def _peer_places(ranks: list[int], peers: list[int], sends: list[bool]) -> dict[tuple[int, int, bool], int]:
    """``{(rank, peer, is_send): i}``: the peer is the rank's ``i``-th receiver (or sender), in rank order."""
    out: dict[tuple[int, int, bool], int] = {}
    count: dict[tuple[int, bool], int] = {}
    for r, peer, is_send in sorted(set(zip(ranks, peers, sends, strict=True))):
        out[(r, peer, is_send)] = count.get((r, is_send), 0)
        count[(r, is_send)] = out[(r, peer, is_send)] + 1
    return out


def _distinct_peers(rank: np.ndarray, peer: np.ndarray) -> dict[int, int]:
    """``{rank: how many distinct peers}`` over the (rank, peer) rows."""
    if not len(rank):
        return {}
    pairs = np.unique(np.stack([rank, peer], axis=1), axis=0)
    r, n = np.unique(pairs[:, 0], return_counts=True)
    return dict(zip(r.tolist(), n.tolist(), strict=True))


_MAX_KEPT = 32
_KEPT: collections.OrderedDict[Hashable, tuple[list[tuple[Outgoing, Wanted]], Schedule]] = collections.OrderedDict()
register_clear(_KEPT.clear)


def pair_schedule(
    tensors: Sequence[TensorSpec],
    rank_plans: Mapping[int, RankPlan],
    options: Options,
    mail: Mail,
    *,
    key: Hashable | None = None,
) -> Schedule:
    """Run :func:`pair_paced` for this process's ranks, delivering its payloads with ``mail``.

    With a ``key`` (the same inputs give the same key), the schedule is kept (the last 32;
    ``jreshard.clear_caches()`` empties them) and asked again it is not rebuilt, but its
    conversation is replayed: the same payloads are sent and the peers' received and dropped.
    So a process that kept it and one that did not (after ``clear_caches()``, say) still
    exchange the same messages, and no peer waits for mail that never comes.
    """
    kept = _KEPT.get(key) if key is not None else None
    if kept is not None:
        _KEPT.move_to_end(key)
        said, sched = kept
        for out, want in said:
            mail(out, want)
        return sched
    talk = pair_paced(tensors, rank_plans, options)
    log: list[tuple[Outgoing, Wanted]] = []
    got: dict[Key, np.ndarray] | None = None
    try:
        while True:
            out, want = talk.send(got) if got is not None else next(talk)
            log.append((out, want))
            got = mail(out, want)
    except StopIteration as done:
        sched = done.value
    if key is not None:
        _KEPT[key] = (log, sched)
        if len(_KEPT) > _MAX_KEPT:
            _KEPT.popitem(last=False)
    return sched
