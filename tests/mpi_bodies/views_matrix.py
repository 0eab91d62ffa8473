"""The views acceptance matrix across processes (cases: ``views_cases``).

``cluster``: every process of one jax cluster calls ``jreshard.transfer`` on the same tree of views over
global arrays (FSDP over every device) into TP2 x DP2 over every device in another order, the plain
leaf ``c`` cast by a bfloat16 ShapeDtypeStruct target; small chunks, staging and groups.

``refit source|destination``: an MPMD trainer (float32 arrays, FSDP) and server (its bfloat16 / FP8
abstract tree and a recipe of views over ``views.param`` leaves). First a server with a wrong recipe
and dtype is refused on every process of both sides; then the right group refits two versions.

Each process reports the target shards it checked bit for bit against numpy, the network bytes its
ranks sent and the brute-force bound.
"""

import sys

import numpy as np
from _common import main
from views_cases import EXPERTS, SPECS, bits, build, globals_, network_bound, references


def _check(out: dict, refs: dict, shardings: dict) -> int:
    checked = 0
    for name, ref in refs.items():
        leaf = out[name]
        assert leaf.sharding == shardings[name], name
        assert leaf.shape == ref.shape and leaf.dtype == ref.dtype, (name, leaf.shape, leaf.dtype, ref.dtype)
        for s in leaf.addressable_shards:
            assert np.array_equal(bits(np.asarray(s.data)), bits(ref[s.index])), name
            checked += 1
    return checked


def cluster() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jreshard
    from jreshard import Layout, views
    from jreshard.mpi.cluster import initialize

    initialize()
    devs = jax.devices()
    fsdp = NamedSharding(Mesh(np.array(devs), ("f",)), P("f"))
    order = devs[1:] + devs[:1]
    mesh = Mesh(np.array(order).reshape(len(devs) // 2, 2), ("dp", "tp"))
    g = globals_()
    x = {n: jax.make_array_from_callback(a.shape, fsdp, lambda i, a=a: a[i]) for n, a in g.items()}
    shardings = {k: NamedSharding(mesh, P(*s)) for k, s in SPECS.items()}
    tree = {"w": x["w"], "c": x["c"], **build(views, x)}
    target = dict(shardings)
    target["c"] = jax.ShapeDtypeStruct(g["c"].shape, jnp.bfloat16, sharding=shardings["c"])
    topo = jreshard.Topology.from_devices(devs)
    small = jreshard.Options(timeout_s=60, chunk_bytes=48, staging_bytes=256, max_group_ops=2)
    out, rep = jreshard.transfer(tree, target, topology=topo, report=True, options=small)
    checked = _check(out, references(g), shardings)
    tree["c"] = views.astype(x["c"], "bfloat16")
    dsts = {k: Layout.from_sharding(shardings[k], v.shape, v.dtype) for k, v in tree.items()}
    bound = network_bound(tree, lambda lf: Layout.from_sharding(lf.source.sharding, lf.shape, lf.dtype), dsts, topo)
    return {
        "checked": checked,
        "sent": rep.network_bytes,
        "bound": bound,
        "backend": rep.backend.value,
        "peak_staging": rep.peak_staging_bytes,
    }


def refit(role: str) -> dict:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    side = world.Split(0 if role == "source" else 1, world.Get_rank())

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard import Options, views
    from jreshard.errors import LayoutMismatchError
    from jreshard.mpi.cluster import initialize
    from jreshard.refit import RefitGroup
    from jreshard.sharding.topology import Link

    if side.Get_size() > 1:
        initialize(side, port=None)
    devs = jax.devices()
    g = globals_()
    opts = Options(timeout_s=60, chunk_bytes=64, staging_bytes=512, max_group_ops=2)
    if role == "source":
        fsdp = NamedSharding(Mesh(np.array(devs), ("f",)), P("f"))
        sds = {n: jax.ShapeDtypeStruct(a.shape, jnp.float32, sharding=fsdp) for n, a in g.items()}
        try:
            RefitGroup("source", sds, options=opts)
            rejected = None
        except LayoutMismatchError as err:
            rejected = str(err)
        group = RefitGroup("source", sds, options=opts)
        for v in (1, 2):
            x = {n: jax.make_array_from_callback(a.shape, fsdp, lambda i, a=a, v=v: (a + v)[i]) for n, a in g.items()}
            group.push(x, version=v)
        return {"rejected": rejected, "sent": group.sent_bytes.get(Link.NETWORK, 0), "checked": 0}
    mesh = Mesh(np.array(devs).reshape(len(devs) // 2, 2), ("dp", "tp"))
    shardings = {k: NamedSharding(mesh, P(*s)) for k, s in SPECS.items()}
    refs0 = references(g)
    sds = {k: jax.ShapeDtypeStruct(r.shape, r.dtype, sharding=shardings[k]) for k, r in refs0.items()}
    params = {n: views.param(f"['{n}']", a.shape, "float32") for n, a in g.items()}
    recipe = {"w": None, "c": None, **build(views, params)}
    # wrong: q read with another shape, a parameter the trainer does not have, a dtype views cannot cast to
    bad_params = dict(params, q=views.param("['q']", (16, 12), "float32"), k=views.param("['kk']", (16, 4), "float32"))
    bad_sds = dict(sds, c=jax.ShapeDtypeStruct((16, 8), jnp.int32, sharding=shardings["c"]))
    try:
        RefitGroup("destination", bad_sds, options=opts, recipe={"w": None, "c": None, **build(views, bad_params)})
        rejected = None
    except LayoutMismatchError as err:
        rejected = str(err)
    group = RefitGroup("destination", sds, options=opts, recipe=recipe)
    checked = 0
    for v in (1, 2):
        new, got = group.pull(like=sds)
        assert got == v, (got, v)
        checked += _check(new, references({n: a + v for n, a in g.items()}), shardings)
    gv = group._views
    tree = dict(zip(gv.dst_names, gv.views, strict=True))
    tree = {k[2:-2]: t for k, t in tree.items()}  # "['qkv']" -> "qkv"
    dsts = {k[2:-2]: d for k, d in zip(gv.dst_names, gv.dsts, strict=True)}
    layout = dict(zip(gv.src_names, gv.layouts, strict=True))
    bound = network_bound(tree, lambda lf: layout[lf.source.name], dsts, group.topology)
    lowered = sum(low.network_bytes for low in group.lowerings)
    assert EXPERTS == tree["experts"].shape[0]
    return {
        "rejected": rejected,
        "sent": group.sent_bytes.get(Link.NETWORK, 0),
        "checked": checked,
        "bound": bound,
        "lowered": lowered,
    }


def body() -> dict:
    if sys.argv[1] == "cluster":
        return cluster()
    return refit(sys.argv[2])


if __name__ == "__main__":
    main(f"matrix-{sys.argv[1]}" + (f"-{sys.argv[2]}" if len(sys.argv) > 2 else ""), body)
