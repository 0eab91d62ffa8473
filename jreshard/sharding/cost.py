"""Cost model: the predicted time of a plan, its bottleneck, and a lower bound.

Every number here is a *prediction* of a model, never a measurement.

**The machine.** Every rank has five independent ports, each a server that
works through its load at a fixed rate (``Topology.links``):

=================  =========================================  ==============
port               load                                       rate
=================  =========================================  ==============
``NETWORK_SEND``   bytes the rank sends over the network       ``network_bw``
``NETWORK_RECV``   bytes it receives over the network          ``network_bw``
``FAST_SEND``      bytes it sends over fast links              ``fast_bw``
``FAST_RECV``      bytes it receives over fast links           ``fast_bw``
``SAME_DEVICE``    bytes copied into its buffers on its device ``same_device_bw``
=================  =========================================  ==============

The NIC is full duplex (send and receive are separate ports), and so is the
fast link. Every message (all pieces one sender sends one receiver at one stage,
see ``plan.py``) costs one ``latency_s`` on the sender's send port and on the
receiver's receive port: a message's chunks stream back to back, so its latency
is paid once.

**Busy time.** For rank ``r`` and port ``p`` with ``B[r, p]`` bytes and
``M[r, p]`` messages::

    busy[r, p] = B[r, p] / bw[p] + M[r, p] * latency_s

**Pipeline.** Messages are cut into chunks of ``C = plan.options.chunk_bytes``
and the stages of a plan (stage ``s`` forwards what arrived at stage ``s - 1``:
a landing, then relays along a chain of domains, then fast-link fan-out) run as
a pipeline over chunks: the fan-out of chunk ``k`` runs while chunk ``k + 1``
crosses the network. A pipeline of ``S`` stages, stage ``s`` taking ``c_s`` per
chunk, moving ``K`` chunks, ends after ``Σ_s c_s + (K - 1) max_s c_s``: the
first chunk goes through every stage, then the slowest stage sets the pace.
With ``K max_s c_s`` the busy time of the slowest port, that is::

    predicted = max_{r,p} busy[r, p]  +  fill
    fill      = Σ_s c_s - max_s c_s
    c_s       = latency_s + min(C, m_s) / bw_s

where ``m_s`` is the largest message of stage ``s`` (a smaller message is one
short chunk) and ``bw_s`` is the slowest link kind stage ``s`` uses. A plan of one
stage has no fill; a chain of ``h`` network hops adds about ``h - 1`` network
chunk times.

**Lower bound.** The same per-port loads under perfect balance: inside each
fast-link domain ``G``, spread the busy time of each port kind evenly over the
``n_G`` ranks of ``G`` that take part in the plan (hold a source or a
destination box, or move bytes)::

    bound = max_{G, p} (Σ_{r in G} busy[r, p]) / n_G

Since a maximum is never below a mean and ``fill >= 0``, ``predicted >= bound``
for every plan; the two are equal when the busiest port of a perfectly balanced
plan has no pipeline to fill.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from jreshard.errors import TopologyError
from jreshard.sharding.plan import Plan
from jreshard.sharding.topology import Link, Topology

__all__ = ["LoadTable", "Port", "Prediction", "predict", "predict_loads"]


class Port(enum.IntEnum):
    """One of a rank's independent links, in one direction."""

    NETWORK_SEND = 0
    NETWORK_RECV = 1
    FAST_SEND = 2
    FAST_RECV = 3
    SAME_DEVICE = 4

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", " ")


