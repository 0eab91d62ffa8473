"""Bounded exchange groups: a round's send/recv operations split so no rank posts more than ``max_group_ops``.

NCCL runs the point-to-point operations between ``ncclGroupStart`` and
``ncclGroupEnd`` as one group, and very large groups are known to hang (Megatron-LM
reports a refit that hangs at about 24,000 send/recv operations on one rank in one
group, while 8,000 pass). The engine posts one group per schedule round, and a
round has no limit on the chunks that move in place, so a rank with thousands of
small shards could post thousands of operations at once.

:func:`group_rounds` cuts every round into consecutive groups ``0, 1, ...``:

- each message (one send and its receive) lies in exactly one group, the same at
  both ends, so every group is a complete, matched exchange;
- no rank has more than ``max_group_ops`` operations (sends plus receives) in a group (a
  message a rank sends itself is two, so with ``max_group_ops=1`` it is alone in its group);
- the messages between one ordered pair of ranks keep their tag order across the
  groups (a later chunk never lands in an earlier group).

Every process derives the same cut from the schedule alone (messages are visited
in ``(src, dst, tag)`` order, first fit), and every rank runs its groups in order,
skipping those it has no part in. That is deadlock free: all operations of group
0 are posted by both of their ends before either waits on anything else, so group
0 completes everywhere; then the same holds for group 1, and so on.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jreshard.schedule.steps import Schedule
from jreshard.sharding.topology import Link

__all__ = ["RoundGroups", "group_rounds", "plan_op_counts", "rank_op_counts"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RoundGroups:
    """How each round is cut into groups.

    Attributes:
      max_ops: the bound on one rank's operations in one group.
      group_of: per round that needs cutting, ``{(src, dst, tag): group}``; a round
        absent from it runs as one group.
      groups: per round, how many groups it has (1 when not cut).
    """

    max_ops: int
    group_of: Mapping[int, Mapping[tuple[int, int, int], int]]
    groups: Mapping[int, int]

    def rank_groups(self, schedule: Schedule, rank: int) -> int:
        """How many exchange groups ``rank`` runs over the whole refit."""
        total = 0
        for rnd, step in schedule.steps.get(rank, {}).items():
            cut = self.group_of.get(rnd)
            if cut is None:
                total += 1 if (step.sends or step.recvs) else 0
                continue
            mine = {cut[(rank, w.peer, w.tag)] for w in step.sends} | {cut[(w.peer, rank, w.tag)] for w in step.recvs}
            total += len(mine)
        return total


def _first_fit(msgs: Sequence[tuple[int, int, int]], max_ops: int) -> tuple[dict[tuple[int, int, int], int], int]:
    load: list[collections.Counter[int]] = []
    last: dict[tuple[int, int], int] = {}
    out: dict[tuple[int, int, int], int] = {}
    for src, dst, tag in msgs:
        g = last.get((src, dst), 0)
        need = {src: 2} if src == dst else {src: 1, dst: 1}  # a message a rank sends itself: a send and a receive
        while True:
            if g == len(load):
                load.append(collections.Counter())
            # an empty group takes any message (a self-message is 2 operations even when max_ops is 1)
            if all(load[g][r] == 0 or load[g][r] + n <= max_ops for r, n in need.items()):
                break
            g += 1
        for r, n in need.items():
            load[g][r] += n
        last[(src, dst)] = g
        out[(src, dst, tag)] = g
    return out, len(load)


@functools.lru_cache(maxsize=32)
def group_rounds(schedule: Schedule, max_ops: int) -> RoundGroups:
    """Cut every round of ``schedule`` into groups of at most ``max_ops`` operations per rank (module docstring).

    Example:
      >>> import numpy as np, jreshard
      >>> from jreshard.engine.driver import schedule_local
      >>> from jreshard.engine.loopback import LocalComm
      >>> src = jreshard.Layout.from_mesh(np.arange(4), ("x",), ("x",), (64,), "float32")
      >>> dst = jreshard.Layout.replicated(range(4, 8), (64,), "float32")
      >>> topo = jreshard.Topology.uniform(range(8), domain_size=4)
      >>> opts = jreshard.Options(chunk_bytes=64)
      >>> _, _, sched = schedule_local([(src, dst)] * 3, ["a", "b", "c"], topo, opts, LocalComm(range(8)))
      >>> rank_op_counts(sched)[4]  # (sends, receives) of rank 4: it forwards what it got to ranks 5-7
      (9, 12)
      >>> [group_rounds(sched, m).rank_groups(sched, 4) for m in (100, 3, 2)]  # one group per round, or more
      [4, 9, 12]
    """
    if not isinstance(max_ops, int) or max_ops < 1:
        raise ValueError(f"group_rounds: max_ops={max_ops!r} must be an int >= 1")
    per_round: dict[int, list[tuple[int, int, int]]] = collections.defaultdict(list)
    count: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for rank, by_round in schedule.steps.items():
        for rnd, step in by_round.items():
            per_round[rnd].extend((rank, w.peer, w.tag) for w in step.sends)
            count[rnd][rank] += len(step.sends) + len(step.recvs)
    group_of, groups = {}, {}
    for rnd, msgs in per_round.items():
        if max(count[rnd].values(), default=0) <= max_ops:
            groups[rnd] = 1
            continue
        group_of[rnd], groups[rnd] = _first_fit(sorted(msgs), max_ops)
    return RoundGroups(max_ops=max_ops, group_of=group_of, groups=groups)


def rank_op_counts(schedule: Schedule) -> dict[int, tuple[int, int]]:
    """``{rank: (send operations, receive operations)}`` over the whole refit."""
    out = {}
    for rank, by_round in schedule.steps.items():
        out[rank] = (sum(len(s.sends) for s in by_round.values()), sum(len(s.recvs) for s in by_round.values()))
    return out


def plan_op_counts(plan: Any, chunk_bytes: int) -> dict[int, tuple[int, int]]:
    """``{rank: (send operations, receive operations)}`` of ``plan`` cut into ``chunk_bytes`` chunks,
    counted from the plan's rows without building the schedule (the same numbers as
    :func:`rank_op_counts`: a message of ``n`` bytes is ``ceil(n / chunk_bytes)`` chunks)."""
    cols = [
        np.concatenate([getattr(tp, f) for tp in plan.tensor_plans] or [np.zeros(0, np.int64)]).astype(np.int64)
        for f in ("stage", "src", "dst", "link", "nbytes")
    ]
    stage, src, dst, link, nbytes = cols
    keep = link != int(Link.SAME_DEVICE)
    stage, src, dst, nbytes = stage[keep], src[keep], dst[keep], nbytes[keep]
    if not len(src):
        return {}
    n = int(max(src.max(), dst.max())) + 1
    code = (stage * n + src) * n + dst
    keys, inv = np.unique(code, return_inverse=True)
    total = np.bincount(inv, weights=nbytes, minlength=len(keys)).astype(np.int64)
    chunks = -(-total // chunk_bytes)
    k_src, k_dst = (keys // n) % n, keys % n
    sends = np.bincount(k_src, weights=chunks, minlength=n).astype(np.int64)
    recvs = np.bincount(k_dst, weights=chunks, minlength=n).astype(np.int64)
    ranks = sorted(set(k_src.tolist()) | set(k_dst.tolist()))
    return {r: (int(sends[r]), int(recvs[r])) for r in ranks}
