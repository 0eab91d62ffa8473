"""The tables behind pair-paced rounds (:mod:`jreshard.schedule.pairsched`): every chunk and box of the ranks one
process drives as numpy columns, and the :class:`~jreshard.schedule.steps.Step` of each rank and round from them.

Equal, step for step, to building the chunks with
:func:`~jreshard.schedule.steps.chunk_pieces` and the tables with
:func:`~jreshard.schedule.kernels.build_table` one box at a time; no Python work per box.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from jreshard.errors import TransferError
from jreshard.schedule.chunktable import (
    ChunkBoxes,
    contiguous,
    descriptor_rows,
    row_all,
    row_dot,
    row_prod,
    segment_starts,
)
from jreshard.schedule.ranksteps import RankSteps
from jreshard.schedule.steps import DST, SRC, STAGING, TAG_CHUNK_BITS, Step
from jreshard.sharding.layout import Layout
from jreshard.sharding.plan import RankPlan
from jreshard.sharding.rankplan import SEND
from jreshard.sharding.rows import TensorSpec
from jreshard.sharding.topology import Link

__all__ = ["MessageTable", "after_arrivals", "build_steps", "message_table", "round_groups", "shard_boxes", "spans"]

_LINKS = tuple(Link)
SEND_KIND, RECV_KIND = 0, 1


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class MessageTable:
    """The messages of some ranks (in each rank's plan order) and their pieces as byte boxes.

    Attributes:
      rank, kind, stage, peer, link: per message (``kind`` SEND_KIND or RECV_KIND).
      piece_msg, tensor, lo, hi: per piece, its message, tensor and byte box (left-padded to one width).
    """

    rank: np.ndarray
    kind: np.ndarray
    stage: np.ndarray
    peer: np.ndarray
    link: np.ndarray
    piece_msg: np.ndarray
    tensor: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


def _byte_bounds(t, items: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``start:`` of a rank table as byte boxes, left-padded with extent-1 dimensions to ``width``."""
    n = len(t.ndim)
    lo = np.zeros((n, width), np.int64)
    hi = np.ones((n, width), np.int64)
    item = items[t.tensor]
    for k in np.unique(t.ndim).tolist():
        rows = np.flatnonzero(t.ndim == k)
        if k == 0:
            lo[rows, -1], hi[rows, -1] = 0, item[rows]
            continue
        lo[rows, width - k :], hi[rows, width - k :] = t.lo[rows, :k], t.hi[rows, :k]
        lo[rows, -1] *= item[rows]
        hi[rows, -1] *= item[rows]
    return lo, hi


def message_table(rank_plans: Mapping[int, RankPlan], items: np.ndarray, width: int) -> MessageTable:
    """The sent and received messages of ``rank_plans``' ranks, rank by rank in plan order."""
    cols: dict[str, list[np.ndarray]] = {k: [] for k in MessageTable.__slots__}
    base = 0
    for r in sorted(rank_plans):
        t = rank_plans[r].table
        cuts = t.cuts
        nmsg = len(cuts) - 1
        if nmsg <= 0:
            continue
        start = int(cuts[0])
        first = cuts[:-1]
        cols["rank"].append(np.full(nmsg, r, np.int64))
        cols["kind"].append(np.where(t.kind[first] == SEND, SEND_KIND, RECV_KIND).astype(np.int64))
        cols["stage"].append(t.stage[first].astype(np.int64))
        cols["peer"].append(t.peer[first].astype(np.int64))
        cols["link"].append(t.link[first].astype(np.int64))
        cols["piece_msg"].append(base + np.repeat(np.arange(nmsg), np.diff(cuts)))
        rows = slice(start, len(t))
        cols["tensor"].append(t.tensor[rows].astype(np.int64))
        sub = _Rows(t.tensor[rows], t.lo[rows], t.hi[rows], t.ndim[rows])
        lo, hi = _byte_bounds(sub, items, width)
        cols["lo"].append(lo)
        cols["hi"].append(hi)
        base += nmsg
    out = {}
    for k, parts in cols.items():
        if parts:
            out[k] = np.concatenate(parts)
        else:
            out[k] = np.zeros((0, width), np.int64) if k in ("lo", "hi") else np.zeros(0, np.int64)
    return MessageTable(**out)


@dataclasses.dataclass(frozen=True, slots=True)
class _Rows:
    tensor: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    ndim: np.ndarray


def shard_boxes(
    tensors: Sequence[TensorSpec], rank: np.ndarray, tensor: np.ndarray, side: np.ndarray, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """Byte bounds (left-padded to ``width``) of the ``side`` shard of ``tensor`` on ``rank``, per row.

    Raises:
      TransferError: a rank holds no such shard.
    """
    n = len(rank)
    lo = np.zeros((n, width), np.int64)
    hi = np.ones((n, width), np.int64)
    if not n:
        return lo, hi
    ntens = len(tensors)
    key = (rank * ntens + tensor) * 2 + side
    uniq, inv = np.unique(key, return_inverse=True)
    ulo = np.zeros((len(uniq), width), np.int64)
    uhi = np.ones((len(uniq), width), np.int64)
    for i, k in enumerate(uniq.tolist()):
        s, rest = k % 2, k // 2
        r, t = divmod(rest, ntens)
        lay: Layout = tensors[t].src if s == SRC else tensors[t].dst
        box = lay._index().get(r)
        if box is None:
            which = "source" if s == SRC else "destination"
            raise TransferError(f"rank {r} holds no {which} shard of tensor {t}")
        item = lay.itemsize
        if box.ndim == 0:
            uhi[i, -1] = item
            continue
        k_ = box.ndim
        ulo[i, width - k_ :], uhi[i, width - k_ :] = box.lo, box.hi
        ulo[i, -1] *= item
        uhi[i, -1] *= item
    return ulo[inv.reshape(-1)], uhi[inv.reshape(-1)]


def spans(lo: np.ndarray, hi: np.ndarray, strides: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per non-empty box, the range of C-order offsets from its first to past its last element
    (``strides``: per box, of a space holding it): boxes that meet have ranges that meet."""
    return row_dot(lo, strides), row_dot(hi - 1, strides) + 1


def after_arrivals(
    arrivals: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    queries: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    block: int = 1 << 22,
) -> np.ndarray:
    """Per query box, the round after the last arrival with its key whose box meets it (0 when none).

    ``arrivals`` are ``(key, lo, hi, round, span_lo, span_hi)`` and ``queries`` ``(key, lo, hi, span_lo,
    span_hi)`` (:func:`spans`). Only the arrivals of the query's key whose spans can meet the query's
    are tested box against box: those with a span start below the query's span end, from the first
    whose running span end (sorted by span start) passes the query's span start.
    """
    a_key, a_lo, a_hi, a_round, a_s0, a_s1 = arrivals
    q_key, q_lo, q_hi, q_s0, q_s1 = queries
    out = np.zeros(len(q_key), np.int64)
    if not len(q_key) or not len(a_key):
        return out
    keys, a_dense = np.unique(a_key, return_inverse=True)
    big = int(max(a_s1.max(), q_s1.max())) + 1
    if len(keys) * big >= 1 << 62:  # the codes would not fit: no pruning by span
        a_s0, a_s1, q_s0, q_s1 = np.zeros_like(a_s0), np.ones_like(a_s1), np.zeros_like(q_s0), np.ones_like(q_s1)
        big = 2
    a_dense = a_dense.reshape(-1)
    order = np.lexsort((a_s0, a_dense))
    a_dense, a_lo, a_hi, a_round = a_dense[order], a_lo[order], a_hi[order], a_round[order]
    code0 = a_dense * big + a_s0[order]
    reach = np.maximum.accumulate(a_dense * big + a_s1[order])  # running span end, key by key
    q_dense = np.searchsorted(keys, q_key)
    known = (q_dense < len(keys)) & (keys[np.minimum(q_dense, len(keys) - 1)] == q_key)
    first = np.searchsorted(reach, q_dense * big + q_s0, "right")
    stop = np.searchsorted(code0, q_dense * big + q_s1, "left")
    cnt = np.where(known, np.maximum(stop - first, 0), 0)
    cum = np.cumsum(cnt)
    done = 0
    while done < len(q_key):
        # Queries done..stop hold at most `block` pairs (at least one query).
        end = max(done + 1, int(np.searchsorted(cum, (cum[done - 1] if done else 0) + block, "right")))
        q = np.arange(done, end)
        c = cnt[q]
        qi = np.repeat(q, c)
        ai = np.repeat(first[q], c) + (np.arange(int(c.sum())) - np.repeat(segment_starts(c), c))
        hit = row_all((a_lo[ai] < q_hi[qi]) & (a_hi[ai] > q_lo[qi]))
        if len(qi):
            np.maximum.at(out, qi, np.where(hit, a_round[ai] + 1, 0))
        done = end
    return out


def build_steps(
    chunks: ChunkBoxes,
    msgs: MessageTable,
    chunk_round: np.ndarray,
    tensors: Sequence[TensorSpec],
    width: int,
    align: int,
) -> tuple[dict[int, Mapping[int, Step]], dict[int, int]]:
    """Every rank's :class:`Step` per round (a :class:`~jreshard.schedule.ranksteps.RankSteps`) from its chunks
    and their rounds, and the most staging it holds.

    Within a rank's round the chunks go in the order the scalar builder appended them: by stage,
    sends before receives, then by message.
    """
    nch = len(chunk_round)
    if not nch:
        return {}, {}
    cm = chunks.chunk_msg
    rank, kind, stage = msgs.rank[cm], msgs.kind[cm], msgs.stage[cm]
    side_of_chunk = np.where((kind == SEND_KIND) & (stage == 0), SRC, DST)
    # Every piece's shard (rank, tensor, side); every box's bounds inside it.
    pm = msgs.piece_msg
    p_side = np.where((msgs.kind[pm] == SEND_KIND) & (msgs.stage[pm] == 0), SRC, DST)
    p_lo, p_hi = shard_boxes(tensors, msgs.rank[pm], msgs.tensor, p_side, width)
    box_chunk, bp = chunks.chunk, chunks.piece
    slo, shi = p_lo[bp], p_hi[bp]
    outside = ~row_all((chunks.lo >= slo) & (chunks.hi <= shi))
    if outside.any():
        bad = int(np.flatnonzero(outside)[0])
        raise TransferError(
            f"the plan moves bytes {chunks.lo[bad].tolist()}..{chunks.hi[bad].tolist()} of tensor "
            f"{int(msgs.tensor[bp[bad]])} through rank {int(rank[box_chunk[bad]])}, whose shard is "
            f"{slo[bad].tolist()}..{shi[bad].tolist()}"
        )
    rel, shape, outer = chunks.lo - slo, chunks.hi - chunks.lo, shi - slo
    nbox = np.diff(chunks.chunk_start)
    first = chunks.chunk_start[:-1]
    in_place = nbox == 1
    one = first[in_place]
    in_place[in_place] = contiguous(rel[one], shape[one], outer[one])
    # Chunks in execution order: rank, round, stage, sends first, message.
    order = np.lexsort((cm, kind, stage, chunk_round, rank))
    nbytes = chunks.chunk_bytes
    pad = -(-nbytes // align) * align
    o_rank, o_round = rank[order], chunk_round[order]
    group_new = np.r_[True, (o_rank[1:] != o_rank[:-1]) | (o_round[1:] != o_round[:-1])]
    gid = np.cumsum(group_new) - 1
    staged_pad = np.where(in_place[order], 0, pad[order])
    run = np.cumsum(staged_pad) - staged_pad
    start = np.empty(nch, np.int64)
    start[order] = run - (run[group_new])[gid]
    staged = ~in_place
    end = np.where(staged, start + nbytes, 0)
    vol = row_prod(shape)
    cum = np.cumsum(vol) - vol  # where each box starts in its chunk: cum - cum[chunk's first box]

    def rows(want: np.ndarray) -> np.ndarray:
        """The descriptor rows of the boxes of chunks ``want`` (in execution order), chunk by chunk."""
        cnt = nbox[want]
        idx = np.repeat(first[want], cnt) + (np.arange(int(cnt.sum())) - np.repeat(segment_starts(cnt), cnt))
        c = box_chunk[idx]
        at = start[c] + cum[idx] - cum[first[c]]
        table = descriptor_rows(2 * msgs.tensor[bp[idx]] + side_of_chunk[c], rel[idx], shape[idx], outer[idx], at)
        table.setflags(write=False)
        return table

    o_staged = staged[order]
    o_send = kind[order] == SEND_KIND
    pack_rows = rows(order[o_staged & o_send])
    unpack_rows = rows(order[o_staged & ~o_send])
    one_off = first[order]
    st = np.ones((len(one_off), width), np.int64)
    oo = outer[one_off]
    for d in range(width - 2, -1, -1):
        st[:, d] = st[:, d + 1] * oo[:, d + 1]
    box_off = row_dot(rel[one_off], st)  # per chunk in execution order: its first box's offset
    # Per chunk (execution order): its wire, and how many pack / unpack rows it has.
    oc = order
    o_kind = kind[oc]
    wbuf = np.where(in_place[oc], 2 * msgs.tensor[bp[first[oc]]] + side_of_chunk[oc], STAGING)
    woff = np.where(in_place[oc], box_off, start[oc])
    tag = (stage[oc] << TAG_CHUNK_BITS) | (chunks.chunk_index[oc] & ((1 << TAG_CHUNK_BITS) - 1))
    peer = msgs.peer[cm[oc]]
    link = msgs.link[cm[oc]]
    npack = np.where(staged[oc] & (o_kind == SEND_KIND), nbox[oc], 0)
    nunpack = np.where(staged[oc] & (o_kind == RECV_KIND), nbox[oc], 0)
    pack_at = np.r_[0, np.cumsum(npack)]
    unpack_at = np.r_[0, np.cumsum(nunpack)]
    bounds = np.r_[np.flatnonzero(group_new), nch]
    is_send_o = o_kind == SEND_KIND
    cols = (peer, tag, link, nbytes[oc], wbuf, woff)
    send_cols = tuple(c[is_send_o] for c in cols)
    recv_cols = tuple(c[~is_send_o] for c in cols)
    send_at = np.r_[0, np.cumsum(is_send_o)][bounds]
    recv_at = bounds - send_at
    heads = bounds[:-1]
    g_rank = o_rank[heads]
    rank_cut = np.r_[np.flatnonzero(np.r_[True, g_rank[1:] != g_rank[:-1]]), len(heads)]
    steps: dict[int, Mapping[int, Step]] = {}
    for g0, g1 in zip(rank_cut[:-1].tolist(), rank_cut[1:].tolist(), strict=True):
        s0, s1, v0, v1 = int(send_at[g0]), int(send_at[g1]), int(recv_at[g0]), int(recv_at[g1])
        b0, b1 = int(bounds[g0]), int(bounds[g1])
        p0, p1, u0, u1 = int(pack_at[b0]), int(pack_at[b1]), int(unpack_at[b0]), int(unpack_at[b1])
        steps[int(g_rank[g0])] = RankSteps(
            o_round[heads[g0:g1]],
            tuple(c[s0:s1] for c in send_cols),  # type: ignore[arg-type]
            tuple(c[v0:v1] for c in recv_cols),  # type: ignore[arg-type]
            send_at[g0 : g1 + 1] - s0,
            recv_at[g0 : g1 + 1] - v0,
            pack_rows[p0:p1],
            unpack_rows[u0:u1],
            pack_at[bounds[g0 : g1 + 1]] - p0,
            unpack_at[bounds[g0 : g1 + 1]] - u0,
        )
    peak = np.zeros(len(np.unique(rank)), np.int64)
    ranks_u, rinv = np.unique(rank, return_inverse=True)
    np.maximum.at(peak, rinv.reshape(-1), end)
    staging = dict(zip(ranks_u.tolist(), peak.tolist(), strict=True))
    return steps, staging


def round_groups(
    chunks: ChunkBoxes, msgs: MessageTable, chunk_round: np.ndarray, msg_key: np.ndarray
) -> dict[int, dict[tuple[int, int, int], int]]:
    """``{round: {(src, dst, tag): group key}}`` for the rounds whose chunks here have more than one key
    (a round left out runs as one group: all its chunks have the same key)."""
    cm = chunks.chunk_msg
    key = msg_key[cm]
    if not len(key):
        return {}
    order = np.lexsort((key, chunk_round))
    r_o, k_o = chunk_round[order], key[order]
    first = np.r_[True, r_o[1:] != r_o[:-1]]
    start_key = k_o[first][np.cumsum(first) - 1]
    mixed_round = np.unique(r_o[(k_o != start_key)])
    if not len(mixed_round):
        return {}
    sel = np.flatnonzero(np.isin(chunk_round, mixed_round))
    m = cm[sel]
    is_send = msgs.kind[m] == SEND_KIND
    src = np.where(is_send, msgs.rank[m], msgs.peer[m])
    dst = np.where(is_send, msgs.peer[m], msgs.rank[m])
    tag = (msgs.stage[m] << TAG_CHUNK_BITS) | (chunks.chunk_index[sel] & ((1 << TAG_CHUNK_BITS) - 1))
    out: dict[int, dict[tuple[int, int, int], int]] = {}
    for rnd, s, d, t, k in zip(
        chunk_round[sel].tolist(), src.tolist(), dst.tolist(), tag.tolist(), key[sel].tolist(), strict=True
    ):
        out.setdefault(rnd, {})[(s, d, t)] = k
    return out
