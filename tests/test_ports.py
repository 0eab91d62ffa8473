"""The coordinator port: held from the moment it is chosen until the jax coordinator has bound it."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jreshard.mpi.cluster import coordinator_host
from jreshard.net.ports import reserved_port

ROOT = Path(__file__).parent.parent

COORDINATOR = """
import sys, jax
from jreshard.net.ports import reserved_port
def start(port):
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0, initialization_timeout=30)
    print("coordinator up:", jax.process_count(), flush=True)
    jax.distributed.shutdown()
if sys.argv[1] == "held":
    with reserved_port() as port:
        start(port)
else:  # the old way: a port found free and let go; here something takes it before the coordinator binds
    import socket
    with socket.socket() as taker:
        taker.bind(("127.0.0.1", 0))
        start(taker.getsockname()[1])
"""


def _coordinator(mode: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_FLAGS"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", COORDINATOR, mode], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_nothing_else_can_bind_a_held_port():
    with reserved_port() as port:
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            with socket.socket(family) as other, pytest.raises(OSError) as taken:
                other.bind((host, port))
            assert taken.value.errno == errno.EADDRINUSE, (host, taken.value)
    with socket.socket() as after:  # let go at the end of the block
        after.bind(("127.0.0.1", port))


def test_held_ports_are_distinct():
    with reserved_port() as a, reserved_port() as b, reserved_port() as c:
        assert len({a, b, c}) == 3


def test_a_jax_coordinator_starts_on_a_held_port_and_dies_on_a_taken_one():
    up = _coordinator("held")
    assert up.returncode == 0 and "coordinator up: 1" in up.stdout, up.stdout + up.stderr
    taken = _coordinator("taken")  # what CI once saw: gRPC cannot bind, and the process crashes
    assert taken.returncode != 0 and "Failed to add port" in taken.stderr, taken.stdout + taken.stderr


def test_the_coordinator_is_on_loopback_only_when_every_process_shares_a_host():
    assert coordinator_host(["a", "a", "a"]) == "127.0.0.1"
    assert coordinator_host(["node7", "node8", "node7"]) == "node7"


def test_without_ipv6_the_port_is_held_on_every_ipv4_address(monkeypatch):
    real = socket.socket

    def no_ipv6(family=socket.AF_INET, *args, **kwargs):
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real(family, *args, **kwargs)

    monkeypatch.setattr(socket, "socket", no_ipv6)
    with reserved_port() as port:
        with real(socket.AF_INET) as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
