"""The trainer of the elastic fault suite: ``fault_trainer.py``, in its own network namespace.

Listens on ``$JRESHARD_HOST``, writes its address to ``$JRESHARD_ADDRESS``, says ``joined`` for each
replica it admits, and once ``$JRESHARD_GO`` exists pushes versions 1..``$JRESHARD_STEPS``; before
each push after a loss it waits (bounded) until three replicas are live again. One JSON line per
event: ``listening``, ``joined``, ``start``, ``pushed`` (committed, lost), ``lost``, ``end``
(``history``: every replica it admitted, the lost with their reason).
"""

from __future__ import annotations

import json
import os
import threading
import time

import jax
import numpy as np
from _fault_model import value
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jreshard import Options, TransferTimeoutError
from jreshard.elastic import ElasticTrainer


def say(**event) -> None:
    print(json.dumps(event), flush=True)


def main() -> None:
    say(event="ready", pid=os.getpid())
    steps, timeout = int(os.environ["JRESHARD_STEPS"]), float(os.environ["JRESHARD_TIMEOUT"])
    sharding = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",)), P("fsdp"))

    def params(v: int) -> dict:
        return {"w": jax.device_put(value(v), sharding)}

    opts = Options(timeout_s=timeout, chunk_bytes=1 << 18, staging_bytes=1 << 21)
    tr = ElasticTrainer(
        params(0), host=os.environ["JRESHARD_HOST"], address_file=os.environ["JRESHARD_ADDRESS"], options=opts
    )
    say(event="listening", address=tr.address)
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for name, info in tr.replicas().items():
                if info.id not in seen:
                    seen.add(info.id)
                    say(event="joined", name=name, id=info.id)
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()
    go = os.environ["JRESHARD_GO"]
    deadline = time.monotonic() + 300
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.02)
    first = int(os.environ.get("JRESHARD_FIRST", "1"))  # a trainer started in a dead one's place goes on
    for v in range(first, steps + 1):
        if (v > 1 or first > 1) and len(tr.replicas()) < 3:
            try:
                tr.wait(count=3, timeout_s=90.0)
            except TransferTimeoutError as err:
                say(event="short", error=str(err))
        say(event="start", version=v)
        report = tr.push(params(v), version=v)
        say(event="pushed", version=v, committed=list(report.committed), lost=report.lost, seconds=report.seconds)
        for name, why in report.lost.items():
            say(event="lost", name=name, version=v, why=why)
    done.set()
    history = [[i.name, i.id, i.state.value, i.version, i.error] for i in tr.history()]
    tr.close()
    say(event="end", history=history)


if __name__ == "__main__":
    main()
