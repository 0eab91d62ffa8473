"""The delta codec (jreshard.engine.delta) against a numpy oracle: every change pattern round-trips bit for
bit, the compiled kernel writes the same bodies as the numpy fallback, a body is never longer than its chunk,
and a malformed body raises before it writes (never past the buffer it was given)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jreshard.engine import delta

PATTERNS = ("none", "one", "sparse", "dense", "all", "edges", "nan_payload", "signed_zero", "runs", "far")


def _change(rng: np.random.Generator, base: np.ndarray, pattern: str) -> np.ndarray:
    """``base`` with ``pattern``'s changes (bytes; the float patterns on the float32 / bfloat16 bits)."""
    new = base.copy()
    n = len(new)
    if n == 0 or pattern == "none":
        return new
    if pattern == "one":
        i = int(rng.integers(n))
        new[i] ^= np.uint8(1 << int(rng.integers(8)))
    elif pattern == "sparse":
        idx = rng.choice(n, size=max(1, n // 50), replace=False)
        new[idx] = rng.integers(0, 256, len(idx), dtype=np.uint8)
    elif pattern == "dense":
        idx = rng.random(n) < 0.6
        new[idx] ^= np.uint8(0x5A)
    elif pattern == "all":
        new ^= np.uint8(0xFF)
    elif pattern == "edges":  # the first and last bytes: the chunk's edges, the last unit partial or not
        new[0] ^= np.uint8(0x80)
        new[-1] ^= np.uint8(0x01)
    elif pattern == "far":  # two changes far apart: a gap of several varint bytes
        new[0] ^= np.uint8(1)
        new[-1] ^= np.uint8(1)
    elif pattern == "runs":
        for _ in range(3):
            lo = int(rng.integers(n))
            new[lo : lo + int(rng.integers(1, 40))] ^= np.uint8(0x33)
    elif pattern in ("nan_payload", "signed_zero"):
        words = n // 4
        if words == 0:
            new[0] ^= np.uint8(1)
            return new
        f = new[: 4 * words].view(np.uint32)
        i = int(rng.integers(words))
        if pattern == "nan_payload":  # one NaN for another: equal as floats (both NaN), different as bits
            f[i] = np.uint32(0x7FC00001) if f[i] != np.uint32(0x7FC00001) else np.uint32(0x7FC00002)
        else:  # -0.0 <-> 0.0: equal as floats, different as bits
            f[i] = np.uint32(0x80000000) if f[i] != np.uint32(0x80000000) else np.uint32(0)
    return new


def _oracle_changed(new: np.ndarray, base: np.ndarray, unit: int) -> int:
    n = -(-len(new) // unit)
    pad = np.zeros(n * unit, bool)
    pad[: len(new)] = new != base
    return int(pad.reshape(n, unit).any(axis=1).sum())


@given(
    nbytes=st.integers(0, 700),
    unit=st.sampled_from(delta.UNITS),
    pattern=st.sampled_from(PATTERNS),
    seed=st.integers(0, 2**31),
)
def test_round_trip_and_native_equals_numpy(nbytes: int, unit: int, pattern: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, nbytes, dtype=np.uint8)
    if pattern in ("nan_payload", "signed_zero") and nbytes >= 4:  # start from floats that hold such values
        base[: 4 * (nbytes // 4)].view(np.float32)[:] = rng.choice([0.0, -0.0, np.nan, 1.5], nbytes // 4)
    new = _change(rng, base, pattern)
    out_np = np.full(nbytes + 8, 0xEE, np.uint8)
    kind, size, changed = delta.encode_numpy(new, base, out_np, unit)
    assert changed == _oracle_changed(new, base, unit)
    assert size <= nbytes and (size == 0) == (kind == delta.KIND_SAME)
    assert (kind == delta.KIND_SAME) == (changed == 0)
    if pattern in ("nan_payload", "signed_zero", "one", "edges") and nbytes:
        assert changed > 0  # bits, not values: a NaN payload or a zero's sign is a change
    out = np.full(nbytes + 8, 0xEE, np.uint8)
    assert delta.encode(new, base, out, unit) == (kind, size, changed)
    assert out[:size].tobytes() == out_np[:size].tobytes()
    for apply in (delta.apply, delta.apply_numpy):
        held = np.full(nbytes + 16, 0xAB, np.uint8)
        held[8 : 8 + nbytes] = base
        assert apply(out[:size].copy(), kind, held[8 : 8 + nbytes], unit) == (
            changed if kind != delta.KIND_FULL else -(-nbytes // unit)
        )
        assert held[8 : 8 + nbytes].tobytes() == new.tobytes()
        assert (held[:8] == 0xAB).all() and (held[8 + nbytes :] == 0xAB).all()


def test_choice_follows_the_change() -> None:
    base = np.zeros(4096, np.uint8)
    out = np.empty(4096, np.uint8)
    one = base.copy()
    one[100] = 1
    assert delta.encode(one, base, out, 2)[:2] == (delta.KIND_GAPS, 4 + 1 + 2)  # count, one gap, one value
    run = base.copy()
    run[100:300] = 1
    assert delta.encode(run, base, out, 2)[:2] == (delta.KIND_RUNS, 4 + 8 + 200)
    scattered = base.copy()
    scattered[::4] = 1  # every other unit: a 1-bit mask beats a byte per gap
    assert delta.encode(scattered, base, out, 2)[0] == delta.KIND_MASK
    random = base.copy()
    random[np.random.default_rng(0).choice(4096, 100, replace=False)] = 1  # scattered: Adam under bfloat16
    assert delta.encode(random, base, out, 2)[0] == delta.KIND_GAPS
    assert delta.encode(base ^ np.uint8(1), base, out, 2)[:2] == (delta.KIND_FULL, 4096)
    assert delta.encode(base.copy(), base, out, 2) == (delta.KIND_SAME, 0, 0)


@given(nbytes=st.integers(1, 300), unit=st.sampled_from(delta.UNITS), seed=st.integers(0, 2**31))
def test_malformed_bodies_raise_and_never_write_outside(nbytes: int, unit: int, seed: int) -> None:
    """Random and mutated bodies: apply either raises ValueError having written nothing, or writes inside the
    chunk only (a valid body by chance); the compiled and numpy apply agree on which."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, nbytes, dtype=np.uint8)
    new = _change(rng, base, str(rng.choice(["sparse", "runs", "one"])))
    out = np.empty(nbytes, np.uint8)
    _, size, _ = delta.encode(new, base, out, unit)
    body = out[:size].copy()
    bodies = [rng.integers(0, 256, int(rng.integers(0, 2 * nbytes + 8)), dtype=np.uint8)]
    if size:
        cut = body[: int(rng.integers(size))]
        flipped = body.copy()
        flipped[int(rng.integers(size))] ^= np.uint8(1 << int(rng.integers(8)))
        bodies += [cut, flipped, np.concatenate([body, [0]]).astype(np.uint8)]
    for b in bodies:
        for k in (*delta.KINDS, 9):
            results = []
            for apply in (delta.apply, delta.apply_numpy):
                held = np.full(nbytes + 16, 0xAB, np.uint8)
                held[8 : 8 + nbytes] = base
                try:
                    apply(b, k, held[8 : 8 + nbytes], unit)
                    results.append(held.tobytes())
                except ValueError:
                    assert held[8 : 8 + nbytes].tobytes() == base.tobytes()  # nothing written
                    results.append(None)
                assert (held[:8] == 0xAB).all() and (held[8 + nbytes :] == 0xAB).all()
            assert results[0] == results[1]


@pytest.mark.parametrize("unit", [0, 3, 16])
def test_bad_unit(unit: int) -> None:
    x = np.zeros(4, np.uint8)
    for fn in (delta.encode, delta.encode_numpy):
        with pytest.raises(ValueError, match="unit"):
            fn(x, x, x.copy(), unit)


def test_sizes_come_from_the_buffers() -> None:
    x = np.zeros(8, np.uint8)
    for fn in (delta.encode, delta.encode_numpy):
        with pytest.raises(ValueError, match="base"):
            fn(x, x[:4], np.empty(8, np.uint8), 1)
        with pytest.raises(ValueError, match="out"):
            fn(x, x, np.empty(7, np.uint8), 1)


@pytest.mark.parametrize("unit", delta.UNITS)
def test_every_byte_of_a_word_is_seen(unit: int) -> None:
    """One changed byte at every position of two 64-unit words and the partial unit after them: the kernel
    compares whole words at a time (lanes folded to bits), so each byte of each lane must mark its own unit."""
    nbytes = 2 * 64 * unit + unit - 1 if unit > 1 else 2 * 64 + 1
    base = np.random.default_rng(unit).integers(0, 256, nbytes, dtype=np.uint8)
    out = np.empty(nbytes, np.uint8)
    for i in range(nbytes):
        for bit in (0, 7):
            new = base.copy()
            new[i] ^= np.uint8(1 << bit)
            kind, size, changed = delta.encode(new, base, out, unit)
            assert changed == 1, (i, bit)
            assert (kind, size) == delta.encode_numpy(new, base, np.empty(nbytes, np.uint8), unit)[:2]
            held = base.copy()
            delta.apply(out[:size].copy(), kind, held, unit)
            assert held.tobytes() == new.tobytes(), (i, bit)
