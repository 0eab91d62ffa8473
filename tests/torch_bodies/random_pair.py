"""A JAX trainer refits a PyTorch receiver (no jax) of random tensors over NIXL, two programs on loopback:
``random_pair.py trainer ADDRESS SEED LEAVES [delta]`` (2 CPU devices) and ``random_pair.py server:I ADDRESS SEED
LEAVES [in_place] [delta]`` (process I of 2). The leaves of ``random_trees.torch_leaves``; the trainer's on random
shardings, three versions pushed (``delta``: each changes a tenth of the elements, and the trainer has deltas
on; it reports how each went). Each server pulls until the trainer closes and checks every tensor's bytes
against the host values; one JSON line per side on stdout. The key is ``$JRESHARD_SECRET``."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROLE, ADDRESS, SEED, COUNT = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if ROLE.startswith("server"):
    sys.modules["jax"] = None  # a PyTorch server: jax is never imported
    sys.modules["jaxlib"] = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for random_trees

import numpy as np  # noqa: E402
from random_trees import torch_leaves, values  # noqa: E402

from jreshard import Options  # noqa: E402
from jreshard.errors import PeerError, TransferError  # noqa: E402

DELTA = "delta" in sys.argv[5:]
OPTIONS = Options(timeout_s=30.0, delta="on" if DELTA else "auto")
VERSIONS = (1, 2, 3)
LEAVES = torch_leaves(SEED, COUNT)


def run_trainer() -> dict:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard import RefitGroup

    mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    r = random.Random(SEED + 1)

    def sharding(shape: tuple[int, ...]) -> NamedSharding:
        dims = [d for d, n in enumerate(shape) if n % 2 == 0]
        spec = [None] * len(shape)
        if dims and r.random() < 0.7:
            spec[r.choice(dims)] = "fsdp"
        return NamedSharding(mesh, P(*spec))

    shardings = {n: sharding(s) for n, s, _, _ in LEAVES}

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
    import torch

    from jreshard.sharding.box import Box
    from jreshard.torch.receiver import Receiver, Shard

    shards, boxes = {}, {}
    for n, shape, dtype, split in LEAVES:
        lo, hi = [0] * len(shape), list(shape)
        if split is not None:
            half = shape[split] // 2
            lo[split], hi[split] = index * half, (index + 1) * half
        t = torch.zeros(Box(tuple(lo), tuple(hi)).shape, dtype=getattr(torch, dtype))
        shards[f"['{n}']"] = Shard(t, shape, Box(tuple(lo), tuple(hi)))  # the trainer's leaf, by its key path
        boxes[n] = tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))
    rx = Receiver.connect(shards, address=ADDRESS, index=index, count=2, options=OPTIONS, in_place=in_place)
    checked, bad, end = [], [], ""
    while True:
        try:
            v = rx.pull(timeout_s=60.0)
        except (PeerError, TransferError) as err:  # the trainer closed after its last version
            end = f"{type(err).__name__}: {err}"[:300]
            break
        for n, shape, dtype, _ in LEAVES:
            want = np.ascontiguousarray(values(n, shape, dtype, v, DELTA)[boxes[n]]).reshape(-1).view(np.uint8)
            got = shards[f"['{n}']"].tensor.reshape(-1).view(torch.uint8).numpy()
            if got.tobytes() != want.tobytes():
                bad.append(f"{n} {shape} {dtype} at version {v}")
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
