"""Parameter shape tables and the layouts real trainers and inference engines give them.

A :class:`Model` is a table of :class:`Param` s (name, shape, dtype, role and
transformer layer). A :class:`Parallelism` turns each parameter into a
:class:`~jreshard.sharding.layout.Layout` the way a framework does: a mesh of
ranks per pipeline stage, and a partition spec chosen by the parameter's role:

=================  =====================  ==========================================
role               shape                  spec (``tp``, ``ep``, ``fsdp`` axes)
=================  =====================  ==========================================
``COLUMN``         ``[in, out]``          ``(fsdp, tp)``: column parallel
``ROW``            ``[in, out]``          ``(tp, fsdp)``: row parallel
``EXPERT_COLUMN``  ``[experts, in, out]`` ``(ep, expert_fsdp, tp if expert_tp)``
``EXPERT_ROW``     ``[experts, in, out]`` ``(ep, tp if expert_tp, expert_fsdp)``
``EMBEDDING``      ``[vocab, hidden]``    ``(tp, fsdp)``: vocabulary parallel
``HEAD``           ``[hidden, vocab]``    ``(fsdp, tp)``
``REPLICATED``     any                    2-d: ``(fsdp, None)``; 1-d: replicated
=================  =====================  ==========================================

A dimension is split only by whole units (attention heads: ``Param.unit``
elements); where the axes do not divide it, the minor axes are dropped until
they do (a tensor-parallel degree above the number of KV heads replicates the
KV projections, as inference engines do). Layers map to pipeline stages in
contiguous near-equal runs; the embedding sits on the first stage and the
final norm and head on the last.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

import numpy as np

from jreshard.errors import LayoutError, TopologyError
from jreshard.sharding.dtypes import numpy_dtype
from jreshard.sharding.layout import Layout
from jreshard.sharding.topology import Topology

__all__ = ["Model", "Param", "Parallelism", "ParamRole", "gqa_attention", "refit_topology"]


class ParamRole(enum.Enum):
    """How frameworks shard a parameter (module docstring)."""

    COLUMN = "column"
    ROW = "row"
    EXPERT_COLUMN = "expert_column"
    EXPERT_ROW = "expert_row"
    EMBEDDING = "embedding"
    HEAD = "head"
    REPLICATED = "replicated"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Param:
    """One parameter tensor.

    Args:
      name: its name in the checkpoint (``layers.3.mlp.experts.down_proj``).
      shape: its global shape; matrices are ``[in, out]``, stacked experts ``[experts, in, out]``.
      dtype: element dtype name.
      role: how it is sharded.
      layer: its transformer layer, or ``None`` (embedding, final norm, head).
      unit: the sharded dimension is split only by multiples of this many elements.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"
    role: ParamRole = ParamRole.REPLICATED
    layer: int | None = None
    unit: int = 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * numpy_dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Model:
    """A model's parameter table.

    Example:
      >>> m = Model(name="toy", layers=1, params=(Param(name="w", shape=(4, 8), role=ParamRole.COLUMN, layer=0),))
      >>> m.nbytes, len(m.params)
      (64, 1)
    """

    name: str
    layers: int
    params: tuple[Param, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @property
    def n_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)


