"""python -m jreshard {demo}: the command line. Environment variables are read here only."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _demo(args: argparse.Namespace) -> int:
    import numpy as np

    from jreshard.planning import flat_direct, gather_broadcast, plan
    from jreshard.sharding.layout import Layout
    from jreshard.sharding.topology import Topology

    # A [256, 2048, 7168] bf16 expert tensor: EP16 trainer -> TP8 x 4 replicas, 72-GPU domains.
    shape = (256, 2048, 7168)
    src = Layout.from_mesh(np.arange(16), ("ep",), ("ep",), shape, "bfloat16")
    dst = Layout.from_mesh(np.arange(72, 72 + 32).reshape(4, 8), ("dp", "tp"), (None, None, "tp"), shape, "bfloat16")
    topo = Topology.uniform(range(72 + 32), domain_size=72)
    rows = [("jreshard", plan(src, dst, topo)), ("gather-broadcast", gather_broadcast(src, dst, topo)),
            ("flat-direct", flat_direct(src, dst, topo))]
    print(f"tensor {shape} bfloat16: EP16 (ranks 0-15) -> TP8 x DP4 (ranks 72-103), 72 ranks per fast-link domain")
    print(f"{'plan':<18}{'network':>14}{'lower bound':>14}{'fast':>14}{'max NIC send':>14}{'max NIC recv':>14}{'messages':>10}")
    for name, p in rows:
        s = p.stats()
        print(
            f"{name:<18}{_fmt_bytes(s.network_bytes):>14}{_fmt_bytes(s.network_bytes_lower_bound):>14}"
            f"{_fmt_bytes(s.fast_bytes):>14}{_fmt_bytes(s.max_rank_network_send_bytes):>14}"
            f"{_fmt_bytes(s.max_rank_network_recv_bytes):>14}{s.messages:>10}"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jreshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="the main job: plan a large layout change, beside the baselines")
    d.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
