"""The cases of the views acceptance matrix, shared by the in-process tests and the bodies under mpiexec.

Five cases, one pytree: plain float32 arrays, a float32 -> bfloat16 cast, a fused bfloat16 ``qkv``
with the one key/value head repeated for TP2 (GQA), four experts stacked into ``[E, in, out]``, and
block FP8 weights and scales (blocks inside each source shard: quantised at the sender). Sources are
FSDP over 4 devices (rows), destinations TP2 x DP2. References are numpy (``jnp.astype`` for the
bfloat16 rounding); bounds are counted element by element, independent of the lowering.
"""

from __future__ import annotations

import numpy as np

TP = 2
BLOCK = (4, 8)  # 4-row blocks in the 4-row source shards of a 16-row matrix over 4 devices
EXPERTS = 4
# each destination leaf's PartitionSpec over the server's ("dp", "tp") mesh
SPECS = {"w": (None, "tp"), "c": (None, "tp"), "qkv": (None, "tp"), "experts": ("tp",), "m_w": (None, "tp")}
SPECS["m_s"] = (None, "tp")


def globals_() -> dict[str, np.ndarray]:
    """The trainer's global float32 arrays, by name."""

    def val(shape: tuple[int, ...], salt: int) -> np.ndarray:
        n = int(np.prod(shape))
        x = np.sin(np.arange(n, dtype=np.float64) * 0.37 + salt) * (100 + 7 * salt) / 3
        return x.astype(np.float32).reshape(shape)

    g = {"w": val((16, 8), 1), "c": val((16, 8), 2), "q": val((16, 16), 3), "k": val((16, 4), 4)}
    g["v"] = val((16, 4), 5)
    g |= {f"e{i}": val((8, 8), 10 + i) for i in range(EXPERTS)}
    g["m"] = val((16, 16), 20)
    return g


def build(views, x: dict) -> dict:
    """The destination tree of views over ``x`` (arrays or ``views.param`` leaves, by name).

    ``c`` is absent: its cast is the destination's dtype (a ShapeDtypeStruct target, or a
    RefitGroup declaration), not a view.
    """
    kk, vv = (views.concat([x[n]] * TP, axis=1) for n in ("k", "v"))  # the one kv head, repeated for TP2
    qkv = views.astype(views.concat([x["q"], kk, vv], axis=1, groups=TP), "bfloat16")
    experts = views.stack([x[f"e{i}"] for i in range(EXPERTS)], axis=0)
    w8, s8 = views.quantize_fp8(x["m"], block=BLOCK)
    return {"qkv": qkv, "experts": experts, "m_w": w8, "m_s": s8}


def _bf16(a: np.ndarray) -> np.ndarray:
    import jax.numpy as jnp

    return np.asarray(jnp.asarray(a).astype(jnp.bfloat16))


def references(g: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What every destination leaf must hold, from numpy (and ``jnp.astype``) on the global arrays."""
    from jreshard.views import quantize_fp8_reference

    def grouped(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate([np.split(p, TP, axis=1)[i] for i in range(TP) for p in parts], axis=1)

    kk, vv = (np.concatenate([g[n]] * TP, axis=1) for n in ("k", "v"))
    w8, s8 = quantize_fp8_reference(g["m"], BLOCK)
    return {
        "w": g["w"],
        "c": _bf16(g["c"]),
        "qkv": _bf16(grouped([g["q"], kk, vv])),
        "experts": np.stack([g[f"e{i}"] for i in range(EXPERTS)], axis=0),
        "m_w": w8,
        "m_s": s8,
    }


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"uint{8 * a.dtype.itemsize}") if a.dtype.itemsize > 1 else a.view(np.uint8)


def fp8_bound(part: str, xlay, dst, topo) -> int:
    """The network bound of a block-FP8 output, element by element: an output element that a domain needs
    and whose block's source elements are not all held in that domain enters it once, in the output's
    dtype (1 byte a weight, 4 a scale)."""
    m, n = xlay.shape
    bm, bn = BLOCK
    total = 0
    for g in sorted({topo.domain_of(r) for r in dst.ranks}):
        held = np.zeros((m, n), bool)
        for r, b in zip(xlay.ranks, xlay.boxes, strict=True):
            if r in topo and topo.domain_of(r) == g:
                held[b.slices()] = True
        whole = held.reshape(m // bm, bm, n // bn, bn).all(axis=(1, 3))  # per block
        if part == "weights":
            whole = np.repeat(np.repeat(whole, bm, 0), bn, 1)
        need = np.zeros(whole.shape, bool)
        for r, b in zip(dst.ranks, dst.boxes, strict=True):
            if topo.domain_of(r) == g:
                need[b.slices()] = True
        total += int((need & ~whole).sum()) * (1 if part == "weights" else 4)
    return total


def network_bound(tree: dict, layouts_of, dsts: dict, topo) -> int:
    """The brute-force bound of a destination tree of views (``views.brute_force_network_bound`` for the
    index-map leaves, :func:`fp8_bound` for the block-FP8 ones); ``layouts_of(leaf)`` is a leaf's layout."""
    from jreshard.views import as_view, brute_force_network_bound
    from jreshard.views.quant import QuantView

    plain = {k: as_view(v) for k, v in tree.items() if not isinstance(v, QuantView)}
    leaves = list({id(lf.source): lf for v in plain.values() for lf in v.leaves()}.values())
    lays = [layouts_of(lf) for lf in leaves]
    total = brute_force_network_bound(list(plain.values()), leaves, lays, [dsts[k] for k in plain], topo)
    for k, v in tree.items():
        if isinstance(v, QuantView):
            (xleaf,) = v.x.leaves()
            total += fp8_bound(v.part, layouts_of(xleaf), dsts[k], topo)
    return total
