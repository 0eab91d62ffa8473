"""The README's Python examples run (docs that run)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_python_blocks_run():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "the README has Python examples"
    for i, block in enumerate(blocks):
        namespace: dict = {"__name__": f"readme_block_{i}"}
        exec(compile(block, f"README.md block {i}", "exec"), namespace)
