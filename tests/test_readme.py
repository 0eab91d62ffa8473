"""The README and the docs pages state numbers that reproduce.

(Every code block of README.md and docs/*.md runs in tests/test_docs_blocks.py.)

- The README keeps its two commands, ``make test`` and ``make demo``.
- A table of measured times (a header with "median") sits right after the command that makes it (a
  ``benchmarks/`` script) and is followed by the machine it ran on.
- In every other table, a column that holds times says whose they are: **predicted** by the cost model, or
  measured and published by others.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_TIME = re.compile(r"\b\d+(?:\.\d+)?\s*(?:s|ms|us|µs)\b")


def tables(page: pathlib.Path) -> list[tuple[int, list[str], list[list[str]], str, str]]:
    """(line, header cells, body rows, the 8 lines before, the 4 lines after) of each Markdown table."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-:| ]+\|$", lines[i + 1]):
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                j += 1

            def cells(row: str) -> list[str]:
                return [c.strip() for c in row.strip().strip("|").split("|")]

            out.append(
                (
                    i + 1,
                    cells(lines[i]),
                    [cells(r) for r in lines[i + 2 : j]],
                    "\n".join(lines[max(0, i - 8) : i]),
                    "\n".join(lines[j : j + 4]),
                )
            )
            i = j
        else:
            i += 1
    return out


ALL = [(page, *t) for page in PAGES for t in tables(page)]


def test_readme_keeps_its_two_commands():
    text = (ROOT / "README.md").read_text()
    assert re.search(r"^make test\b", text, flags=re.M) and re.search(r"^make demo\b", text, flags=re.M)


@pytest.mark.parametrize("page,line,header,rows,before,after", ALL, ids=lambda v: getattr(v, "name", None))
def test_numbers_say_where_they_come_from(page, line, header, rows, before, after):
    where = f"{page.name}:{line}"
    if any("median" in h for h in header):
        commands = re.findall(r"`([^`]*benchmarks/\w+\.py[^`]*)`", before)
        assert commands, f"{where}: a measured table follows the command that makes it"
        assert all((ROOT / re.search(r"benchmarks/\w+\.py", c).group(0)).exists() for c in commands), where
        assert "Machine:" in after, f"{where}: say which machine the numbers come from (a Machine: line after it)"
        return
    for k, h in enumerate(header):
        column = [r[k] for r in rows if k < len(r)]
        if any(_TIME.search(c) for c in column):
            assert re.search(r"predicted|measured by|published", h, flags=re.I), (
                f"{where}: column {h!r} holds times: say 'predicted' or who measured them, or make the table a "
                "measured one (median [min-max], the command before it, the machine after it)"
            )
