"""Plans compiled into XLA collectives: ``Options(backend="xla")``.

For the tensors of one call, the plan (:mod:`jreshard.sharding`) becomes one jitted
``jax.shard_map`` over a 1-D mesh of every device taking part: static slices pack each
device's send buffers (as raw ``uint8`` lanes, :mod:`jreshard.xla.lanes`), one
``jax.lax.ppermute`` per permutation of a stage (:mod:`jreshard.xla.perms`), static
``dynamic_update_slice`` unpacks into the destination shards, network stage then
fast-link stage as in the plan (:mod:`jreshard.xla.xlaplan`, :mod:`jreshard.xla.compiled`).
Computations are cached by layouts, topology, options and donation; ``transfer_into`` donates the
destination shards, so XLA writes into their memory (:mod:`jreshard.xla.run`).

Not run on GPU or TPU: tested on CPU devices, in one process and across the processes of a
``jax.distributed`` CPU cluster (gloo). XLA orders the transfer on the device streams and
allocates every buffer itself, which is why it exists; whether it is faster there is not measured.
"""
