"""When ``transfer_into`` may write in place, and how it takes an ``into`` array's memory: the rule, once.

Every path that writes into ``into`` (the in-process copies, the views, the engine's rounds in one
process, the repacked sub-byte and key leaves, the XLA computation) asks this module, in this order:

1. :func:`claim`: which ``into`` leaves may be written in place. One may when nothing else can
   observe its memory: it is live, holds bytes, and shares no buffer with any source leaf nor with an
   ``into`` leaf claimed before it (the same array twice). For each other leaf, why not
   (a :class:`~jreshard.report.NotInPlace`; ``None`` for a leaf with no byte to place).
2. :func:`donate`: the claimed arrays are consumed as ``jax.jit(..., donate_argnums=...)`` consumes its
   arguments (donated to an identity computation, one call per device assignment): the caller's
   array is deleted, the output owns the memory. jax hands the memory over only where it allocated it
   and nothing outside jax holds it; otherwise the output is a copy, in memory ``into`` never had.
3. :meth:`Taken.count`: every byte written into memory that was not ``into``'s is counted in the
   report (``not_in_place_bytes``) with its reason: the unclaimed leaves' fresh buffers, and the
   donations jax answered with a copy (:attr:`~jreshard.report.NotInPlace.NOT_HANDED_OVER`).

jax is imported when first needed: the engine's other paths (a receiver without jax) import this module too.

Reading shard addresses from jax builds a Python object per shard; :func:`remember` records the
addresses of the arrays jreshard returns, so the next call reads them back with one dictionary lookup.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from jreshard.report import NotInPlace, ReportBuilder
from jreshard.sharding.caches import cache
from jreshard.sharding.dtypes import storage_bytes
from jreshard.types import Array, Sharding

__all__ = [
    "Claims",
    "Taken",
    "addresses_of",
    "claim",
    "donate",
    "remember",
    "remember_all",
    "rewrapped",
    "shard_addresses",
    "shard_arrays",
    "shard_pointer",
    "source_addresses",
    "storage",
    "take",
    "with_weak_type",
]

Addresses = tuple[int, ...]  # one per addressable shard, ``addressable_data`` order; 0 for an empty shard


def shard_arrays(a: Array) -> Sequence[Any]:
    """The single-device arrays of ``a`` in ``addressable_data`` order."""
    try:
        return a._arrays  # jax's own list: no Shard objects built
    except AttributeError:  # pragma: no cover - other jax versions
        return [a.addressable_data(i) for i in range(len(a.addressable_shards))]


def device_shards(a: Array) -> list[tuple[Any, Any]]:
    """``(device, single-device array)`` of each addressable shard of ``a``: jax's own list of them
    (:func:`shard_arrays`: no Shard object built) beside the devices in the same order."""
    from jreshard.sharding.jax import addressable_order

    return list(zip(addressable_order(a.sharding), shard_arrays(a), strict=True))


def shard_pointer(a: Array) -> int:
    """The buffer address of a single-device array (0 when it holds no byte)."""
    return 0 if a.size == 0 else int(a.unsafe_buffer_pointer())


def shard_addresses(a: Array) -> Addresses:
    """The buffer addresses of ``a``'s addressable shards, read from jax."""
    return tuple(shard_pointer(s) for s in shard_arrays(a))


def storage(a: Array) -> int:
    """Bytes of ``a``'s addressable shards as its devices hold them (packed for sub-byte dtypes)."""
    return sum(storage_bytes(np.dtype(s.dtype), s.size) for s in shard_arrays(a))


# id -> (weakref, shard addresses, whether jax allocated the memory) of the arrays jreshard returned.
_KNOWN: dict[int, tuple[Any, Addresses, bool]] = {}
_SWEEP_AT = 4096


def remember(a: Array, ptrs: Sequence[int], by_jax: bool) -> None:
    """Record the shard addresses (``addressable_data`` order) of an array jreshard returns, and whether
    jax allocated its memory (a donated output) or jreshard's buffer pool did (a ``transfer`` result).

    Reading them back costs a dictionary lookup, where jax builds a Python object per shard. An
    entry is used only while its weak reference still gives the very same array; dead entries are
    dropped whenever the table has doubled since the last sweep.
    """
    remember_all([a], [ptrs], by_jax)


def remember_all(arrays: Sequence[Any], ptrs: Sequence[Sequence[int]], by_jax: bool) -> None:
    """:func:`remember` for many arrays (``ptrs[k]``: the addresses of ``arrays[k]``)."""
    global _SWEEP_AT
    known, ref = _KNOWN, weakref.ref
    for a, p in zip(arrays, ptrs, strict=True):
        known[id(a)] = (ref(a), tuple(p), by_jax)
    if len(known) > _SWEEP_AT:
        for key in [k for k, (r, _, _) in known.items() if r() is None]:
            del known[key]
        _SWEEP_AT = max(4096, 2 * len(known))


