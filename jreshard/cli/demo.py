"""The demo (``make demo``, ``python -m jreshard demo``): refit a small transformer, on 8 CPU devices.

A trainer holds the parameters FSDP-sharded over devices 0-3; an inference engine
wants them tensor-parallel (TP2 x DP2) over devices 4-7. Every refit, the trainer
updates its weights, then :func:`jreshard.transfer` moves them to the inference
layout and ``jax.device_put`` does the same for comparison; the two results are
checked to be bit-for-bit equal, shard by shard.

The two halves are modelled as two nodes (two fast-link domains): that is the
topology the plan is made for, so the table's bytes are what would cross the
network and the fast links in that deployment. In this process all 8 devices
share one host's memory, so the engine copies each piece straight from source
shard to destination shard; the times are those copies, measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from jreshard.types import Array, PyTree

__all__ = [
    "DemoConfig",
    "add_arguments",
    "inference_specs",
    "init_params",
    "main",
    "run",
    "run_from_args",
    "trainer_specs",
]

N_DEVICES = 8


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    """The demo's model and loop.

    Args:
      vocab, d_model, layers: the transformer's size (float32 weights, tied embedding).
      refits: how many train-then-refit rounds to run.
      seed: the parameters' random seed.
    """

    vocab: int = 8192
    d_model: int = 256
    layers: int = 16
    refits: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        for f in ("vocab", "d_model", "layers", "refits"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"DemoConfig: {f}={v!r} must be a positive int")
        if self.d_model % 4 or self.vocab % 4:
            raise ValueError(
                f"DemoConfig: d_model={self.d_model} and vocab={self.vocab} must be multiples of 4 "
                "(the trainer shards them 4 ways)"
            )


def init_params(cfg: DemoConfig) -> dict[str, Any]:
    """A pure-jax transformer's parameters: a tied embedding, and per layer a fused QKV
    projection, an output projection, a 4x MLP and two norm scales."""
    import jax
    import jax.numpy as jnp

    d, keys = cfg.d_model, iter(jax.random.split(jax.random.key(cfg.seed), 4 * cfg.layers + 1))

    def dense(shape: tuple[int, int]) -> jax.Array:
        return jax.random.normal(next(keys), shape, jnp.float32) / jnp.sqrt(shape[0])

    layers = [
        {
            "qkv": dense((d, 3 * d)),
            "out": dense((d, d)),
            "up": dense((d, 4 * d)),
            "down": dense((4 * d, d)),
            "norm1": jnp.ones((d,), jnp.float32),
            "norm2": jnp.ones((d,), jnp.float32),
        }
        for _ in range(cfg.layers)
    ]
    return {"embed": dense((cfg.vocab, d)), "layers": layers, "norm": jnp.ones((d,), jnp.float32)}


def trainer_specs(params: PyTree) -> PyTree:
    """FSDP: every parameter's first dimension split over the ``fsdp`` axis."""
    import jax
    from jax.sharding import PartitionSpec as P

    return jax.tree.map(lambda _: P("fsdp"), params)


def inference_specs(params: PyTree) -> PyTree:
    """Megatron-style tensor parallelism on the ``tp`` axis, replicated over ``dp``: QKV and MLP-up split
    by columns, the output and MLP-down projections by rows, the embedding by vocabulary; norms replicated."""
    from jax.sharding import PartitionSpec as P

    by_name = {"qkv": P(None, "tp"), "up": P(None, "tp"), "out": P("tp"), "down": P("tp"), "embed": P("tp")}
    layers = [{k: by_name.get(k, P()) for k in layer} for layer in params["layers"]]
    return {"embed": by_name["embed"], "layers": layers, "norm": P()}


def _setup_devices() -> None:
    """8 CPU devices, if jax has not started yet (the demo's one change to the environment)."""
    if "jax" in sys.modules:
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(N_DEVICES))
    flag = f"--xla_force_host_platform_device_count={N_DEVICES}"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _equal_shards(a: Array, b: Array) -> bool:
    import jax
    import numpy as np

    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if x.sharding != y.sharding:
            return False
        ys = {s.device: s.data for s in y.addressable_shards}
        if not all(np.array_equal(np.asarray(s.data), np.asarray(ys[s.device])) for s in x.addressable_shards):
            return False
    return True


