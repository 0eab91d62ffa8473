"""Padding of backend xla's permutations on the README models' layouts, from the plans (nothing runs).

    JAX_PLATFORMS=cpu python benchmarks/xla_padding.py            # every README model
    JAX_PLATFORMS=cpu python benchmarks/xla_padding.py --n 64 --only qwen3-235b

For each model: the refit plan from trainer to inference on ``n + n`` ranks (64 + 64, or the
model's smallest size where its parallel layout needs more: DeepSeek-V3 and Kimi-K2 split over
multiples of 128 GPUs), in fast-link domains of 64 ranks (NVL72 racks, as ``plan_bench.py``); each
stage's messages cut into permutations exactly as ``Options(backend="xla")`` cuts them
(:func:`jreshard.xla.xlaplan.stage_permutations`, the same function the computation is built
from); printed: the bytes the permutations carry (the plan's network and fast-link bytes), the
padding bytes (every pair of a ``ppermute`` sends its largest member's length) and their share,
and the ``ppermute`` count. The cut bounds padding at ``tol / (1 - tol)`` = 5.3% of the payload
by construction; the acceptance bound is 10%.
"""

from __future__ import annotations

import argparse
import time

from jreshard.models import refit, refit_topology
from jreshard.models.recipes import MODELS
from jreshard.sharding.planner import plan_layouts
from jreshard.sharding.topology import Link
from jreshard.xla.perms import padding_bytes
from jreshard.xla.xlaplan import stage_permutations

NIC, NVLINK = 50e9, 900e9
DOMAIN = 64
README_MODELS = ("deepseek-v3", "kimi-k2", "qwen3-235b", "llama3-70b")


def one(name: str, n: int) -> dict:
    n = max(n, MODELS[name].gpu_multiple)
    r = refit(name, n, n)
    topo = refit_topology(n, n, DOMAIN, network_bw=NIC, fast_bw=NVLINK)
    t0 = time.perf_counter()
    plan = plan_layouts(r.pairs, topo, names=r.names)
    t1 = time.perf_counter()
    cut = stage_permutations(plan)
    t2 = time.perf_counter()
    stats = plan.stats()
    payload = {Link.NETWORK: 0, Link.FAST: 0}
    for perms, links in cut.values():
        for p in perms:
            for s in p.segments:
                payload[Link.FAST if links[s.message] == Link.SAME_DEVICE else Link(int(links[s.message]))] += s.nbytes
    moved = sum(payload.values())
    pad = sum(padding_bytes(perms) for perms, _ in cut.values())
    return {
        "name": name,
        "n": n,
        "tensors": len(r.pairs),
        "moved": moved,
        "network": payload[Link.NETWORK],
        "plan_network": stats.network_bytes,
        "fast": payload[Link.FAST],
        "plan_fast": stats.fast_bytes,
        "padding": pad,
        "share": pad / moved if moved else 0.0,
        "ppermutes": sum(len(perms) for perms, _ in cut.values()),
        "messages": sum(len(links) for _, links in cut.values()),
        "plan_s": t1 - t0,
        "cut_s": t2 - t1,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=64, help="ranks per side (raised to a model's smallest size)")
    ap.add_argument("--only", nargs="*", default=README_MODELS, choices=sorted(MODELS))
    args = ap.parse_args()
    print(f"backend xla padding from the plans, {DOMAIN} ranks per fast-link domain (nothing runs)")
    print(
        f"{'model':<12} {'ranks':>9} {'moved GB':>10} {'padding GB':>11} {'share':>7} {'ppermutes':>9}  equal to plan"
    )
    worst = 0.0
    for name in args.only:
        o = one(name, args.n)
        same = o["network"] == o["plan_network"] and o["fast"] == o["plan_fast"]
        worst = max(worst, o["share"])
        print(
            f"{o['name']:<12} {o['n']:>4}+{o['n']:<4} {o['moved'] / 1e9:>10.2f} {o['padding'] / 1e9:>11.4f} "
            f"{o['share']:>6.2%} {o['ppermutes']:>9}  {'yes' if same else 'NO'} "
            f"(network {o['network'] / 1e9:.2f} GB, fast {o['fast'] / 1e9:.2f} GB; {o['messages']} messages; "
            f"planned in {o['plan_s']:.2f} s, cut in {o['cut_s']:.2f} s)"
        )
    print(f"largest padding share: {worst:.2%} (bound 10%)")


if __name__ == "__main__":
    main()
