"""One side of an MPMD (or two-launch) refit: a small transformer's parameters, FSDP on the trainer
(source), TP x DP on the server (destination), ``JRESHARD_STEPS`` versioned refits, every byte checked.

Usage: ``refit_body.py source|destination [mode]``; modes: ``ok`` (MPMD over MPI_COMM_WORLD),
``connect:<file>`` (two launches), ``kill-source`` / ``kill-destination`` (with connect: one process
of that side kills itself in the data phase of version 3), ``mismatch`` (bad declarations), ``guard``
(as ``ok``, with every whole-plan function made to raise: ``no_whole_plan.guard``).
"""

import os
import signal
import sys
import time

import numpy as np
from _common import main

D, F, V, LAYERS = 16, 32, 64, 2


def shapes() -> dict:
    p = {"embed": (V, D)}
    for i in range(LAYERS):
        p |= {f"l{i}_wq": (D, D), f"l{i}_wo": (D, D), f"l{i}_w1": (D, F), f"l{i}_w2": (F, D), f"l{i}_norm": (D,)}
    return p


def value(name: str, shape: tuple, version: int) -> np.ndarray:
    """Every version differs from the one before in about 2 of every 13 elements (a delta has work)."""
    salt = sum(map(ord, name))
    i = np.arange(np.prod(shape))
    return ((i % 9973) + salt * 0.5 + version * 1000 * (i % 13 == version % 13)).astype(np.float32).reshape(shape)


