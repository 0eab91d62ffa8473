"""benchmarks/published.py: every published row replayed with network bytes equal to the lower bound,
the per-NIC bound from the layouts alone, and the printed labels."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from jreshard.models import published_configs

_path = Path(__file__).parent.parent / "benchmarks" / "published.py"
_spec = importlib.util.spec_from_file_location("published_bench", _path)
assert _spec is not None and _spec.loader is not None
published = importlib.util.module_from_spec(_spec)
sys.modules["published_bench"] = published  # dataclasses look their module up there
_spec.loader.exec_module(published)


def test_every_shipped_row_is_replayed():
    assert set(published.ORDER) == set(published_configs())


@pytest.mark.parametrize("key", ["m2n-qwen235b-128gpus-gb200", "nemo-rl-qwen235b-h100"])
def test_qwen_rows_move_exactly_the_lower_bound(key, capsys):
    row = published.replay(key)  # raises unless plan network bytes == lower bound == the layouts' bound
    assert row.network_bytes == row.lower_bound
    assert row.nic_bound_s <= row.predicted_s <= 1.1 * row.nic_bound_s  # within 10% of the per-NIC floor
    published.print_row(row)
    out = capsys.readouterr().out
    assert "predicted, jreshard" in out and "published," in out and "NIC 50 GB/s per GPU" in out
    assert "(equal: yes)" in out


def test_m2n_qwen_numbers():
    row = published.replay("m2n-qwen235b-128gpus-gb200")
    # One 64-GPU generator rack needs the whole model once: 470.19 GB through 64 NICs of 50 GB/s.
    assert row.network_bytes == row.model_bytes
    assert abs(row.nic_bound_s - row.model_bytes / (64 * 50e9)) < 1e-9
    assert dict(row.measured_ms) == {"hierarchical": 988.75, "direct P2P": 2175.16}


@pytest.mark.slow
@pytest.mark.parametrize("key", ["m2n-dsv3-readme-row-gb200", "m2n-dsv3-256gpus-gb200", "nemo-rl-dsv3-h100"])
def test_deepseek_rows_move_exactly_the_lower_bound(key):
    row = published.replay(key)
    assert row.network_bytes == row.lower_bound
    if key.startswith("m2n"):
        assert row.network_bytes == 2 * row.model_bytes  # two generator racks, each needs the model once
