"""Fuzz an ElasticTrainer's service with random messages over authenticated connections, as a peer holding the
secret could send them (a misconfigured program, another version of jreshard).

Each example connects to one trainer in this process (8 CPU devices, the trainer on two), sends one to four
messages (random hellos: ``op``, ``name``, ``decl``, ``peer_address``, ``process``, ``processes`` and the fields
of a member's messages, each a well-formed value or random JSON: ints up to 2**80, floats, strings, lists,
dicts), closes, and checks that the trainer still serves (its service thread has not stopped). The first example
that stops it is printed and the run exits 3. ``tests/test_elastic_inproc.py`` runs a short derandomised pass.

Run:
  JAX_PLATFORMS=cpu .venv/bin/python tools/fuzz_elastic.py [--examples 300] [--valid-hello] [--with-version]

``--valid-hello``: each example starts with a hello that admits it as a member, so its messages reach the
member's handlers. ``--with-version``: the trainer holds a version first, so every member is caught up (slower:
a member that does not answer times out, ``timeout_s=2``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jreshard import Options
from jreshard.elastic import ElasticTrainer
from jreshard.errors import JReshardError
from jreshard.net.channel import connect, parse_address
from jreshard.refit.decl import declare_local

KEY = b"fuzz-elastic-key-0123456789abcdef"
SHAPES = {"a": (16, 8), "b": (8,)}


def run(examples: int, *, valid_hello: bool = False, with_version: bool = False, derandomize: bool = False) -> str:
    """Fuzz one trainer with ``examples`` examples; what stopped it (``""``: nothing did).

    ``derandomize``: the same examples every run (for a test)."""
    devices = jax.devices()
    src = NamedSharding(Mesh(np.array(devices[:2]), ("fsdp",)), P("fsdp"))
    dst = Mesh(np.array(devices[2:4]).reshape(1, 2), ("dp", "tp"))
    params = {k: jax.device_put(np.zeros(s, np.float32), src) for k, s in SHAPES.items()}
    like = {
        k: jax.ShapeDtypeStruct(s, np.float32, sharding=NamedSharding(dst, P(None, "tp") if len(s) == 2 else P()))
        for k, s in SHAPES.items()
    }
    decl = declare_local("destination", like, list(devices[2:4]), None)
    options = Options(timeout_s=2.0, chunk_bytes=64, staging_bytes=1024, secret=KEY)
    trainer = ElasticTrainer(params, devices=list(devices[:2]), options=options)
    if with_version:
        trainer.push(params, version=1)

    value = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**80), max_value=2**80)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
        max_leaves=6,
    )
    ops = st.sampled_from(["hello", "hello", "hello", "have", "at", "leave", "failed"])

    def mostly(good: st.SearchStrategy) -> st.SearchStrategy:
        """``good`` three times in four, else any value: well-formed messages with one field wrong reach deepest."""
        return st.one_of(good, good, good, value)

    message = st.fixed_dictionaries(
        {"op": mostly(ops)},
        optional={
            "name": st.text(max_size=6) | value,
            "decl": st.just(decl) | value,
            "peer_address": st.just(["127.0.0.1", 1]) | value,
            "process": st.integers(0, 3) | value,
            "processes": st.integers(1, 3) | value,
            "delta": value,
            "version": value,
            "base": value,
            "error": value,
            "source": value,
        },
    )
    count, stopped = [0], [""]

    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],
        derandomize=derandomize,
        database=None,
    )
    @given(st.lists(message, min_size=1, max_size=4))
    def fuzz(msgs: list[dict]) -> None:
        count[0] += 1
        if stopped[0]:
            return
        if valid_hello:
            hello = {"op": "hello", "name": f"m{count[0]}", "decl": decl, "peer_address": ["127.0.0.1", 1]}
            msgs = [hello | {"process": 0, "processes": 1}, *msgs]
        ch = connect(parse_address(trainer.address, timeout_s=1), "the trainer", key=KEY, timeout_s=2)
        try:
            for m in msgs:
                try:
                    ch.send_control(m, timeout_s=1.0)
                except JReshardError:  # the trainer closed this connection: it refused what came before
                    break
            time.sleep(0.02)
        finally:
            ch.close()
        time.sleep(0.01)
        if trainer._stop:  # its service thread stopped
            stopped[0] = f"the trainer stopped serving ({trainer._fatal}) after {msgs!r:.3000}"

    try:
        fuzz()
    finally:
        trainer.close()
    return stopped[0] or ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=300)
    ap.add_argument("--valid-hello", action="store_true")
    ap.add_argument("--with-version", action="store_true")
    a = ap.parse_args()
    stopped = run(a.examples, valid_hello=a.valid_hello, with_version=a.with_version)
    if stopped:
        print(stopped, flush=True)
        return 3
    print(f"fuzz_elastic: {a.examples} examples; the trainer serves on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