def addresses_of(a: Array) -> tuple[Addresses, bool]:
    """The shard addresses of ``a`` (``addressable_data`` order, 0 for an empty shard), and whether jax is
    known to have allocated them (an array jreshard returned from a donation)."""
    entry = _KNOWN.get(id(a))
    if entry is not None and entry[0]() is a:
        return entry[1], entry[2]
    return shard_addresses(a), False


@dataclasses.dataclass(frozen=True, slots=True)
class Claims:
    """The answer of :func:`claim`.

    Attributes:
      owned: ``{leaf: (shard addresses, allocated by jax)}`` of the ``into`` leaves that may be written in place.
      why: ``{leaf: reason}`` for the others (``None``: a leaf with no byte to place).
    """

    owned: dict[int, tuple[Addresses, bool]]
    why: dict[int, NotInPlace | None]


def claim(into: Sequence[Any], leaves: Sequence[int], sources: Collection[int]) -> Claims:
    """Which ``into[i]`` (for ``i`` in ``leaves``, in that order) may be written in place.

    One may when it is live, holds bytes, and shares no buffer address with ``sources`` (every
    source shard of the call: a buffer the call reads) nor with an ``into`` leaf claimed before it.

    Args:
      into: per leaf of the call, its ``into`` array.
      leaves: the leaves whose bytes move, in the order they are claimed.
      sources: buffer addresses of every source shard (0 is ignored).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> a, b = jnp.zeros(4), jnp.ones(4)
      >>> c = claim([a, a, b], [0, 1, 2], sources=set(shard_addresses(b)))
      >>> sorted(c.owned), [(i, why.name) for i, why in sorted(c.why.items())]
      ([0], [(1, 'SHARES_ANOTHER_INTO'), (2, 'SHARES_A_SOURCE')])
    """
    if all(not into[i].is_deleted() and into[i].size for i in leaves):
        entries = [addresses_of(into[i]) for i in leaves]
        flat = [p for addrs, _ in entries for p in addrs if p]
        distinct = set(flat)
        if len(distinct) == len(flat) and distinct.isdisjoint(sources):  # the steady state: all owned
            return Claims(dict(zip(leaves, entries, strict=True)), {})
    claimed: set[int] = set()
    owned: dict[int, tuple[Addresses, bool]] = {}
    why: dict[int, NotInPlace | None] = {}
    for i in leaves:
        t = into[i]
        if t.is_deleted():
            why[i] = NotInPlace.DELETED
            continue
        if t.size == 0:  # nothing to write in place (and jax's donation mis-shapes empty shards)
            why[i] = None
            continue
        addrs, by_jax = addresses_of(t)
        ptrs = set(addrs) - {0}
        if not ptrs.isdisjoint(sources):
            why[i] = NotInPlace.SHARES_A_SOURCE
        elif not ptrs.isdisjoint(claimed):
            why[i] = NotInPlace.SHARES_ANOTHER_INTO
        else:
            owned[i] = (addrs, by_jax)
            claimed |= ptrs
    return Claims(owned, why)


def source_addresses(leaves: Sequence[Any]) -> set[int]:
    """The buffer addresses of every live jax array among ``leaves`` (0 left out)."""
    import jax

    out: set[int] = set()
    for a in leaves:
        if isinstance(a, jax.Array) and not a.is_deleted():
            out.update(shard_addresses(a))
    out.discard(0)
    return out


