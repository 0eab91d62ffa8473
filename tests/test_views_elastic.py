"""The views acceptance matrix through elastic refit, in one process.

The cases of ``tests/mpi_bodies/views_cases.py`` (plain float32, a float32 -> bfloat16 cast, a fused bfloat16
``qkv`` with the key/value head repeated for TP2, four stacked experts, block FP8 weights and scales): a float32
FSDP trainer on devices 0-3 pushes versions; replicas declare the server's bfloat16 / FP8 tree on a TP2 x DP2 mesh
over devices 4-7 and a recipe of views over ``views.param`` leaves. Every replica is its own process in the
protocol (its own authenticated connection, its own fast-link domain, every byte a NIXL WRITE of this
process's agent to itself); two replicas share devices 4-7 here, as two hosts of 4 devices would have their
own, so every byte between them counts as network.

Every destination shard is compared bit for bit with numpy (``jnp.astype`` for bfloat16), and the network bytes
the engine sent (counted at each sender's ``run_pair``) with the brute-force bound in the wire dtype,
element by element (``views_cases.network_bound``), built here from the layouts alone.
"""

from __future__ import annotations

import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _elastic_faults import break_the_trainers_send
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mpi_launch import BODIES

from jreshard import Layout, LayoutMismatchError, Options, Topology, views
from jreshard.elastic import CatchUp, ElasticReplica, ElasticTrainer
from jreshard.elastic import membership as membership_module
from jreshard.elastic import pairs as pairs_module
from jreshard.elastic import replica as replica_module
from jreshard.sharding.topology import Link

sys.path.insert(0, str(BODIES))
from views_cases import SPECS, bits, build, globals_, network_bound, references

pytestmark = pytest.mark.timeout(120)
D = jax.devices()
KEY = b"elastic-views-test-key-0123456789"
OPTS = Options(timeout_s=20.0, chunk_bytes=64, staging_bytes=512, max_group_ops=4, secret=KEY)
G = globals_()
FSDP = NamedSharding(Mesh(np.array(D[:4]), ("f",)), P("f"))
SERVER = Mesh(np.array(D[4:8]).reshape(2, 2), ("dp", "tp"))
SHARDINGS = {k: NamedSharding(SERVER, P(*s)) for k, s in SPECS.items()}
PARAMS = {n: views.param(f"['{n}']", a.shape, "float32") for n, a in G.items()}
RECIPE = {"w": None, "c": None, **build(views, PARAMS)}


def params(v: int) -> dict:
    return {n: jax.device_put(a + v, FSDP) for n, a in G.items()}


def refs(v: int) -> dict[str, np.ndarray]:
    return references({n: a + v for n, a in G.items()})


def like(**dtypes) -> dict:
    """The server's abstract tree: each leaf the reference's shape and dtype (or the one given)."""
    return {k: jax.ShapeDtypeStruct(r.shape, dtypes.get(k, r.dtype), sharding=SHARDINGS[k]) for k, r in refs(0).items()}


def check(tree: dict, v: int, **dtypes) -> int:
    """Compare every shard of ``tree`` with numpy bit for bit; the number of shards compared."""
    want = refs(v)
    if "c" in dtypes:  # the c leaf kept in float32: the trainer's own bits
        want["c"] = (G["c"] + v).astype(dtypes["c"])
    n = 0
    for name, ref in want.items():
        leaf = tree[name]
        assert leaf.sharding == SHARDINGS[name] and leaf.dtype == ref.dtype and leaf.shape == ref.shape, name
        for s in leaf.addressable_shards:
            np.testing.assert_array_equal(bits(np.asarray(s.data)), bits(ref[s.index]), err_msg=name)
            n += 1
    return n


# ---- the brute-force bounds, from the layouts alone ---------------------------------------------
def _shifted(lay: Layout, by: int) -> Layout:
    return Layout.from_boxes(lay.shape, lay.dtype, {r + by: b for r, b in zip(lay.ranks, lay.boxes, strict=True)})


