"""The delta codec: what changed in a chunk of wire bytes since the base the destination holds.

A chunk (the bytes one row of a round sends: a staging image or a run of a shard, in the wire dtype,
after a view's cast) is compared with the previous version of the same chunk in units of ``unit`` bytes
(the last unit may be partial). A unit changed when any bit differs: bit patterns compare as bits, so a
NaN whose payload changed, or ``-0.0`` after ``0.0``, is a change. The body sent for the chunk is the
smallest of:

- :data:`KIND_SAME`: nothing changed, an empty body;
- :data:`KIND_MASK`: a bitmask of ``ceil(n / 8)`` bytes (bit ``u % 8`` of byte ``u // 8`` marks unit
  ``u``), then the changed units' new bytes in order;
- :data:`KIND_RUNS`: a little-endian ``uint32`` count of runs, then per run its first unit and its length
  (``uint32`` each; runs ascending, with a gap between two), then the changed units' new bytes;
- :data:`KIND_GAPS`: a little-endian ``uint32`` count of changed units, then per changed unit the units
  skipped since the one before as an LEB128 varint (one byte for a gap under 128), then their new bytes:
  the smallest for changes scattered at random (Adam's updates crossing a bfloat16 rounding boundary);
- :data:`KIND_FULL`: the chunk itself, whenever nothing above is smaller,

so a body is never longer than the chunk. :func:`apply` writes a body in place over the base; it trusts
nothing in it (every count, run and length is checked against the chunk and the body before a byte is
written) and raises :class:`ValueError` naming what is wrong.

Both run compiled (``_delta.c``) where it was built (:func:`compiled`), with the GIL released, and in numpy
otherwise: the same bodies byte for byte (a property test holds them to each other and to a numpy oracle).

Example:
  >>> import numpy as np
  >>> base = np.zeros(8, np.uint8); new = base.copy(); new[5] = 7
  >>> out = np.empty(8, np.uint8)
  >>> kind, size, changed = encode(new, base, out, 1)
  >>> (kind, size, changed)  # one changed byte: a 1-byte mask and its value
  (2, 2, 1)
  >>> held = base.copy(); _ = apply(out[:size], kind, held, 1); bool((held == new).all())
  True
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

__all__ = [
    "KINDS",
    "KIND_FULL",
    "KIND_GAPS",
    "KIND_MASK",
    "KIND_RUNS",
    "KIND_SAME",
    "apply",
    "apply_numpy",
    "compiled",
    "encode",
    "encode_numpy",
]

KIND_SAME, KIND_FULL, KIND_MASK, KIND_RUNS, KIND_GAPS = 0, 1, 2, 3, 4
KINDS = {KIND_SAME: "same", KIND_FULL: "full", KIND_MASK: "mask", KIND_RUNS: "runs", KIND_GAPS: "gaps"}
MAX_VARINT = 5  # bytes of a uint32 in LEB128
UNITS = (1, 2, 4, 8)


def _native() -> ModuleType | None:
    try:
        from jreshard.engine import _delta
    except ImportError:
        return None
    return _delta


_NATIVE = _native()


def compiled() -> bool:
    """Whether the compiled kernels (``_delta.c``) were built; numpy runs the same encoding otherwise."""
    return _NATIVE is not None


def encode(new: np.ndarray, base: np.ndarray, out: np.ndarray, unit: int) -> tuple[int, int, int]:
    """Encode ``new`` against ``base`` into ``out``: ``(kind, body bytes, changed units)``.

    Args:
      new: the chunk's bytes now (1-D uint8).
      base: the same chunk as the destination holds it (1-D uint8, as long as ``new``).
      out: where the body goes (1-D uint8, at least as long as ``new``).
      unit: the comparison unit in bytes: 1, 2, 4 or 8.

    Raises:
      ValueError: the sizes disagree or ``unit`` is not one of those.
    """
    if _NATIVE is not None:
        kind, size, changed = _NATIVE.encode(new, base, out, unit)
        return int(kind), int(size), int(changed)
    return encode_numpy(new, base, out, unit)


def apply(body: np.ndarray, kind: int, dst: np.ndarray, unit: int) -> int:
    """Write the body of an encoded chunk over ``dst`` (which holds the base), in place: the changed units.

    Raises:
      ValueError: the body is malformed for a chunk of ``len(dst)`` bytes (nothing was written).
    """
    if _NATIVE is not None:
        return int(_NATIVE.apply(body, kind, dst, unit))
    return apply_numpy(body, kind, dst, unit)


def _check_unit(unit: int) -> None:
    if unit not in UNITS:
        raise ValueError(f"delta: unit={unit!r} must be 1, 2, 4 or 8")


def _changed(new: np.ndarray, base: np.ndarray, unit: int) -> np.ndarray:
    """Per unit, whether any of its bytes differ (the last unit may be partial)."""
    nbytes = len(new)
    n = -(-nbytes // unit)
    diff = np.zeros(n * unit, bool)
    diff[:nbytes] = new != base
    return np.asarray(diff.reshape(n, unit).any(axis=1))


def _unit_bytes(units: np.ndarray, nbytes: int, unit: int) -> np.ndarray:
    """The byte mask of the units marked in ``units``."""
    return np.repeat(units, unit)[:nbytes]


def _runs(units: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First unit and length of every run of marked units."""
    edges = np.diff(np.concatenate([[0], units.astype(np.int8), [0]]))
    starts = np.flatnonzero(edges == 1)
    return starts, np.flatnonzero(edges == -1) - starts


