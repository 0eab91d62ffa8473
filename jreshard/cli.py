"""python -m jreshard {plan, simulate, demo}: the command line. Environment variables are read here only.

``plan`` prints a plan's bytes by link kind, the lower bound, per-rank loads and
message counts beside the baselines; ``simulate`` prints the cost model's
predicted times (predictions, not measurements). Both take a model
(``--model deepseek-v3``) or one tensor (``--shape``, ``--src``, ``--dst``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


LAYOUT_SYNTAX = """\
layouts (--src, --dst):  MESH[:SPEC][@FIRST_RANK]
  MESH        mesh axes major to minor, AXIS=SIZE joined by commas: "ep=16", "dp=4,tp=8"
  SPEC        one entry per tensor dimension, joined by commas (missing trailing entries
              replicate): "-" replicates the dimension, "tp" splits it over axis tp,
              "dp+tp" splits it over dp then tp (major to minor), as in a PartitionSpec
  FIRST_RANK  the mesh holds ranks FIRST_RANK, FIRST_RANK+1, ... in row-major order;
              default: 0 for --src, and for --dst the first rank of the next fast-link
              domain after the source's ranks
  example: --shape 256,2048,7168 --src "ep=16:ep" --dst "dp=4,tp=8:-,-,tp"
           is P("ep") on 16 GPUs -> P(None, None, "tp") on a (dp=4, tp=8) mesh
topology: ranks in consecutive blocks of --domain-size form one fast-link domain
  (trainer ranks first, inference ranks from the next domain on). --cluster sets
  defaults: nvl72 = 72 GPUs per domain, 50 GB/s NIC, 900 GB/s NVLink (GB200);
  h100 = 8 GPUs per domain, 50 GB/s NIC, 450 GB/s NVLink (DGX H100).
