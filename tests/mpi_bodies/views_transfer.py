"""Views across processes: every process calls jreshard.transfer on the same fused views of global arrays.

float32 q, k, v over FSDP on every device of the cluster, fused into a bfloat16 qkv (TP-grouped, k and v
repeated as for GQA) on a TP x DP mesh of every device in another order, plus a block-FP8 quantised
matrix, in chunks of 48 bytes, 256 bytes of staging a rank and at most 2 operations a group. Each
addressable target shard must equal the same composition done with numpy on the global arrays; each
process reports the bytes it sent, the staging it held and the lowering's bytes.
"""

import numpy as np
from _common import main


def body() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jreshard
    from jreshard import Layout, views
    from jreshard.mpi.cluster import initialize
    from jreshard.views.lowering import lower_tree

    initialize()
    devs = jax.devices()
    n = len(devs)
    fsdp = NamedSharding(Mesh(np.array(devs), ("f",)), P("f"))
    order = devs[1:] + devs[:1]
    tp = 2
    server = NamedSharding(Mesh(np.array(order).reshape(n // tp, tp), ("dp", "tp")), P(None, "tp"))
    g = {
        name: (np.arange(16 * w, dtype=np.float32).reshape(16, w) * (i + 1) / 7)
        for i, (name, w) in enumerate((("q", 16), ("k", 4), ("v", 4), ("m", 32), ("a", 16)))
    }
    x = {name: jax.make_array_from_callback(a.shape, fsdp, lambda idx, a=a: a[idx]) for name, a in g.items()}
    kk, vv = (views.concat([x[s]] * tp, axis=1) for s in ("k", "v"))
    qkv = views.astype(views.concat([x["q"], kk, vv], axis=1, groups=tp), jnp.bfloat16)
    w8, s8 = views.quantize_fp8(x["m"], block=(8, 8))  # 8-row blocks over 4-row shards: quantised on arrival
    # 4-row blocks within each source shard: quantised at the sender, 1 byte a weight on the wire
    wa, sa = views.quantize_fp8(x["a"], block=(16 // n, 8))
    tree = {"qkv": qkv, "w": w8, "s": s8, "q": x["q"], "wa": wa, "sa": sa}
    target = dict.fromkeys(tree, server)
    # small chunks, a small staging bound and at most 2 operations a group: the engine's rounds bound all three
    small = jreshard.Options(timeout_s=60, chunk_bytes=48, staging_bytes=256, max_group_ops=2)
    out, rep = jreshard.transfer(tree, target, report=True, options=small)

    def grouped(parts):
        return np.concatenate([np.split(p, tp, axis=1)[i] for i in range(tp) for p in parts], axis=1)

    ref_qkv = np.asarray(
        jnp.asarray(grouped([g["q"], np.concatenate([g["k"]] * tp, 1), np.concatenate([g["v"]] * tp, 1)])).astype(
            jnp.bfloat16
        )
    )
    ref_w, ref_s = views.quantize_fp8_reference(g["m"], (8, 8))
    ref_wa, ref_sa = views.quantize_fp8_reference(g["a"], (16 // n, 8))
    checked = 0
    refs = {"qkv": ref_qkv, "w": ref_w, "s": ref_s, "q": g["q"], "wa": ref_wa, "sa": ref_sa}
    for name, ref in refs.items():
        leaf = out[name]
        assert leaf.sharding == server and leaf.shape == ref.shape and leaf.dtype == ref.dtype, name
        for s in leaf.addressable_shards:
            a, b = np.asarray(s.data), ref[s.index]
            assert np.array_equal(a.view(f"uint{8 * a.dtype.itemsize}"), b.view(f"uint{8 * b.dtype.itemsize}")), name
            checked += 1
    # a ShapeDtypeStruct target of another dtype is an astype, across processes too
    sds = jax.ShapeDtypeStruct(g["q"].shape, jnp.bfloat16, sharding=server)
    cast = jreshard.transfer(x["q"], sds, options=small)
    ref_cast = np.asarray(jnp.asarray(g["q"]).astype(jnp.bfloat16))
    assert cast.dtype == jnp.bfloat16 and cast.sharding == server
    for s in cast.addressable_shards:
        assert np.array_equal(np.asarray(s.data).view(np.uint16), ref_cast[s.index].view(np.uint16)), "sds cast"
        checked += 1
    try:
        jreshard.transfer_into({"qkv": qkv}, {"qkv": out["qkv"]})
        refused = ""
    except jreshard.BackendUnavailableError as err:
        refused = str(err)
    flat = [qkv, w8, s8, views.as_view(x["q"]), wa, sa]
    leaves = list({id(lf.source): lf for v in flat for lf in v.leaves()}.values())
    lays = [Layout.from_sharding(lf.source.sharding, lf.shape, lf.dtype) for lf in leaves]
    dsts = [Layout.from_sharding(server, v.shape, v.dtype) for v in flat]
    topo = jreshard.Topology.from_devices(devs)
    low = lower_tree(flat, leaves, lays, dsts, topo)
    return {
        "checked": checked,
        "refused": refused,
        "network": rep.network_bytes,
        "fast": rep.fast_bytes,
        "same_device": rep.same_device_bytes,
        "messages": rep.messages,
        "peak_staging": rep.peak_staging_bytes,
        "backend": rep.backend.value,
        "expect_network": sum(lw.network_bytes for lw in low),
        "expect_moved": sum(lw.network_bytes + lw.fast_bytes + lw.same_device_bytes for lw in low),
    }


if __name__ == "__main__":
    main("views", body)
