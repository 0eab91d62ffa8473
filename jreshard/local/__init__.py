"""The ``local`` transport: every device of a transfer in this process.

On CPU devices the call runs as direct copies between the shards' buffers
(:mod:`jreshard.engine.inprocess`), with no messages at all. On GPUs in one process the engine runs
over :class:`~jreshard.local.gpu.CupyLocalComm`, sends and receives as stream-ordered device copies
(not run on GPU). :mod:`jreshard.local.record` is its record for the registry.
"""
