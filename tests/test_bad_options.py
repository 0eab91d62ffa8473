"""Bad Options fields: each raises a TypeError or ValueError naming the field and the value."""

from __future__ import annotations

import pytest

from jreshard import Options


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
