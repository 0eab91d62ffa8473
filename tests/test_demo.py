"""The demo's main job, reduced: it prints the plans beside the baselines and one row per refit, and every
refit is bit-for-bit what jax.device_put gives."""

from __future__ import annotations

import io

import pytest

from jreshard.cli.demo import DemoConfig, main, run


def test_demo_prints_the_table_and_refits_exactly():
    out = io.StringIO()
    rows = run(DemoConfig(vocab=256, d_model=64, layers=1, refits=3), out=out)
    text = out.getvalue()
    for needed in ("jreshard", "gather-broadcast", "flat-direct", "transfer_into ms", "device_put ms"):
        assert needed in text
    assert [r["refit"] for r in rows] == [1, 2, 3]
    assert all(r["exact"] for r in rows)
    r = rows[0]
    assert r["network_bytes"] == r["network_bytes_lower_bound"] > 0
    assert r["gather_broadcast_network_bytes"] > 2 * r["network_bytes"]
    table = [line for line in text.splitlines() if line.strip().split(" ")[0] in {"1", "2", "3"}]
    assert len(table) == 3 and all(line.rstrip().endswith("yes") for line in table)


def test_demo_main_returns_zero(capsys):
    assert main(["--refits", "1", "--layers", "1", "--d-model", "32", "--vocab", "64"]) == 0
    assert "median time" in capsys.readouterr().out


def test_demo_config_is_validated():
    with pytest.raises(ValueError, match="multiples of 4"):
        DemoConfig(d_model=30)
    with pytest.raises(ValueError, match="refits=0"):
        DemoConfig(refits=0)
