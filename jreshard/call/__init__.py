"""One call of ``transfer`` / ``transfer_into``, from the user's pytree to the runner that moves it.

- :mod:`jreshard.call.front`: flatten the pytree once into the call's leaves and targets;
- :mod:`jreshard.call.normalize`: targets (shardings, ``ShapeDtypeStruct``, typed keys) made uniform;
- :mod:`jreshard.call.describe`: arrays and shardings described in error messages;
- :mod:`jreshard.call.repack`: typed keys and sub-byte dtypes carried as their raw bytes;
- :mod:`jreshard.call.routes`: which transport runs a call, and running it;
- :mod:`jreshard.call.views`: the call of a view (casts, slices, fused parameters) of the source's tree.
"""
