"""Planner speed and predicted refit times at scale.

    JAX_PLATFORMS=cpu python benchmarks/plan_bench.py            # everything (several minutes on 2 cores)
    JAX_PLATFORMS=cpu python benchmarks/plan_bench.py --quick    # only the 128 + 128 models
    JAX_PLATFORMS=cpu python benchmarks/plan_bench.py --repeat 5 # each model in 5 fresh processes (default 3)
    JAX_PLATFORMS=cpu python benchmarks/plan_bench.py --only deepseek-v3:4096  # only these model sizes (3. to 5.)

Prints:
1. the published FFN-MoE case (one [256, 2048, 7168] bf16 tensor, EP16 -> TP8 x r):
   jreshard's and the baselines' predicted times beside the published measurements;
2. the time to plan one tensor across 512 + 512 ranks;
3. for DeepSeek-V3 and Kimi-K2, trainer and inference on 128 + 128 (and DeepSeek-V3
   on 1024 + 1024): time to plan the whole model, to plan one rank's part alone (its ``RankPlan``), a
   cached plan call; network bytes against the lower bound; predicted refit times of
   jreshard and the baselines; and where the planning time goes (a profile);
4. DeepSeek-V3 on 4096 + 4096: one rank's plan, and ``simulate_layouts`` (the
   whole refit predicted one layout pair at a time) with its time and peak memory;
5. for DeepSeek-V3 on 128 + 128, 1024 + 1024 and 4096 + 4096: one process's own
   schedule (``jreshard.schedule.pairsched``, what every process of a multi-process transfer
   builds for the ranks it drives), for a process driving one destination rank, where its
   time goes, and the process's peak memory by then. The peers' mail is answered here in
   one process: their peer counts are exact, the rounds of received stage-0 chunks are
   exact (``0, 1, ...``, as every sender places them), those of later stages a stand-in
   (``k + stage``) that changes round numbers, not the work. The peer counts come from
   the peers' own rank plans, the same way at every size: the destination rank's plan
   names its peers (the ranks it receives from and sends to), one ``rank_plans`` call
   builds theirs, and each peer's distinct receivers and senders, and the bytes it sends and
   receives in all, are read from its plan's sent and received rows. This setup runs in a separate process and is not
   timed (its time is printed apart), so neither its time nor its memory counts
   (``plan_bench_local.py``, beside this file, holds this part).

Each model configuration runs in a fresh process, so no cache from another
configuration helps it, ``--repeat`` times (the 4096 + 4096 one once): times are the
median, with min-max, of wall-clock (and CPU, as the machine may be shared). A rank's
plan is columns of numpy arrays; the time to build its Message and Piece values
(done when a consumer first reads them) is printed beside it. Every refit time printed is *predicted* by the cost model
(``jreshard.cost``), never measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
from plan_bench_local import local_schedule, peak_mib, peer_mail_process, print_local, profile, timed

from jreshard.cost import predict
from jreshard.models import refit, refit_topology
from jreshard.sharding.baselines import flat_direct_layouts, gather_broadcast_layouts
from jreshard.sharding.box import Box
from jreshard.sharding.caches import clear_caches
from jreshard.sharding.layout import Layout
from jreshard.sharding.planner import plan_layouts, rank_plan
from jreshard.sharding.simulate import simulate_layouts
from jreshard.sharding.topology import Topology

NIC, NVLINK = 50e9, 900e9  # GB200 NVL72: 400 Gb/s NIC per GPU; NVLink 5 at 900 GB/s each way per GPU
DOMAIN = 64  # GPUs of a job per NVL72 rack: 128 + 128 GPUs fill 4 racks, as in the published DeepSeek-V3 run

# Published measurements (the NCCL M2N README, nccl-extensions): NCCL M2N, flat direct sends, all-gather + broadcast.
PUBLISHED = {2: (10.25, 20.86), 4: (13.83, 35.84), 8: (9.78, 77.26)}
PUBLISHED_GATHER = "222-240"
FLOOR_MS = 7168e6 / (16 * 50e9) * 1e3  # the published floor: 7168 MB / (16 x 50 GB/s) = 8.96 ms


def _median_call(fn, repeat: int = 7) -> float:
    """Median wall time of ``repeat`` calls (a cached call is short enough for the machine's noise to matter)."""
    times = [timed(fn)[1] for _ in range(repeat)]
    return float(np.median(times))


def ffn_moe() -> None:
    """One [256, 2048, 7168] bf16 expert tensor, EP16 on 16 GPUs of one NVL72 rack, to TP8 x r replicas
    on another rack (r = 8 fills 64 of its 72 GPUs)."""
    print("== published FFN-MoE case: [256, 2048, 7168] bf16 (7.52 GB = 7168 MiB), EP16 -> TP8 x r, NVL72 racks,")
    print(f"   50 GB/s per NIC, 900 GB/s NVLink; sources in rack 0, destinations in rack 1; floor {FLOOR_MS:.2f} ms")
    print(
        f"{'r':>3}{'jreshard':>12}{'published':>11}{'flat direct':>13}{'published':>11}"
        f"{'gather+bcast ring':>18}{'gather+bcast':>14}{'published':>11}{'jreshard/floor':>16}"
    )
    shape = (256, 2048, 7168)
    for r in (2, 4, 8):
        src = Layout.from_mesh(np.arange(16), ("ep",), ("ep",), shape, "bfloat16")
        dst = Layout.from_mesh(
            np.arange(72, 72 + 8 * r).reshape(r, 8), ("dp", "tp"), (None, None, "tp"), shape, "bfloat16"
        )
        topo = Topology.uniform(range(72 + 8 * r), 72, network_bw=NIC, fast_bw=NVLINK)
        pairs = [(src, dst)]
        jr = predict(plan_layouts(pairs, topo)).seconds * 1e3
        fd = predict(flat_direct_layouts(pairs, topo)).seconds * 1e3
        ring = predict(gather_broadcast_layouts(pairs, topo, ring=True)).seconds * 1e3
        gb = predict(gather_broadcast_layouts(pairs, topo)).seconds * 1e3
        pub, pub_flat = PUBLISHED[r]
        print(
            f"{r:>3}{jr:>9.2f} ms{pub:>8.2f} ms{fd:>10.2f} ms{pub_flat:>8.2f} ms{ring:>15.2f} ms{gb:>11.0f} ms"
            f"{PUBLISHED_GATHER:>8} ms{jr / FLOOR_MS:>15.3f}x"
        )
    print("   jreshard, flat direct and gather+bcast columns are predicted (cost model); 'published' are measured")
    print("   by NVIDIA (NCCL M2N, flat direct sends, all-gather + broadcast). The exact floor for 7.52e9 bytes")
    print(f"   over 16 x 50e9 B/s is {7.516192768e9 / 16 / NIC * 1e3:.2f} ms (the published 8.96 ms counts 7168 MB).\n")


def single_tensor() -> None:
    """One tensor across 512 + 512 ranks, planned from scratch."""
    print("== one tensor across 512 + 512 ranks (8 ranks per domain)")
    shape = (256, 2048, 7168)
    cases = {
        "EP16 x DP32 -> TP8 x DP64": (
            Layout.from_mesh(np.arange(512).reshape(32, 16), ("dp", "ep"), ("ep",), shape, "bfloat16"),
            Layout.from_mesh(np.arange(512, 1024).reshape(64, 8), ("dp", "tp"), (None, None, "tp"), shape, "bfloat16"),
        ),
        "FSDP512 -> TP8 x DP64": (
            Layout.from_mesh(np.arange(512), ("fsdp",), (None, "fsdp"), shape, "bfloat16"),
            Layout.from_mesh(np.arange(512, 1024).reshape(64, 8), ("dp", "tp"), (None, None, "tp"), shape, "bfloat16"),
        ),
    }
    topo = Topology.uniform(range(1024), 8, network_bw=NIC, fast_bw=450e9)
    for label, (src, dst) in cases.items():
        p, wall, cpu = timed(lambda s=src, d=dst: plan_layouts([(s, d)], topo))
        s = p.stats()
        print(
            f"   {label:<28} planned in {wall * 1e3:7.1f} ms wall ({cpu * 1e3:.1f} ms CPU): {s.messages} messages, "
            f"network {s.network_bytes / 1e9:.2f} GB = lower bound {s.network_bytes_lower_bound / 1e9:.2f} GB; "
            f"{predict(p)}"
        )
    print()


def _copy(lay: Layout) -> Layout:
    return Layout(lay.shape, lay.dtype, lay.ranks, tuple(Box(b.lo, b.hi) for b in lay.boxes))


def one_model(name: str, n: int, whole: bool, baselines: bool) -> dict:
    """Everything about one model configuration (run in a fresh process)."""
    r = refit(name, n, n)
    topo = refit_topology(n, n, DOMAIN, network_bw=NIC, fast_bw=NVLINK)
    out: dict = {
        "name": r.model.name,
        "n": n,
        "tensors": len(r.pairs),
        "pairs": len(set(r.pairs)),
        "bytes": r.model.nbytes,
        "trainer": r.trainer.name,
        "inference": r.inference.name,
    }
    # One rank's plan first, so that nothing the whole plan computed helps it.
    dst_rank, src_rank = n + n // 2 + 3, n // 2 + 3
    rplan, out["rank_plan_dst_s"], out["rank_plan_dst_cpu"] = timed(
        lambda: rank_plan(r.pairs, dst_rank, topo, names=r.names)
    )
    # The rank plan is columns (numpy); its Message and Piece values are built the first time they are read.
    _, out["rank_plan_objects_s"], _ = timed(lambda: (rplan.copies, rplan.sends, rplan.recvs))
    out["rank_plan_pieces"] = len(rplan.table)
    _, out["rank_plan_src_s"], out["rank_plan_src_cpu"] = timed(
        lambda: rank_plan(r.pairs, src_rank, topo, names=r.names)
    )
    out["rank_plan_cached_s"] = _median_call(lambda: rank_plan(r.pairs, dst_rank, topo, names=r.names))
    if not whole:
        if name == "deepseek-v3":  # before simulate_layouts, so the peak memory is the schedule's process's
            out.update(local_schedule(r, topo, dst_rank, peer_mail_process(name, n, dst_rank, DOMAIN, NIC, NVLINK)))
        sim, out["simulate_s"], out["simulate_cpu"] = timed(lambda: simulate_layouts(r.pairs, topo, names=r.names))
        out["network"], out["bound"], out["rows"] = sim.network_bytes, sim.network_bytes_lower_bound, sim.rows
        out["predicted"] = {"jreshard": (sim.prediction.seconds, sim.prediction.bound_seconds, _where(sim.prediction))}
        out["maxrss_mib"] = peak_mib()
        return out
    p, out["plan_s"], out["plan_cpu"] = timed(lambda: plan_layouts(r.pairs, topo, names=r.names))
    out["cached_s"] = _median_call(lambda: plan_layouts(r.pairs, topo, names=r.names))
    # Equal layouts built anew, one object per tensor (as a caller rebuilding them every step would):
    # the first lookup compares each once, later lookups go by identity.
    fresh = [(_copy(s), _copy(d)) for s, d in r.pairs]
    _, out["cached_fresh_s"], _ = timed(lambda: plan_layouts(fresh, topo, names=r.names))
    out["cached_fresh_again_s"] = _median_call(lambda: plan_layouts(fresh, topo, names=r.names))
    s, out["stats_s"], out["stats_cpu"] = timed(p.stats)
    out["network"], out["bound"] = s.network_bytes, s.network_bytes_lower_bound
    out["rows"] = sum(len(tp) for tp in p.tensor_plans)
    out["predicted"] = {}
    builds = [("jreshard", lambda p=p: p)]
    if baselines:
        builds += [
            ("gather-broadcast", lambda: gather_broadcast_layouts(r.pairs, topo, names=r.names)),
            ("gather-broadcast (ring)", lambda: gather_broadcast_layouts(r.pairs, topo, names=r.names, ring=True)),
            ("flat-direct", lambda: flat_direct_layouts(r.pairs, topo, names=r.names)),
        ]
    for label, build in builds:
        pr = predict(build())
        out["predicted"][label] = (pr.seconds, pr.bound_seconds, _where(pr))
    del p
    clear_caches()
    out["profile"] = profile(lambda: plan_layouts(r.pairs, topo, names=r.names))
    if name == "deepseek-v3":
        out.update(local_schedule(r, topo, dst_rank, peer_mail_process(name, n, dst_rank, DOMAIN, NIC, NVLINK)))
    out["maxrss_mib"] = peak_mib()
    return out


def _where(pr) -> str:
    return f"rank {pr.bottleneck_rank} {pr.bottleneck_port.label}" if pr.bottleneck_port is not None else "-"


CONFIGS_QUICK = (("deepseek-v3", 128, "whole"), ("kimi-k2", 128, "whole"))
CONFIGS = (*CONFIGS_QUICK, ("deepseek-v3", 1024, "whole-nobase"), ("deepseek-v3", 4096, "rank"))


_TIMES = (
    "plan_s",
    "plan_cpu",
    "rank_plan_dst_s",
    "rank_plan_dst_cpu",
    "rank_plan_src_s",
    "rank_plan_src_cpu",
    "rank_plan_cached_s",
    "rank_plan_objects_s",
    "cached_s",
    "local_sched_s",
    "local_sched_cpu",
)


def _span(values: list[float]) -> str:
    """`` (min-max over n fresh processes)`` when there are several runs."""
    if len(values) < 2:
        return ""
    return f" [{min(values) * 1e3:.1f}-{max(values) * 1e3:.1f} ms over {len(values)} processes]"


def models(configs: tuple[tuple[str, int, str], ...], repeat: int) -> None:
    print(f"== whole models: trainer ranks 0..n-1, inference ranks n..2n-1; NVL72 racks with {DOMAIN} GPUs each")
    print("   (each side starts a rack of its own), 50 GB/s NIC, 900 GB/s NVLink, 5 us latency, 8 MiB chunks")
    print("   times: wall clock, and the process's CPU time (the machine may be shared: CPU is the planner's own)\n")
    for name, n, mode in configs:
        cmd = [sys.executable, __file__, "--one", name, str(n), mode]
        runs = []
        for _ in range(repeat if mode != "rank" else 1):  # the 4096 + 4096 run (simulate) takes minutes: once
            res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy(), check=True)
            runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
        o = runs[0]
        for key in _TIMES:
            if key in o:
                o[key] = float(np.median([x[key] for x in runs]))
                o[key + "_range"] = _span([x[key] for x in runs])
        print(
            f"{o['name']} on {n} + {n} GPUs: {o['tensors']} tensors ({o['pairs']} distinct layout pairs), "
            f"{o['bytes'] / 1e12:.2f} TB; trainer {o['trainer']}, inference {o['inference']}"
        )
        if "plan_s" in o:
            print(
                f"   plan the whole model      {o['plan_s']:7.3f} s wall ({o['plan_cpu']:.3f} s CPU), {o['rows']} rows"
                f"{o['plan_s_range']}"
            )
        print(
            f"   one destination's plan    {o['rank_plan_dst_s']:7.3f} s wall ({o['rank_plan_dst_cpu']:.3f} s CPU)"
            f"{o['rank_plan_dst_s_range']}, {o['rank_plan_pieces']} pieces"
        )
        print(
            f"     its Message/Piece values {o['rank_plan_objects_s']:6.3f} s more, built when first read"
            f"{o['rank_plan_objects_s_range']}"
        )
        print(
            f"   one source's plan         {o['rank_plan_src_s']:7.3f} s wall ({o['rank_plan_src_cpu']:.3f} s CPU)"
            f"{o['rank_plan_src_s_range']}"
        )
        print(
            f"   a plan asked again        {o['rank_plan_cached_s'] * 1e3:7.3f} ms (median of 7; templates cached)"
            f"{o['rank_plan_cached_s_range']}"
        )
        if "plan_s" in o:
            print(
                f"   cached plan (median of 7) {o['cached_s'] * 1e3:7.3f} ms{o['cached_s_range']} (same layouts); "
                "equal layouts built "
                f"anew: {o['cached_fresh_s'] * 1e3:.3f} ms first call, {o['cached_fresh_again_s'] * 1e3:.3f} ms after"
            )
            print(f"   plan.stats()              {o['stats_s']:7.3f} s wall ({o['stats_cpu']:.3f} s CPU)")
        if "local_sched_s" in o:
            print_local(o)
        if "simulate_s" in o:
            print(
                f"   simulate_layouts          {o['simulate_s']:7.3f} s wall ({o['simulate_cpu']:.3f} s CPU), "
                f"{o['rows']} rows never held at once"
            )
        ratio = o["network"] / o["bound"] if o["bound"] else 1.0
        print(
            f"   network bytes             {o['network'] / 1e12:.4f} TB, lower bound {o['bound'] / 1e12:.4f} TB "
            f"(ratio {ratio:.4f})"
        )
        base = o["predicted"]["jreshard"][0]
        for label, (secs, bound, where) in o["predicted"].items():
            print(
                f"   predicted {label:<24}{secs:9.3f} s  (predicted bound {bound:.3f} s; {where}; "
                f"{secs / base:.2f}x jreshard)"
            )
        if "profile" in o:
            print("   where the whole-plan time goes (own time, profiled run, caches cleared):")
            for what, share in o["profile"]:
                print(f"     {share * 100:5.1f}%  {what}")
        print(f"   peak memory of the process {o['maxrss_mib']:.0f} MiB\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only the 128 + 128 configurations")
    ap.add_argument(
        "--repeat", type=int, default=3, help="fresh processes per configuration (medians and ranges; default 3)"
    )
    ap.add_argument(
        "--only",
        action="append",
        metavar="MODEL:N",
        help="only this model configuration (repeatable; e.g. deepseek-v3:4096), without the first two sections",
    )
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "N", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        name, n, mode = args.one
        print(json.dumps(one_model(name, int(n), whole=mode.startswith("whole"), baselines=mode == "whole")))
        return
    configs: tuple[tuple[str, int, str], ...] = CONFIGS_QUICK if args.quick else CONFIGS
    if args.only:
        known = {f"{name}:{n}": (name, n, mode) for name, n, mode in CONFIGS}
        unknown = [c for c in args.only if c not in known]
        if unknown:
            ap.error(f"--only {', '.join(unknown)}: not a configuration; choose from {', '.join(known)}")
        configs = tuple(known[c] for c in args.only)
    else:
        ffn_moe()
        single_tensor()
    models(configs, max(1, args.repeat))


if __name__ == "__main__":
    main()
