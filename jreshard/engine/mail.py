"""The scheduling mail over a transport: the few integers ranks exchange to agree on rounds.

:func:`jreshard.schedule.pairsched.pair_schedule` takes a :data:`~jreshard.schedule.pairsched.Mail`
function and never touches a transport; this module makes one over a :class:`Communicator`,
so the mail travels as the chunks do.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import numpy as np

from jreshard.engine.buffers import Buffers, CpuBuffers
from jreshard.engine.comm import Communicator, RecvOp, SendOp
from jreshard.schedule.pairsched import Key, Mail

__all__ = ["comm_mail"]


def comm_mail(
    comm: Communicator,
    timeout_s: float,
    *,
    buffers: Buffers | None = None,
    devices: Mapping[int, Any] | None = None,
) -> Mail:
    """A mail function over ``comm``: one exchange per call, int64 payloads as bytes (tags as given).

    The payloads travel in ``buffers``' memory, so a transport that moves only device memory (NCCL)
    carries them as it carries the chunks: each rank's outgoing payloads are uploaded in one buffer
    on its device (``devices[rank]``), its incoming ones land in one staging buffer there, and come
    back to the host after the exchange. With host buffers (the default,
    :class:`~jreshard.engine.buffers.CpuBuffers`) nothing is copied.
    """
    buffers = buffers if buffers is not None else CpuBuffers()
    where = dict(devices or {})

    def mail(out: Mapping[Key, np.ndarray], want: Mapping[Key, int]) -> dict:
        sends: list[SendOp] = []
        recvs: list[RecvOp] = []
        held = []  # host payloads stay alive until the exchange has run
        for r, run in itertools.groupby(sorted(out), key=lambda k: k[0]):
            keys = list(run)
            host = np.concatenate([np.ascontiguousarray(out[k], np.int64).view(np.uint8) for k in keys])
            held.append(host)
            buf, pos = buffers.upload(host, where.get(r)), 0
            for a, b, tag in keys:
                n = 8 * out[(a, b, tag)].size
                sends.append(SendOp(a, b, tag, buf[pos : pos + n]))
                pos += n
        inboxes = []
        for r, run in itertools.groupby(sorted(want, key=lambda k: (k[1], k)), key=lambda k: k[1]):
            keys = list(run)
            sizes = [8 * want[k] for k in keys]
            buf = buffers.staging(sum(sizes), where.get(r))
            starts = np.cumsum([0, *sizes[:-1]]).tolist()
            recvs.extend(
                RecvOp(a, b, tag, buf[p : p + n]) for (a, b, tag), p, n in zip(keys, starts, sizes, strict=True)
            )
            inboxes.append((buf, keys, starts, sizes))
        if sends or recvs:
            buffers.fence()
            comm.exchange(sends, recvs, timeout_s=timeout_s)
            buffers.synchronize()
        del held
        got = {}
        for buf, keys, starts, sizes in inboxes:
            host = buffers.download(buf)
            for k, p, n in zip(keys, starts, sizes, strict=True):
                got[k] = host[p : p + n].view(np.int64).copy()
        return got

    return mail
