"""Replay the published refit measurements: jreshard's plan and predicted time beside the measured times.

For each published row shipped in ``jreshard/models/configs`` (NVIDIA NCCL M2N's
DeepSeek-V3 and Qwen3-235B rows on GB200 NVL72, the DeepSeek-V3 system config
shipped beside the first row, which differs from it, and NeMo RL's DeepSeek-V3 and
Qwen3-235B refits on DGX H100) this prints:

- the model's bytes, the plan's network bytes and the lower bound (they must be equal);
- the per-NIC lower bound: the time no plan can beat when every GPU's NIC moves data
  at full speed, ``max(bound / (trainer GPUs x NIC), max over inference domains of
  what the domain needs / (its GPUs x NIC))``;
- jreshard's **predicted** time (``jreshard.cost.predict``) and flat direct sends'
  **predicted** time, under the cost-model parameters printed beside them;
- the **published** measured times and the ratios published / predicted.

Nothing here is measured: the published times were measured by their authors on
their GPUs; jreshard's are predictions of its cost model.

Run: ``JAX_PLATFORMS=cpu python benchmarks/published.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jreshard
from jreshard.models import CLUSTERS, MODELS, published_configs, refit_topology, system_refit

ORDER = (
    "m2n-dsv3-readme-row-gb200",
    "m2n-dsv3-256gpus-gb200",
    "m2n-qwen235b-128gpus-gb200",
    "nemo-rl-dsv3-h100",
    "nemo-rl-qwen235b-h100",
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One replayed published row."""

    key: str
    title: str
    sides: str
    model_bytes: int
    network_bytes: int
    lower_bound: int
    nic_bound_s: float
    predicted_s: float
    predicted_flat_s: float
    measured_ms: tuple[tuple[str, float], ...]
    params: str
    planned_s: float


def per_nic_bound(pairs, topo, n_train: int) -> tuple[int, float]:
    """(network lower bound in bytes, the per-NIC lower bound in seconds): every element a destination
    domain holds enters it once, through the NICs of that domain's GPUs, and leaves the trainer
    through the trainer GPUs' NICs. Computed from the layouts alone, not from a plan."""
    need: dict[int, int] = {}
    for _, dst in pairs:
        for box, ranks in dst.replica_groups():
            for d in {topo.domain_of(r) for r in ranks}:
                need[d] = need.get(d, 0) + box.volume * dst.itemsize
    gpus: dict[int, int] = {}
    for r in topo.ranks:
        if r >= n_train:
            gpus[topo.domain_of(r)] = gpus.get(topo.domain_of(r), 0) + 1
    nic = topo.links.network_bw
    total = sum(need.values())
    return total, max([total / (n_train * nic)] + [need[d] / (gpus[d] * nic) for d in need])


def replay(key: str) -> Row:
    cfg = published_configs()[key]
    assert cfg.model is not None and cfg.cluster is not None and cfg.domain_size is not None
    cl = CLUSTERS[cfg.cluster]
    links = {"network_bw": cl.nic_gbs * 1e9, "fast_bw": cl.fast_gbs * 1e9, "latency_s": cl.latency_us * 1e-6}
    r = system_refit(MODELS[cfg.model].model(), cfg)
    n_train, n_gen = cfg.train.num_gpus, cfg.generation.num_gpus
    topo = refit_topology(n_train, n_gen, cfg.domain_size, **links)
    src, dst = [s for s, _ in r.pairs], [d for _, d in r.pairs]
    t = time.perf_counter()
    plan = jreshard.plan(src, dst, topo)
    planned = time.perf_counter() - t
    s = plan.stats()
    bound, nic_bound = per_nic_bound(r.pairs, topo, n_train)
    if not s.network_bytes == s.network_bytes_lower_bound == bound:
        raise AssertionError(
            f"{key}: network bytes {s.network_bytes} != lower bound {s.network_bytes_lower_bound} (layouts: {bound})"
        )
    flat = jreshard.baselines.flat_direct(src, dst, topo)
    params = (
        f"{cl.name}: NIC {cl.nic_gbs:g} GB/s per GPU, NVLink {cl.fast_gbs:g} GB/s per GPU (each way), "
        f"latency {cl.latency_us:g} us, {cfg.domain_size} GPUs of the job per fast-link domain"
    )
    return Row(
        key=key,
        title=cfg.title,
        sides=f"trainer {n_train} GPUs {cfg.train.name} -> generator {n_gen} GPUs {cfg.generation.name}",
        model_bytes=r.model.nbytes,
        network_bytes=s.network_bytes,
        lower_bound=s.network_bytes_lower_bound,
        nic_bound_s=nic_bound,
        predicted_s=jreshard.cost.predict(plan).seconds,
        predicted_flat_s=jreshard.cost.predict(flat).seconds,
        measured_ms=cfg.measured_ms,
        params=params,
        planned_s=planned,
    )


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def print_row(row: Row) -> None:
    print(f"\n{row.title}")
    print(f"  {row.sides}")
    print(f"  cost model: {row.params}")
    eq = "yes" if row.network_bytes == row.lower_bound else "NO"
    print(
        f"  model {_gb(row.model_bytes)}; plan network {_gb(row.network_bytes)}, lower bound {_gb(row.lower_bound)}"
        f" (equal: {eq}); planned in {row.planned_s:.2f} s"
    )
    print(f"  per-NIC lower bound        {row.nic_bound_s * 1e3:10.1f} ms")
    print(f"  predicted, jreshard        {row.predicted_s * 1e3:10.1f} ms")
    print(f"  predicted, flat direct     {row.predicted_flat_s * 1e3:10.1f} ms")
    for label, ms in row.measured_ms:
        print(
            f"  published, {label:<15} {ms:10.1f} ms   = {ms / (row.predicted_s * 1e3):5.2f}x jreshard predicted,"
            f" {ms / (row.nic_bound_s * 1e3):5.2f}x the per-NIC bound"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", choices=ORDER, default=list(ORDER), help="rows to replay (default: all)")
    args = ap.parse_args()
    print("Published refit measurements replayed: 'published' = measured by the authors on their GPUs,")
    print("'predicted' = jreshard's cost model (jreshard.cost.predict), never measured here.")
    rows = [replay(k) for k in args.rows]
    for row in rows:
        print_row(row)
    keys = {r.key: r for r in rows}
    if {"m2n-dsv3-readme-row-gb200", "m2n-dsv3-256gpus-gb200"} <= keys.keys():
        a, b = keys["m2n-dsv3-readme-row-gb200"], keys["m2n-dsv3-256gpus-gb200"]
        print(
            "\nDeepSeek-V3: NCCL M2N's README row says trainer TP1 CP1 EP16 DP2 PP4, the system config shipped for it"
            "\n(dsv3-256gpus-gb200.json) says TP1 EP16 PP8 DP1; both replayed above. Same network bytes"
            f" ({_gb(a.network_bytes)} and {_gb(b.network_bytes)}), predicted {a.predicted_s * 1e3:.1f} ms and"
            f" {b.predicted_s * 1e3:.1f} ms."
        )


if __name__ == "__main__":
    main()
