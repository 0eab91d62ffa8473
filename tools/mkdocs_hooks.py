"""MkDocs hooks for the jreshard site (mkdocs.yml names this file).

- The repository's README.md becomes the home page and CHANGELOG.md the changelog page, their
  links rewritten from the repository root to the site (``docs/x.md`` -> ``x.md``).
- Every ``notebooks/*.ipynb`` is added to the site, where mkdocs-jupyter renders its stored outputs
  (no notebook runs during the build), and listed under "Notebooks" in the navigation, titled by its
  first heading.
- The API reference (docs/api.md) gets an entry for every name of ``jreshard.__all__`` it does not list
  yet, under "More", so a name added to the package is documented without editing the page.
- User-guide pages other engineers are still writing are left out of the navigation until their
  file exists; any other page the navigation names must exist (strict mode fails otherwise).
"""

from __future__ import annotations

import ast
import json
import pathlib
import re

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES_IN_PROGRESS = frozenset({"elastic.md", "published.md", "architecture.md"})
_LINK = re.compile(r"\]\((?!https?://|#)([^)\s]+)\)")


def site_link(target: str) -> str:
    """Rewrites one README link target from the repository root to the site root.

    >>> site_link("docs/transfer.md"), site_link("docs/images/a.png"), site_link("CHANGELOG.md")
    ('transfer.md', 'images/a.png', 'changelog.md')
    """
    if target.startswith("docs/"):
        return target.removeprefix("docs/")
    if target == "CHANGELOG.md":
        return "changelog.md"
    return target


def readme_as_page(text: str) -> str:
    """The README's text with every relative link pointing into the site."""
    return _LINK.sub(lambda m: f"]({site_link(m.group(1))})", text)


def notebook_title(path: pathlib.Path) -> str:
    """The first Markdown heading of a notebook, without its number ("3. At scale" -> "At scale")."""
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("#"):
                    return re.sub(r"^#+\s*(\d+\.\s*)?", "", line).strip()
    return path.stem


def public_names() -> list[str]:
    """``jreshard.__all__``, read from the source without importing the package."""
    for node in ast.parse((ROOT / "jreshard" / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise RuntimeError("jreshard/__init__.py defines no __all__")


def with_every_public_name(markdown: str) -> str:
    r"""The API page, with a ``::: jreshard.NAME`` entry appended for each public name it does not list.

    >>> with_every_public_name("::: jreshard.plan\n").count(":::") == len(public_names())
    True
    """
    listed = set(re.findall(r"^::: jreshard\.(\w+)\s*$", markdown, flags=re.M))
    extra = [n for n in public_names() if n not in listed]
    if not extra:
        return markdown
    return markdown.rstrip("\n") + "\n\n## More\n\n" + "\n\n".join(f"::: jreshard.{n}" for n in extra) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:
    return with_every_public_name(markdown) if page.file.src_uri == "api.md" else markdown


def notebooks() -> list[pathlib.Path]:
    return sorted((ROOT / "notebooks").glob("*.ipynb"))


def on_config(config):
    nav = []
    for entry in config["nav"]:
        ((title, value),) = entry.items()
        if title == "Notebooks":
            value = [{notebook_title(p): f"notebooks/{p.name}"} for p in notebooks()]
        elif isinstance(value, list):
            value = [
                e
                for e in value
                if next(iter(e.values())) not in PAGES_IN_PROGRESS or (ROOT / "docs" / next(iter(e.values()))).exists()
            ]
        nav.append({title: value})
    config["nav"] = nav
    return config


@event_priority(100)  # before mkdocs-jupyter wraps the notebooks
def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "index.md", content=readme_as_page((ROOT / "README.md").read_text())))
    files.append(File.generated(config, "changelog.md", content=(ROOT / "CHANGELOG.md").read_text()))
    for path in notebooks():
        files.append(File(f"notebooks/{path.name}", str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files
