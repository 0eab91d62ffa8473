"""A JAX trainer refits a PyTorch server that has no jax: two programs over NIXL, the server two processes as
vLLM's TP2 in bfloat16 (the two programs in two network namespaces joined by a bridge), every tensor bit for
bit what vLLM's loaders would hold and the network bytes the lower bound; then the server's TP forward pass gives
the trainer's logits. A server or the trainer killed mid-refit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _netns import Network, available
from _vllm_reference import jax_forward, torch_forward, trainer

from jreshard.integrations import vllm

pytest.importorskip("nixl_cu12", reason="the NIXL tests need nixl-cu12 (pip install --no-deps nixl-cu12)")
torch = pytest.importorskip("torch")  # installed by `make test` (the torch extra)

ROOT = Path(__file__).parent.parent
BODY = ROOT / "tests" / "torch_bodies" / "vllm_pair.py"
pytestmark = pytest.mark.timeout(240)

LLAMA = dict(vocab_size=200, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=8)  # fmt: skip


def start(role: str, address: str, cfg: dict, out: Path, ns: str | None = None, **env_extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_FLAGS"))}
    env |= {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4", "OMP_NUM_THREADS": "1"}
    env |= {"JRESHARD_SECRET": "jax-trainer-torch-server-key-0123", **env_extra}
    if ns:  # the namespace's own interfaces only
        env = {k: v for k, v in env.items() if not k.startswith("UCX_")} | {k: v for k, v in env_extra.items()}
    prefix = ["ip", "netns", "exec", ns] if ns else []
    return subprocess.Popen(
        [*prefix, sys.executable, str(BODY), role, address, json.dumps(cfg), str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def events(proc: subprocess.Popen) -> list[dict]:
    out = proc.communicate(timeout=200)[0]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")] or [{"output": out[-3000:]}]


@pytest.fixture
def network():
    """A trainer host and a server host in two network namespaces on a bridge, links at 1 Gbit/s (loopback,
    ``None``, where namespaces cannot be made here)."""
    if available():
        yield None
        return
    net = Network(["trainer", "server"], rate="1gbit")
    try:
        yield net
    finally:
        net.close()


@pytest.mark.parametrize(
    "cfg",
    [
        LLAMA,  # TP2 over 2 kv heads; vocabulary 200 padded to 256: rank 1 holds 72 real rows of 128
        dict(LLAMA, num_kv_heads=1),  # GQA, TP above the kv heads: the one kv head on both ranks
    ],
)
def test_five_refits_into_a_torch_tp2_server_without_jax(tmp_path, cfg, network):
    address = str(tmp_path / "address")
    where = {}
    if network is not None:  # UCX over TCP between the "hosts", as between machines
        net = {"UCX_TLS": "tcp,self", "UCX_TCP_BRIDGE_ENABLE": "y"}
        where = {h: dict(ns=network.ns[h], JRESHARD_HOST=network.addr[h], **net) for h in ("trainer", "server")}
    procs = [start("trainer", address, cfg, tmp_path, **where.get("trainer", {}))]
    procs += [start(f"server:{i}:2", address, cfg, tmp_path, **where.get("server", {})) for i in (0, 1)]
    trained, *served = (events(p) for p in procs)
    assert all(p.returncode == 0 for p in procs), (trained, served)
    pushed = [e for e in trained if e.get("event") == "pushed"]
    assert [e["version"] for e in pushed] == [1, 2, 3, 4, 5], trained
    m = vllm.DecoderShape(**cfg)
    # The network bytes of every refit are the lower bound: each server process is its own domain and holds
    # no source, so each element of each box it holds crosses the network once, in bfloat16 (cast at the sender).
    bound = sum(s.box.volume * 2 for r in (0, 1) for s in vllm.vllm_shards(m, r, 2).values())
    assert [e["network"] for e in pushed] == [bound] * 5
    for got in served:
        assert got[0]["event"] == "formed" and got[0]["jax"] == [], got[0]
        result = got[-1]
        assert result["checked"] == [1, 2, 3, 4, 5] and result["bad"] == [], result
    # The server's tensors compute the trainer's model.
    ranks = []
    for i in (0, 1):
        with np.load(tmp_path / f"rank{i}.npz") as z:
            ranks.append({k: torch.from_numpy(z[k]).to(torch.bfloat16) for k in z.files})
    tokens = np.random.default_rng(1).integers(0, m.vocab_size, size=10)
    want = jax_forward(trainer(m, seed=5), m, tokens)
    got = torch_forward(ranks, m, tokens)
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()


def test_a_server_killed_mid_refit_then_new_servers(tmp_path):
    """The trainer's push raises within the timeout, the surviving server keeps its previous version, and the
    trainer serves two new server processes in a new group."""
    address = str(tmp_path / "address")
    trainer_p = start("trainer", address, LLAMA, tmp_path, TRAINER="replace", VERSIONS="4")
    first = [start("server:0:2", address, LLAMA, tmp_path), start("server:1:2:die:2", address, LLAMA, tmp_path)]
    survivor, victim = (events(p) for p in first)
    assert first[1].returncode == -9, victim
    ended = next(e for e in survivor if e.get("event") == "ended")
    assert ended["intact"] is True and ended["kept"] is True, ended
    assert survivor[-1]["checked"] == [1] and survivor[-1]["bad"] == [], survivor
    fresh = [start(f"server:{i}:2", address, LLAMA, tmp_path) for i in (0, 1)]
    served = [events(p) for p in fresh]
    trained = events(trainer_p)
    assert trainer_p.returncode == 0, trained
    failed = next(e for e in trained if e.get("event") == "failed")
    assert failed["version"] == 2 and failed["seconds"] < 30.0, trained  # within the timeout (30 s)
    assert [e["version"] for e in trained if e.get("event") == "pushed"] == [1, 3, 4], trained
    for got in served:
        assert got[-1]["checked"] == [3, 4] and got[-1]["bad"] == [], got


def test_a_trainer_killed_mid_refit_leaves_every_server_on_its_version(tmp_path):
    address = str(tmp_path / "address")
    procs = [start("trainer", address, LLAMA, tmp_path, TRAINER="die:3")]
    procs += [start(f"server:{i}:2", address, LLAMA, tmp_path) for i in (0, 1)]
    trained, *served = (events(p) for p in procs)
    assert procs[0].returncode == -9, trained
    for got in served:
        ended = next(e for e in got if e.get("event") == "ended")
        assert ended["intact"] is True and ended["kept"] is True, ended
        assert got[-1]["checked"] == [1, 2] and got[-1]["bad"] == [] and got[-1]["version"] == 2, got


def test_the_same_over_mpi(tmp_path):
    """One MPMD mpiexec: the trainer, then the two TP ranks of the server (``Receiver.over_mpi``)."""
    from mpi_launch import launch, need_mpi, program, results

    need_mpi()
    launch(
        [program(1, "vllm_torch_body.py", "trainer"), program(2, "vllm_torch_body.py", "server")],
        tmp_path,
        devices=2,
        timeout_s=180,
    )
    src, dst = results(tmp_path, "vllm-trainer"), results(tmp_path, "vllm-server")
    assert len(src) == 1 and len(dst) == 2, (src, dst)
    for r in [*src.values(), *dst.values()]:
        assert "error" not in r, r
    for d in dst.values():
        assert d["exact"] == [True, True, True] and d["version"] == 3 and d["loaded"] == [], d


@pytest.mark.parametrize(("seed", "flags"), [(1, ""), (4, "in_place")])
def test_a_pytorch_receiver_of_random_tensors_over_mpi(tmp_path, seed, flags):
    """A JAX trainer refits a PyTorch receiver (no jax, two processes) of random tensors: every dtype jax and torch
    both hold (complex, unsigned and the float8s of both families included), shapes with sizes of 0 (these
    were refused by the planner: no process declared them) and scalars, halves and whole tensors per process;
    staged and in place. Two versions, every tensor's bytes checked."""
    from mpi_launch import launch, need_mpi, program, results

    need_mpi()
    args = [str(seed), "16"]
    launch(
        [
            program(1, "torch_random_body.py", "trainer", *args),
            program(2, "torch_random_body.py", "server", *args, flags),
        ],
        tmp_path,
        devices=2,
        timeout_s=180,
    )
    src, dst = results(tmp_path, "torch-random-trainer"), results(tmp_path, "torch-random-server")
    assert len(src) == 1 and len(dst) == 2, (src, dst)
    for r in [*src.values(), *dst.values()]:
        assert "error" not in r, r
    for d in dst.values():
        assert d["bad"] == [] and d["version"] == 2 and d["loaded"] == [], d


