"""Fused refit recipes: a trainer's parameter table to a TP inference engine's own format, as views.

- Llama-3 and Qwen3: ``qkv = concat([q, k_rep, v_rep], axis=1, groups=tp)`` where ``k_rep``
  repeats each key/value head ``tp // kv_heads`` times when TP exceeds the KV heads (GQA),
  ``gate_up = concat([gate, up], axis=1, groups=tp)``, every leaf bfloat16.
- DeepSeek-V3 and Kimi-K2: the same ``gate_up`` fusion for dense and shared experts; the routed
  experts stay stacked ``[E, in, out]`` (fused ``gate_up`` along ``out``) and go to block FP8
  ``(128, 128)`` with float32 ``scale_inv``.

:func:`fused_stats` lowers every leaf (:mod:`jreshard.views.lowering`) and adds the bytes, beside the
hybrid baseline of NeMo RL: FFN weights planned shard to shard, every other tensor gathered and broadcast.
Leaves that are the same up to a renumbering of ranks share one lowering (:func:`_relabelled`): the layers
of one pipeline stage, and those of the stages whose ranks are a shift of another stage's.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jreshard.models.recipes import refit
from jreshard.models.table import Param, ParamRole
from jreshard.sharding.layout import Layout
from jreshard.sharding.topology import Topology
from jreshard.views import concat, quantize_fp8
from jreshard.views.algebra import Leaf, View
from jreshard.views.bounds import box_network_bound, quant_network_bound
from jreshard.views.lowering import lower

__all__ = ["FusedStats", "fused_report", "fused_stats", "fused_views"]

FP8_MODELS = ("deepseek-v3", "kimi-k2")
_FFN = re.compile(r"\.(mlp\.(experts\.|shared_experts\.)?(gate|up|down)_proj)$")


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Source:
    """One trainer tensor (its own identity, even where two share a layout object)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def fused_views(name: str, n_train: int, n_infer: int) -> tuple[list[tuple[str, View, Layout]], dict[int, Layout]]:
    """``[(inference name, view, destination layout)]`` and ``{id(source): trainer layout}``."""
    r = refit(name, n_train, n_infer)
    inf, layers = r.inference, r.model.layers
    tp = dict(inf.mesh)[inf.tp] if inf.tp else 1
    leaf: dict[str, Leaf] = {}
    layouts: dict[int, Layout] = {}
    params = {p.name: p for p in r.model.params}
    for p, (src, _) in zip(r.model.params, r.pairs, strict=True):
        s = _Source(p.name, p.shape, p.dtype)
        leaf[p.name], layouts[id(s)] = Leaf(s), src
    out: list[tuple[str, View, Layout]] = []
    done: set[str] = set()

    def dst(n: str, like: Param, shape: tuple[int, ...], unit: int = 1) -> Layout:
        q = dataclasses.replace(like, name=n, shape=shape, unit=unit)
        return inf.layout(q, layers, n_train)

    for p, (_, d) in zip(r.model.params, r.pairs, strict=True):
        if p.name in done:
            continue
        base = p.name.rsplit(".", 1)[0]
        if p.name.endswith("self_attn.q_proj"):
            k, v = params[f"{base}.k_proj"], params[f"{base}.v_proj"]
            kv = k.shape[1] // k.unit
            rep = max(1, tp // kv)
            kk, vv = (concat([leaf[x.name]] * rep, axis=1, groups=kv) for x in (k, v))
            view = concat([leaf[p.name], kk, vv], axis=1, groups=tp).astype("bfloat16")
            out.append((f"{base}.qkv_proj", view, dst(f"{base}.qkv_proj", p, view.shape)))
            done |= {p.name, k.name, v.name}
        elif p.name.endswith("gate_proj"):
            up = params[f"{base}.up_proj"]
            experts = p.role == ParamRole.EXPERT_COLUMN
            groups = tp if (not experts or inf.expert_tp) else 1
            view = concat([leaf[p.name], leaf[up.name]], axis=-1, groups=groups).astype("bfloat16")
            out += _maybe_fp8(name, f"{base}.gate_up_proj", view, p, experts, dst)
            done |= {p.name, up.name}
        elif p.role == ParamRole.EXPERT_ROW:
            out += _maybe_fp8(name, p.name, leaf[p.name].astype("bfloat16"), p, True, dst)
        else:
            out.append((p.name, leaf[p.name].astype("bfloat16"), d))
    return out, layouts


def _maybe_fp8(model: str, n: str, view: View, like: Param, experts: bool, dst: Any) -> list:
    if not (experts and model in FP8_MODELS):
        return [(n, view, dst(n, like, view.shape))]
    w, s = quantize_fp8(view, (128, 128))
    return [(n, w, dst(n, like, w.shape)), (f"{n}_scale_inv", s, dst(f"{n}_scale_inv", like, s.shape))]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FusedStats:
    """Bytes of a fused refit (views, all shard to shard) and of the hybrid baseline."""

    leaves: int
    destination_bytes: int
    network_bytes: int
    network_bound: int
    fast_bytes: int
    same_device_bytes: int
    quantised_at_sender: int
    quantised: int
    max_nic_send: int
    max_nic_recv: int
    max_fast_send: int
    hybrid_network_bytes: int
    hybrid_max_nic_send: int
    hybrid_max_nic_recv: int
    hybrid_shard_to_shard_fraction: float
    hybrid_predicted_seconds: float


def _relabelled(
    layouts: tuple[Layout, ...], topology: Topology, renumber: bool = True
) -> tuple[tuple, tuple[int, ...]]:
    """A key that two sets of layouts share when they are the same up to renumbering their ranks in ascending
    order, with the ranks' fast-link domains renumbered in ascending order and their devices told apart alike;
    and the ranks, ascending (the key's rank ``i`` is ``ranks[i]``).

    Such layouts lower alike, rank ``i`` for rank ``i``: every choice :func:`~jreshard.views.lowering.lower`
    and the bounds make compares two ranks (replica groups list their ranks ascending, a sender is the least
    loaded then the lowest), two domains (destinations go domain by domain, ascending) or two devices (equal or
    not), and a renumbering in ascending order keeps every such comparison. ``renumber=False``: the layouts
    themselves are the key (each leaf lowered for its own ranks; the check of the renumbering).
    """
    ranks = tuple(sorted({r for lay in layouts for r in lay.ranks}))
    if not renumber:
        return layouts, ranks
    new = {r: i for i, r in enumerate(ranks)}
    domains = {g: i for i, g in enumerate(sorted({topology.domain_of(r) for r in ranks}))}
    devices: dict[Any, int] = {}
    peers = tuple(
        (domains[topology.domain_of(r)], devices.setdefault(topology.device_of(r), len(devices))) for r in ranks
    )
    shapes = tuple((lay.shape, lay.dtype, tuple(new[r] for r in lay.ranks), lay.boxes) for lay in layouts)
    return (shapes, peers), ranks


def fused_stats(name: str, n_train: int, n_infer: int, topology: Topology, *, _relabel: bool = True) -> FusedStats:
    """Lower every fused leaf of model ``name`` and add the bytes (module docstring).

    Example:
      >>> from jreshard.models import refit_topology
      >>> s = fused_stats("llama3-70b", 8, 8, refit_topology(8, 8, 8))
      >>> s.network_bytes == s.network_bound, s.hybrid_network_bytes > s.network_bytes
      (True, True)
    """
    import jreshard

    items, layouts = fused_views(name, n_train, n_infer)
    from jreshard.sharding.topology import Link

    cache: dict[tuple, tuple] = {}
    loads: dict[tuple, int] = {}
    net = bound = fast = same = at_sender = quant = dbytes = 0
    for _, view, d in items:
        leaves = view.leaves()
        lays = [layouts[id(leaf.source)] for leaf in leaves]
        shape, ranks = _relabelled((*lays, d), topology, _relabel)
        key = (view.signature(lambda lf, lv=leaves: next(i for i, x in enumerate(lv) if x is lf)), shape)
        if key not in cache:
            number = {r: i for i, r in enumerate(ranks)}
            low = lower(view, leaves, lays, d, topology)
            tasks = len(low.tasks)
            if tasks:
                qb = quant_network_bound(view, lays, d, topology)
                b = low.network_bytes if qb is None else qb  # None: a domain holds a source (not bounded)
            else:
                b = box_network_bound(view, leaves, lays, d, topology)
            cache[key] = (
                low.network_bytes,
                b,
                low.fast_bytes,
                low.same_device_bytes,
                sum(t.at_sender for t in low.tasks),
                tasks,
                tuple((number[r_], lk, out, nb) for r_, lk, out, nb in low.loads),
            )
        n, b, f, lo, a, t, rows = cache[key]
        for i, lk, out, nb in rows:
            loads[(ranks[i], lk, out)] = loads.get((ranks[i], lk, out), 0) + nb
        net, bound, fast, same, at_sender, quant = net + n, bound + b, fast + f, same + lo, at_sender + a, quant + t
        dbytes += d.nbytes
    r = refit(name, n_train, n_infer)
    ffn = [i for i, nm in enumerate(r.names) if _FFN.search(nm)]
    rest = [i for i in range(len(r.names)) if i not in set(ffn)]
    h_ffn = jreshard.plan([r.pairs[i][0] for i in ffn], [r.pairs[i][1] for i in ffn], topology).stats()
    h_rest = jreshard.baselines.gather_broadcast([r.pairs[i][0] for i in rest], [r.pairs[i][1] for i in rest], topology)
    ffn_bytes = sum(r.pairs[i][0].nbytes for i in ffn)
    pred = jreshard.cost.predict(jreshard.plan([r.pairs[i][0] for i in ffn], [r.pairs[i][1] for i in ffn], topology))
    pred_rest = jreshard.cost.predict(h_rest)

    def most(link: Any, out: bool) -> int:
        return max([nb for (_, lk, o), nb in loads.items() if lk is link and o is out], default=0)

    return FusedStats(
        leaves=len(items),
        destination_bytes=dbytes,
        network_bytes=net,
        network_bound=bound,
        fast_bytes=fast,
        same_device_bytes=same,
        quantised_at_sender=at_sender,
        quantised=quant,
        max_nic_send=most(Link.NETWORK, True),
        max_nic_recv=most(Link.NETWORK, False),
        max_fast_send=most(Link.FAST, True),
        hybrid_network_bytes=h_ffn.network_bytes + h_rest.stats().network_bytes,
        hybrid_max_nic_send=h_ffn.max_rank_network_send_bytes + h_rest.stats().max_rank_network_send_bytes,
        hybrid_max_nic_recv=h_ffn.max_rank_network_recv_bytes + h_rest.stats().max_rank_network_recv_bytes,
        hybrid_predicted_seconds=pred.seconds + pred_rest.seconds,
        hybrid_shard_to_shard_fraction=ffn_bytes / r.model.nbytes,
    )


def fused_report(name: str, n_train: int, n_infer: int, topology: Topology, *, simulate: bool = False) -> int:
    """Print the fused refit of ``name`` beside the hybrid baseline (``python -m jreshard plan --fused``)."""
    import time

    t = time.perf_counter()
    s = fused_stats(name, n_train, n_infer, topology)
    secs = time.perf_counter() - t

    def fmt(n: float) -> str:
        return f"{n / 1e12:.3f} TB" if n >= 1e11 else f"{n / 1e9:.2f} GB"

    print(
        f"\nfused inference format (views): {s.leaves} leaves, {fmt(s.destination_bytes)} in the inference format;"
        f" planned in {secs:.1f} s"
    )
    if s.quantised:
        print(
            f"routed experts in block FP8 (128 x 128): {s.quantised_at_sender} of {s.quantised} destination shards"
            " quantised at the sender (each block in one source shard): 1 byte a weight, 4 a scale"
        )
    cols = ("network", "lower bound", "fast", "max NIC send", "max NIC recv", "shard-to-shard")
    print(f"\n{'plan':<34}" + "".join(f"{c:>15}" for c in cols))
    rows = (
        (
            "jreshard fused views",
            (fmt(s.network_bytes), fmt(s.network_bound), fmt(s.fast_bytes)),
            (fmt(s.max_nic_send), fmt(s.max_nic_recv), "100%"),
        ),
        (
            "hybrid (FFN reshard + broadcast)",
            (fmt(s.hybrid_network_bytes), "-", "-"),
            (fmt(s.hybrid_max_nic_send), fmt(s.hybrid_max_nic_recv), f"{100 * s.hybrid_shard_to_shard_fraction:.1f}%"),
        ),
    )
    for label, a, b in rows:
        print(f"{label:<34}" + "".join(f"{v:>15}" for v in (*a, *b)))
    print(
        f"\nnetwork bytes: the hybrid moves {s.hybrid_network_bytes / max(s.network_bytes, 1):.2f}x the fused views'."
        "\nhybrid: FFN weights (gate/up/down, dense and expert) planned shard to shard in the trainer's dtype, every"
        "\nother tensor gathered and broadcast (NeMo RL); fused views: every leaf shard to shard, cast (and quantised)"
        "\nat the sender. The hybrid's max NIC columns add its two plans' busiest ranks. Lower bound: every element"
        "\na domain needs and holds no source of enters it once, in the wire dtype (float8 for quantised experts)."
    )
    if simulate:
        fused_t = max(s.max_nic_send, s.max_nic_recv) / topology.links.network_bw
        fast_t = s.max_fast_send / topology.links.fast_bw
        print(
            f"\npredicted: fused views {max(fused_t, fast_t) * 1e3:.1f} ms (busiest NIC or fast link over its"
            f" bandwidth); hybrid {s.hybrid_predicted_seconds * 1e3:.1f} ms (cost model, its two plans one after"
            " the other)"
        )
    return 0