def donate(
    arrays: Sequence[Any], before: Sequence[Addresses], by_jax: Sequence[bool], weak: Sequence[bool] | None = None
) -> list[tuple[Any, Addresses]]:
    """New arrays that own the memory of ``arrays`` (deleted), with their shard addresses.

    ``arrays`` are donated to an identity computation, one call per device assignment for the
    whole pytree, as ``jax.jit(..., donate_argnums=...)`` would: every array that shared the
    memory is deleted, and the outputs take it over. jax aliases an output to its input when
    it allocated the input itself; an input it did not take over (not deleted: something outside
    jax holds it), or one whose memory came from elsewhere (jreshard's buffer pool, a numpy array),
    comes back as a copy. Addresses are therefore reused only for inputs jax allocated (``by_jax``)
    and took over, after a spot check of up to 8 of them against jax's own answer; every other
    output's addresses are read from jax, so a copy shows as addresses that differ from ``before``.

    Args:
      arrays: global arrays.
      before: their shard addresses (``addressable_data`` order).
      by_jax: whether jax allocated each one's memory.
      weak: the ``weak_type`` each output takes (the source leaf's, as ``jax.device_put`` keeps it);
        default each input's.
    """
    import jax

    weak = [a.weak_type for a in arrays] if weak is None else weak
    # One call per device assignment (in order: jit needs every argument on the same one) and sharding
    # kind (jit cannot mix a GSPMDSharding with NamedShardings in one call).
    by_devices: dict[Any, list[int]] = {}
    keys: dict[int, Any] = {}  # id(sharding) -> its key (the shardings stay alive through the call)
    for i, a in enumerate(arrays):
        sh = a.sharding
        key = keys.get(id(sh))
        if key is None:
            key = keys[id(sh)] = (tuple(d.id for d in sh._device_assignment), type(sh))
        by_devices.setdefault(key, []).append(i)
    out: list[tuple[Any, Addresses]] = [(None, ())] * len(arrays)
    for idx in by_devices.values():
        group = [arrays[i] for i in idx]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            kinds = tuple((type(a.sharding), a.sharding, weak[i]) for i, a in zip(idx, group, strict=True))
            moved = [
                m if m.sharding is a.sharding else rewrapped(m, a.sharding)
                for m, a in zip(_identity(kinds)(*group), group, strict=True)
            ]
        jax.block_until_ready(moved)
        trust = [by_jax[i] and a.is_deleted() for i, a in zip(idx, group, strict=True)]
        sample = [k for k in range(len(idx)) if trust[k]]
        sample = sample[:: max(1, len(sample) // 8)][:8]
        if any(shard_addresses(moved[k]) != before[idx[k]] for k in sample):
            trust = [False] * len(idx)  # an output did not alias its input: read every address from jax
        for k, (i, m) in enumerate(zip(idx, moved, strict=True)):
            out[i] = (m, before[i] if trust[k] else shard_addresses(m))
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Taken:
    """The ``into`` leaves :func:`take` consumed, and why the others were not.

    Attributes:
      donated: ``{leaf: (the array that owns the memory now, its shard addresses)}``.
      why: ``{leaf: reason}`` for the moved leaves not claimed (``None``: no byte to place).
    """

    donated: dict[int, tuple[Any, Addresses]]
    why: dict[int, NotInPlace | None]

    def count(self, builder: ReportBuilder, leaf: int, nbytes: int) -> None:
        """Count ``nbytes`` of leaf ``leaf`` written into fresh buffers because it was not claimed."""
        why = self.why[leaf]
        builder.add_unowned(nbytes, leaf, why)


def take(
    into: Sequence[Any],
    leaves: Sequence[int],
    sources: Collection[int],
    builder: ReportBuilder,
    weak: Sequence[bool] | None = None,
) -> Taken:
    """:func:`claim` then :func:`donate` the ``into`` leaves ``leaves``, counting in ``builder`` every donation
    jax answered with a copy (:attr:`~jreshard.report.NotInPlace.NOT_HANDED_OVER`: the bytes are written
    into memory ``into`` never had).

    The caller writes each donated leaf through the returned array, gives the others fresh buffers and
    counts them with :meth:`Taken.count`.

    Args:
      into: per leaf of the call, its ``into`` array.
      leaves: the leaves whose bytes move.
      sources: buffer addresses of every source shard of the call.
      builder: the call's report.
      weak: per leaf of the call, the ``weak_type`` its result takes (default each ``into``'s own).
    """
    claims = claim(into, leaves, sources)
    mine = [i for i in leaves if i in claims.owned]
    got = donate(
        [into[i] for i in mine],
        [claims.owned[i][0] for i in mine],
        [claims.owned[i][1] for i in mine],
        None if weak is None else [weak[i] for i in mine],
    )
    donated = dict(zip(mine, got, strict=True))
    for i in mine:
        if donated[i][1] != claims.owned[i][0]:  # jax copied: the result is in fresh memory, not into's
            builder.add_unowned(storage(donated[i][0]), i, NotInPlace.NOT_HANDED_OVER)
    return Taken(donated, claims.why)


@cache(max_size=64)
def _identity(kinds: tuple[tuple[type, Any, bool], ...]) -> Any:
    """An identity computation that takes its arguments' memory, keeps their shardings and gives each
    output the ``weak_type`` asked for.

    Keyed by ``(type, sharding, weak)``: shardings of two kinds can compare equal, and the outputs
    must keep each argument's kind.
    """
    import jax

    shardings = tuple(s for _, s, _ in kinds)
    weaks = tuple(w for _, _, w in kinds)

    def same(*xs: Any) -> tuple[Any, ...]:
        return tuple(with_weak_type(x, w) for x, w in zip(xs, weaks, strict=True))

    return jax.jit(same, donate_argnums=tuple(range(len(shardings))), out_shardings=shardings)


def rewrapped(a: Array, sharding: Sharding) -> Any:
    """``a`` carrying the very ``sharding`` object (an equal one came out of the cached computation), over the
    same buffers: what ``jax.device_put`` returns carries its target's object."""
    if a.sharding is sharding:
        return a
    try:
        from jax._src.array import ArrayImpl
    except ImportError:  # pragma: no cover - another jax: an equal sharding object
        return a
    if type(a) is not ArrayImpl:  # a key array (its own class): it keeps the equal object
        return a
    return ArrayImpl(a.aval, sharding, list(shard_arrays(a)), committed=True)


def with_weak_type(x: Any, weak: bool) -> Any:
    """``x`` with ``weak_type=weak``, a no-op in the compiled program (jax has no public spelling of it)."""
    if x.weak_type == weak:
        return x
    from jax._src.lax import lax as lax_internal

    return lax_internal._convert_element_type(x, x.dtype, weak_type=weak)
