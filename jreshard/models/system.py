"""M2N system configs (trainer and generator parallelism), cluster presets and the published refit rows.

A system config is the JSON format of NVIDIA NCCL M2N's benchmarks
(``nccl_m2n/benchmarks/configs/system_configs/*.json``): a ``train`` and a
``generation`` object, each with ``num_gpus``, ``tp_size``, ``cp_size``,
``ep_size``, ``pp_size``, ``fsdp_size`` and ``dp_size``. Both sides map to
:class:`~jreshard.models.megatron.MegatronParallel` the way M2N reads them: the
trainer's experts use expert TP 1 (MoE parallel folding); a generator without
expert parallelism splits its experts' weights over TP (as vLLM does), one with
it splits the expert dimension.

The configs this package ships (:func:`published_configs`) add, beside those two
objects, the model, the cluster, the domain size and the published measured
times, each file naming its source.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import os
from collections.abc import Mapping
from typing import Any

from jreshard.models.megatron import MegatronParallel, megatron_layouts
from jreshard.models.table import Model
from jreshard.sharding.layout import Layout

__all__ = [
    "CLUSTERS",
    "Cluster",
    "SystemConfig",
    "SystemRefit",
    "published_configs",
    "read_system_config",
    "system_config_from_dict",
    "system_refit",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """A cluster preset: GPUs per fast-link domain and link speeds per GPU, each way."""

    name: str
    domain_size: int
    nic_gbs: float
    fast_gbs: float
    latency_us: float
    about: str


CLUSTERS: dict[str, Cluster] = {
    "nvl72": Cluster(
        name="nvl72",
        domain_size=72,
        nic_gbs=50.0,
        fast_gbs=900.0,
        latency_us=5.0,
        about="GB200 NVL72: 72 GPUs per NVLink domain, 900 GB/s NVLink and one 400 Gb/s NIC per GPU",
    ),
    "h100": Cluster(
        name="h100",
        domain_size=8,
        nic_gbs=50.0,
        fast_gbs=450.0,
        latency_us=5.0,
        about="DGX H100: 8 GPUs per NVLink domain, 450 GB/s NVLink and one 400 Gb/s NIC per GPU",
    ),
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SystemConfig:
    """Both sides of a refit, from a system config file.

    Attributes:
      train, generation: the two sides' parallelism.
      title: a description (the file name when the file has none).
      model: a built-in model name the file names, or ``None``.
      cluster: a :data:`CLUSTERS` key the file names, or ``None``.
      domain_size: GPUs of the job per fast-link domain the file names, or ``None``.
      measured_ms: published measured times, ``(label, milliseconds)`` pairs.
      published: what the measured times are (system, benchmark).
      source: where the facts come from.
    """

    train: MegatronParallel
    generation: MegatronParallel
    title: str
    model: str | None = None
    cluster: str | None = None
    domain_size: int | None = None
    measured_ms: tuple[tuple[str, float], ...] = ()
    published: str = ""
    source: str = ""


_FIELDS = ("num_gpus", "tp_size", "cp_size", "ep_size", "pp_size", "fsdp_size", "dp_size")


def _side(d: Any, which: str, where: str) -> MegatronParallel:
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: the {which!r} object is missing or not an object (got {d!r})")
    unknown = sorted(set(d) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where}: {which} has unknown keys {unknown}; expected {list(_FIELDS)}")
    if "num_gpus" not in d:
        raise ValueError(f"{where}: {which}.num_gpus is missing")
    v = {k: d.get(k, 1) for k in _FIELDS}
    for k, x in v.items():
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise ValueError(f"{where}: {which}.{k}={x!r} must be an int >= 1")
    ep, tp = v["ep_size"], v["tp_size"]
    etp = 1 if which == "train" or ep > 1 else tp
    try:
        return MegatronParallel(
            num_gpus=v["num_gpus"],
            tp=tp,
            cp=v["cp_size"],
            ep=ep,
            etp=etp,
            pp=v["pp_size"],
            fsdp=v["fsdp_size"],
            dp=v["dp_size"],
        )
    except ValueError as err:
        raise type(err)(f"{where}: {which}: {err}") from None


def system_config_from_dict(d: Mapping[str, Any], *, where: str = "system config") -> SystemConfig:
    """A :class:`SystemConfig` from a parsed M2N system-config object (extra top-level keys are read if known).

    Example:
      >>> cfg = system_config_from_dict({"train": {"num_gpus": 64, "tp_size": 2, "cp_size": 2, "ep_size": 16,
      ...     "pp_size": 4, "dp_size": 1}, "generation": {"num_gpus": 64, "tp_size": 8, "dp_size": 8}})
      >>> cfg.train.dense_dp, cfg.train.expert_dp, cfg.generation.etp
      (4, 1, 8)
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: expected a JSON object with 'train' and 'generation', got {type(d).__name__}")
    train, gen = _side(d.get("train"), "train", where), _side(d.get("generation"), "generation", where)
    pub = d.get("published") or {}
    ms = tuple((str(k), float(x)) for k, x in (pub.get("measured_ms") or {}).items())
    dom = d.get("domain_size")
    if dom is not None and (not isinstance(dom, int) or isinstance(dom, bool) or dom < 1):
        raise ValueError(f"{where}: domain_size={dom!r} must be an int >= 1")
    cluster = d.get("cluster")
    if cluster is not None and cluster not in CLUSTERS:
        raise ValueError(f"{where}: cluster={cluster!r} is not one of {sorted(CLUSTERS)}")
    published = " ".join(str(pub.get(k, "")) for k in ("what", "note") if pub.get(k))
    return SystemConfig(
        train=train,
        generation=gen,
        title=str(d.get("title") or where),
        model=d.get("model"),
        cluster=cluster,
        domain_size=dom,
        measured_ms=ms,
        published=published,
        source=str(d.get("_source", "")),
    )


