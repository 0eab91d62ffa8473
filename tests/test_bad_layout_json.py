"""Bad Layout JSON: a LayoutJSONError (a ValueError) that shows the text, never an error inside the handler."""

from __future__ import annotations

import pytest

from jreshard import Layout, LayoutJSONError


def test_bytes_that_are_not_json():
    with pytest.raises(LayoutJSONError, match=r"cannot parse 'xyz"):
        Layout.from_json(b"xyz" * 100)


def test_long_text_is_cut_at_200_characters():
    with pytest.raises(LayoutJSONError, match=r"cannot parse '\{\{\{+\.\.\.'"):
        Layout.from_json("{" * 500)


def test_bytes_that_are_not_utf8():
    with pytest.raises(LayoutJSONError, match="cannot parse"):
        Layout.from_json(b"\xff" * 300)


def test_missing_field_names_it():
    with pytest.raises(LayoutJSONError, match="'boxes'"):
        Layout.from_json('{"shape": [2], "dtype": "float32", "ranks": [0]}')