@pytest.mark.parametrize(("seed", "flags"), [(2, ""), (5, "in_place"), (3, "in_place delta")])
def test_a_pytorch_receiver_of_random_tensors_over_nixl(tmp_path, seed, flags):
    """The random tensors of the MPI test above, between two programs over NIXL (loopback): a JAX trainer of 2
    devices, a PyTorch receiver of two processes without jax, staged and in place; three versions, every tensor's
    bytes checked after each; with ``delta``, versions that change a tenth of their elements go as deltas."""
    body = ROOT / "tests" / "torch_bodies" / "random_pair.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XLA_FLAGS"))}
    env |= {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2", "OMP_NUM_THREADS": "1"}
    env |= {"JRESHARD_SECRET": "jax-trainer-torch-random-key-0123"}
    address, args = str(tmp_path / "address"), [str(seed), "16"]
    roles = [["trainer", *flags.split()], ["server:0", *flags.split()], ["server:1", *flags.split()]]
    procs = [
        subprocess.Popen(
            [sys.executable, str(body), role, address, *args, *rest],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for role, *rest in roles
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=200)[0])
        finally:
            if p.poll() is None:
                p.kill()
    got = [json.loads(next((ln for ln in o.splitlines() if ln.startswith("{")), "{}")) for o in outs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[-3000:] for o in outs]
    assert got[0]["pushed"] == [1, 2, 3], got
    if "delta" in flags:
        assert got[0]["modes"] == ["full", "delta", "delta"], got
    for d in got[1:]:
        assert d["checked"] == [1, 2, 3] and d["bad"] == [] and d["loaded"] == [], d
        assert "closed" in d["end"], d  # the trainer's close ends the pulls, nothing else
