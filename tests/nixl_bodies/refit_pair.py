"""One side of a RefitGroup over NIXL between two separate launches: ``refit_pair.py ROLE ADDRESS MODE``.

Each program has 2 CPU devices; the source holds the parameters FSDP-sharded, the destination
TP-sharded. Source modes: ``five`` (versions 1-5), ``replace`` (version 1, then version 2 to a
destination that dies mid-pull, then a new group with a new destination for versions 3-5).
Destination modes: ``ok`` (pull until the source closes), ``die:V`` (SIGKILL itself in the middle
of pulling version V). Every pulled version is compared element by element; one JSON line per
event on stdout, the results last. The key is ``$JRESHARD_SECRET``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jreshard import Options, RefitGroup
from jreshard.errors import PeerError, TransferError
from jreshard.nixl import NixlAgent, NixlComm

SHAPES = {"w": (16, 8), "b": (8,)}
OPTIONS = Options(timeout_s=20.0, chunk_bytes=128, staging_bytes=1024)  # the rendezvous waits for a launch


def value(k: str, version: int) -> np.ndarray:
    """A version differs from the one before in about 2 of every 5 elements (deltas are on by default)."""
    i = np.arange(int(np.prod(SHAPES[k])), dtype=np.float32)
    return (i * (1 + (k == "b")) + 1000 * version * (i % 5 == version % 5)).reshape(SHAPES[k])


def say(**event) -> None:
    print(json.dumps(event), flush=True)


def _delta(group: RefitGroup) -> list:
    rep = group.delta_report
    return [rep.mode, rep.sent_bytes, rep.full_bytes, list(rep.reasons)]


def source(address: str, mode: str) -> None:
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))

    def params(v: int) -> dict:
        return {k: jax.device_put(value(k, v), NamedSharding(mesh, P("fsdp"))) for k in SHAPES}

    group = RefitGroup.connect("source", params(0), address=address, transport="nixl", options=OPTIONS)
    say(event="formed")
    if mode == "five":
        for v in range(1, 6):
            group.push(params(v), version=v)
            say(event="pushed", version=v, delta=_delta(group))
        group.close()
        return
    group.push(params(1), version=1)
    say(event="pushed", version=1, delta=_delta(group))
    t0 = time.monotonic()
    try:
        group.push(params(2), version=2)
        say(event="pushed", version=2, delta=_delta(group))
    except (PeerError, TransferError) as err:  # the destination died mid-pull
        say(event="failed", version=2, error=f"{type(err).__name__}: {err}", seconds=time.monotonic() - t0)
    group.close()
    group = RefitGroup.connect("source", params(0), address=address, transport="nixl", options=OPTIONS)
    say(event="formed")
    for v in (3, 4, 5):
        group.push(params(v), version=v)
        say(event="pushed", version=v, delta=_delta(group))
    group.close()


def arm_kill(version: int) -> None:
    """SIGKILL this process at its second data exchange of ``version`` (some bytes in, some not)."""
    state = {"calls": 0}

    def deadly(real):
        def exchange(self, sends, recvs, *, timeout_s):
            if state.get("v") == version and recvs:
                state["calls"] += 1
                if state["calls"] == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(self, sends, recvs, timeout_s=timeout_s)

        return exchange

    NixlComm.exchange = deadly(NixlComm.exchange)  # type: ignore[method-assign]
    NixlComm.exchange_sized = deadly(NixlComm.exchange_sized)  # type: ignore[method-assign]  # the delta rounds'
    from jreshard.nixl.prepared import NixlPrepared

    real_start = NixlPrepared.start

    def deadly_start(self, group, timeout_s):  # the same, where the groups are prepared
        if state.get("v") == version and self._rgroups[group]:
            state["calls"] += 1
            if state["calls"] == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        return real_start(self, group, timeout_s)

    NixlPrepared.start = deadly_start  # type: ignore[method-assign]
    arm_kill.state = state  # type: ignore[attr-defined]


def destination(address: str, mode: str) -> None:
    mesh = Mesh(np.array(jax.devices()).reshape(1, 2), ("dp", "tp"))
    spec = {"w": P(None, "tp"), "b": P()}
    like = {k: jax.ShapeDtypeStruct(s, np.float32, sharding=NamedSharding(mesh, spec[k])) for k, s in SHAPES.items()}
    die = int(mode[4:]) if mode.startswith("die:") else None
    if die is not None:
        arm_kill(die)
    group = RefitGroup.connect("destination", like, address=address, transport="nixl", options=OPTIONS)
    say(event="formed")
    checked, bad, end = [], [], ""
    while True:
        if die is not None:
            arm_kill.state["v"] = (group.version or 0) + 1  # type: ignore[attr-defined]
        try:
            tree, v = group.pull(like=like, timeout_s=30.0)
        except (PeerError, TransferError) as err:
            end = f"{type(err).__name__}: {err}"
            break
        for k in SHAPES:
            shards = tree[k].addressable_shards
            if tree[k].sharding != like[k].sharding or not all(
                np.array_equal(np.asarray(sh.data), value(k, v)[sh.index]) for sh in shards
            ):
                bad.append([v, k])
        checked.append(v)
        say(event="pulled", version=v, registrations=NixlAgent.shared().registrations, delta=_delta(group))
    say(checked=checked, bad=bad, end=end)


if __name__ == "__main__":
    role, address, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    (source if role == "source" else destination)(address, mode)
