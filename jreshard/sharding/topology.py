"""Topology: which ranks share a device, which share a fast-link domain, and
the link bandwidths the cost model uses.

A *domain* is a set of ranks joined by fast links (NVLink: the 8 GPUs of a DGX
node, the 72 of an NVL72 rack; the CPU devices of one host). Between domains is
the network, one NIC per rank. Ranks that share a device (a colocated trainer
and inference engine) copy on that device; they must be in the same domain.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import numbers
from collections.abc import Iterable, Mapping, Sequence

from jreshard.errors import LayoutJSONError, TopologyError

__all__ = ["Link", "Links", "Topology"]


class Link(enum.IntEnum):
    """How bytes move between two ranks."""

    SAME_DEVICE = 0  # a memory copy on one device
    FAST = 1  # same fast-link domain: NVLink, or shared host memory
    NETWORK = 2  # different domains: through the NICs


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Links:
    """Per-rank link speeds used by the cost model (bytes per second, seconds).

    The defaults describe an H100/H200 DGX-class node: a 400 Gb/s NIC per GPU
    (50 GB/s each way), NVLink at 450 GB/s each way, and a device copy at
    1.5 TB/s. They are model inputs, not measurements.
    """

    network_bw: float = 50e9
    fast_bw: float = 450e9
    same_device_bw: float = 1.5e12
    latency_s: float = 5e-6

    def __post_init__(self) -> None:
        for f in ("network_bw", "fast_bw", "same_device_bw"):
            v = getattr(self, f)
            if not v > 0:
                raise TopologyError(f"Links: {f}={v!r} must be a positive number of bytes per second")
        if not self.latency_s >= 0:
            raise TopologyError(f"Links: latency_s={self.latency_s!r} must be >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class Topology:
    """Ranks, their fast-link domains and devices, and link speeds.

    Args:
      ranks: every rank, ascending.
      domains: ``domains[i]`` is the domain id of ``ranks[i]``.
      devices: ``devices[i]`` is a device key; ranks with equal keys share a device.
      links: link speeds for the cost model.

    Example:
      >>> topo = Topology.uniform(range(8), domain_size=4)
      >>> topo.domain_of(5), topo.link(0, 3).name, topo.link(3, 4).name
      (1, 'FAST', 'NETWORK')
    """

    ranks: tuple[int, ...]
    domains: tuple[int, ...]
    devices: tuple[int, ...]
    links: Links = Links()
    _hash: int = dataclasses.field(init=False, repr=False, compare=False, default=0)
    _domain: dict[int, int] = dataclasses.field(init=False, repr=False, compare=False, default_factory=dict)
    _device: dict[int, int] = dataclasses.field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("ranks", "domains", "devices"):
            _check_ints(getattr(self, name), f"Topology: {name}")
        order = sorted(range(len(self.ranks)), key=lambda i: int(self.ranks[i]))
        ranks = tuple(int(self.ranks[i]) for i in order)
        domains = tuple(int(self.domains[i]) for i in order)
        devices = tuple(int(self.devices[i]) for i in order)
        if not (len(self.ranks) == len(self.domains) == len(self.devices)):
            raise TopologyError(
                f"Topology: {len(self.ranks)} ranks, {len(self.domains)} domains, {len(self.devices)} devices"
            )
        if len(set(ranks)) != len(ranks):
            dup = sorted({r for r in ranks if ranks.count(r) > 1})
            raise TopologyError(f"Topology: ranks {dup} are listed more than once")
        domain = dict(zip(ranks, domains, strict=True))
        device = dict(zip(ranks, devices, strict=True))
        dev_domain: dict[int, int] = {}
        for r in ranks:
            d = dev_domain.setdefault(device[r], domain[r])
            if d != domain[r]:
                raise TopologyError(
                    f"Topology: rank {r} shares device {device[r]} with a rank of domain {d} "
                    f"but is in domain {domain[r]}; ranks on one device must be in one domain"
                )
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "domains", domains)
        object.__setattr__(self, "devices", devices)
        object.__setattr__(self, "_domain", domain)
        object.__setattr__(self, "_device", device)
        object.__setattr__(self, "_hash", hash((ranks, domains, devices, self.links)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return (self.ranks, self.domains, self.devices, self.links) == (
            other.ranks,
            other.domains,
            other.devices,
            other.links,
        )

    # ----- constructors -------------------------------------------------
    @classmethod
    def from_domains(
        cls,
        domains: Mapping[int, int],
        *,
        devices: Mapping[int, int] | None = None,
        **links: float,
    ) -> Topology:
        """Explicit fast-link domains: ``{rank: domain_id}``.

        Args:
          domains: the domain of every rank.
          devices: optional ``{rank: device_key}``; ranks with one key share a
            device. By default every rank is its own device.
          **links: overrides of :class:`Links` fields (``network_bw=...``).
        """
        if not isinstance(domains, Mapping):
            raise TypeError(
                f"Topology.from_domains: domains={domains!r} is a {type(domains).__name__}; "
                "expected {rank: domain_id}"
            )
        if devices is not None and not isinstance(devices, Mapping):
            raise TypeError(
                f"Topology.from_domains: devices={devices!r} is a {type(devices).__name__}; "
                "expected {rank: device_key}"
            )
        _check_ints(domains.keys(), "Topology.from_domains: the ranks (keys) of domains")
        _check_ints(domains.values(), "Topology.from_domains: the domain ids (values) of domains")
        if devices:
            _check_ints(devices.values(), "Topology.from_domains: the device keys (values) of devices")
        ranks = tuple(domains)
        dev = devices or {}
        missing = [r for r in dev if r not in domains]
        if missing:
            raise TopologyError(f"Topology.from_domains: devices names ranks {missing} that have no domain")
        # A rank without a device key gets a key of its own (never equal to a given one).
        base = max(dev.values(), default=-1) + 1
        return cls(
            ranks,
            tuple(domains[r] for r in ranks),
            tuple(dev.get(r, base + i) for i, r in enumerate(ranks)),
            Links(**links),
        )

    @classmethod
    def uniform(cls, ranks: Iterable[int], domain_size: int, **links: float) -> Topology:
        """Consecutive blocks of ``domain_size`` ranks form one domain each.

        Ranks are taken in the order given: ``ranks[i]`` is in domain ``i // domain_size``.
        """
        ranks = tuple(ranks)
        _check_ints(ranks, "Topology.uniform: ranks")
        if not _is_int(domain_size):
            raise TypeError(f"Topology.uniform: domain_size={domain_size!r} must be an int")
        if domain_size < 1:
            raise TopologyError(f"Topology.uniform: domain_size={domain_size} must be >= 1")
        if len(set(ranks)) != len(ranks):
            dup = sorted({r for r in ranks if ranks.count(r) > 1})
            raise TopologyError(f"Topology.uniform: ranks={_short(ranks)} lists ranks {dup} more than once")
        return cls.from_domains({r: i // domain_size for i, r in enumerate(ranks)}, **links)  # type: ignore[arg-type]

    @classmethod
    def from_devices(
        cls,
        devices: Sequence[object],
        *,
        rank_of: Mapping[object, int] | None = None,
        domain_of: Mapping[object, int] | None = None,
        **links: float,
    ) -> Topology:
        """From jax devices: one domain per host (``process_index``) by default.

        Args:
          devices: jax devices (anything with ``id`` and ``process_index``).
          rank_of: ``{device: rank}``; by default a device's rank is ``device.id``.
          domain_of: ``{device: domain}``; by default its ``process_index``.
          **links: overrides of :class:`Links` fields.
        """
        doms: dict[int, int] = {}
        devs: dict[int, int] = {}
        for d in devices:
            r = rank_of[d] if rank_of is not None else int(d.id)  # type: ignore[attr-defined]
            doms[r] = domain_of[d] if domain_of is not None else int(d.process_index)  # type: ignore[attr-defined]
            devs[r] = int(d.id)  # type: ignore[attr-defined]
        return cls.from_domains(doms, devices=devs, **links)  # type: ignore[arg-type]  # links are Links fields

    @staticmethod
    def check_arg(topology: object, name: str = "topology") -> None:
        """Raise TypeError unless ``topology`` is a :class:`Topology` or None (a string, a dict...).

        Example:
          >>> Topology.check_arg("abc")
          Traceback (most recent call last):
          ...
          TypeError: topology='abc' is a str; expected a jreshard.Topology or None
        """
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"{name}={topology!r} is a {type(topology).__name__}; expected a jreshard.Topology or None")

    # ----- queries ------------------------------------------------------
    def __contains__(self, rank: object) -> bool:
        return rank in self._domain

    def domain_of(self, rank: int) -> int:
        try:
            return self._domain[rank]
        except KeyError:
            raise TopologyError(f"rank {rank} is not in the topology (ranks {_short(self.ranks)})") from None

    def device_of(self, rank: int) -> int:
        try:
            return self._device[rank]
        except KeyError:
            raise TopologyError(f"rank {rank} is not in the topology (ranks {_short(self.ranks)})") from None

    def link(self, a: int, b: int) -> Link:
        """The link bytes take from rank ``a`` to rank ``b``."""
        if self.device_of(a) == self.device_of(b):
            return Link.SAME_DEVICE
        return Link.FAST if self.domain_of(a) == self.domain_of(b) else Link.NETWORK

    def check_ranks(self, ranks: Iterable[int], what: str) -> None:
        """Raise TopologyError naming the ranks of ``what`` missing from the topology."""
        missing = sorted({r for r in ranks if r not in self._domain})
        if missing:
            raise TopologyError(
                f"{what} uses ranks {_short(tuple(missing))} that are not in the topology "
                f"(topology ranks {_short(self.ranks)}); "
                "the fix is to build the topology over every rank of both layouts"
            )

    def bandwidth(self, link: Link) -> float:
        return {
            Link.SAME_DEVICE: self.links.same_device_bw,
            Link.FAST: self.links.fast_bw,
            Link.NETWORK: self.links.network_bw,
        }[link]

    # ----- JSON ---------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(
            {
                "ranks": list(self.ranks),
                "domains": list(self.domains),
                "devices": list(self.devices),
                "links": dataclasses.asdict(self.links),
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Topology:
        try:
            obj = json.loads(text)
            if isinstance(obj, dict) and isinstance(obj.get("links"), dict) and "local_bw" in obj["links"]:
                raise LayoutJSONError(
                    f"Topology.from_json: links has local_bw={obj['links']['local_bw']!r}, now named same_device_bw "
                    "(the rate of a copy on one device); the fix is to rename the key to same_device_bw"
                )
            return cls(tuple(obj["ranks"]), tuple(obj["domains"]), tuple(obj["devices"]), Links(**obj["links"]))
        except (TopologyError, LayoutJSONError):
            raise
        except (ValueError, KeyError, TypeError) as err:
            raise LayoutJSONError(f"Topology.from_json: cannot parse {str(text)[:200]!r}: {err}") from err


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_ints(values: Iterable[object], what: str) -> None:
    """Raise TypeError naming ``what`` and the first value that is not an int (bools and floats are not)."""
    for v in values:
        if not _is_int(v):
            raise TypeError(f"{what}: {v!r} is a {type(v).__name__}; expected an int")


def _short(ranks: tuple[int, ...]) -> str:
    return str(ranks) if len(ranks) <= 12 else f"({', '.join(map(str, ranks[:10]))}, ... {len(ranks)} in all)"
