"""benchmarks/gpu_xla_stage.py's stage runs on CPU devices too, and every check passes there."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

from gpu_xla_stage import main, xla_stage


def test_the_xla_stage_passes_on_cpu_devices():
    got = []
    xla_stage(lambda check, status, **data: got.append((check, status, data)), quick=True)
    assert [c for c, _, _ in got] == ["xla compile", "xla transfer", "xla transfer_into", "xla ppermute"]
    assert all(s == "ok" for _, s, _ in got), got
    data = {c: d for c, _, d in got}
    assert data["xla compile"]["platform"] == "cpu" and data["xla compile"]["ppermutes"] == 0
    assert data["xla transfer"]["moved_bytes"] == 16 << 20
    assert all(data["xla transfer_into"]["in_place"])


def test_the_stage_runs_alone_and_writes_json_lines(tmp_path):
    out = tmp_path / "xla.jsonl"
    assert main([str(out), "--quick"]) == 0
    assert len(out.read_text().splitlines()) == 4