every time `simulate` prints is predicted by the cost model (jreshard.cost), not measured."""

_CLUSTERS = {"nvl72": (72, 50.0, 900.0), "h100": (8, 50.0, 450.0)}  # domain size, NIC GB/s, fast GB/s


def _si(n: float, unit: str = "B") -> str:
    """Decimal units, like the GB/s of the links: 7168 MB, 1.34 TB."""
    for prefix in ("", "k", "M", "G", "T", "P"):
        if abs(n) < 1000 or prefix == "P":
            return f"{n:.0f} {prefix}{unit}" if prefix == "" else f"{n:.2f} {prefix}{unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _seconds(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.3f} s"


def parse_layout(text: str, shape: Sequence[int], dtype: str, first_rank: int) -> Any:
    """A Layout from the command-line syntax (``LAYOUT_SYNTAX``); ``first_rank`` unless ``@N`` is given.

    Raises:
      argparse.ArgumentTypeError: the text does not follow the syntax.

    Example:
      >>> lay = parse_layout("dp=2,tp=4:-,tp@8", (6, 16), "float32", 0)
      >>> lay.ranks[:3], lay.box_of(9)
      ((8, 9, 10), Box(lo=(0, 4), hi=(6, 8)))
    """
    import numpy as np

    from jreshard.errors import LayoutError
    from jreshard.sharding.layout import Layout

    body, _, at = text.partition("@")
    mesh_text, _, spec_text = body.partition(":")
    try:
        axes = [(a.strip(), int(n)) for a, n in (item.split("=") for item in mesh_text.split(","))]
        first = int(at) if at else first_rank
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"layout {text!r}: the mesh must read AXIS=SIZE,AXIS=SIZE and the first rank an integer, "
            f"e.g. 'dp=4,tp=8:-,tp@72'"
        ) from None
    if any(n < 1 for _, n in axes):
        raise argparse.ArgumentTypeError(f"layout {text!r}: mesh axis sizes must be >= 1")
    spec: list[Any] = []
    for entry in spec_text.split(",") if spec_text else []:
        entry = entry.strip()
        spec.append(None if entry in ("-", "", "None") else tuple(entry.split("+")))
    names = [a for a, _ in axes]
    ranks = np.arange(first, first + int(np.prod([n for _, n in axes]))).reshape([n for _, n in axes])
    try:
        return Layout.from_mesh(ranks, names, spec, shape, dtype)
    except LayoutError as err:
        raise argparse.ArgumentTypeError(f"layout {text!r}: {err}") from None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Case:
    """What `plan` and `simulate` work on: layout pairs, names, a topology and a description."""

    title: str
    sides: tuple[str, str]
    pairs: tuple
    names: tuple[str, ...]
    topology: Any
    options: Any


def _case(args: argparse.Namespace) -> _Case:
    from jreshard.models import refit, refit_topology
    from jreshard.options import Options

    domain, nic, fast = _CLUSTERS[args.cluster]
    domain = args.domain_size or domain
    links = {
        "network_bw": (args.nic_gbs or nic) * 1e9,
        "fast_bw": (args.fast_gbs or fast) * 1e9,
        "latency_s": args.latency_us * 1e-6,
    }
    options = Options(
        relays=not args.no_relays, chunk_bytes=args.chunk_mib << 20, staging_bytes=max(256, args.chunk_mib) << 20
    )
    if args.model:
        try:
            r = refit(args.model, args.train_gpus, args.infer_gpus)
        except ValueError as err:
            raise SystemExit(f"error: {err}") from None
        topo = refit_topology(args.train_gpus, args.infer_gpus, domain, **links)
        gib = r.model.nbytes
        return _Case(
            title=f"{r.model.name}: {len(r.pairs)} tensors, {_si(gib)}, {r.model.n_params / 1e9:.0f}B parameters",
            sides=(
                f"trainer   ranks 0-{args.train_gpus - 1}: {r.trainer.name}",
                f"inference ranks {args.train_gpus}-{args.train_gpus + args.infer_gpus - 1}: {r.inference.name}",
            ),
            pairs=r.pairs,
            names=r.names,
            topology=topo,
            options=options,
        )
    if not (args.shape and args.src and args.dst):
        raise SystemExit("give --model NAME, or --shape, --src and --dst (see --help for the layout syntax)")
    from jreshard.sharding.topology import Topology

    shape = tuple(int(v) for v in args.shape.split(","))
    try:
        src = parse_layout(args.src, shape, args.dtype, 0)
        first_dst = -(-(max(src.ranks) + 1) // domain) * domain
        dst = parse_layout(args.dst, shape, args.dtype, first_dst)
    except argparse.ArgumentTypeError as err:
        raise SystemExit(f"error: {err}") from None
    n = max(max(src.ranks), max(dst.ranks)) + 1
    topo = Topology.uniform(range(n), domain, **links)
    return _Case(
        title=f"tensor {shape} {src.dtype}: {_si(src.nbytes)}",
        sides=(
            f"source      ranks {min(src.ranks)}-{max(src.ranks)}: {args.src}",
            f"destination ranks {min(dst.ranks)}-{max(dst.ranks)}: {args.dst}",
        ),
        pairs=((src, dst),),
        names=("x",),
        topology=topo,
        options=options,
    )


def _plans(case: _Case) -> list[tuple[str, Any, float]]:
    """jreshard's plan and the three baselines, each with the seconds it took to build."""
    from jreshard.sharding.baselines import flat_direct_layouts, gather_broadcast_layouts
    from jreshard.sharding.program import plan_layouts

    out = []
    for label, build in (
        ("jreshard", lambda: plan_layouts(case.pairs, case.topology, case.options, case.names)),
        ("gather-broadcast", lambda: gather_broadcast_layouts(case.pairs, case.topology, case.options, case.names)),
        (
            "gather-broadcast (ring)",
            lambda: gather_broadcast_layouts(case.pairs, case.topology, case.options, case.names, ring=True),
        ),
        ("flat-direct", lambda: flat_direct_layouts(case.pairs, case.topology, case.options, case.names)),
    ):
        t = time.perf_counter()
        p = build()
        out.append((label, p, time.perf_counter() - t))
    return out


def _header(case: _Case) -> None:
    lk = case.topology.links
    doms = sorted(set(case.topology.domains))
    print(case.title)
    for line in case.sides:
        print(line)
    print(
        f"topology: {len(case.topology.ranks)} ranks in {len(doms)} fast-link domains; NIC {_si(lk.network_bw, 'B/s')}"
        f" each way, fast links {_si(lk.fast_bw, 'B/s')} each way, latency {lk.latency_s * 1e6:g} us"
    )


def _plan_cmd(args: argparse.Namespace) -> int:
    case = _case(args)
    _header(case)
    if args.fused:
        return _fused(args, case, simulate=False)
    cols = (
        "network",
        "lower bound",
        "fast",
        "local",
        "max NIC send",
        "max NIC recv",
        "max fast send",
        "messages",
        "stages",
        "planned in",
    )
    print(f"\n{'plan':<24}" + "".join(f"{c:>14}" for c in cols))
    drawn = None
    for label, p, secs in _plans(case):
        drawn = p if drawn is None else drawn  # jreshard's own plan comes first
        s = p.stats()
        vals = (
            _si(s.network_bytes),
            _si(s.network_bytes_lower_bound),
            _si(s.fast_bytes),
            _si(s.local_bytes),
            _si(s.max_rank_network_send_bytes),
            _si(s.max_rank_network_recv_bytes),
            _si(s.max_rank_fast_send_bytes),
            str(s.messages),
            str(s.stages),
            _seconds(secs),
        )
        print(f"{label:<24}" + "".join(f"{v:>14}" for v in vals))
    print(
        "\nnetwork: bytes crossing between fast-link domains; lower bound: the bytes any plan must move there;"
        "\nmax NIC send/recv, max fast send: the busiest rank's load on that link, each way."
    )
    if args.draw and drawn is not None:
        import matplotlib

        matplotlib.use("Agg")
        from jreshard.draw import draw_loads, draw_plan

        ax = draw_plan(drawn) if len(drawn.tensors) == 1 else draw_loads(drawn)
        ax.figure.savefig(args.draw, dpi=110)
        print(f"\nsaved a picture of the {drawn.kind} plan to {args.draw}")
    return 0