def _domains(processes: int) -> Topology:
    """Ranks 0-3 the source (one domain: it holds nothing a replica needs), ranks 4-7 the replica, each of
    its ``processes`` its own fast-link domain (as elastic plans a replica of several processes)."""
    per = 4 // processes
    return Topology.from_domains({r: 0 if r < 4 else 1 + (r - 4) // per for r in range(8)})


def trainer_bound(processes: int = 1, **dtypes) -> int:
    """Trainer (ranks 0-3: devices 0-3) -> a replica (ranks 4-7: devices 4-7)."""
    tree = {"w": PARAMS["w"], "c": views.astype(PARAMS["c"], dtypes.get("c", "bfloat16")), **build(views, PARAMS)}
    src = {f"['{n}']": Layout.from_sharding(FSDP, a.shape, "float32") for n, a in G.items()}
    dsts = {k: Layout.from_sharding(SHARDINGS[k], v.shape, v.dtype) for k, v in tree.items()}
    return network_bound(tree, lambda lf: src[lf.source.name], dsts, _domains(processes))


def peer_bound(processes: int = 1) -> int:
    """A replica (its devices 4-7 as ranks 0-3) -> an identical one (ranks 4-7): its arrays, as they are."""
    want = refs(0)
    tree = {k: views.param(k, r.shape, r.dtype.name) for k, r in want.items()}
    lays = {k: Layout.from_sharding(SHARDINGS[k], r.shape, r.dtype.name) for k, r in want.items()}
    return network_bound(tree, lambda lf: _shifted(lays[lf.source.name], -4), lays, _domains(processes))


# ---- the bytes the engine sent --------------------------------------------------------------------
class Sent:
    """Records the network bytes every sender's ``run_pair`` sent (the trainer's and the serving peers')."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.by: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        real = pairs_module.run_pair
        for module, who in ((membership_module, "trainer"), (replica_module, "replica")):

            def spy(pair, process, channels, *, shards, options, who=who, **kw):
                out, stats = real(pair, process, channels, shards=shards, options=options, **kw)
                if process < pair.n_src:  # a sender
                    with self._lock:
                        self.by.append((who, int(stats.sent_bytes.get(Link.NETWORK, 0))))
                return out, stats

            monkeypatch.setattr(module, "run_pair", spy)

    def take(self) -> list[tuple[str, int]]:
        with self._lock:
            out, self.by = self.by, []
        return out


def join(trainer: ElasticTrainer, name: str, tree: dict, recipe=RECIPE) -> ElasticReplica:
    return ElasticReplica(tree, trainer.address, name=name, devices=list(D[4:8]), options=OPTS, recipe=recipe)


def test_replicas_with_a_recipe_and_a_bfloat16_like_join_catch_up_from_a_peer_and_take_every_version(monkeypatch):
    sent = Sent(monkeypatch)
    tb, pb = trainer_bound(), peer_bound()
    assert tb > 0 and pb > 0
    with ElasticTrainer(params(0), devices=list(D[:4]), options=OPTS) as trainer:
        r1 = join(trainer, "r1", like())
        trainer.wait(count=1)
        trainer.push(params(1), version=1)
        tree, v = r1.pull()
        assert v == 1 and check(tree, 1) == 6 * 4  # every destination shard of every case
        assert sent.take() == [("trainer", tb)]
        # an identical replica (same like, same recipe) copies version 1 from r1, as plain arrays
        r2 = join(trainer, "r2", like())
        tree2, v2 = r2.pull()
        assert v2 == 1 and check(tree2, 1) == 6 * 4
        assert r2.arrivals[-1].source == "replica 'r1'"
        assert sent.take() == [("replica", pb)]
        # another declaration (c kept in float32): no peer holds its tensors, so the trainer serves it
        r3 = join(trainer, "r3", like(c=jnp.float32))
        tree3, v3 = r3.pull()
        assert v3 == 1 and check(tree3, 1, c=np.float32) == 6 * 4
        assert r3.arrivals[-1].source == "trainer"
        tb3 = trainer_bound(c="float32")
        assert sent.take() == [("trainer", tb3)] and tb3 > tb  # c crosses in float32, not bfloat16
        report = trainer.push(params(2), version=2)
        assert sorted(report.committed) == ["r1", "r2", "r3"] and not report.lost
        for r, kw in ((r1, {}), (r2, {}), (r3, {"c": np.float32})):
            tree, v = r.pull(newer_than=1)
            assert v == 2 and check(tree, 2, **kw) == 6 * 4
        assert sorted(sent.take()) == sorted([("trainer", tb), ("trainer", tb), ("trainer", tb3)])
        assert tree2["qkv"].dtype == jnp.bfloat16 and r1.version == 2  # r2's version 1 tree is untouched
        assert check(tree2, 1) == 6 * 4
        for r in (r1, r2, r3):
            r.leave()


def test_a_bad_replica_declaration_is_refused_listing_every_problem_and_the_trainer_serves_on(monkeypatch):
    sent = Sent(monkeypatch)
    with ElasticTrainer(params(0), devices=list(D[:4]), options=OPTS) as trainer:
        r1 = join(trainer, "r1", like())
        trainer.wait(count=1)
        trainer.push(params(1), version=1)
        sent.take()
        # q read with another shape, a parameter the trainer does not have, a dtype views cannot cast to
        bad = dict(PARAMS, q=views.param("['q']", (16, 12), "float32"), k=views.param("['kk']", (16, 4), "float32"))
        with pytest.raises(LayoutMismatchError, match=r"\(4 problems; nothing moved\)") as err:
            join(trainer, "bad", like(c=jnp.int32), recipe={"w": None, "c": None, **build(views, bad)})
        msg = str(err.value)
        assert "parameter ['c']: source dtype float32 cannot be cast to destination dtype int32" in msg
        assert "recipe leaf ['qkv']: it reads source parameter ['q'] as shape (16, 12), but the source declares" in msg
        assert "recipe leaf ['qkv']: it reads ['kk'], which the source side does not declare" in msg
        assert "parameter ['k'] is declared by the source side only" in msg
        assert sent.take() == []  # nothing moved
        assert set(trainer.replicas()) == {"r1"} and trainer.replicas(include_gone=True).keys() == {"r1"}
        report = trainer.push(params(2), version=2)
        assert report.committed == ("r1",) and not report.lost
        tree, v = r1.pull(newer_than=1)
        assert v == 2 and check(tree, 2) == 6 * 4
        assert sent.take() == [("trainer", trainer_bound())]
        r1.leave()


def test_a_recipe_that_is_not_shaped_like_the_tree_is_refused_before_connecting():
    with ElasticTrainer(params(0), devices=list(D[:4]), options=OPTS) as trainer:
        with pytest.raises(ValueError, match="the recipe does not have the structure of the parameters"):
            join(trainer, "r1", like(), recipe={"qkv": RECIPE["qkv"]})
        assert trainer.replicas() == {}


def test_with_the_trainers_copy_deleted_only_a_joiner_of_a_peers_form_is_served(monkeypatch):
    from jreshard import PeerError

    sent = Sent(monkeypatch)
    with ElasticTrainer(params(0), devices=list(D[:4]), options=OPTS, catch_up=CatchUp.TRAINER) as trainer:
        r1 = join(trainer, "r1", like())
        trainer.wait(count=1)
        p = params(1)
        trainer.push(p, version=1)
        for a in p.values():
            a.delete()  # as a donating train step would
        sent.take()
        r2 = join(trainer, "r2", like())  # r1's form: served by r1 though the trainer prefers itself
        tree, v = r2.pull()
        assert v == 1 and check(tree, 1) == 6 * 4 and r2.arrivals[-1].source == "replica 'r1'"
        assert sent.take() == [("replica", peer_bound())]
        r3 = join(trainer, "r3", like(c=jnp.float32))  # no replica holds its tensors, the trainer's are gone
        with pytest.raises(PeerError, match="the trainer's connection closed"):  # dropped: not a timeout
            r3.pull(timeout_s=10.0)
        why = trainer.replicas(include_gone=True)["r3"].error
        assert why == "no live replica of its declaration holds version 1 and the trainer's copy was deleted (donated)"
        assert sent.take() == [] and sorted(trainer.replicas()) == ["r1", "r2"]
        report = trainer.push(params(2), version=2)
        assert sorted(report.committed) == ["r1", "r2"]
        for r in (r1, r2):
            tree, v = r.pull(newer_than=1)
            assert v == 2 and check(tree, 2) == 6 * 4
            r.leave()


def test_a_views_refit_that_breaks_midway_leaves_the_previous_version(monkeypatch):
    from jreshard import PeerError

    with ElasticTrainer(params(0), devices=list(D[:4]), options=OPTS) as trainer:
        r1 = join(trainer, "r1", like())
        trainer.wait(count=1)
        trainer.push(params(1), version=1)
        held, _ = r1.pull()
        break_the_trainers_send(monkeypatch, after=3)  # the trainer's side stops after its first exchanges of version 2
        report = trainer.push(params(2), version=2)
        assert report.committed == () and "during version 2" in report.lost["r1"]
        with pytest.raises(PeerError, match="r1"):
            r1.pull(newer_than=1)
        tree, v = r1.pull(allow_stale=True)  # dropped: stale, handed out only when asked
        assert v == 1 and tree is held and check(tree, 1) == 6 * 4  # every shard still version 1's bits
        r1.leave()


def _decls(tree: dict, recipe=RECIPE) -> list[dict]:
    from jreshard.refit.decl import declare_local

    return [declare_local("destination", tree, list(D[4:8]), None, recipe)]


def test_the_catch_up_choice_takes_only_a_peer_of_the_joiners_form():
    from jreshard.refit.decl import declare_local

    trainer = [declare_local("source", params(0), list(D[:4]), None)]
    same, other = _decls(like()), _decls(like(c=jnp.float32))
    flipped = dict(RECIPE, m_w=views.quantize_fp8(PARAMS["m"], block=(8, 8))[0])  # another recipe, same dtypes
    assert pairs_module.same_form(same, _decls(like())) and not pairs_module.same_form(same, other)
    assert not pairs_module.same_form(same, _decls(like(), flipped))
    links: dict[str, float] = {}
    for prefer in CatchUp:
        got = pairs_module.choose_source(prefer, trainer, {"p": other}, same, OPTS, links)
        assert got is None, prefer  # a peer of another form never serves, even when preferred
        assert pairs_module.choose_source(prefer, None, {"p": other}, same, OPTS, links) is None
    assert pairs_module.choose_source(CatchUp.PEER, trainer, {"p": other, "q": same}, same, OPTS, links) == "q"
    assert pairs_module.choose_source(CatchUp.TRAINER, trainer, {"q": same}, same, OPTS, links) is None
    # AUTO compares the cost model's predictions: the views from the trainer and the peer's plain arrays
    from_trainer = pairs_module.pair_plan(trainer, same, OPTS, links)
    from_peer = pairs_module.pair_plan(same, same, OPTS, links, peer=True)
    assert from_trainer.views is not None and from_peer.views is None  # the peer's pair is plain arrays
    t, p = from_trainer.predicted_seconds(), from_peer.predicted_seconds()
    assert t > 0 and p > 0
    # the views' prediction reads the schedule's chunks: the bytes the bound counts, at the network rate
    from jreshard.cost import Port
    from jreshard.refit.views import predict_group

    pv = from_trainer.views
    pred = predict_group(pv.schedule, pv.lowerings, from_trainer.topology, from_trainer.options)
    assert pred.seconds == t and pred.bottleneck_port in (Port.NETWORK_SEND, Port.NETWORK_RECV)
    rates = from_trainer.topology.links
    wire = sum(
        w.nbytes
        for st in pv.schedule.schedule.steps.values()
        for x in st.values()
        for w in x.sends
        if w.link is Link.NETWORK
    )
    assert wire == trainer_bound() == sum(low.network_bytes for low in pv.lowerings)
    assert pred.busy_seconds >= wire / 4 / rates.network_bw  # at best spread over the 4 receiving NICs
    want = "q" if p <= t * 1.01 else None
    assert pairs_module.choose_source(CatchUp.AUTO, trainer, {"q": same}, same, OPTS, links) == want
    assert pairs_module.choose_source(CatchUp.AUTO, None, {"q": same}, same, OPTS, links) == "q"


# ---- separate programs ------------------------------------------------------------------------------
@pytest.fixture
def programs():
    from test_elastic import Program

    started: list = []

    def start(*args: str, env: dict[str, str]):
        p = Program(*args, env=env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


@pytest.mark.timeout(240)
def test_a_trainer_of_two_processes_and_replicas_of_one_and_two_with_views_between_programs(
    tmp_path, programs, held_port
):
    """A trainer of two processes (two devices each, FSDP over the four) and replicas that are programs of
    their own (four devices, TP2 x DP2, the recipe and bfloat16 / FP8 like): r1 (one process) takes version 1
    from both trainer processes; r2 (two processes, one DP row each) joins and copies version 1 from r1 as
    plain arrays; both take version 2. Every shard bit-exact; the network bytes of each sender (summed over
    the trainer's processes) the bound, each process of r2 its own fast-link domain."""
    address = str(tmp_path / "address")
    cluster = {"JAX_NUM_CPU_DEVICES": "2", "JRESHARD_COORDINATOR": f"127.0.0.1:{held_port()}"}
    cluster["JRESHARD_PROCESSES"] = "2"
    trainer = [programs("views.py", "trainer", address, env=cluster | {"JRESHARD_PROCESS": str(i)}) for i in (0, 1)]
    r1 = programs("views.py", "replica", address, "r1", env={"JAX_NUM_CPU_DEVICES": "4"})
    trainer[0].wait_event("join-now", timeout_s=180)
    two = {"JAX_NUM_CPU_DEVICES": "2", "JRESHARD_COORDINATOR": f"127.0.0.1:{held_port()}", "JRESHARD_PROCESSES": "2"}
    r2 = [programs("views.py", "replica", address, "r2", env=two | {"JRESHARD_PROCESS": str(i)}) for i in (0, 1)]
    lead, follow = trainer[0].result(), trainer[1].result()
    assert lead["at1"] == ["r1", "r2"] and lead["joined"] == {"r1": "trainer", "r2": "replica 'r1'"}
    assert lead["committed1"] == ["r1"] and lead["committed2"] == ["r1", "r2"]
    tb1, tb2 = trainer_bound(), trainer_bound(processes=2)
    assert tb2 > tb1 > 0  # r2's two processes each take their own copy
    assert lead["sent"]["1"] + follow["sent"]["1"] == tb1  # both trainer processes sent their shards
    assert lead["sent"]["1"] > 0 and follow["sent"]["1"] > 0
    assert lead["sent"]["2"] + follow["sent"]["2"] == tb1 + tb2
    one, (two0, two1) = r1.result(), (p.result() for p in r2)
    assert [r["process"] for r in (one, two0, two1)] == [0, 0, 1]
    for r, shards in ((one, 6 * 4), (two0, 6 * 2), (two1, 6 * 2)):
        assert r["bad"] == [], (r["name"], r["bad"])
        assert r["checked"] == {"1": shards, "2": shards}, r["name"]
        assert "the trainer closed" in r["end"]
    assert one["arrivals"] == [[1, "trainer"], [2, "trainer"]]
    assert two0["arrivals"] == two1["arrivals"] == [[1, "replica 'r1'"], [2, "trainer"]]
    assert one["served"] == peer_bound(processes=2) > 0 and two0["served"] == two1["served"] == 0
