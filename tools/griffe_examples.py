"""A Griffe extension for the API reference: the package's docstrings title their doctests ``Example:``,
which the Google docstring parser does not know as a section; read it as ``Examples:`` so each doctest
renders as Python code rather than as prose."""

from __future__ import annotations

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", flags=re.M)


class ExampleSections(griffe.Extension):
    """Renames ``Example:`` section titles to ``Examples:`` in every loaded docstring."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