def run(cfg: DemoConfig, out: PyTree = None) -> list[dict[str, Any]]:
    """Run the demo and print its table to ``out`` (stdout by default).

    Returns:
      One dict per refit: ``refit``, ``transfer_s``, ``transfer_into_s``, ``device_put_s``, ``exact``
      (both results equal ``jax.device_put``'s, shard by shard), and the plan's bytes.

    Raises:
      RuntimeError: fewer than 8 jax devices (jax was started before the demo could ask for 8).
    """
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    import jreshard

    out = out or sys.stdout
    devices = jax.devices()
    if len(devices) < N_DEVICES:
        raise RuntimeError(
            f"the demo needs {N_DEVICES} jax devices and found {len(devices)}; the fix is to start it before jax "
            f"is imported, or to set JAX_NUM_CPU_DEVICES={N_DEVICES} (with JAX_PLATFORMS=cpu)"
        )

    def say(*a: object) -> None:
        print(*a, file=out, flush=True)

    trainer = jax.make_mesh((4,), ("fsdp",), devices=devices[:4])
    server = jax.make_mesh((2, 2), ("dp", "tp"), devices=devices[4:8])
    params = init_params(cfg)
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(trainer, s), trainer_specs(params)))
    targets = jax.tree.map(lambda s: NamedSharding(server, s), inference_specs(params))
    # Trainer and inference engine modelled as two nodes: devices 0-3 one fast-link domain, 4-7 another.
    topo = jreshard.Topology.from_devices(devices[:8], domain_of={d: int(d.id >= 4) for d in devices[:8]})

    n_params = sum(x.size for x in jax.tree.leaves(params))
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    say(
        f"jreshard demo: refit a {cfg.layers}-layer transformer (d_model {cfg.d_model}, vocab {cfg.vocab}), "
        f"{n_params / 1e6:.1f} M float32 parameters, {_mib(n_bytes)} MiB, {len(jax.tree.leaves(params))} tensors"
    )
    say(f"  trainer:   FSDP over devices 0-3 (one modelled node)   [{devices[0].platform}, jax {jax.__version__}]")
    say("  inference: TP2 x DP2 over devices 4-7 (another modelled node)")

    plans = {
        "jreshard": jreshard.plan(params, targets, topo),
        "gather-broadcast": jreshard.baselines.gather_broadcast(params, targets, topo),
        "flat-direct": jreshard.baselines.flat_direct(params, targets, topo),
    }
    say("\nplans, MODELLED: the bytes a two-node deployment would move, counted from the plans (MiB):")
    say(f"  {'plan':<22}{'network':>9}{'bound':>8}{'fast':>8}{'same dev':>9}{'busiest NIC send':>18}{'messages':>10}")
    for name, p in plans.items():
        s = p.stats()
        say(
            f"  {name:<22}{_mib(s.network_bytes):>9}{_mib(s.network_bytes_lower_bound):>8}{_mib(s.fast_bytes):>8}"
            f"{_mib(s.same_device_bytes):>9}{_mib(s.max_rank_network_send_bytes):>18}{s.messages:>10}"
        )

    @jax.jit
    def train_step(p: PyTree, step: jax.Array) -> PyTree:  # a stand-in optimizer step: every weight changes
        return jax.tree.map(lambda w: w * 0.999 + 1e-3 * jax.numpy.sin(step + w), p)

    js = plans["jreshard"].stats()
    gb = plans["gather-broadcast"].stats()
    say("\nrefits, MEASURED on this host (times) beside the MODELLED plan bytes (MiB); each result checked")
    say("  bit-for-bit against jax.device_put's. transfer: into new arrays; transfer_into: into the engine's")
    say("  current weights (consumed like donated arguments)")
    say(
        f"  {'refit':>5}{'model net MiB':>14}{'= bound':>9}{'gather-broadcast':>17}{'model fast':>11}"
        f"{'transfer ms':>13}{'transfer_into ms':>18}{'device_put ms':>15}{'exact':>7}"
    )
    rows = []
    at_bound = js.network_bytes == js.network_bytes_lower_bound
    serving = jax.tree.map(lambda p, s: jax.numpy.zeros(p.shape, p.dtype, device=s), params, targets)
    for i in range(1, cfg.refits + 1):
        params = jax.block_until_ready(train_step(params, jax.numpy.float32(i)))
        # Each timed on the same freshly trained weights. device_put goes last: it leaves a host copy cached
        # on the source arrays, which would make a second device_put of them faster.
        t0 = time.perf_counter()
        fresh = jax.block_until_ready(jreshard.transfer(params, targets, topology=topo))
        t1 = time.perf_counter()
        serving = jax.block_until_ready(jreshard.transfer_into(params, serving, topology=topo))
        t2 = time.perf_counter()
        reference = jax.block_until_ready(jax.device_put(params, targets))
        t3 = time.perf_counter()
        exact = _equal_shards(fresh, reference) and _equal_shards(serving, reference)
        row = {
            "refit": i,
            "transfer_s": t1 - t0,
            "transfer_into_s": t2 - t1,
            "device_put_s": t3 - t2,
            "exact": exact,
            "network_bytes": js.network_bytes,
            "network_bytes_lower_bound": js.network_bytes_lower_bound,
            "fast_bytes": js.fast_bytes,
            "gather_broadcast_network_bytes": gb.network_bytes,
        }
        rows.append(row)
        say(
            f"  {i:>5}{_mib(js.network_bytes):>14}{'yes' if at_bound else 'NO':>9}"
            f"{_mib(gb.network_bytes):>17}{_mib(js.fast_bytes):>11}{row['transfer_s'] * 1e3:>13.1f}"
            f"{row['transfer_into_s'] * 1e3:>18.1f}{row['device_put_s'] * 1e3:>15.1f}{'yes' if exact else 'NO':>7}"
        )
        del fresh, reference
    later = rows[1:] or rows

    def median(key: str) -> float:
        return float(np.median([r[key] for r in later])) * 1e3

    say(
        f"\nMODELLED network bytes: jreshard {_mib(js.network_bytes)} MiB = the lower bound; gather-broadcast "
        f"{_mib(gb.network_bytes)} MiB ({gb.network_bytes / max(js.network_bytes, 1):.1f}x)."
    )
    tr, into, dp = median("transfer_s"), median("transfer_into_s"), median("device_put_s")
    say(
        f"MEASURED median time{' after the first refit' if len(rows) > 1 else ''}: transfer {tr:.1f} ms, "
        f"transfer_into {into:.1f} ms, jax.device_put {dp:.1f} ms for {_mib(n_bytes)} MiB of weights "
        f"({_mib(2 * n_bytes)} MiB written: two replicas)."
    )
    say(
        f"MEASURED ratio to jax.device_put: transfer {dp / tr:.2f}x, transfer_into {dp / into:.2f}x "
        f"({'faster' if dp > tr else 'NOT faster'} than device_put on this model; one host, noisy: see "
        "benchmarks/transfer_bench.py for medians and spreads)"
    )
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options, for its own parser and for the ``python -m jreshard demo`` subcommand."""
    defaults = DemoConfig()
    parser.add_argument("--refits", type=int, default=defaults.refits, help="train-then-refit rounds (default 5)")
    parser.add_argument(
        "--layers", type=int, default=defaults.layers, help=f"transformer layers (default {defaults.layers})"
    )
    parser.add_argument(
        "--d-model", type=int, default=defaults.d_model, help=f"model width (default {defaults.d_model})"
    )
    parser.add_argument("--vocab", type=int, default=defaults.vocab, help="vocabulary size (default 8192)")


def run_from_args(args: argparse.Namespace) -> int:
    """Run the demo with parsed options; 0 when every refit matched ``jax.device_put`` exactly."""
    cfg = DemoConfig(vocab=args.vocab, d_model=args.d_model, layers=args.layers, refits=args.refits)
    _setup_devices()
    rows = run(cfg)
    return 0 if all(r["exact"] for r in rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jreshard.cli.demo [--refits N] [--layers L] [--d-model D] [--vocab V]``."""
    parser = argparse.ArgumentParser(prog="python -m jreshard demo", description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
