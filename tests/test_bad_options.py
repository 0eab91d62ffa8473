"""Bad Options fields: each raises a TypeError or ValueError naming the field and the value."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jreshard import Options
from jreshard.options import wait_s


@pytest.mark.parametrize("value", ["no", 0, 1, None])
def test_relays_must_be_a_bool(value):
    with pytest.raises(TypeError, match=rf"relays={value!r} must be True or False"):
        Options(relays=value)


@pytest.mark.parametrize("field", ["staging_bytes", "chunk_bytes"])
def test_sizes_reject_bools(field):
    with pytest.raises(ValueError, match=rf"{field}=True must be a positive int"):
        Options(**{field: True})


def test_min_stripe_bytes_rejects_float():
    with pytest.raises(ValueError, match=r"min_stripe_bytes=1\.5"):
        Options(min_stripe_bytes=1.5)


@pytest.mark.parametrize("value", [{}, "fast", 3])
def test_options_of_names_the_value(value):
    with pytest.raises(TypeError, match=rf"options={value!r} is a {type(value).__name__}"):
        Options.of(value)


@pytest.mark.parametrize("field", ["staging_bytes", "chunk_bytes", "min_stripe_bytes", "max_group_ops", "delta_bytes"])
@pytest.mark.parametrize("kind", [np.int64, np.int32, np.uint32])
def test_integer_fields_take_numpys_integers_and_hold_python_ints(field, kind):
    o = Options(**{field: kind(8 << 20)})  # staging_bytes at least the default chunk
    assert getattr(o, field) == 8 << 20 and type(getattr(o, field)) is int
    assert o == Options(**{field: 8 << 20}) and hash(o) == hash(Options(**{field: 8 << 20}))


def test_copy_threads_takes_numpys_integers_and_refuses_bools():
    assert Options(copy_threads=np.int64(2)).copy_threads == 2
    for bad in (True, 0, 1.0, np.float64(2.0), "2"):
        with pytest.raises(ValueError, match=r"copy_threads=.* must be None or an int >= 1"):
            Options(copy_threads=bad)


@pytest.mark.parametrize("field", ["staging_bytes", "chunk_bytes", "max_group_ops"])
@pytest.mark.parametrize("bad", [np.float64(1024.0), np.bool_(True), "1024"])
def test_integer_fields_refuse_floats_bools_and_strings_of_any_kind(field, bad):
    with pytest.raises(ValueError, match=rf"{field}="):
        Options(**{field: bad})


@pytest.mark.parametrize("value", [2, 2.5, np.float32(2.5), np.int64(2), np.float64(0.25)])
def test_timeout_takes_any_real_number_and_holds_a_float(value):
    o = Options(timeout_s=value)
    assert o.timeout_s == float(value) and type(o.timeout_s) is float


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, -math.inf, math.nan, np.float64("inf"), True, "5", None])
def test_timeout_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match=r"timeout_s=.* must be a positive, finite number of seconds"):
        Options(timeout_s=bad)


def test_a_wait_is_none_for_the_default_or_a_finite_number_of_seconds():
    assert wait_s(None, 300.0, "w") == 300.0
    assert [wait_s(v, 300.0, "w") for v in (0, 2, 2.5, np.float32(0.5), np.int64(3))] == [0.0, 2.0, 2.5, 0.5, 3.0]
    for bad in (math.inf, -math.inf, math.nan, -1, True, np.bool_(False), "5", [1]):
        with pytest.raises(ValueError, match=r"^the call: timeout_s=.* must be None or a finite number of seconds"):
            wait_s(bad, 300.0, "the call")
