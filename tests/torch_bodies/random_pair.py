"""A JAX trainer refits a PyTorch receiver (no jax) of random tensors over NIXL, two programs on loopback:
``random_pair.py trainer ADDRESS SEED LEAVES [delta]`` (2 CPU devices) and ``random_pair.py server:I ADDRESS SEED
LEAVES [in_place] [delta]`` (process I of 2). The leaves of ``random_trees.torch_leaves``; the trainer's on random
shardings, three versions pushed (``delta``: each changes a tenth of the elements, and the trainer has deltas
on; it reports how each went). Each server pulls until the trainer closes and checks every tensor's bytes
against the host values; one JSON line per side on stdout. The key is ``$JRESHARD_SECRET``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROLE, ADDRESS, SEED, COUNT = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if ROLE.startswith("server"):
    sys.modules["jax"] = None  # a PyTorch server: jax is never imported
    sys.modules["jaxlib"] = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for random_trees

from random_trees import torch_leaves, torch_mismatches, torch_shardings, torch_shards, values  # noqa: E402

from jreshard import Options  # noqa: E402
from jreshard.errors import PeerError, TransferError  # noqa: E402

DELTA = "delta" in sys.argv[5:]
OPTIONS = Options(timeout_s=30.0, delta="on" if DELTA else "auto")
VERSIONS = (1, 2, 3)
LEAVES = torch_leaves(SEED, COUNT)


def run_trainer() -> dict:
    import jax

    from jreshard import RefitGroup

    shardings = torch_shardings(SEED, LEAVES, jax.devices()[:2])

    def params(v: int) -> dict:
        return {n: jax.device_put(values(n, s, d, v, DELTA), shardings[n]) for n, s, d, _ in LEAVES}

    group = RefitGroup.connect("source", params(0), address=ADDRESS, transport="nixl", options=OPTIONS)
    pushed, modes = [], []
    try:
        for v in VERSIONS:
            group.push(params(v), version=v)
            pushed.append(v)
            modes.append(group.delta_report.mode if group.delta_report is not None else None)
    finally:
        group.close()
    return {"pushed": pushed, "modes": modes}


def run_server(index: int, in_place: bool) -> dict:
    from jreshard.torch.receiver import Receiver

    shards, boxes = torch_shards(LEAVES, index)
    rx = Receiver.connect(shards, address=ADDRESS, index=index, count=2, options=OPTIONS, in_place=in_place)
    checked, bad, end = [], [], ""
    while True:
        try:
            v = rx.pull(timeout_s=60.0)
        except (PeerError, TransferError) as err:  # the trainer closed after its last version
            end = f"{type(err).__name__}: {err}"[:300]
            break
        bad += torch_mismatches(LEAVES, shards, boxes, v, DELTA)
        checked.append(v)
    rx.close()
    loaded = sorted(m for m in sys.modules if m.startswith("jax") and sys.modules[m] is not None)
    return {"checked": checked, "bad": bad, "end": end, "loaded": loaded}


if __name__ == "__main__":
    if ROLE == "trainer":
        out = run_trainer()
    else:
        out = run_server(int(ROLE.split(":")[1]), "in_place" in sys.argv[5:])
    print(json.dumps(out), flush=True)
