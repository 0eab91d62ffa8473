"""python -m jreshard {plan, simulate, demo}: the command line. Environment variables are read here only.

``plan`` prints a plan's bytes by link kind, the lower bound, per-rank loads and
message counts beside the baselines, and every rank's send/recv operations and
exchange groups; ``simulate`` prints the cost model's predicted times
(predictions, not measurements). Both take a model (``--model deepseek-v3``, or
``--hf-config config.json``), the two sides' parallelism from an M2N system
config (``--system-config``), or one tensor (``--shape``, ``--src``, ``--dst``).
Every bad argument is an argparse error (exit status 2) before any work.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jreshard.cli.args import LAYOUT_SYNTAX, add_case_args, parse_layout, png_path

if TYPE_CHECKING:
    from jreshard.options import Options
    from jreshard.sharding.plan import Plan
    from jreshard.sharding.topology import Topology

__all__ = ["main", "parse_layout"]


def _si(n: float, unit: str = "B") -> str:
    """Decimal units, like the GB/s of the links: 7168 MB, 1.34 TB."""
    for prefix in ("", "k", "M", "G", "T", "P"):
        if abs(n) < 1000 or prefix == "P":
            return f"{n:.0f} {prefix}{unit}" if prefix == "" else f"{n:.2f} {prefix}{unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _seconds(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.3f} s"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Case:
    """What `plan` and `simulate` work on: layout pairs, a topology and a description."""

    title: str
    sides: tuple[str, str]
    pairs: tuple
    topology: Topology
    options: Options


def _links(args: argparse.Namespace, cluster: Any) -> dict[str, float]:
    pick = lambda given, default: default if given is None else given  # noqa: E731 - 0 is never a default
    return {
        "network_bw": pick(args.nic_gbs, cluster.nic_gbs) * 1e9,
        "fast_bw": pick(args.fast_gbs, cluster.fast_gbs) * 1e9,
        "latency_s": pick(args.latency_us, cluster.latency_us) * 1e-6,
    }


def _case(args: argparse.Namespace, parser: argparse.ArgumentParser) -> _Case:
    from jreshard import Options, Topology
    from jreshard.models import CLUSTERS, MODELS, read_hf_config, refit, refit_topology, system_refit

    sysc = args.system_config
    cluster = CLUSTERS[args.cluster or (sysc.cluster if sysc and sysc.cluster else "nvl72")]
    domain = args.domain_size if args.domain_size is not None else (sysc and sysc.domain_size) or cluster.domain_size
    links = _links(args, cluster)
    chunk = args.chunk_mib << 20
    options = Options(
        relays=not args.no_relays,
        chunk_bytes=chunk,
        staging_bytes=max(256 << 20, chunk),
        max_group_ops=args.max_group_ops if args.max_group_ops is not None else Options().max_group_ops,
    )
    if getattr(args, "fused", False) and not args.model:
        parser.error("--fused needs --model (a built-in model whose fused inference format is known)")
    given = [f for f, v in (("--model", args.model), ("--hf-config", args.hf_config), ("--shape", args.shape)) if v]
    if len(given) > 1:
        parser.error(f"give one of --model, --hf-config and --shape, not {' and '.join(given)}")
    if sysc is not None or args.hf_config:
        if sysc is None:
            parser.error(f"--hf-config {args.hf_config!r} needs --system-config for the two sides' parallelism")
        if args.shape:
            parser.error("--system-config describes a model refit; it does not take --shape")
        name = args.model or sysc.model
        try:
            model = read_hf_config(args.hf_config) if args.hf_config else MODELS[name].model() if name else None
        except ValueError as err:
            parser.error(str(err))
        if model is None:
            parser.error(f"--system-config {sysc.title!r} names no model: give --model or --hf-config")
        r = system_refit(model, sysc)
        n_train, n_gen = sysc.train.num_gpus, sysc.generation.num_gpus
        trainer, inference, pairs = sysc.train.name, sysc.generation.name, r.pairs
    elif args.model:
        try:
            rf = refit(args.model, args.train_gpus, args.infer_gpus)
        except ValueError as err:
            parser.error(str(err))
        model, pairs, n_train, n_gen = rf.model, rf.pairs, args.train_gpus, args.infer_gpus
        trainer, inference = rf.trainer.name, rf.inference.name
    else:
        if not (args.shape and args.src and args.dst):
            parser.error("give --model NAME, --system-config FILE, or --shape, --src and --dst (layout syntax below)")
        try:
            src = parse_layout(args.src, args.shape, args.dtype, 0)
            dst = parse_layout(args.dst, args.shape, args.dtype, -(-(max(src.ranks) + 1) // domain) * domain)
        except argparse.ArgumentTypeError as err:
            parser.error(str(err))
        n = max(max(src.ranks), max(dst.ranks)) + 1
        return _Case(
            title=f"tensor {args.shape} {src.dtype}: {_si(src.nbytes)}",
            sides=(
                f"source      ranks {min(src.ranks)}-{max(src.ranks)}: {args.src}",
                f"destination ranks {min(dst.ranks)}-{max(dst.ranks)}: {args.dst}",
            ),
            pairs=((src, dst),),
            topology=Topology.uniform(range(n), domain, **links),
            options=options,
        )
    return _Case(
        title=f"{model.name}: {len(pairs)} tensors, {_si(model.nbytes)}, {model.n_params / 1e9:.0f}B parameters",
        sides=(
            f"trainer   ranks 0-{n_train - 1}: {trainer}",
            f"inference ranks {n_train}-{n_train + n_gen - 1}: {inference}",
        ),
        pairs=tuple(pairs),
        topology=refit_topology(n_train, n_gen, domain, **links),
        options=options,
    )


BASELINES = ("jreshard", "gather-broadcast", "gather-broadcast (ring)", "flat-direct")


def _plans(case: _Case) -> list[tuple[str, Any, float]]:
    """jreshard's plan and the three baselines (names: ``BASELINES``), each with the seconds it took."""
    import jreshard

    src, dst = [s for s, _ in case.pairs], [d for _, d in case.pairs]
    topo, opts = case.topology, case.options
    builders = (
        lambda: jreshard.plan(src, dst, topo, opts),
        lambda: jreshard.baselines.gather_broadcast(src, dst, topo, opts),
        lambda: jreshard.baselines.gather_broadcast(src, dst, topo, opts, ring=True),
        lambda: jreshard.baselines.flat_direct(src, dst, topo, opts),
    )
    out = []
    for label, build in zip(BASELINES, builders, strict=True):
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