def body() -> dict:
    from mpi4py import MPI

    from jreshard.engine import replay

    role = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "ok"
    steps = int(os.environ.get("JRESHARD_STEPS", "5"))
    world = MPI.COMM_WORLD
    connect = mode.startswith("connect") or mode.startswith("kill")
    side = world if connect else world.Split(0 if role == "source" else 1, world.Get_rank())

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard.errors import LayoutMismatchError, TransferError
    from jreshard.mpi.cluster import initialize
    from jreshard.options import Options
    from jreshard.refit import RefitGroup

    if side.Get_size() > 1:
        initialize(side, port=None)
    devs = jax.devices()
    if role == "source":
        mesh = jax.sharding.Mesh(np.array(devs), ("fsdp",))
        spec = {k: P("fsdp") if len(s) == 2 or s[0] % len(devs) == 0 else P() for k, s in shapes().items()}
    else:
        dp = 2 if len(devs) % 2 == 0 and len(devs) > 1 else 1
        mesh = jax.sharding.Mesh(np.array(devs).reshape(dp, len(devs) // dp), ("dp", "tp"))
        spec = {}
        for k, s in shapes().items():
            spec[k] = P() if len(s) == 1 else P("tp", None) if k.endswith(("wo", "w2")) else P(None, "tp")
    # ``cast``: the server declares bfloat16 (a float32 trainer, the bits of x.astype(bfloat16) on the server)
    dtype = jax.numpy.bfloat16 if mode == "cast" and role == "destination" else np.float32
    sds = {k: jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, spec[k])) for k, s in shapes().items()}
    opts = Options(
        timeout_s=float(os.environ.get("JRESHARD_TIMEOUT", "30")),
        chunk_bytes=512,
        staging_bytes=1 << 16,
        delta=os.environ.get("JRESHARD_DELTA", "auto"),
    )
    kwargs = {}
    if mode == "mismatch":
        if role == "destination":
            sds["embed"] = jax.ShapeDtypeStruct((V + 1, D), np.float32, sharding=sds["embed"].sharding)
            sds["extra"] = sds.pop("l0_norm")
            if jax.process_index() == 1:
                kwargs["devices"] = list(devs)  # every device of the server cluster: two are not its own
        try:
            RefitGroup(role, sds, options=opts, **kwargs)
        except LayoutMismatchError as err:
            return {"rejected": str(err)}
        return {"rejected": None}

    planned_ranks = None
    if mode == "guard":
        from no_whole_plan import guard

        planned_ranks = guard(setattr)
    if connect:
        address = os.environ["JRESHARD_ADDRESS"]
        group = RefitGroup.connect(role, sds, address=address, options=opts)
    else:
        group = RefitGroup(role, sds, options=opts)
    victim = mode == f"kill-{role}" and side.Get_rank() == side.Get_size() - 1

    def make(version):
        return {
            k: jax.make_array_from_callback(
                s.shape, s.sharding, lambda i, k=k, s=s: value(k, s.shape, version)[i].astype(s.dtype)
            )
            for k, s in sds.items()
        }

    def check(tree, version):
        n = 0
        for k, a in tree.items():
            assert a.sharding == sds[k].sharding, (k, a.sharding)
            for sh in a.addressable_shards:
                want = value(k, a.shape, version).astype(a.dtype)[sh.index]
                assert np.asarray(sh.data).tobytes() == want.tobytes(), (k, version)
                n += sh.data.nbytes
        return n

    planned = None if mode in ("guard", "cast") else group.plan.stats().network_bytes  # a cast moves views
    log = {"versions": [], "bytes": [], "network_bytes": planned}
    current = make(0) if role == "destination" else None
    for v in range(1, steps + 1):
        if victim and v == 3:
            calls = [0]  # the groups this process posts, however the engine posts them (whole, or ahead)

            def die() -> None:
                # Stall, then die: the survivors are waiting in their rounds of version 3 by then, even on a
                # loaded machine where they reach them late (they wait for this process's bytes meanwhile).
                time.sleep(1.0)
                os.kill(os.getpid(), signal.SIGKILL)

            def dying(real, calls=calls):
                def post(*a, **k):
                    calls[0] += 1
                    if calls[0] == 2:
                        die()
                    return real(*a, **k)

                return post

            def dying_after(real):  # a delta refit's group (one per round): its bytes moved, the refit not committed
                def post(*a, **k):
                    out = real(*a, **k)
                    die()
                    return out

                return post

            group._comm.exchange = dying(group._comm.exchange)
            group._comm.start_rows = dying(group._comm.start_rows)
            group._comm.exchange_sized = dying_after(group._comm.exchange_sized)
            # A prepared refit starts its groups itself: the victim's are re-prepared to run from Python, with
            # the same count of posts before it dies (its survivors replay theirs as usual).
            replay.release(group._comm)
            prepare = group._comm.prepare

            def prepared(groups, prepare=prepare, dying=dying):
                p = prepare(groups)
                p.native = None
                p.start = dying(p.start)
                return p

            group._comm.prepare = prepared
        t0 = time.monotonic()
        try:
            if role == "source":
                group.push(make(v), version=v)
            else:
                new, got = group.pull(into=current)
                assert got == v, (got, v)
                if current is not None and v > 1:
                    check(current, v - 1)  # the previous version's arrays are untouched
                log["bytes"].append(check(new, v))
                current = new
        except TransferError as err:
            # how many steps this process replayed in the compiled loop before the failure (its survivors wait there)
            log["native_steps"] = sum(r.native_steps for r in replay._by_comm.get(group._comm, {}).values())
            log["failed_at"] = v
            log["error"] = f"{type(err).__name__}: {err}"
            log["elapsed"] = time.monotonic() - t0
            log["version_after_failure"] = group.version
            if current is not None:
                log["previous_intact_bytes"] = check(current, v - 1)
            break
        log["versions"].append(group.version)
        rep = group.delta_report
        log.setdefault("delta", []).append([rep.mode, rep.sent_bytes, rep.full_bytes, rep.recv_bytes])
    log.pop("error", None) if "failed_at" not in log else None
    if planned_ranks is not None:
        log |= {"planned_ranks": sorted(set(planned_ranks)), "mine": list(group._comm.local_ranks)}
    return log


if __name__ == "__main__":
    mode = sys.argv[2] if len(sys.argv) > 2 else "ok"
    main(f"refit-{sys.argv[1]}", body, hard_exit=mode.startswith("kill"))