def _varints(values: np.ndarray) -> np.ndarray:
    """``values`` (non-negative int64) as LEB128 varints, one after the other."""
    sizes = np.ones(len(values), np.int64)
    for j in range(1, MAX_VARINT + 2):
        sizes += values >= (1 << (7 * j))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    out = np.empty(int(sizes.sum()), np.uint8)
    for j in range(int(sizes.max(initial=0))):
        has = sizes > j
        more = (sizes > j + 1).astype(np.int64) << 7
        out[starts[has] + j] = ((values[has] >> (7 * j)) & 0x7F) | more[has]
    return out


def _read_varints(region: np.ndarray, count: int) -> tuple[np.ndarray, int] | None:
    """The first ``count`` LEB128 varints of ``region`` and the bytes they take (``None``: malformed)."""
    if count == 0:
        return np.zeros(0, np.int64), 0
    ends = np.flatnonzero((region & 0x80) == 0)[:count]
    if len(ends) < count:
        return None
    starts = np.concatenate([[0], ends[:-1] + 1])
    lengths = ends - starts + 1
    if (lengths > MAX_VARINT).any():
        return None
    values = np.zeros(count, np.int64)
    for j in range(int(lengths.max())):
        has = lengths > j
        values[has] |= (region[starts[has] + j].astype(np.int64) & 0x7F) << (7 * j)
    return values, int(ends[-1]) + 1