def read_system_config(path: str | os.PathLike[str]) -> SystemConfig:
    """Read an M2N system-config file.

    Raises:
      ValueError: not JSON, or a side that is missing or inconsistent (the message names the file and field).
    """
    where = os.fspath(path)
    try:
        with open(path) as f:
            d = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON: {err}") from None
    return system_config_from_dict(d, where=os.path.basename(where))


def published_configs() -> dict[str, SystemConfig]:
    """The published refit rows shipped with jreshard, by file stem.

    Example:
      >>> sorted(published_configs())  # doctest: +NORMALIZE_WHITESPACE
      ['m2n-dsv3-256gpus-gb200', 'm2n-dsv3-readme-row-gb200', 'm2n-qwen235b-128gpus-gb200',
       'nemo-rl-dsv3-h100', 'nemo-rl-qwen235b-h100']
    """
    out = {}
    for entry in sorted(importlib.resources.files("jreshard.models").joinpath("configs").iterdir(), key=str):
        if entry.name.endswith(".json"):
            out[entry.name[: -len(".json")]] = system_config_from_dict(json.loads(entry.read_text()), where=entry.name)
    return out


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SystemRefit:
    """A model refit under a system config: trainer ranks ``0..``, generator ranks after them."""

    model: Model
    config: SystemConfig
    pairs: tuple[tuple[Layout, Layout], ...]
    names: tuple[str, ...]


def system_refit(model: Model, config: SystemConfig) -> SystemRefit:
    """Every parameter's (trainer, generator) layout pair under ``config``.

    Example:
      >>> from jreshard.models import qwen3_235b
      >>> r = system_refit(qwen3_235b(), published_configs()["m2n-qwen235b-128gpus-gb200"])
      >>> len(r.pairs), r.pairs[0][0].ranks[:2], r.pairs[0][1].ranks[:2]
      (1131, (0, 1), (64, 65))
    """
    src = megatron_layouts(model, config.train, 0)
    dst = megatron_layouts(model, config.generation, config.train.num_gpus)
    return SystemRefit(
        model=model,
        config=config,
        pairs=tuple(zip(src, dst, strict=True)),
        names=tuple(p.name for p in model.params),
    )
