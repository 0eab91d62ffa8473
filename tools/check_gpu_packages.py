"""Check that the GPU machine's package set is enough for ``benchmarks/gpu_check.py`` (run by ``make test``).

The GPU machine gpu_check is prepared for has no package index and only these Python packages
(CuPy and NCCL for CUDA 13 there; their CUDA 12 builds stand in here, as the CI machines have no
CUDA 13 wheels to spare): :data:`PACKAGES`. No matplotlib, nbformat or mkdocs. This script

1. builds a virtual environment with exactly those packages (no ``--system-site-packages``, which
   would hide a missing one), cached in ``.cache/gpu-packages-<hash>`` keyed on the package list and
   the interpreter, so a second run reuses it;
2. installs jreshard itself into it without extras or dependencies (``pip install --no-deps``) and
   runs ``pip check`` (jreshard's declared dependencies are met by the set);
3. imports, from outside the checkout, every module gpu_check's stages import;
4. runs ``gpu_check.py --dry-run`` and collects the ``pytest`` stage exactly as gpu_check runs it
   (the same flags, with ``--collect-only``), which must find the GPU tests with no collection error.

Usage: ``python tools/check_gpu_packages.py [--python python3.12]``; exits non-zero, saying what
failed, when any step fails. Needs a package index (or pip's configured wheel folders) the first time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "jax",
    "jaxlib",
    "numpy",
    "ml_dtypes",
    "cupy-cuda12x",  # cupy-cuda13x on the GPU machine
    "nvidia-nccl-cu12",  # nvidia-nccl-cu13 there
    "nvidia-ml-py",
    "mpi4py",
    "pytest",
    "pytest-timeout",
    "hypothesis",
)
ABSENT = ("matplotlib", "nbformat", "nbclient", "mkdocs")  # not on the GPU machine: must stay absent here
STAGE_IMPORTS = (
    "jax, jax.numpy, jax.dlpack, numpy, ml_dtypes, cupy, cupy.cuda.nccl, pynvml, pytest, pytest_timeout, hypothesis",
    "jreshard, jreshard.cuda.buffers, jreshard.nccl.cupy_nccl, jreshard.cuda.kernels, jreshard.cuda.nvml",
    "jreshard.engine.rounds, jreshard.schedule.pairsched, jreshard.nccl.rendezvous, jreshard.sharding.planner",
)


def run(cmd: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    print(f"  {what}: rc {proc.returncode} in {time.perf_counter() - t0:.1f} s", flush=True)
    if proc.returncode:
        sys.exit(f"check_gpu_packages: {what} failed ({' '.join(cmd)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def interpreter(asked: str | None) -> str:
    """The Python to build the environment with: the one asked, else python3.12 (the GPU machine's), else this one."""
    if asked:
        return asked
    found = shutil.which("python3.12")
    if found and subprocess.run([found, "-c", "import venv"], capture_output=True).returncode == 0:
        return found  # a pyenv shim without 3.12 selected is found but does not run
    return sys.executable


def venv_for(python: str) -> Path:
    """The cached environment with exactly :data:`PACKAGES`, built when missing."""
    version = subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\n".join((version.strip(), *PACKAGES)).encode()).hexdigest()[:16]
    venv = ROOT / ".cache" / f"gpu-packages-{key}"
    stamp = venv / ".complete"
    if stamp.exists():
        print(f"  reusing {venv.relative_to(ROOT)} (key {key})", flush=True)
        return venv
    if venv.exists():
        shutil.rmtree(venv)  # a build cut short
    venv.parent.mkdir(parents=True, exist_ok=True)
    run([python, "-m", "venv", str(venv)], "python -m venv")
    py = str(venv / "bin" / "python")
    run([py, "-m", "pip", "install", "-q", *PACKAGES], "pip install the GPU machine's packages")
    stamp.write_text("\n".join(PACKAGES) + "\n")
    return venv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    ap.add_argument("--python", help="interpreter to build the environment with (default python3.12, else this one)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    print("check_gpu_packages: the GPU machine's package set", flush=True)
    venv = venv_for(interpreter(args.python))
    py = str(venv / "bin" / "python")
    with tempfile.TemporaryDirectory() as build:
        env = dict(os.environ, TMPDIR=build)
        cmd = [py, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(ROOT)]
        run(cmd, "pip install --no-deps jreshard", env=env)
    run([py, "-m", "pip", "check"], "pip check")
    listed = run([py, "-m", "pip", "list", "--format=freeze"], "pip list").stdout.lower()
    present = [p for p in ABSENT if f"\n{p}==" in "\n" + listed]
    if present:
        sys.exit(f"check_gpu_packages: {present} are installed, but the GPU machine does not have them")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"
    with tempfile.TemporaryDirectory() as away:  # outside the checkout: the installed jreshard
        for line in STAGE_IMPORTS:
            run([py, "-W", "ignore", "-c", f"import {line}"], f"import {line.split(',')[0]}, ...", cwd=away, env=env)
    dry = run([py, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run"], "gpu_check.py --dry-run", cwd=ROOT, env=env)
    print("\n".join("    " + line for line in dry.stdout.splitlines()))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_stages import pytest_command

    collected = run(
        pytest_command(py, collect_only=True), "pytest --collect-only (the pytest stage)", cwd=ROOT, env=env
    )
    tail = [line for line in collected.stdout.splitlines() if line.strip()][-1]
    lines = collected.stdout.splitlines()
    n = {f: sum(1 for line in lines if line.startswith(f"tests/{f}::")) for f in ("test_gpu.py", "test_gpu_casts.py")}
    if "error" in tail.lower() or 0 in n.values():
        sys.exit(f"check_gpu_packages: the pytest stage collects {n} tests: {tail}")
    counts = ", ".join(f"{k} in {f}" for f, k in n.items())
    print(f"  the pytest stage collects {counts} ({tail}); done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