def _simulate_cmd(args: argparse.Namespace) -> int:
    from jreshard.cost import predict

    case = _case(args)
    _header(case)
    if args.fused:
        return _fused(args, case, simulate=True)
    print(f"chunk {case.options.chunk_bytes / (1 << 20):g} MiB; relays {'on' if case.options.relays else 'off'}")
    rows = [(label, p, predict(p)) for label, p, _ in _plans(case)]
    best = rows[0][2].seconds
    print(
        f"\n{'plan':<24}{'predicted time':>16}{'predicted bound':>17}{'pipeline fill':>15}  {'bottleneck':<28}"
        f"{'vs jreshard':>12}"
    )
    for label, _, pr in rows:
        where = "-" if pr.bottleneck_port is None else f"rank {pr.bottleneck_rank} {pr.bottleneck_port.label}"
        ratio = f"{pr.seconds / best:.2f}x" if best > 0 else "-"
        print(
            f"{label:<24}{_seconds(pr.seconds):>16}{_seconds(pr.bound_seconds):>17}{_seconds(pr.fill_seconds):>15}"
            f"  {where:<28}{ratio:>12}"
        )
    print(
        "\nall times are predicted by the cost model (docs/cost_model.md), not measured; the bound is the same"
        "\nloads spread evenly over the ranks of each domain."
    )
    return 0


def _fused(args: argparse.Namespace, case: _Case, simulate: bool) -> int:
    if not args.model:
        raise SystemExit("error: --fused needs --model")
    from jreshard.models.fused import fused_report

    return fused_report(args.model, args.train_gpus, args.infer_gpus, case.topology, simulate=simulate)


def _add_case_args(p: argparse.ArgumentParser) -> None:
    from jreshard.models import MODELS

    p.add_argument("--model", choices=sorted(MODELS), help="a model with its trainer and inference layouts")
    p.add_argument("--train-gpus", type=int, default=128, help="trainer GPUs, ranks 0.. (default 128)")
    p.add_argument("--infer-gpus", type=int, default=128, help="inference GPUs, after the trainer's (default 128)")
    p.add_argument("--shape", help="one tensor instead of a model: its shape, e.g. 256,2048,7168")
    p.add_argument("--dtype", default="bfloat16", help="the tensor's dtype (default bfloat16)")
    p.add_argument("--src", help="the tensor's source layout (syntax below)")
    p.add_argument("--dst", help="the tensor's destination layout (syntax below)")
    p.add_argument("--cluster", choices=sorted(_CLUSTERS), default="nvl72", help="link and domain defaults")
    p.add_argument("--domain-size", type=int, help="GPUs per fast-link domain (overrides --cluster)")
    p.add_argument("--nic-gbs", type=float, help="NIC GB/s per GPU, each way (overrides --cluster)")
    p.add_argument("--fast-gbs", type=float, help="fast-link GB/s per GPU, each way (overrides --cluster)")
    p.add_argument("--latency-us", type=float, default=5.0, help="per-message latency, microseconds (default 5)")
    p.add_argument("--chunk-mib", type=int, default=8, help="pipeline chunk, MiB (default 8)")
    p.add_argument("--no-relays", action="store_true", help="plan without relays between destination domains")
    p.add_argument(
        "--fused", action="store_true", help="refit into the inference engine's fused format (views), beside the hybrid"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jreshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = argparse.RawDescriptionHelpFormatter
    for name, func, text in (
        ("plan", _plan_cmd, "bytes by link kind, lower bound, per-rank loads and messages, beside the baselines"),
        ("simulate", _simulate_cmd, "predicted refit times of jreshard and the baselines (cost model)"),
    ):
        p = sub.add_parser(name, help=text, description=text, epilog=LAYOUT_SYNTAX, formatter_class=fmt)
        _add_case_args(p)
        p.set_defaults(func=func)
        if name == "plan":
            p.add_argument(
                "--draw",
                metavar="PNG",
                help="save a picture: the tensor's shards and moves (one tensor) or per-rank loads (a model)",
            )
    from jreshard import demo as demo_module  # stdlib-only import; jax starts inside run_from_args

    d = sub.add_parser("demo", help="the main job: refit a small transformer on 8 CPU devices, beside jax.device_put")
    demo_module.add_arguments(d)
    d.set_defaults(func=demo_module.run_from_args)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
