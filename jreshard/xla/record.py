"""The XLA transport's record for the registry (:mod:`jreshard.call.routes`).

The plan compiled into one jitted ``shard_map`` of ``ppermute``s over every device taking part
(:mod:`jreshard.xla.run`): a runner in place of the engine, in one process or across the processes
of a ``jax.distributed`` cluster. It needs nothing but jax. ``auto`` never picks it: on CPU in one
process the direct copies were measured faster (``benchmarks/transfer_bench.py``), and it has not
been run on GPU or TPU.
"""

from __future__ import annotations

from jreshard.engine.record import Reach, TransportRecord
from jreshard.xla.run import run_xla

__all__ = ["RECORD"]

RECORD: TransportRecord[None] = TransportRecord(
    name="xla",
    summary="one XLA computation of collective permutes over the devices",
    serves=frozenset(set(Reach) - {Reach.PROGRAMS}),
    run=run_xla,
)