def encode_numpy(new: np.ndarray, base: np.ndarray, out: np.ndarray, unit: int) -> tuple[int, int, int]:
    """:func:`encode` in numpy (the fallback, and the reference the compiled kernel is tested against)."""
    _check_unit(unit)
    nbytes = len(new)
    if len(base) != nbytes:
        raise ValueError(f"delta.encode: new has {nbytes} bytes, base {len(base)}")
    if len(out) < nbytes:
        raise ValueError(f"delta.encode: out has {len(out)} bytes, the chunk {nbytes}")
    n = -(-nbytes // unit)
    units = _changed(new, base, unit)
    k = int(units.sum())
    if k == 0:
        return KIND_SAME, 0, 0
    byte_mask = _unit_bytes(units, nbytes, unit)
    values = new[byte_mask]
    starts, lens = _runs(units)
    where = np.flatnonzero(units)
    gaps = _varints(np.diff(np.concatenate([[-1], where])) - 1)
    mask_size = -(-n // 8) + len(values)
    runs_size = 4 + 8 * len(starts) + len(values) if n <= 0xFFFFFFFF else nbytes + 1
    gaps_size = 4 + len(gaps) + len(values) if n <= 0xFFFFFFFF else nbytes + 1
    if mask_size < nbytes and mask_size <= runs_size and mask_size <= gaps_size:
        bits = np.packbits(units, bitorder="little")
        out[: len(bits)] = bits
        out[len(bits) : mask_size] = values
        return KIND_MASK, mask_size, k
    if runs_size < nbytes and runs_size <= gaps_size:
        head = np.empty(1 + 2 * len(starts), "<u4")
        head[0] = len(starts)
        head[1::2], head[2::2] = starts, lens
        out[: 4 * len(head)] = head.view(np.uint8)
        out[4 * len(head) : runs_size] = values
        return KIND_RUNS, runs_size, k
    if gaps_size < nbytes:
        out[:4] = np.array([k], "<u4").view(np.uint8)
        out[4 : 4 + len(gaps)] = gaps
        out[4 + len(gaps) : gaps_size] = values
        return KIND_GAPS, gaps_size, k
    out[:nbytes] = new
    return KIND_FULL, nbytes, k


def apply_numpy(body: np.ndarray, kind: int, dst: np.ndarray, unit: int) -> int:
    """:func:`apply` in numpy (the fallback): every check made before the first byte is written."""
    _check_unit(unit)
    nbytes, blen = len(dst), len(body)
    n = -(-nbytes // unit)
    if kind == KIND_SAME:
        if blen:
            raise ValueError(f"delta.apply: an unchanged chunk with a body ({blen}, 0)")
        return 0
    if kind == KIND_FULL:
        if blen != nbytes:
            raise ValueError(f"delta.apply: a whole chunk of another size (body, chunk) ({blen}, {nbytes})")
        dst[:] = body
        return n
    if kind == KIND_MASK:
        mbytes = -(-n // 8)
        if blen < mbytes:
            raise ValueError(f"delta.apply: a mask body shorter than its mask (body, mask) ({blen}, {mbytes})")
        bits = np.unpackbits(body[:mbytes], bitorder="little")
        if bits[n:].any():
            raise ValueError(f"delta.apply: a mask with bits past the chunk (units, mask bytes) ({n}, {mbytes})")
        units = bits[:n].astype(bool)
    elif kind == KIND_RUNS:
        if blen < 4:
            raise ValueError(f"delta.apply: a runs body without its count (body, 4) ({blen}, 4)")
        m = int(body[:4].view("<u4")[0])
        if m > (blen - 4) // 8:
            raise ValueError(f"delta.apply: more runs than the body holds (runs, body) ({m}, {blen})")
        head = body[4 : 4 + 8 * m].view("<u4").astype(np.int64)
        starts, lens = head[0::2], head[1::2]
        ends = starts + lens
        gaps_ok = (starts[1:] > ends[:-1]).all() if m > 1 else True
        if m and (not gaps_ok or (lens == 0).any() or (ends > n).any()):
            raise ValueError("delta.apply: a run out of order or past the chunk")
        units = np.zeros(n, bool)
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            units[s:e] = True
        mbytes = 4 + 8 * m
    elif kind == KIND_GAPS:
        if blen < 4:
            raise ValueError(f"delta.apply: a gaps body without its count (body, 4) ({blen}, 4)")
        count = int(body[:4].view("<u4")[0])
        if count > n:
            raise ValueError(f"delta.apply: more changed units than the chunk has (count, units) ({count}, {n})")
        read = _read_varints(body[4:], count)
        if read is None:
            raise ValueError("delta.apply: a gap past the body or too long")
        gaps, used = read
        where = np.cumsum(gaps + 1) - 1
        if count and where[-1] >= n:
            raise ValueError("delta.apply: a gap past the chunk")
        units = np.zeros(n, bool)
        units[where] = True
        mbytes = 4 + used
    else:
        raise ValueError(f"delta.apply: unknown encoding kind {kind}")
    byte_mask = _unit_bytes(units, nbytes, unit)
    v = int(byte_mask.sum())
    if blen != mbytes + v:
        raise ValueError(
            f"delta.apply: a body whose values do not match its {KINDS[kind]} (body, expected) ({blen}, {mbytes + v})"
        )
    dst[byte_mask] = body[mbytes:]
    return int(units.sum())
