"""The documentation site and the public API it documents.

- ``jreshard.__all__`` is the public API: every name in it resolves, ``dir(jreshard)`` shows exactly it, and
  no public name of the package is left out of it.
- The API reference (docs/api.md) has one ``::: jreshard.NAME`` entry for every name in ``__all__``, and
  each one has a docstring; the strict build renders every one of them.
- ``mkdocs build --strict`` succeeds (broken links, missing pages or references fail it).
- The repository's documentation stands alone: it cites no file outside the repository.
"""

from __future__ import annotations

import inspect
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

import jreshard

ROOT = pathlib.Path(__file__).resolve().parents[1]
API_PAGE = ROOT / "docs" / "api.md"
# Names of things outside the repository, which its documentation must not cite.
OUTSIDE = re.compile(r"DESIGN\.md|REFERENCE\.md|shared/|Issue [0-9]")


def documented_names() -> list[str]:
    return re.findall(r"^::: jreshard\.(\w+)\s*$", API_PAGE.read_text(), flags=re.M)


def test_all_is_the_public_api():
    assert len(jreshard.__all__) == len(set(jreshard.__all__)), "a name twice in __all__"
    missing = [n for n in jreshard.__all__ if not hasattr(jreshard, n)]
    assert not missing, f"in __all__ but not importable: {missing}"
    assert dir(jreshard) == sorted([*jreshard.__all__, "__version__"])
    # A public name added to the package (not a submodule import) must be added to __all__ too.
    public = {
        n
        for n, v in vars(jreshard).items()
        if not n.startswith("_") and not (isinstance(v, types.ModuleType) and n not in jreshard.__all__)
    }
    assert public <= set(jreshard.__all__), f"public but not in __all__: {sorted(public - set(jreshard.__all__))}"
    assert {"TransferReport", "transfer", "transfer_into", "RefitGroup", "Plan", "Options"} <= set(jreshard.__all__)
    assert jreshard.TransferReport.__name__ == "TransferReport"


def test_api_reference_lists_public_names_once():
    """docs/api.md places public names in sections; the site's hook appends any it does not list."""
    names = documented_names()
    assert len(names) == len(set(names)), "a name twice in docs/api.md"
    assert set(names) <= set(jreshard.__all__), f"not public: {sorted(set(names) - set(jreshard.__all__))}"
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import mkdocs_hooks
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert mkdocs_hooks.public_names() == jreshard.__all__
    page = mkdocs_hooks.with_every_public_name(API_PAGE.read_text())
    assert sorted(re.findall(r"^::: jreshard\.(\w+)\s*$", page, flags=re.M)) == sorted(jreshard.__all__)
    assert mkdocs_hooks.with_every_public_name("::: jreshard.plan\n").count(":::") == len(jreshard.__all__)


@pytest.mark.parametrize("name", jreshard.__all__)
def test_every_public_name_has_a_docstring(name):
    doc = inspect.getdoc(getattr(jreshard, name))
    assert doc and len(doc.split()) >= 3, f"jreshard.{name} needs a docstring for the API reference"


def test_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: what ``make test`` runs; then every public name is rendered in the reference."""
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert r.returncode == 0, r.stderr[-4000:]
    html = (tmp_path / "site" / "api.html").read_text()
    rendered = set(re.findall(r'id="jreshard\.(\w+)"', html))
    assert set(jreshard.__all__) <= rendered, f"not rendered: {sorted(set(jreshard.__all__) - rendered)}"
    site = tmp_path / "site"
    assert (site / "index.html").exists() and (site / "getting_started.html").exists()
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks and all((site / "notebooks" / f"{n}.html").exists() for n in notebooks)
    assert "image/png" in (site / "notebooks" / f"{notebooks[0]}.html").read_text(), "stored outputs are shown"


def standalone_files() -> list[pathlib.Path]:
    files = [ROOT / "README.md"]
    for folder, patterns in (("docs", ("*.md", "*.py")), ("notebooks", ("*.ipynb", "*.py")), ("jreshard", ("*.py",))):
        files += [p for pat in patterns for p in sorted((ROOT / folder).rglob(pat))]
    return files


def test_docs_cite_nothing_outside_the_repository():
    hits = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()[:120]}"
        for p in standalone_files()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_the_pattern_finds_what_it_should():
    bad = ["see DESIGN.md", "(REFERENCE.md)", "`../shared/REFERENCE.md`", "Issue 4's target"]
    assert all(OUTSIDE.search(s) for s in bad)
    assert not OUTSIDE.search("the shared memory transport; issue a command")