def gqa_attention(i: int, hidden: int, heads: int, kv: int, hd: int, *, qk_norm: bool = False) -> list[Param]:
    """Layer ``i``'s input norm and grouped-query attention (Llama and Qwen naming),
    column-parallel q/k/v and row-parallel o, split by whole heads of ``hd``."""
    a = f"layers.{i}.self_attn"
    norms = [Param(name=f"{a}.q_norm", shape=(hd,), layer=i), Param(name=f"{a}.k_norm", shape=(hd,), layer=i)]
    return [
        Param(name=f"layers.{i}.input_layernorm", shape=(hidden,), layer=i),
        Param(name=f"{a}.q_proj", shape=(hidden, heads * hd), role=ParamRole.COLUMN, layer=i, unit=hd),
        Param(name=f"{a}.k_proj", shape=(hidden, kv * hd), role=ParamRole.COLUMN, layer=i, unit=hd),
        Param(name=f"{a}.v_proj", shape=(hidden, kv * hd), role=ParamRole.COLUMN, layer=i, unit=hd),
        *(norms if qk_norm else []),
        Param(name=f"{a}.o_proj", shape=(heads * hd, hidden), role=ParamRole.ROW, layer=i, unit=hd),
        Param(name=f"layers.{i}.post_attention_layernorm", shape=(hidden,), layer=i),
    ]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Parallelism:
    """One side's parallel layout: pipeline stages, each a mesh of ranks.

    Args:
      name: a short description ("PP8 x EP16 (Megatron)").
      mesh: per stage, ``(axis_name, size)`` pairs, major to minor.
      pp: pipeline stages; stage ``s`` holds ranks ``first + s*stage_size + arange(stage_size)``.
      tp: the tensor-parallel axis, or ``None``.
      ep: the axes that split the expert dimension.
      fsdp: the axes that split the other dimension of dense parameters (FSDP/ZeRO-3).
      expert_fsdp: the same for expert parameters.
      expert_tp: whether ``tp`` also splits the experts' intermediate dimension.

    Example:
      >>> side = Parallelism(name="TP2", mesh=(("tp", 2),))
      >>> side.layout(Param(name="w", shape=(4, 8), role=ParamRole.COLUMN, layer=0), 10, first_rank=4).box_of(5)
      Box(lo=(0, 4), hi=(4, 8))
    """

    name: str
    mesh: tuple[tuple[str, int], ...]
    pp: int = 1
    tp: str | None = "tp"
    ep: tuple[str, ...] = ()
    fsdp: tuple[str, ...] = ()
    expert_fsdp: tuple[str, ...] = ()
    expert_tp: bool = False

    def __post_init__(self) -> None:
        names = [a for a, _ in self.mesh]
        used = [a for a in (self.tp,) if a] + [*self.ep, *self.fsdp, *self.expert_fsdp]
        bad = [a for a in used if a not in names]
        if bad:
            raise LayoutError(f"Parallelism {self.name}: axes {bad} are not mesh axes {names}")
        if self.pp < 1 or any(n < 1 for _, n in self.mesh):
            raise LayoutError(f"Parallelism {self.name}: pp={self.pp} and mesh={self.mesh} need sizes >= 1")

    @property
    def stage_size(self) -> int:
        return math.prod(n for _, n in self.mesh)

    @property
    def n_gpus(self) -> int:
        return self.pp * self.stage_size

    def stage_of(self, param: Param, layers: int) -> int:
        """Contiguous near-equal runs of layers per stage."""
        if param.layer is None:
            return 0 if param.role == ParamRole.EMBEDDING else self.pp - 1
        return param.layer * self.pp // layers

    def spec(self, param: Param) -> tuple[tuple[str, ...], ...]:
        """The partition spec of ``param`` (module docstring), one tuple of axes per dimension."""
        tp = (self.tp,) if self.tp else ()
        etp = tp if self.expert_tp else ()
        role, nd = param.role, len(param.shape)
        wanted: tuple[tuple[str, ...], ...]
        if role == ParamRole.COLUMN or role == ParamRole.HEAD:
            wanted = (self.fsdp, tp)
        elif role == ParamRole.ROW or role == ParamRole.EMBEDDING:
            wanted = (tp, self.fsdp)
        elif role == ParamRole.EXPERT_COLUMN:
            wanted = (self.ep, self.expert_fsdp, etp)
        elif role == ParamRole.EXPERT_ROW:
            wanted = (self.ep, etp, self.expert_fsdp)
        else:
            wanted = (self.fsdp,) + ((),) * (nd - 1) if nd >= 2 else ((),) * nd
        sizes = dict(self.mesh)
        out = []
        for d, axes in enumerate(wanted):
            unit = param.unit if role in (ParamRole.COLUMN, ParamRole.ROW) and tuple(axes) == tp else 1
            out.append(_fit(param.shape[d], unit, tuple(axes), sizes))
        return tuple(out)

    def layout(self, param: Param, layers: int, first_rank: int) -> Layout:
        """The layout of ``param`` when this side's ranks start at ``first_rank``."""
        start = first_rank + self.stage_of(param, layers) * self.stage_size
        return _layout(start, self.mesh, self.spec(param), param.shape, param.dtype)


def _fit(n: int, unit: int, axes: tuple[str, ...], sizes: dict[str, int]) -> tuple[str, ...]:
    """The longest major prefix of ``axes`` whose blocks hold whole units of a dimension of size ``n``."""
    while axes and (n % unit or (n // unit) % math.prod(sizes[a] for a in axes)):
        axes = axes[:-1]
    return axes


@functools.lru_cache(maxsize=8192)
def _layout(start: int, mesh: tuple[tuple[str, int], ...], spec: tuple, shape: tuple[int, ...], dtype: str) -> Layout:
    # One Layout object per distinct (ranks, spec, shape): equal layers share it, so plans share cache entries.
    names = tuple(a for a, _ in mesh)
    ranks = np.arange(start, start + math.prod(n for _, n in mesh)).reshape([n for _, n in mesh])
    return Layout.from_mesh(ranks, names, spec, shape, dtype)


def refit_topology(n_src: int, n_dst: int, domain_size: int, **links: float) -> Topology:
    """Trainer ranks ``0..n_src-1``, inference ranks ``n_src..n_src+n_dst-1``,
    ``domain_size`` ranks per fast-link domain, each side starting a domain of its own.

    Example:
      >>> t = refit_topology(4, 4, domain_size=3)
      >>> [t.domain_of(r) for r in range(8)]
      [0, 0, 0, 1, 2, 2, 2, 3]
    """
    if n_src < 1 or n_dst < 1:
        raise TopologyError(f"refit_topology: n_src={n_src} and n_dst={n_dst} must be >= 1")
    if domain_size < 1:
        raise TopologyError(f"refit_topology: domain_size={domain_size} must be >= 1")
    src_domains = -(-n_src // domain_size)
    doms = {r: r // domain_size for r in range(n_src)}
    doms.update({n_src + i: src_domains + i // domain_size for i in range(n_dst)})
    return Topology.from_domains(doms, devices=None, **links)
