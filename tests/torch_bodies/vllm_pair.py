"""One side of a JAX trainer refitting a PyTorch vLLM-style server over NIXL: ``vllm_pair.py ROLE ADDRESS CFG OUT``.

``trainer``: jax, 4 CPU devices, the parameters float32 and FSDP-sharded in a flat dict of Tunix's names;
pushes versions 1..5 (``VERSIONS`` in the environment changes that), then closes. ``TRAINER=replace``: after a
failed push, a new group for the next versions; ``TRAINER=die:V``: SIGKILL in the middle of pushing version V.
``server:I:N``: process I of N, vLLM's TP rank I of N, bfloat16 torch tensors, jax blocked (never imported):
pulls until the trainer closes, checks every tensor bit for bit against a numpy re-enactment of vLLM's weight
loaders, and saves its tensors of the last version to ``OUT/rank{I}.npz``. ``server:I:N:die:V`` SIGKILLs
itself in the middle of pulling version V. One JSON line per event on stdout. ``CFG`` is the DecoderShape as
JSON. The key is ``$JRESHARD_SECRET``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for _vllm_reference

ROLE, ADDRESS, CFG, OUT = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), Path(sys.argv[4])
if ROLE.startswith("server"):
    sys.modules["jax"] = None  # a PyTorch server: jax is never imported
    sys.modules["jaxlib"] = None

import numpy as np  # noqa: E402
from _vllm_reference import hf_names, trainer, vllm_rank  # noqa: E402

from jreshard import Options  # noqa: E402
from jreshard.errors import PeerError, TransferError  # noqa: E402
from jreshard.integrations import vllm  # noqa: E402

OPTIONS = Options(timeout_s=30.0)
MODEL = vllm.DecoderShape(**CFG)
VERSIONS = int(os.environ.get("VERSIONS", "5"))
HOST = os.environ.get("JRESHARD_HOST", "127.0.0.1")  # this program's address (its namespace's, across two)


def die_when(now, *, sending: bool) -> None:
    """SIGKILL this process at its first exchange that sends (``sending``) or receives bytes while ``now()``: an
    exchange, a delta refit's sized exchange, or the start of a prepared group."""
    from jreshard.nixl.comm import NixlComm
    from jreshard.nixl.prepared import NixlPrepared

    def deadly(real):
        def exchange(self, sends, recvs, *, timeout_s):
            if now() and (sends if sending else recvs):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, sends, recvs, timeout_s=timeout_s)

        return exchange

    real_start = NixlPrepared.start

    def deadly_start(self, group, timeout_s):
        if now() and (self._sgroups if sending else self._rgroups)[group]:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_start(self, group, timeout_s)

    NixlComm.exchange = deadly(NixlComm.exchange)  # type: ignore[method-assign]
    NixlComm.exchange_sized = deadly(NixlComm.exchange_sized)  # type: ignore[method-assign]
    NixlPrepared.start = deadly_start  # type: ignore[method-assign]


def say(**event) -> None:
    print(json.dumps(event), flush=True)


def run_trainer() -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard import Link, RefitGroup

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))

    def params(v: int) -> dict:
        return {k: jax.device_put(a, NamedSharding(mesh, P("fsdp" if a.shape[0] % 4 == 0 else None)))
                for k, a in trainer(MODEL, seed=v).items()}  # fmt: skip

    mode = os.environ.get("TRAINER", "")
    if mode.startswith("die:"):  # SIGKILL this trainer in the middle of pushing version V
        doomed = int(mode[4:])
        die_when(lambda: state["v"] == doomed, sending=True)
    state = {"v": 0}
    group = RefitGroup.connect("source", params(0), address=ADDRESS, transport="nixl", options=OPTIONS, host=HOST)
    say(event="formed")
    v = 1
    while v <= VERSIONS:
        state["v"] = v
        t0 = time.monotonic()
        try:
            group.push(params(v), version=v)
        except (PeerError, TransferError) as err:
            say(event="failed", version=v, error=f"{type(err).__name__}: {err}"[:300], seconds=time.monotonic() - t0)
            group.close()
            if mode != "replace":
                return
            group = RefitGroup.connect(
                "source", params(0), address=ADDRESS, transport="nixl", options=OPTIONS, host=HOST
            )
            say(event="formed")
            v += 1  # the new servers start from the next version
            continue
        say(event="pushed", version=v, network=int(group.sent_bytes.get(Link.NETWORK, 0)))
        v += 1
    group.close()


def run_server(index: int, count: int, die: int | None) -> None:
    import torch

    from jreshard.torch.receiver import Receiver

    tensors = {
        name: torch.full(s.tensor_shape, float("nan"), dtype=torch.bfloat16)
        for name, s in vllm.vllm_shards(MODEL, index, count).items()
    }
    for name, t in tensors.items():  # vLLM fills the padding rows of the vocabulary with zeros
        s = vllm.vllm_shards(MODEL, index, count)[name]
        if s.tensor_box.shape != s.tensor_shape:
            t.zero_()
    shards, recipe = vllm.receiver_shards(tensors, MODEL, index, count)
    rx = Receiver.connect(shards, recipe=recipe, address=ADDRESS, index=index, count=count, options=OPTIONS, host=HOST)
    say(event="formed", jax=[m for m in ("jax", "jaxlib") if sys.modules.get(m) is not None])
    if die is not None:  # SIGKILL at the first exchange of version ``die`` that receives bytes
        die_when(lambda: (rx.version or 0) + 1 == die, sending=False)
    checked, bad, end = [], [], ""
    while True:
        before = {k: t.clone() for k, t in tensors.items()}
        try:
            v = rx.pull(timeout_s=60.0)
        except (PeerError, TransferError) as err:
            end = f"{type(err).__name__}: {err}"
            kept = all(torch.equal(before[k].view(torch.int16), t.view(torch.int16)) for k, t in tensors.items())
            say(event="ended", error=end[:300], intact=err.destination_intact, kept=kept)
            break
        want = vllm_rank(MODEL, hf_names(MODEL, trainer(MODEL, seed=v)), index, count)
        for name, t in tensors.items():
            ref = torch.from_numpy(np.ascontiguousarray(want[name])).to(torch.bfloat16)
            if not torch.equal(ref.view(torch.int16), t.view(torch.int16)):
                bad.append([v, name])
        checked.append(v)
        say(event="pulled", version=v)
    np.savez(OUT / f"rank{index}.npz", **{k: t.float().numpy() for k, t in tensors.items()})
    say(event="result", checked=checked, bad=bad[:10], version=rx.version)
    rx.close()


if ROLE == "trainer":
    run_trainer()
else:
    parts = ROLE.split(":")
    run_server(int(parts[1]), int(parts[2]), int(parts[4]) if len(parts) > 4 else None)
