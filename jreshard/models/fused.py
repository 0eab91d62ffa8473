"""Fused refit recipes: a trainer's parameter table to a TP inference engine's own format, as views.

- Llama-3 and Qwen3: ``qkv = concat([q, k_rep, v_rep], axis=1, groups=tp)`` where ``k_rep``
  repeats each key/value head ``tp // kv_heads`` times when TP exceeds the KV heads (GQA),
  ``gate_up = concat([gate, up], axis=1, groups=tp)``, every leaf bfloat16.
- DeepSeek-V3 and Kimi-K2: the same ``gate_up`` fusion for dense and shared experts; the routed
  experts stay stacked ``[E, in, out]`` (fused ``gate_up`` along ``out``) and go to block FP8
  ``(128, 128)`` with float32 ``scale_inv``.

:func:`fused_stats` lowers every leaf (:mod:`jreshard.views.lowering`; layers with equal layouts
share one lowering) and adds the bytes, beside the hybrid baseline of NeMo RL: FFN weights planned
shard to shard, every other tensor gathered and broadcast.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jreshard.models.recipes import refit
from jreshard.models.table import Param, Role
from jreshard.sharding.layout import Layout
from jreshard.sharding.topology import Topology
from jreshard.views import concat, quantize_fp8
from jreshard.views.algebra import Leaf, View
from jreshard.views.bounds import box_network_bound
from jreshard.views.lowering import lower

__all__ = ["FusedStats", "fused_stats", "fused_views"]

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
            experts = p.role == Role.EXPERT_COLUMN
            groups = tp if (not experts or inf.expert_tp) else 1
            view = concat([leaf[p.name], leaf[up.name]], axis=-1, groups=groups).astype("bfloat16")
            out += _maybe_fp8(name, f"{base}.gate_up_proj", view, p, experts, dst)
            done |= {p.name, up.name}
        elif p.role == Role.EXPERT_ROW:
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
    local_bytes: int
    quantised_at_sender: int
    quantised: int
    hybrid_network_bytes: int
    hybrid_shard_to_shard_fraction: float


def fused_stats(name: str, n_train: int, n_infer: int, topology: Topology) -> FusedStats:
    """Lower every fused leaf of model ``name`` and add the bytes (module docstring).

    Example:
      >>> from jreshard.models import refit_topology
      >>> s = fused_stats("llama3-70b", 8, 8, refit_topology(8, 8, 8))
      >>> s.network_bytes == s.network_bound, s.hybrid_network_bytes > s.network_bytes
      (True, True)
    """
    import jreshard

    items, layouts = fused_views(name, n_train, n_infer)
    cache: dict[tuple, tuple[int, int, int, int, int, int]] = {}
    net = bound = fast = local = at_sender = quant = dbytes = 0
    for _, view, d in items:
        leaves = view.leaves()
        lays = [layouts[id(leaf.source)] for leaf in leaves]
        key = (view.signature(lambda lf, lv=leaves: next(i for i, x in enumerate(lv) if x is lf)), tuple(lays), d)
        if key not in cache:
            low = lower(view, leaves, lays, d, topology)
            tasks = len(low.tasks)
            b = low.network_bytes if tasks else box_network_bound(view, leaves, lays, d, topology)
            cache[key] = (
                low.network_bytes,
                b,
                low.fast_bytes,
                low.local_bytes,
                sum(t.at_sender for t in low.tasks),
                tasks,
            )
        n, b, f, lo, a, t = cache[key]
        net, bound, fast, local, at_sender, quant = net + n, bound + b, fast + f, local + lo, at_sender + a, quant + t
        dbytes += d.nbytes
    r = refit(name, n_train, n_infer)
    ffn = [i for i, nm in enumerate(r.names) if _FFN.search(nm)]
    rest = [i for i in range(len(r.names)) if i not in set(ffn)]
    h_ffn = jreshard.plan([r.pairs[i][0] for i in ffn], [r.pairs[i][1] for i in ffn], topology).stats()
    h_rest = jreshard.baselines.gather_broadcast([r.pairs[i][0] for i in rest], [r.pairs[i][1] for i in rest], topology)
    ffn_bytes = sum(r.pairs[i][0].nbytes for i in ffn)
    return FusedStats(
        leaves=len(items),
        destination_bytes=dbytes,
        network_bytes=net,
        network_bound=bound,
        fast_bytes=fast,
        local_bytes=local,
        quantised_at_sender=at_sender,
        quantised=quant,
        hybrid_network_bytes=h_ffn.network_bytes + h_rest.stats().network_bytes,
        hybrid_shard_to_shard_fraction=ffn_bytes / r.model.nbytes,
    )
