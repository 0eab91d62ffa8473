"""Megatron-style parallelism (TP, CP, EP, expert TP, PP, DP, FSDP) mapped to shardings.

:class:`MegatronParallel` is one side of a refit as Megatron-LM (and NVIDIA's
M2N system configs) describe it; :func:`megatron_placement` is the one function
that turns it, for one parameter, into a mesh of ranks and a partition spec,
from which :meth:`MegatronPlacement.layout` builds a jreshard ``Layout`` and
:meth:`MegatronPlacement.named_sharding` a ``jax.sharding.NamedSharding``.

**Rank order** (Megatron's ``RankGenerator``, order ``tp-cp-ep-dp-pp``, the
first axis varying fastest):

- pipeline stages are outermost: stage ``s`` holds ranks
  ``first + s*S .. first + (s+1)*S - 1`` with ``S = num_gpus / pp``;
- dense parameters see the stage as a ``(dp, fsdp, cp, tp)`` mesh: ``tp``
  varies fastest, ``dp = S / (tp*cp*fsdp)``;
- expert parameters (MoE parallel folding: the expert mesh covers the same
  ranks with its own axes) see it as ``(edp, efsdp, ep, etp)``: ``etp``
  fastest, ``edp = S / (ep*etp*fsdp)``.

**Specs** (matrices are ``[in, out]``, stacked experts ``[experts, in, out]``):
column-parallel ``(fsdp, tp)``, row-parallel ``(tp, fsdp)``, the embedding
``(tp, fsdp)`` (vocabulary parallel), the head ``(fsdp, tp)``, expert column
``(ep, efsdp, etp)``, expert row ``(ep, etp, efsdp)``, 2-d replicated
parameters (routers, low-rank projections) ``(fsdp, -)``, 1-d ones replicated.
Context parallelism never splits a weight (its ranks hold replicas), and FSDP is
modelled as sharding the dimension tensor parallelism leaves alone, inside the
data-parallel ranks. A dimension is split only by whole attention heads; where
the degree does not divide it, the minor axes are dropped (more TP ranks than
KV heads replicate the KV projections, as Megatron and vLLM do). Layers map to
stages in contiguous near-equal runs (``layer * pp // layers``), the embedding
to the first stage, the final norm and head to the last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jreshard.errors import IndivisibleError
from jreshard.models.table import Model, Param, ParamRole, _fit, _layout
from jreshard.sharding.layout import Layout
from jreshard.types import Sharding

__all__ = ["MegatronParallel", "MegatronPlacement", "megatron_layouts", "megatron_placement"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MegatronParallel:
    """One side's Megatron parallelism.

    Args:
      num_gpus: GPUs of this side.
      tp, cp, pp: tensor, context and pipeline parallel degrees.
      ep: expert parallel degree; etp: expert tensor parallel degree.
      fsdp: FSDP degree, inside the data-parallel ranks (1: plain data parallel).
      dp: the data-parallel degree, if stated; it must equal the dense DP
        ``S/(tp*cp)`` or the expert DP ``S/(ep*etp)`` (M2N configs state the latter
        for trainers with experts), else construction raises.
      name: a description; default from the degrees.

    Example:
      >>> side = MegatronParallel(num_gpus=64, tp=2, cp=2, ep=16, pp=4)
      >>> side.stage_size, side.dense_dp, side.expert_dp
      (16, 4, 1)
    """

    num_gpus: int
    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1
    fsdp: int = 1
    dp: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        for f in ("num_gpus", "tp", "cp", "ep", "etp", "pp", "fsdp"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MegatronParallel: {f}={v!r} must be an int >= 1")
        if self.num_gpus % self.pp:
            raise IndivisibleError(f"MegatronParallel: num_gpus={self.num_gpus} is not a multiple of pp={self.pp}")
        s = self.num_gpus // self.pp
        for what, n in (("tp*cp*fsdp", self.tp * self.cp * self.fsdp), ("ep*etp*fsdp", self.ep * self.etp * self.fsdp)):
            if s % n:
                raise IndivisibleError(
                    f"MegatronParallel: a pipeline stage of {s} GPUs (num_gpus={self.num_gpus} / pp={self.pp}) "
                    f"is not a multiple of {what}={n}"
                )
        if self.dp is not None and self.dp not in (self.dense_dp, self.expert_dp):
            raise ValueError(
                f"MegatronParallel: dp={self.dp!r} matches neither the dense data-parallel degree "
                f"{self.dense_dp} = {s}/(tp={self.tp}*cp={self.cp}) nor the expert one "
                f"{self.expert_dp} = {s}/(ep={self.ep}*etp={self.etp}) of num_gpus={self.num_gpus}, pp={self.pp}"
            )
        if not self.name:
            label = f"TP{self.tp} CP{self.cp} EP{self.ep} ETP{self.etp} PP{self.pp}"
            label += f" FSDP{self.fsdp}" if self.fsdp > 1 else ""
            object.__setattr__(self, "name", f"{label} (DP{self.dense_dp}, expert DP{self.expert_dp}; Megatron)")

    @property
    def stage_size(self) -> int:
        return self.num_gpus // self.pp

    @property
    def dense_dp(self) -> int:
        return self.stage_size // (self.tp * self.cp)

    @property
    def expert_dp(self) -> int:
        return self.stage_size // (self.ep * self.etp)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MegatronPlacement:
    """A parameter's mesh of ranks and partition spec (one tuple of axis names per dimension).

    Attributes:
      ranks: the mesh's ranks, row-major, shape ``tuple(size for _, size in axes)``.
      axes: ``(name, size)`` per mesh axis, major to minor.
      spec: per tensor dimension, the mesh axes that split it (empty: not split).
    """

    ranks: tuple[int, ...]
    axes: tuple[tuple[str, int], ...]
    spec: tuple[tuple[str, ...], ...]

    def _mesh_ranks(self) -> np.ndarray:
        return np.asarray(self.ranks, np.int64).reshape([n for _, n in self.axes])

    def layout(self, shape: Sequence[int], dtype: str) -> Layout:
        """The jreshard Layout of a tensor of ``shape`` and ``dtype`` under this placement."""
        names = tuple(a for a, _ in self.axes)
        return Layout.from_mesh(self._mesh_ranks(), names, self.spec, tuple(shape), dtype)

    def named_sharding(self, devices: Sequence[Any]) -> Sharding:
        """The ``jax.sharding.NamedSharding``, with rank ``r`` on ``devices[r]``."""
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        mesh = Mesh(np.asarray(devices, dtype=object)[self._mesh_ranks()], tuple(a for a, _ in self.axes))
        entries = [None if not a else (a[0] if len(a) == 1 else a) for a in self.spec]
        return NamedSharding(mesh, PartitionSpec(*entries))


def megatron_placement(param: Param, side: MegatronParallel, layers: int, first_rank: int) -> MegatronPlacement:
    """Where Megatron puts ``param`` on ``side``, whose ranks start at ``first_rank`` (module docstring).

    Args:
      param: the parameter (its ``role`` picks the spec, its ``layer`` the stage).
      side: the parallel degrees.
      layers: transformer layers of the model (for the stage of a layer).
      first_rank: the side's first rank.

    Example:
      >>> side = MegatronParallel(num_gpus=8, tp=2, pp=2)
      >>> p = Param(name="w", shape=(4, 8), role=ParamRole.COLUMN, layer=3)
      >>> pl = megatron_placement(p, side, layers=4, first_rank=0)
      >>> pl.ranks, pl.axes, pl.spec
      ((4, 5, 6, 7), (('dp', 2), ('fsdp', 1), ('cp', 1), ('tp', 2)), ((), ('tp',)))
      >>> pl.layout(p.shape, "float32").box_of(5)
      Box(lo=(0, 4), hi=(4, 8))
    """
    s = side.stage_size
    if param.layer is None:
        stage = 0 if param.role == ParamRole.EMBEDDING else side.pp - 1
    else:
        stage = param.layer * side.pp // layers
    start = first_rank + stage * s
    role, nd = param.role, len(param.shape)
    wanted: tuple[tuple[str, ...], ...]
    if role in (ParamRole.EXPERT_COLUMN, ParamRole.EXPERT_ROW):
        axes = (
            ("edp", s // (side.ep * side.etp * side.fsdp)),
            ("efsdp", side.fsdp),
            ("ep", side.ep),
            ("etp", side.etp),
        )
        etp, fs = ("etp",), ("efsdp",)
        wanted = (("ep",), fs, etp) if role == ParamRole.EXPERT_COLUMN else (("ep",), etp, fs)
    else:
        axes = (("dp", s // (side.tp * side.cp * side.fsdp)), ("fsdp", side.fsdp), ("cp", side.cp), ("tp", side.tp))
        tp, fs = ("tp",), ("fsdp",)
        if role in (ParamRole.COLUMN, ParamRole.HEAD):
            wanted = (fs, tp)
        elif role in (ParamRole.ROW, ParamRole.EMBEDDING):
            wanted = (tp, fs)
        else:
            wanted = (fs,) + ((),) * (nd - 1) if nd >= 2 else ((),) * nd
    sizes = dict(axes)
    spec = []
    for d, want in enumerate(wanted):
        unit = param.unit if role in (ParamRole.COLUMN, ParamRole.ROW) and want == ("tp",) else 1
        kept = _fit(param.shape[d], unit, tuple(a for a in want if sizes[a] > 1), sizes)
        spec.append(kept)
    return MegatronPlacement(ranks=tuple(range(start, start + s)), axes=axes, spec=tuple(spec))


def megatron_layouts(model: Model, side: MegatronParallel, first_rank: int) -> list[Layout]:
    """Every parameter's Layout on ``side`` (ranks from ``first_rank``), in table order.

    Example:
      >>> from jreshard.models.table import Model
      >>> m = Model(name="t", layers=2, params=(Param(name="w", shape=(4, 8), role=ParamRole.ROW, layer=1),))
      >>> [lay.ranks for lay in megatron_layouts(m, MegatronParallel(num_gpus=4, tp=2, pp=2), 8)]
      [(10, 11)]
    """
    out = []
    for p in model.params:
        pl = megatron_placement(p, side, model.layers, first_rank)
        out.append(_layout(pl.ranks[0], pl.axes, pl.spec, p.shape, p.dtype))  # equal layers share one Layout
    return out
