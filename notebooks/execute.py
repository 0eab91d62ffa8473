"""Re-execute the notebooks in place and store their outputs: ``python notebooks/execute.py [NAME.ipynb ...]``.

Run it after changing anything a notebook shows (and ``python notebooks/at_scale_data.py`` first when the
planner, the baselines, the cost model or ``jreshard.models`` change: notebook 03 checks its table reproduces).
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).parent


def main(names: list[str]) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["JAX_NUM_CPU_DEVICES"] = "8"
    paths = [HERE / n for n in names] if names else sorted(HERE.glob("*.ipynb"))
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        t0 = time.perf_counter()
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
        nbformat.write(nb, path)
        print(f"{path.name}: executed in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