EXACT_GROUPS_MAX_CHUNKS = 4000  # above this many chunk messages, scheduling every rank in one process takes long


def _print_ops(plan: Plan, options: Options, per_rank: bool) -> None:
    """Send and receive operations and exchange groups: per fast-link domain (min-max over its ranks),
    or for every rank with ``per_rank``."""
    from jreshard.schedule.groups import plan_op_counts

    counts = plan_op_counts(plan, options.chunk_bytes)
    total = sum(s for s, _ in counts.values())
    exact = total <= EXACT_GROUPS_MAX_CHUNKS
    if exact:  # the rounds each process would run for these ranks, as the engine compiles them
        from jreshard.engine.driver import schedule_local
        from jreshard.engine.loopback import LocalComm
        from jreshard.engine.rounds import compile_rounds

        pairs, names = [(t.src, t.dst) for t in plan.tensors], [t.name for t in plan.tensors]
        _, _, sched = schedule_local(pairs, names, plan.topology, options, LocalComm(plan.topology.ranks))
        groups = {}
        for r in counts:
            rounds = compile_rounds(sched, (r,), (1,), options.max_group_ops).rounds
            groups[r] = sum(len(g) for _, g, _, _ in rounds)
            counts[r] = (
                sum(len(s) for _, g, _, _ in rounds for s, _ in g),
                sum(len(v) for _, g, _, _ in rounds for _, v in g),
            )
        note = (
            "groups: the exchange groups of the engine's rounds (pair-paced, each process scheduling its own"
            "\n  ranks; one group per round, more where a round holds more ops); sends and receives are their"
            "\n  chunks, which may be smaller than chunk_bytes"
        )
    else:
        groups = {r: -(-(s + v) // options.max_group_ops) for r, (s, v) in counts.items()}
        note = (
            f"min groups: ceil(ops / max_group_ops), a lower bound; the engine runs at least one group per round,"
            f"\n  and the exact count needs its schedule (built for plans of up to {EXACT_GROUPS_MAX_CHUNKS} chunk"
            f" messages; this one has {total})"
        )
    print(
        f"\nsend/recv operations {'per rank' if per_rank else 'per fast-link domain (min-max over its ranks)'}"
        f" for the whole refit (chunks of {options.chunk_bytes / (1 << 20):g} MiB,"
        f" max_group_ops {options.max_group_ops}):"
    )
    print(f"  {'ranks':<12}{'sends':>14}{'recvs':>14}{'groups' if exact else 'min groups':>14}")
    topo = plan.topology
    blocks: dict[Any, list[int]] = {}
    for r in sorted(counts):
        blocks.setdefault(r if per_rank else topo.domain_of(r), []).append(r)

    def span(vals: list[int]) -> str:
        return f"{min(vals)}" if min(vals) == max(vals) else f"{min(vals)}-{max(vals)}"

    for ranks in blocks.values():
        cols = [
            span([counts[r][0] for r in ranks]),
            span([counts[r][1] for r in ranks]),
            span([groups[r] for r in ranks]),
        ]
        print(f"  {span(ranks):<12}" + "".join(f"{c:>14}" for c in cols))
    if not counts:  # a tensor of no element: nothing to send
        print("  (none: no rank sends or receives a byte)")
        return
    busiest = max(counts, key=lambda r: sum(counts[r]))
    print(f"  busiest rank {busiest}: {sum(counts[busiest])} operations; {note}")


def _plan_cmd(args: argparse.Namespace) -> int:
    case = _case(args, args.parser)
    _header(case)
    if args.fused:
        return _fused(args, case, simulate=False)
    cols = (
        "network",
        "lower bound",
        "fast",
        "same device",
        "max NIC send",
        "max NIC recv",
        "max fast send",
        "messages",
        "stages",
        "planned in",
    )
    print(f"\n{'plan':<24}" + "".join(f"{c:>14}" for c in cols))
    ranks = {r for s, d in case.pairs for r in (*s.ranks, *d.ranks)}
    if len(ranks) > WHOLE_PLAN_MAX_RANKS:
        return _plan_at_scale(case, len(ranks), args)
    plans = _plans(case)
    for label, p, secs in plans:
        _stats_row(label, p.stats(), secs)
    print(_STATS_NOTE)
    drawn = plans[0][1]  # jreshard's own plan
    _print_ops(drawn, case.options, args.ops_per_rank)
    if args.draw:
        import matplotlib

        matplotlib.use("Agg")
        from jreshard.draw import draw_loads, draw_plan

        ax = draw_plan(drawn) if len(drawn.tensors) == 1 else draw_loads(drawn)
        ax.figure.savefig(args.draw, dpi=110)
        print(f"\nsaved a picture of the {drawn.kind} plan to {args.draw}")
    return 0


_STATS_NOTE = (
    "\nnetwork: bytes crossing between fast-link domains; lower bound: the bytes any plan must move there;"
    "\nmax NIC send/recv, max fast send: the busiest rank's load on that link, each way."
)


def _plan_at_scale(case: _Case, nranks: int, args: argparse.Namespace) -> int:
    """jreshard's plan statistics without holding the whole plan: one layout-pair template at a time."""
    from jreshard.sharding.simulate import simulate_layouts

    t0 = time.perf_counter()
    sim = simulate_layouts(case.pairs, case.topology, case.options)
    _stats_row("jreshard", sim.stats, time.perf_counter() - t0)
    print(_STATS_NOTE)
    print(
        f"\n{nranks} ranks: the statistics of jreshard's whole plan ({sim.rows} byte movements), added up one"
        f"\nlayout-pair template at a time without holding it; the baselines, the per-rank operation counts"
        f"{' and the picture' if args.draw else ''} need whole plans and are not built above"
        f" {WHOLE_PLAN_MAX_RANKS} ranks."
    )
    return 0


def _stats_row(label: str, s: Any, secs: float) -> None:
    vals = (
        _si(s.network_bytes),
        _si(s.network_bytes_lower_bound),
        _si(s.fast_bytes),
        _si(s.same_device_bytes),
        _si(s.max_rank_network_send_bytes),
        _si(s.max_rank_network_recv_bytes),
        _si(s.max_rank_fast_send_bytes),
        str(s.messages),
        str(s.stages),
        _seconds(secs),
    )
    print(f"{label:<24}" + "".join(f"{v:>14}" for v in vals))


WHOLE_PLAN_MAX_RANKS = 2048  # above this, simulate predicts from layout-pair templates and skips the baselines


def _simulate_cmd(args: argparse.Namespace) -> int:
    from jreshard.cost import predict

    case = _case(args, args.parser)
    _header(case)
    if args.fused:
        return _fused(args, case, simulate=True)
    print(f"chunk {case.options.chunk_bytes / (1 << 20):g} MiB; relays {'on' if case.options.relays else 'off'}")
    ranks = {r for s, d in case.pairs for r in (*s.ranks, *d.ranks)}
    if len(ranks) > WHOLE_PLAN_MAX_RANKS:
        return _simulate_at_scale(case, len(ranks))
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


def _simulate_at_scale(case: _Case, nranks: int) -> int:
    """jreshard's predicted refit without building the whole plan: one layout-pair template at a time."""
    from jreshard.sharding.simulate import simulate_layouts

    t0 = time.perf_counter()
    sim = simulate_layouts(case.pairs, case.topology, case.options)
    pr = sim.prediction
    where = "-" if pr.bottleneck_port is None else f"rank {pr.bottleneck_rank} {pr.bottleneck_port.label}"
    print(
        f"\n{nranks} ranks: predicted from the planner's layout-pair templates, one at a time, without holding the"
        f"\nwhole plan ({sim.rows} byte movements); the baselines' whole plans are not built at this size."
    )
    print(f"\n{'plan':<24}{'predicted time':>16}{'predicted bound':>17}{'pipeline fill':>15}  {'bottleneck':<28}")
    print(
        f"{'jreshard':<24}{_seconds(pr.seconds):>16}{_seconds(pr.bound_seconds):>17}{_seconds(pr.fill_seconds):>15}"
        f"  {where:<28}"
    )
    print(
        f"\nnetwork {_si(sim.network_bytes)} (lower bound {_si(sim.network_bytes_lower_bound)}), fast "
        f"{_si(sim.fast_bytes)}, same-device {_si(sim.same_device_bytes)}; "
        f"simulated in {time.perf_counter() - t0:.1f} s"
    )
    print("all times are predicted by the cost model (docs/cost_model.md), not measured.")
    return 0


def _fused(args: argparse.Namespace, case: _Case, simulate: bool) -> int:
    from jreshard.models.fused import fused_report

    return fused_report(args.model, args.train_gpus, args.infer_gpus, case.topology, simulate=simulate)


def main(argv: Sequence[str] | None = None) -> int:
    from jreshard.models import CLUSTERS, published_configs

    parser = argparse.ArgumentParser(prog="python -m jreshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = argparse.RawDescriptionHelpFormatter
    epilog = LAYOUT_SYNTAX % {
        "published": ", ".join(sorted(published_configs())),
        "clusters": "; ".join(f"{c.name} = {c.about}" for c in CLUSTERS.values()),
    }
    for name, func, text in (
        ("plan", _plan_cmd, "bytes by link kind, lower bound, per-rank loads and messages, beside the baselines"),
        ("simulate", _simulate_cmd, "predicted refit times of jreshard and the baselines (cost model)"),
    ):
        p = sub.add_parser(name, help=text, description=text, epilog=epilog, formatter_class=fmt)
        add_case_args(p)
        p.set_defaults(func=func, parser=p)
        if name == "plan":
            p.add_argument("--ops-per-rank", action="store_true", help="print every rank's operations, not per domain")
            p.add_argument(
                "--draw",
                metavar="PNG",
                type=png_path,
                help="save a picture: the tensor's shards and moves (one tensor) or per-rank loads (a model)",
            )
    from jreshard.cli import demo as demo_module  # stdlib-only import; jax starts inside run_from_args

    d = sub.add_parser("demo", help="the main job: refit a small transformer on 8 CPU devices, beside jax.device_put")
    demo_module.add_arguments(d)
    d.set_defaults(func=demo_module.run_from_args)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
