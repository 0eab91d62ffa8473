"""Every code block of README.md and docs/*.md runs verbatim, each in a fresh process.

The environment is the one the README describes: from the repository root, after ``make test`` has built
``.venv``, so ``python`` and ``.venv/bin/...`` are this interpreter's virtual environment. Nothing else is set:
no ``JAX_PLATFORMS``, ``JAX_NUM_CPU_DEVICES`` or ``XLA_FLAGS`` from the test suite reaches a block, so a block
that needs 8 CPU devices sets them itself, before it imports jax.

- ```` ```python ```` blocks run as they are.
- Every other fenced block carries a marker on the line before it:
  - ``<!-- run -->``: each command runs (``$ `` lines of a ``console`` block, or every line of a ``bash``
    block) and must succeed; a ``console`` block's printed output must match the block exactly.
  - ``<!-- run, numbers vary: REASON -->``: the same, but the output is compared with every number (and its
    unit) masked and runs of spaces collapsed (for output that includes measured times).
  - ``<!-- not run: REASON -->``: not run, for the reason given (checked to be a real sentence).

``python tests/test_docs_blocks.py --update`` reruns the ``<!-- run -->`` console blocks and writes their
output back into the pages, after a change to what the command line prints.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VENV_BIN = pathlib.Path(sys.executable).parent
_FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
_MARK = re.compile(r"<!--\s*(?P<kind>not run|run, numbers vary|run)\s*(?::\s*(?P<reason>.*?))?\s*-->\s*$")
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?(?:\s?(?:[kMGT]?B|ms|us|s)\b)?")
SHELLS = ("bash", "sh", "console")


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    """One fenced code block of a page: its language, text, marker and where it starts."""

    page: pathlib.Path
    line: int
    lang: str
    body: str
    start: int  # offset of the body in the page's text
    mark: str | None  # "run", "run, numbers vary", "not run" or None
    reason: str

    @property
    def id(self) -> str:
        return f"{self.page.name}:{self.line}"


def blocks_of(page: pathlib.Path) -> list[Block]:
    """The fenced blocks of one Markdown page, each with the marker on the line before it (if any)."""
    text = page.read_text()
    out = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        out.append(
            Block(
                page=page,
                line=text.count("\n", 0, m.start()) + 1,
                lang=m.group("lang"),
                body=m.group("body"),
                start=m.start("body"),
                mark=mark.group("kind") if mark else None,
                reason=(mark.group("reason") or "") if mark else "",
            )
        )
    return out


ALL = [b for page in PAGES for b in blocks_of(page)]


def clean_env(cwd: pathlib.Path) -> dict[str, str]:
    """This process's environment without the test suite's jax settings, with the venv first on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)  # the checkout, as an installed jreshard would be
    env["MPLBACKEND"] = "Agg"
    return env


def workdir(tmp: pathlib.Path) -> pathlib.Path:
    """A scratch copy of the repository root (links to its entries), so files a block writes land in ``tmp``."""
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv"):
            (tmp / entry.name).symlink_to(entry)
    return tmp


def shell(command: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """Runs one command of a block: ``.venv/bin/`` is this interpreter's venv (the README's set-up)."""
    command = command.replace(".venv/bin/", f"{VENV_BIN}/")
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=clean_env(cwd), capture_output=True, text=True, timeout=240
    )


def commands(block: Block) -> list[tuple[str, str]]:
    """(command, expected output) pairs: ``$ `` lines and what follows them (console), or each bash line."""
    lines = block.body.splitlines()
    out: list[tuple[str, list[str]]] = []
    if block.lang == "console":
        for line in lines:
            if line.startswith("$ "):
                out.append((line[2:], []))
            else:
                assert out, f"{block.id}: a console block starts with a `$ ` command"
                out[-1][1].append(line)
    else:
        joined = re.sub(r"\\\n\s*", " ", block.body)
        out = [(c, []) for line in joined.splitlines() if (c := line.split(" # ")[0].strip()) and c[0] != "#"]
    return [(c, "\n".join(o).rstrip()) for c, o in out]


def normalise(text: str, numbers_vary: bool) -> str:
    text = "\n".join(line.rstrip() for line in text.strip("\n").splitlines())
    if numbers_vary:  # a number with its unit is one token, and column padding follows its width
        text = re.sub(r" +", " ", _NUMBER.sub("#", text))
    return text


@functools.cache
def _run_cached(command: str, tmp: str) -> subprocess.CompletedProcess:
    return shell(command, pathlib.Path(tmp))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return workdir(tmp_path_factory.mktemp("docs_blocks"))


def test_pages_have_blocks_and_markers_are_well_formed():
    assert len(ALL) >= 10 and {b.page.name for b in ALL} >= {"README.md", "transfer.md", "cli.md"}
    for b in ALL:
        if b.lang in ("python", "py") and b.mark is None:
            continue
        assert b.mark is not None, f"{b.id}: a {b.lang or 'plain'} block needs <!-- run --> or <!-- not run: why -->"
        if b.mark == "run":
            assert b.lang in SHELLS, f"{b.id}: only shell blocks take <!-- run -->; python blocks always run"
        if b.mark != "run":
            assert len(b.reason.split()) >= 3, f"{b.id}: say why ({b.mark}: a reason of a few words)"


@pytest.mark.parametrize("block", [b for b in ALL if b.lang in ("python", "py") and b.mark is None], ids=lambda b: b.id)
def test_python_block_runs_verbatim(block, scratch):
    r = subprocess.run(
        [sys.executable, "-c", block.body],
        cwd=scratch,
        env=clean_env(scratch),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, f"{block.id} failed:\n{block.body}\n--- stderr:\n{r.stderr[-3000:]}"


@pytest.mark.parametrize("block", [b for b in ALL if b.mark in ("run", "run, numbers vary")], ids=lambda b: b.id)
def test_shell_block_runs_and_prints_what_it_shows(block, scratch):
    pairs = commands(block)
    assert pairs, f"{block.id}: no command"
    for command, expected in pairs:
        r = _run_cached(command, str(scratch))
        assert r.returncode == 0, f"{block.id}: `{command}` failed:\n{r.stderr[-3000:]}"
        if block.lang == "console" and expected:
            vary = block.mark == "run, numbers vary"
            assert normalise(r.stdout, vary) == normalise(expected, vary), (
                f"{block.id}: `{command}` printed something else (rerun: python tests/test_docs_blocks.py --update)"
                f"\n{r.stdout}"
            )


def update() -> None:
    """Rewrites the output of every ``<!-- run -->`` console block from a fresh run of its commands."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cwd = workdir(pathlib.Path(tmp))
        for page in PAGES:
            text = page.read_text()
            for b in reversed([b for b in blocks_of(page) if b.mark == "run" and b.lang == "console"]):
                body = []
                for command, _ in commands(b):
                    r = shell(command, cwd)
                    if r.returncode:
                        raise SystemExit(f"{b.id}: `{command}` failed:\n{r.stderr}")
                    body += [f"$ {command}", *(line.rstrip() for line in r.stdout.rstrip("\n").splitlines())]
                text = text[: b.start] + "\n".join(body) + "\n" + text[b.start + len(b.body) :]
                print(f"updated {b.id}")
            page.write_text(text)


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        raise SystemExit("usage: python tests/test_docs_blocks.py --update")
    update()
