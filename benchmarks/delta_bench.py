"""Delta refits against full refits: a small transformer trained with Adam, refit to a bfloat16 server after
every step, over a 1 Gbit/s link.

Run (as root for the link; otherwise it runs over loopback and says so):
``.venv/bin/python benchmarks/delta_bench.py [--steps 20] [--lrs 3e-6,1e-5] [--link auto|veth|loopback]``.

Two programs, each with 2 CPU devices, meet over authenticated TCP and move the weights as NIXL WRITEs on
UCX over TCP (``RefitGroup.connect(..., transport="nixl")``): a trainer holding float32 parameters
FSDP-sharded, and a server declaring the same parameters in bfloat16, tensor-parallel (the cast happens on
the trainer, so the wire carries bfloat16). With ``--link veth`` (the default when it can) the benchmark
makes two network namespaces joined by a veth pair, each end held to 1 Gbit/s with
``tc qdisc ... tbf rate 1gbit``, runs one program in each, and deletes them at the end (on failure too);
with ``loopback`` both run here.

For each learning rate, both programs form two groups with the same declarations and Options but
``delta="off"`` and ``delta="on"``. The trainer takes ``--steps`` Adam steps on synthetic next-token data
(seeded); after each step it pushes the new version through both groups, in alternating order (full first
at odd steps, delta first at even ones), so whatever else the machine does falls on both alike; the server
pulls in the same order and hashes what it pulled only after both. A push is timed on the trainer from its begin vote
to every process having committed. Bytes: what the trainer sent (the full group: its network bytes; the
delta group: encodings, headers and length messages, ``group.delta_report``). Bit-exact: the server hashes
every pulled version of both groups, the trainer hashes ``params.astype(bfloat16)`` of every version; a
step counts when all three agree.

Printed: per learning rate and step, the full and delta bytes and seconds, the changed fraction, and the
ratios; then per learning rate the medians over the steps after the first (the first delta refit is full:
the server holds no base yet). The last line, for the first learning rate:
``delta: bytes <pct>% of full, time <ratio>x full on <link>, <n> steps bit-exact``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECRET = "delta-bench-shared-key-0123456789"
D, F, V, LAYERS, T, BATCH = 256, 1024, 4096, 4, 64, 8


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


# ----------------------------------------------------------------------------------------------- model


def init(key):
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(key, 2 + 6 * LAYERS)
    p = {"embed": jax.random.normal(ks[0], (V, D)) * 0.02, "out": jax.random.normal(ks[1], (D, V)) * 0.02}
    for i in range(LAYERS):
        k = ks[2 + 6 * i : 8 + 6 * i]
        p[f"l{i}"] = {
            "wq": jax.random.normal(k[0], (D, D)) * D**-0.5,
            "wk": jax.random.normal(k[1], (D, D)) * D**-0.5,
            "wv": jax.random.normal(k[2], (D, D)) * D**-0.5,
            "wo": jax.random.normal(k[3], (D, D)) * D**-0.5,
            "w1": jax.random.normal(k[4], (D, F)) * D**-0.5,
            "w2": jax.random.normal(k[5], (F, D)) * F**-0.5,
            "n1": jnp.ones(D),
            "n2": jnp.ones(D),
        }
    return p


def loss(p, tokens):
    import jax
    import jax.numpy as jnp
    import optax

    def norm(x, g):
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g

    x = p["embed"][tokens[:, :-1]]
    mask = jnp.tril(jnp.ones((T, T), bool))
    for i in range(LAYERS):
        q = p[f"l{i}"]
        h = norm(x, q["n1"])
        a = (h @ q["wq"]) @ (h @ q["wk"]).swapaxes(-1, -2) / D**0.5
        a = jax.nn.softmax(jnp.where(mask, a, -1e9), -1)
        x = x + (a @ (h @ q["wv"])) @ q["wo"]
        h = norm(x, q["n2"])
        x = x + jax.nn.gelu(h @ q["w1"]) @ q["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(x @ p["out"], tokens[:, 1:]).mean()


def shardings(params, mesh, spec_of):
    import jax
    from jax.sharding import NamedSharding

    return jax.tree_util.tree_map_with_path(lambda path, x: NamedSharding(mesh, spec_of(x.shape)), params)


def digest(tree) -> str:
    """sha256 over every leaf's bytes, leaves in tree order."""
    import jax
    import numpy as np

    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        h.update(np.ascontiguousarray(np.asarray(leaf)).view(np.uint8).tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------- programs


def _order(version: int) -> tuple[str, str]:
    """The order of the two refits of ``version``: alternating, so neither always goes first."""
    return ("off", "on") if version % 2 else ("on", "off")


def _options(delta: str):
    from jreshard import Options

    return Options(timeout_s=120.0, delta=delta)


def trainer(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jreshard import RefitGroup

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    for g, lr in enumerate(args.lrs):
        params = init(jax.random.PRNGKey(0))
        shard = shardings(params, mesh, lambda s: P("fsdp") if s[0] % 2 == 0 else P())
        params = jax.device_put(params, shard)
        opt = optax.adam(lr)
        state = opt.init(params)

        @jax.jit
        def step(p, s, tokens, opt=opt, shard=shard):
            grads = jax.grad(loss)(p, tokens)
            updates, s = opt.update(grads, s, p)
            return jax.lax.with_sharding_constraint(optax.apply_updates(p, updates), shard), s

        groups = {}
        for k, mode in enumerate(("off", "on")):
            address = f"{args.host}:{args.port + 2 * g + k}"
            groups[mode] = RefitGroup.connect(
                "source", params, address=address, transport="nixl", options=_options(mode)
            )
        rng = np.random.default_rng(g)
        for v in range(1, args.steps + 1):
            tokens = jnp.asarray(rng.integers(0, V, (BATCH, T + 1)))
            params, state = step(params, state, tokens)
            jax.block_until_ready(params)
            oracle = digest(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
            out = {"event": "pushed", "lr": lr, "version": v, "oracle": oracle}
            for mode in _order(v):
                group = groups[mode]
                t0 = time.perf_counter()
                group.push(params, version=v)
                seconds = time.perf_counter() - t0
                if mode == "off":
                    out["full"] = {"bytes": sum(group.sent_bytes.values()), "seconds": seconds}
                else:
                    rep = group.delta_report
                    out["delta"] = {
                        "bytes": rep.sent_bytes,
                        "full_bytes": rep.full_bytes,
                        "seconds": seconds,
                        "mode": rep.mode,
                        "changed": rep.changed_fraction,
                        "encode_s": rep.encode_s,
                        "wire_s": rep.wire_s,
                        "report_s": rep.seconds,
                        "kept": rep.kept_bytes,
                    }
            say(**out)
        for group in groups.values():
            group.close()


def server(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jreshard import RefitGroup

    mesh = Mesh(np.array(jax.devices()), ("tp",))
    abstract = jax.eval_shape(lambda: init(jax.random.PRNGKey(0)))
    shard = shardings(abstract, mesh, lambda s: P(None, "tp") if len(s) == 2 else P())
    like = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=s), abstract, shard)
    for g, lr in enumerate(args.lrs):
        groups = {}
        for k, mode in enumerate(("off", "on")):
            address = f"{args.host}:{args.port + 2 * g + k}"
            groups[mode] = RefitGroup.connect(
                "destination", like, address=address, transport="nixl", options=_options(mode)
            )
        for v in range(1, args.steps + 1):
            out: dict = {"event": "pulled", "lr": lr, "version": v}
            trees = {}
            for mode in _order(v):  # nothing but the pulls between the two: the hashes come after
                trees[mode], got = groups[mode].pull(like=like)
                assert got == v, (got, v)
            out |= {mode: digest(tree) for mode, tree in trees.items()}
            out["apply_s"] = groups["on"].delta_report.apply_s
            say(**out)
        for group in groups.values():
            group.close()


# ----------------------------------------------------------------------------------------------- the link


class Link:
    """Two network namespaces joined by a veth pair held to ``rate`` (made here, deleted in :meth:`close`),
    or loopback."""

    def __init__(self, kind: str, rate: str = "1gbit"):
        self.ns: list[str] = []
        self.addr = ("127.0.0.1", "127.0.0.1")
        self.name = "loopback"
        self.why = ""
        if kind == "loopback":
            return
        self.why = self._cannot()
        if self.why:
            if kind == "veth":
                raise SystemExit(f"delta_bench: --link veth: {self.why}")
            return
        tag = os.getpid() % 10000
        net = f"10.214.{os.getpid() % 250 + 1}"
        a, b = f"jdb{tag}a", f"jdb{tag}b"
        try:
            for ns in (a, b):
                self._run("ip", "netns", "add", ns)
                self.ns.append(ns)
            self._run(
                "ip", "link", "add", f"jdv{tag}a", "netns", a, "type", "veth", "peer", "name", f"jdv{tag}b", "netns", b
            )
            for ns, dev, ip in ((a, f"jdv{tag}a", f"{net}.1"), (b, f"jdv{tag}b", f"{net}.2")):
                self._run("ip", "-n", ns, "link", "set", "lo", "up")
                self._run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                self._run("ip", "-n", ns, "link", "set", dev, "up")
                self._run(
                    "tc",
                    "-n",
                    ns,
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    "256kb",
                    "latency",
                    "50ms",
                )
        except BaseException:
            self.close()
            raise
        self.addr = (f"{net}.1", f"{net}.2")
        self.name = f"{rate} veth (tc tbf, two netns)"

    @staticmethod
    def _cannot() -> str:
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None or shutil.which("tc") is None:
            return "needs iproute2 (ip, tc)"
        probe = f"jdbprobe{os.getpid()}"
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if made.returncode != 0:
            return f"ip netns add failed: {made.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return ""

    @staticmethod
    def _run(*cmd: str) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")

    def command(self, side: int, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side], *cmd] if self.ns else cmd

    def close(self) -> None:
        for ns in reversed(self.ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.ns.clear()


# ----------------------------------------------------------------------------------------------- driver


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lrs", default="3e-6,1e-5", help="comma-separated Adam learning rates")
    ap.add_argument("--link", choices=["auto", "veth", "loopback"], default="auto")
    ap.add_argument("--role", choices=["trainer", "server"], help=argparse.SUPPRESS)
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.lrs = [float(x) for x in args.lrs.split(",")]
    if args.role == "trainer":
        return trainer(args)
    if args.role == "server":
        return server(args)

    link = Link(args.link)
    port = 20000 + os.getpid() % 20000
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "UCX_"))}
    env |= {
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": "2",
        "JRESHARD_SECRET": SECRET,
        "UCX_TLS": "tcp,self",  # as between hosts: the bytes cross the link, not shared memory
        "UCX_TCP_BRIDGE_ENABLE": "y",
    }
    common = [
        "--steps",
        str(args.steps),
        "--lrs",
        ",".join(map(str, args.lrs)),
        "--host",
        link.addr[0],
        "--port",
        str(port),
    ]
    me = [sys.executable, str(Path(__file__).resolve())]
    procs = []
    try:
        for side, role in enumerate(("trainer", "server")):
            cmd = link.command(side, [*me, "--role", role, *common])
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=3600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        link.close()
    events = [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in outs]
    if any(p.returncode for p in procs):
        for name, out in zip(("trainer", "server"), outs, strict=True):
            print(f"--- {name} ---\n{out[-4000:]}")
        raise SystemExit("delta_bench: a program failed")
    pushed, pulled = events
    on = link.name + ("" if not link.why else f" (no veth: {link.why})")
    print(f"link: {on}; trainer float32 FSDP x2 -> server bfloat16 TP x2 over NIXL (UCX over TCP)")
    lines = []
    for lr in args.lrs:
        rows = [e for e in pushed if e["lr"] == lr]
        got = {e["version"]: e for e in pulled if e["lr"] == lr}
        print(f"\nAdam lr {lr:g}, {args.steps} steps:")
        print("step  full MB   full ms  delta MB  delta %  delta ms  time x  changed %  enc ms  wire ms  mode")
        exact = 0
        for e in rows:
            f, d = e["full"], e["delta"]
            p = got.get(e["version"], {})
            ok = p.get("off") == p.get("on") == e["oracle"]
            exact += ok
            print(
                f"{e['version']:4d} {f['bytes'] / 1e6:8.3f} {1e3 * f['seconds']:9.1f} {d['bytes'] / 1e6:9.3f} "
                f"{100 * d['bytes'] / f['bytes']:8.2f} {1e3 * d['seconds']:9.1f} {d['seconds'] / f['seconds']:7.3f} "
                f"{100 * d['changed']:10.2f} {1e3 * d['encode_s']:7.1f} {1e3 * d['wire_s']:8.1f}  "
                f"{d['mode']}{'' if ok else '  NOT BIT-EXACT'}"
            )
        later = rows[1:]
        pct = 100 * _median([e["delta"]["bytes"] / e["full"]["bytes"] for e in later])
        ratio = _median([e["delta"]["seconds"] for e in later]) / _median([e["full"]["seconds"] for e in later])
        spread = [e["delta"]["seconds"] / e["full"]["seconds"] for e in later]
        print(
            f"medians over steps 2..{args.steps}: full {1e3 * _median([e['full']['seconds'] for e in later]):.1f} ms, "
            f"delta {1e3 * _median([e['delta']['seconds'] for e in later]):.1f} ms (per-step ratio "
            f"{min(spread, default=float('nan')):.3f}-{max(spread, default=float('nan')):.3f}), kept "
            f"{later[-1]['delta']['kept'] / 1e6 if later else 0:.1f} MB on the trainer"
        )
        lines.append((lr, f"bytes {pct:.1f}% of full, time {ratio:.2f}x full on {link.name}, {exact} steps bit-exact"))
    print()
    for lr, line in lines[1:]:
        print(f"delta (lr {lr:g}): {line}")
    print(f"delta: {lines[0][1]}")


if __name__ == "__main__":
    main()
