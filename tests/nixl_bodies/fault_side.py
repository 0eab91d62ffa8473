"""One side of a RefitGroup for the fault suite: ``fault_side.py ROLE TRANSPORT MODE`` (``nixl`` or ``mpi``;
under ``mpiexec -n 1`` for ``mpi``), the two sides in separate network namespaces.

Environment: ``JRESHARD_ADDRESS`` (the rendezvous file), ``JRESHARD_HOST`` (this namespace's address, the
one the source listens on), ``JRESHARD_TIMEOUT``, versions ``JRESHARD_FIRST``..``JRESHARD_STEPS``,
``JRESHARD_MIB`` (MiB per version). Modes: ``once`` (a failure ends the program), ``again`` (after a
failure the group is closed and this side connects again at the same address, and goes on from the
version that failed; twice at most).

``JRESHARD_BACKGROUND=1``: the destination receives in the background (``pull_async``) while it keeps
running a jitted step on the version it holds, and flips between two steps.

One JSON line per event on stdout: ``ready`` (pid), ``formed``, ``start`` (a version's refit begins),
``pushed`` / ``pulled`` (with the serving steps run during the receive), ``failed`` (the error, its type,
seconds, and which versions the arrays held then match), ``end``. A destination hashes every shard it
holds after every refit and after every failure and names every version all of whose shards match:
exactly one, or the arrays are a mix.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import jreshard  # noqa: F401 - before mpi4py (and jax)


def say(**event) -> None:
    print(json.dumps(event), flush=True)


def main() -> None:
    role, transport, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    if transport == "mpi":
        from mpi4py import MPI  # noqa: F401 - initialised before jax

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard import Options, RefitGroup
    from jreshard.errors import JReshardError, PeerError, TransferError, TransferTimeoutError

    address, host = os.environ["JRESHARD_ADDRESS"], os.environ.get("JRESHARD_HOST", "127.0.0.1")
    timeout = float(os.environ.get("JRESHARD_TIMEOUT", "5"))
    first, steps = int(os.environ.get("JRESHARD_FIRST", "1")), int(os.environ.get("JRESHARD_STEPS", "4"))
    background = os.environ.get("JRESHARD_BACKGROUND") == "1"
    rows = max(2, int(float(os.environ.get("JRESHARD_MIB", "1")) * 256))  # 1 MiB: 256 rows of 1024 float32
    shape = (rows - rows % 2, 1024)
    opts = Options(timeout_s=timeout, chunk_bytes=1 << 18, staging_bytes=1 << 21)

    def value(v: int) -> np.ndarray:
        return np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape) % 8191 + 10000.0 * v

    def digest(a: np.ndarray) -> str:
        return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()

    values = {v: value(v) for v in range(0, steps + 1)}
    devs = jax.devices()
    if role == "source":
        sharding = NamedSharding(Mesh(np.array(devs), ("fsdp",)), P("fsdp"))
    else:
        sharding = NamedSharding(Mesh(np.array(devs).reshape(1, len(devs)), ("dp", "tp")), P(None, "tp"))
    like = {"w": jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)}

    def connect():
        """Connect, again on a timeout, for up to a minute: the peer may be a program still starting."""
        deadline = time.monotonic() + 60
        while True:
            try:
                group = RefitGroup.connect(role, like, address=address, options=opts, transport=transport, host=host)
                say(event="formed")
                return group
            except TransferTimeoutError as err:
                if time.monotonic() > deadline:
                    raise
                say(event="retry", error=str(err)[:300])

    def held(tree) -> list[int]:
        """Every version all of whose shards this process holds (each shard hashed on its own)."""
        if tree is None:
            return [0]  # nothing pulled yet: the destination's "previous version" is its initial state
        got = [(s.index, digest(np.asarray(s.data))) for s in tree["w"].addressable_shards]
        return [v for v, x in values.items() if all(digest(x[i]) == h for i, h in got)]

    serve = jax.jit(lambda w: (w * w).sum())  # the server's step, on the version it holds

    def receive(tree, t0: float):
        """One refit on the destination: blocking, or in the background while serving (bounded either way)."""
        if not background or tree is None:
            return (*group.pull(like=like), 0)
        handle = group.pull_async(into=tree)
        served = 0
        while not handle.ready() and time.monotonic() < t0 + 3 * timeout + 10:
            serve(tree["w"]).block_until_ready()
            served += 1
        return (*handle.result(timeout_s=1.0), served)

    say(event="ready", pid=os.getpid())
    go = os.environ.get("JRESHARD_GO")
    deadline = time.monotonic() + 120
    while go and not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.02)
    group = connect()
    tree, v, retries = None, first, 0
    while v <= steps:
        say(event="start", version=v)
        t0 = time.monotonic()
        try:
            if role == "source":
                group.push({"w": jax.device_put(value(v), sharding)}, version=v)
                say(event="pushed", version=v)
            else:
                new, got, served = receive(tree, t0)
                tree = new
                say(event="pulled", version=got, held=held(tree), asked=v, served=served)
                v = got
        except (TransferError, JReshardError) as err:
            closed = isinstance(err, PeerError) and "closed the group" in str(err)
            if role == "destination" and closed and v > steps:
                break
            say(
                event="failed",
                version=v,
                type=type(err).__name__,
                error=str(err)[:2000],
                seconds=time.monotonic() - t0,
                intact=getattr(err, "destination_intact", None),
                held=held(tree) if role == "destination" else None,
                held_version=None if tree is None else group.version,
            )
            group.close()
            retries += 1
            if mode != "again" or retries > 2:
                say(event="end", versions_done=v - 1)
                return
            group = connect()
            continue
        v += 1
    if role == "source":
        group.close()
    else:  # the source closes after its last version: the next pull says so at once
        try:
            group.pull(like=like, timeout_s=timeout)
        except JReshardError:
            pass
        group.close()
    say(event="end", versions_done=steps)


if __name__ == "__main__":
    main()
