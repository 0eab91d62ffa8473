"""``MpiRendezvous.share`` among the processes of one launch: ``rendezvous_body.py CASE``. ``one``: process 1
makes the value, every process gets it; ``none`` and ``two``: no process or two make it, PeerError everywhere;
``late``: process 2 never calls it, the others raise TransferTimeoutError within ``timeout_s``."""

import sys
import time

from _common import main, world_rank

TIMEOUT_S = 4.0


def body() -> dict:
    from jreshard.errors import PeerError, TransferTimeoutError
    from jreshard.mpi.rendezvous import MpiRendezvous

    case, me = sys.argv[1], world_rank()
    value = {"one": {1: b"id"}, "none": {}, "two": {0: b"a", 1: b"b"}, "late": {0: b"id"}}[case].get(me)
    if case == "late" and me == 2:
        time.sleep(2 * TIMEOUT_S)  # never joins
        return {}
    t0 = time.monotonic()
    try:
        got = MpiRendezvous().share("k", value, timeout_s=TIMEOUT_S)
    except (PeerError, TransferTimeoutError) as err:
        return {"raised": f"{type(err).__name__}: {err}", "after_s": time.monotonic() - t0}
    return {"got": got.decode(), "after_s": time.monotonic() - t0}


if __name__ == "__main__":
    main(f"rendezvous-{sys.argv[1]}", body)
