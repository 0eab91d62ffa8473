"""One process of a ``jax.distributed`` CPU cluster (gloo collectives) running ``transfer`` with backend xla.

    python distributed_transfer.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

Every process builds the same global values (``xla_parity_cases.host_value``) and shardings over the
cluster's devices, calls ``jreshard.transfer`` once for a pytree of them, and checks each of its
addressable result shards bit for bit against the global value at its index; it writes
``OUT_DIR/<process id>.json`` (or the traceback).
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def body(pid: int, nproc: int, port: int) -> dict:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, initialization_timeout=60
    )
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from xla_parity_cases import host_value, same_bits

    import jreshard

    devs = jax.devices()
    n = len(devs)
    half = n // 2
    cases = {
        # the first half of the processes' devices -> the second half: every byte crosses processes
        "rows->cols": (
            (8, 16),
            "float32",
            NamedSharding(Mesh(np.array(devs[:half]), ("x",)), P("x")),
            NamedSharding(Mesh(np.array(devs[half:]), ("y",)), P(None, "y")),
        ),
        # all devices -> all devices in reverse order, another dimension
        "all->reversed": (
            (8, 16),
            "bfloat16",
            NamedSharding(Mesh(np.array(devs), ("x",)), P("x")),
            NamedSharding(Mesh(np.array(devs[::-1]).reshape(2, n // 2), ("a", "b")), P("b", "a")),
        ),
        # replicated on one process's devices -> sharded over every device, sub-byte values
        "replicated->all": (
            (4, 8),
            "int4",
            NamedSharding(Mesh(np.array(devs[:2]), ("x",)), P()),
            NamedSharding(Mesh(np.array(devs), ("x",)), P(None, "x")),
        ),
        "float8": (
            (8, 8),
            "float8_e5m2",
            NamedSharding(Mesh(np.array(devs[half:]), ("x",)), P(None, "x")),
            NamedSharding(Mesh(np.array(devs[:half]), ("x",)), P("x")),
        ),
    }
    host = {k: host_value(shape, dt, seed=i) for i, (k, (shape, dt, _, _)) in enumerate(cases.items())}
    x = {
        k: jax.make_array_from_callback(v.shape, cases[k][2], lambda idx, v=v: v[idx], dtype=v.dtype)
        for k, v in host.items()
    }
    out, rep = jreshard.transfer(
        x, {k: c[3] for k, c in cases.items()}, options=jreshard.Options(backend="xla"), report=True
    )
    checked = 0
    for k, arr in out.items():
        assert arr.sharding == cases[k][3] and arr.dtype == host[k].dtype, k
        for s in arr.addressable_shards:
            assert same_bits(s.data, host[k][s.index]), (k, s.device)
            checked += 1
    result = {
        "checked": checked,
        "backend": rep.backend.value,
        "network_bytes": rep.network_bytes,
        "fast_bytes": rep.fast_bytes,
        "same_device_bytes": rep.same_device_bytes,
        "padding_bytes": rep.padding_bytes,
    }
    # transfer_into across processes: every process donates its own destination shards.
    shape, _, _, dst_sh = cases["rows->cols"]
    into = jax.make_array_from_callback(shape, dst_sh, lambda idx: np.zeros(shape, np.float32)[idx], dtype=np.float32)
    ptrs = {s.device: s.data.unsafe_buffer_pointer() for s in into.addressable_shards}
    got = jreshard.transfer_into(x["rows->cols"], into, options=jreshard.Options(backend="xla"))
    for s in got.addressable_shards:
        assert same_bits(s.data, host["rows->cols"][s.index]), s.device
        assert s.data.unsafe_buffer_pointer() == ptrs[s.device], s.device
    result["into_in_place"] = len(got.addressable_shards)
    result["into_deleted"] = into.is_deleted() if ptrs else None
    if nproc >= 4:
        # Only the first two processes' devices take part: the others get results with no addressable shard.
        sub = devs[: 2 * len(jax.local_devices())]
        a = NamedSharding(Mesh(np.array(sub[:2]), ("x",)), P("x"))
        b = NamedSharding(Mesh(np.array(sub[2:]), ("x",)), P(None, "x"))
        v = host_value((4, 8), "float32", seed=9)
        y = jax.make_array_from_callback(v.shape, a, lambda idx: v[idx], dtype=v.dtype)
        z = jreshard.transfer(y, b, options=jreshard.Options(backend="xla"))
        for s in z.addressable_shards:
            assert same_bits(s.data, v[s.index]), s.device
        result["subset_shards"] = len(z.addressable_shards)
    jax.distributed.shutdown()
    return result


if __name__ == "__main__":
    pid, nproc, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    code = 0
    try:
        result = body(pid, nproc, port)
    except BaseException:
        result, code = {"error": traceback.format_exc()}, 1
    with open(os.path.join(out, f"{pid}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(out, f"{pid}.json.tmp"), os.path.join(out, f"{pid}.json"))
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown: a peer that already left cannot block it
