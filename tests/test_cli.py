"""python -m jreshard plan / simulate / demo."""

from __future__ import annotations

import argparse

import pytest

from jreshard.cli import main, parse_layout
from jreshard.sharding.box import Box

FFN = ["--shape", "256,2048,7168", "--src", "ep=16:ep", "--dst", "dp=4,tp=8:-,-,tp"]


def test_layout_syntax():
    lay = parse_layout("dp=2,tp=4:-,tp@8", (6, 16), "float32", 0)
    assert lay.ranks == tuple(range(8, 16))
    assert lay.box_of(13) == Box((0, 4), (6, 8))  # dp 1, tp 1
    both = parse_layout("dp=2,tp=2:dp+tp", (8, 3), "int8", 4)  # dp major, tp minor: 4 blocks
    assert [both.box_of(r).lo[0] for r in (4, 5, 6, 7)] == [0, 2, 4, 6]
    assert len(parse_layout("dp=4", (8,), "int8", 0).replica_groups()) == 1  # no spec: replicated


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("ep16:ep", "AXIS=SIZE"),
        ("ep=16:tp", "mesh axes"),
        ("ep=3:ep", "not divisible"),
        ("ep=2@x", "AXIS=SIZE"),
        ("ep=0", ">= 1"),
    ],
)
def test_bad_layouts_say_what_is_wrong(text, match):
    with pytest.raises(argparse.ArgumentTypeError, match=match):
        parse_layout(text, (8, 8), "float32", 0)


def test_simulate_one_tensor_prints_predicted_times(capsys):
    assert main(["simulate", *FFN]) == 0
    out = capsys.readouterr().out
    assert "destination ranks 72-103" in out  # the destination starts the next 72-GPU domain
    assert "predicted time" in out and "not measured" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("jreshard ", "flat-direct"))}
    assert "9.45 ms" in rows["jreshard"] and "rank 0 network send" in rows["jreshard"]
    assert "37.74 ms" in rows["flat-direct"] and "3.99x" in rows["flat-direct"]


def test_plan_one_tensor_prints_bytes_beside_the_baselines(capsys):
    assert main(["plan", *FFN, "--domain-size", "72"]) == 0
    out = capsys.readouterr().out
    lines = {line[:24].strip(): line[24:].split() for line in out.splitlines() if " GB " in line}
    assert lines["jreshard"][:4] == ["7.52", "GB", "7.52", "GB"]  # network bytes = the lower bound
    assert lines["flat-direct"][:2] == ["30.06", "GB"]  # 4 replicas each fetch the tensor
    assert {"gather-broadcast", "gather-broadcast (ring)"} <= lines.keys()


def test_simulate_a_model(capsys):
    assert (
        main(["simulate", "--model", "llama3-70b", "--train-gpus", "16", "--infer-gpus", "16", "--cluster", "h100"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("Llama-3-70B: 723 tensors")
    assert "DP2 x FSDP8 (JAX)" in out and "TP8 x DP2" in out
    assert "4 fast-link domains" in out and "450.00 GB/s" in out


def test_help_documents_the_layout_syntax(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "MESH[:SPEC][@FIRST_RANK]" in out and "dp+tp" in out


def test_a_model_or_a_tensor_is_required():
    with pytest.raises(SystemExit, match="give --model"):
        main(["simulate", "--shape", "4,4"])
    with pytest.raises(SystemExit, match="n_train=100 must be a positive multiple of 128"):
        main(["plan", "--model", "deepseek-v3", "--train-gpus", "100"])
    with pytest.raises(SystemExit, match="names mesh axis 'tp'"):
        main(["plan", "--shape", "8,8", "--src", "ep=2:tp", "--dst", "tp=2:-,tp"])


def test_demo_still_runs(capsys):
    assert main(["demo"]) == 0
    assert "jreshard" in capsys.readouterr().out