# (port, link kind, which row column owns the load)
_PORTS = (
    (Port.NETWORK_SEND, Link.NETWORK, "src"),
    (Port.NETWORK_RECV, Link.NETWORK, "dst"),
    (Port.FAST_SEND, Link.FAST, "src"),
    (Port.FAST_RECV, Link.FAST, "dst"),
    (Port.SAME_DEVICE, Link.SAME_DEVICE, "dst"),
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """The predicted time of a plan under the model of the module docstring.

    Attributes:
      seconds: predicted time of the whole plan: ``busy_seconds + fill_seconds``.
      bound_seconds: predicted lower bound: the same loads perfectly balanced
        inside each domain.
      busy_seconds: busy time of the bottleneck port.
      fill_seconds: pipeline fill over the plan's stages.
      bottleneck_rank: the rank whose port is busiest (``None`` for an empty plan).
      bottleneck_port: that port (``None`` for an empty plan).
      bottleneck_bytes: the bytes that port moves.
      stages: the plan's dependency stages.
      port_seconds: per port, the busy time of the busiest rank on it.
    """

    seconds: float
    bound_seconds: float
    busy_seconds: float
    fill_seconds: float
    bottleneck_rank: int | None
    bottleneck_port: Port | None
    bottleneck_bytes: int
    stages: int
    port_seconds: tuple[tuple[Port, float], ...]

    def __str__(self) -> str:
        where = (
            "nothing moves"
            if self.bottleneck_port is None
            else f"bottleneck rank {self.bottleneck_rank} {self.bottleneck_port.label}"
        )
        return (
            f"predicted {self.seconds * 1e3:.3f} ms (predicted bound {self.bound_seconds * 1e3:.3f} ms; "
            f"{where}, pipeline fill {self.fill_seconds * 1e3:.3f} ms over {self.stages} stages)"
        )


def _rates(topology: Topology) -> dict[Link, float]:
    lk = topology.links
    return {Link.NETWORK: lk.network_bw, Link.FAST: lk.fast_bw, Link.SAME_DEVICE: lk.same_device_bw}


def _check_topology(plan: Plan, topology: Topology) -> None:
    """The rows' link kinds come from ``plan.topology``: the domains and devices
    of ``topology`` must agree with it on every rank the plan uses."""
    if topology is plan.topology:
        return
    ranks = sorted({r for t in plan.tensors for r in (*t.src.ranks, *t.dst.ranks)})
    topology.check_ranks(ranks, "the plan")
    a, b = plan.topology, topology
    for r in ranks:
        if (a.domain_of(r), a.device_of(r)) != (b.domain_of(r), b.device_of(r)):
            raise TopologyError(
                f"predict: rank {r} is in domain {b.domain_of(r)} (device {b.device_of(r)}) of topology but in "
                f"domain {a.domain_of(r)} (device {a.device_of(r)}) of the plan's topology; the fix is to plan "
                "with this topology, or to change only its links: dataclasses.replace(plan.topology, links=...)"
            )


def predict(plan: Plan, topology: Topology | None = None) -> Prediction:
    """Predict the time of ``plan`` on ``topology`` (module docstring has the derivation).

    Args:
      plan: a plan (jreshard's or a baseline's).
      topology: domains must match ``plan.topology``; its ``links`` give the
        rates. Defaults to ``plan.topology``.

    Returns:
      A :class:`Prediction`; every number in it is predicted, not measured.

    Raises:
      TopologyError: ``topology`` puts a rank of the plan in another domain or device.

    Example:
      >>> import numpy as np, jreshard
      >>> src = jreshard.Layout.from_mesh(np.arange(2), ("ep",), ("ep",), (4, 1000), "float32")
      >>> dst = jreshard.Layout.from_mesh(np.arange(2, 4), ("tp",), (None, "tp"), (4, 1000), "float32")
      >>> topo = jreshard.Topology.uniform(range(4), domain_size=2, network_bw=1e9, latency_s=0.0)
      >>> p = predict(jreshard.plan(src, dst, topo))
      >>> round(p.seconds * 1e6, 3), round(p.bound_seconds * 1e6, 3), p.bottleneck_port.label
      (8.0, 8.0, 'network send')
    """
    topology = plan.topology if topology is None else topology
    _check_topology(plan, topology)
    c = plan._columns
    layout_ranks = {r for t in plan.tensors for r in (*t.src.ranks, *t.dst.ranks)}
    ranks = np.union1d(
        np.fromiter(layout_ranks, dtype=np.int64, count=len(layout_ranks)), np.union1d(c["src"], c["dst"])
    )
    acc = LoadTable.empty(ranks)
    acc.add(c["src"], c["dst"], c["link"], c["stage"], c["nbytes"])
    return predict_loads(acc, topology, int(plan.options.chunk_bytes))


class LoadTable:
    """Per-rank, per-port bytes and the distinct messages of a plan, added up row block by row block.

    The cost model needs only these, so a plan too large to hold (every row of every tensor
    of a 4096 + 4096 refit) can be predicted from its tensors' rows one block at a time.
    A message is a distinct ``(stage, sender, receiver)`` among the rows that leave their device.
    """

    def __init__(self, ranks: np.ndarray):
        self.ranks = ranks
        self.load = np.zeros((len(Port), len(ranks)), dtype=np.int64)
        self._codes: list[np.ndarray] = []
        self._links: list[np.ndarray] = []
        self._bytes: list[np.ndarray] = []
        self.stages = 0

    @classmethod
    def empty(cls, ranks: np.ndarray) -> LoadTable:
        return cls(np.asarray(ranks, dtype=np.int64))

    def add(
        self, src: np.ndarray, dst: np.ndarray, link: np.ndarray, stage: np.ndarray, nbytes: np.ndarray, times: int = 1
    ) -> None:
        """Add rows (columns as in :class:`~jreshard.sharding.rows.TensorPlan`), each ``times`` times."""
        if not len(src):
            return
        n = len(self.ranks)
        si, di = np.searchsorted(self.ranks, src), np.searchsorted(self.ranks, dst)
        w = nbytes * times
        for port, lk, who in _PORTS:
            m = link == lk
            self.load[port] += np.bincount((si if who == "src" else di)[m], weights=w[m], minlength=n).astype(np.int64)
        remote = link != Link.SAME_DEVICE
        code = (stage[remote].astype(np.int64) * n + si[remote]) * n + di[remote]
        keys, inv = np.unique(code, return_inverse=True)
        mlink = np.zeros(len(keys), dtype=np.int8)
        mlink[inv] = link[remote]
        self._codes.append(keys)
        self._links.append(mlink)
        self._bytes.append(np.bincount(inv, weights=w[remote], minlength=len(keys)))
        self.stages = max(self.stages, int(stage.max()) + 1)

    def messages(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(codes, links, bytes)`` of the distinct messages, codes ``(stage * n + src) * n + dst``."""
        if not self._codes:
            return np.zeros(0, np.int64), np.zeros(0, np.int8), np.zeros(0)
        codes = np.concatenate(self._codes)
        keys, inv = np.unique(codes, return_inverse=True)
        lk = np.zeros(len(keys), dtype=np.int8)
        lk[inv] = np.concatenate(self._links)
        return keys, lk, np.bincount(inv, weights=np.concatenate(self._bytes), minlength=len(keys))


def predict_loads(acc: LoadTable, topology: Topology, chunk: int) -> Prediction:
    """The :class:`Prediction` of the loads and messages in ``acc`` (the module docstring's model)."""
    rate = _rates(topology)
    lat = float(topology.links.latency_s)
    ranks = acc.ranks
    n = len(ranks)
    mkeys, mlink, mbytes = acc.messages()
    mstage = mkeys // (n * n)
    msrc = (mkeys // n) % n
    mdst = mkeys % n

    # busy[r, p] = B[r, p] / bw[p] + M[r, p] * latency
    busy = np.zeros((len(Port), n))
    load = acc.load
    for port, lk, who in _PORTS:
        busy[port] = load[port] / rate[lk]
        if lk != Link.SAME_DEVICE:
            mm = mlink == lk
            count = np.bincount((msrc if who == "src" else mdst)[mm], minlength=n)
            busy[port] += count * lat

    if not busy.any():
        return Prediction(
            seconds=0.0,
            bound_seconds=0.0,
            busy_seconds=0.0,
            fill_seconds=0.0,
            bottleneck_rank=None,
            bottleneck_port=None,
            bottleneck_bytes=0,
            stages=acc.stages,
            port_seconds=tuple((p, 0.0) for p in Port),
        )
    # Ties go to the lowest port, then the lowest rank: deterministic.
    flat = int(np.argmax(busy))
    p_star, r_star = divmod(flat, n)
    busy_max = float(busy[p_star, r_star])

    # fill = Σ_s c_s - max_s c_s, c_s = latency + min(C, m_s) / bw_s (slowest link of stage s)
    costs = []
    for s in np.unique(mstage).tolist():
        at = mstage == s
        slowest = min(rate[Link(int(k))] for k in np.unique(mlink[at]).tolist())
        costs.append(lat + min(chunk, float(mbytes[at].max())) / slowest)
    fill = float(sum(costs) - max(costs)) if costs else 0.0

    # bound = max_{G,p} Σ_{r in G} busy[r, p] / n_G
    dom = np.array([topology.domain_of(int(r)) for r in ranks], dtype=np.int64)
    doms, dinv = np.unique(dom, return_inverse=True)
    n_g = np.bincount(dinv, minlength=len(doms))
    bound = max(float((np.bincount(dinv, weights=busy[p], minlength=len(doms)) / n_g).max()) for p in Port)

    return Prediction(
        seconds=busy_max + fill,
        bound_seconds=bound,
        busy_seconds=busy_max,
        fill_seconds=fill,
        bottleneck_rank=int(ranks[r_star]),
        bottleneck_port=Port(p_star),
        bottleneck_bytes=int(load[p_star, r_star]),
        stages=acc.stages,
        port_seconds=tuple((p, float(busy[p].max())) for p in Port),
    )
