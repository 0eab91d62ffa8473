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


def _error(capsys, argv: list[str]) -> str:
    """Run the CLI expecting an argparse error: exit status 2, one ``error:`` line, no traceback."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_model_or_a_tensor_is_required(capsys):
    assert "give --model NAME" in _error(capsys, ["simulate", "--shape", "4,4"])
    assert "n_train=100 must be a positive multiple of 128" in _error(
        capsys, ["plan", "--model", "deepseek-v3", "--train-gpus", "100"]
    )
    assert "names mesh axis 'tp'" in _error(
        capsys, ["plan", "--shape", "8,8", "--src", "ep=2:tp", "--dst", "tp=2:-,tp"]
    )


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["plan", "--shape", "4096x4096"],
            "argument --shape: must be sizes joined by commas, e.g. 256,2048,7168; got '4096x4096'",
        ),
        (["plan", "--model", "llama3-70b", "--domain-size", "-3"], "argument --domain-size: must be > 0, got '-3'"),
        (["simulate", "--model", "llama3-70b", "--domain-size", "0"], "argument --domain-size: must be > 0, got '0'"),
        (["simulate", "--model", "llama3-70b", "--nic-gbs", "-5"], "argument --nic-gbs: must be > 0, got '-5'"),
        (["simulate", "--model", "llama3-70b", "--nic-gbs", "0"], "argument --nic-gbs: must be > 0, got '0'"),
        (
            ["simulate", "--model", "llama3-70b", "--fast-gbs", "abc"],
            "argument --fast-gbs: must be a number, got 'abc'",
        ),
        (["plan", "--model", "llama3-70b", "--chunk-mib", "0"], "argument --chunk-mib: must be > 0, got '0'"),
        (["plan", "--model", "llama3-70b", "--latency-us", "-1"], "argument --latency-us: must be >= 0, got '-1'"),
        (["plan", "--model", "llama3-70b", "--train-gpus", "0"], "argument --train-gpus: must be > 0, got '0'"),
        (["plan", "--model", "llama3-70b", "--max-group-ops", "0"], "argument --max-group-ops: must be > 0, got '0'"),
        (["plan", "--system-config", "missing.json"], "argument --system-config: 'missing.json': no such file"),
        (["plan", "--hf-config", "missing.json"], "argument --hf-config: 'missing.json': no such file"),
        (["plan", "--model", "llama3-70b", "--shape", "4,4"], "give one of --model, --hf-config and --shape"),
    ],
)
def test_bad_arguments_are_one_line_errors_naming_the_value(capsys, argv, says):
    assert says in _error(capsys, argv)


def test_draw_into_a_missing_folder_is_refused_before_any_work(capsys, tmp_path, monkeypatch):
    import jreshard

    def never(*a, **k):
        raise AssertionError("planned before checking --draw")

    monkeypatch.setattr(jreshard, "plan", never)
    png = tmp_path / "nowhere" / "plan.png"
    line = _error(capsys, ["plan", *FFN, "--draw", str(png)])
    assert f"'{png}': the folder '{png.parent}' does not exist" in line


@pytest.mark.parametrize("shape", ["0,8", "8,0", "0"])
def test_a_tensor_of_no_element_is_planned_and_drawn(capsys, tmp_path, shape):
    """A dimension of size 0: nothing moves, which plan prints and draws (both raised: max() of no rank, a
    division by the dimension's size)."""
    png = tmp_path / "plan.png"
    assert main(["plan", "--shape", shape, "--src", "fsdp=4", "--dst", "tp=2", "--draw", str(png)]) == 0
    out = capsys.readouterr().out
    assert "(none: no rank sends or receives a byte)" in out and png.stat().st_size > 0
    assert main(["simulate", "--shape", shape, "--src", "fsdp=4", "--dst", "tp=2"]) == 0


def test_zero_latency_is_kept_not_replaced_by_the_default(capsys):
    assert main(["simulate", *FFN, "--latency-us", "0"]) == 0
    assert "latency 0 us" in capsys.readouterr().out


def test_system_config_and_hf_config(capsys, tmp_path):
    import json

    assert main(["plan", "--system-config", "m2n-qwen235b-128gpus-gb200"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Qwen3-235B-A22B: 1131 tensors")
    assert "TP2 CP2 EP16 ETP1 PP4 (DP4, expert DP1; Megatron)" in out and "2 fast-link domains" in out
    rows = {line[:24].strip(): line[24:].split() for line in out.splitlines() if " GB " in line}
    assert rows["jreshard"][:4] == ["470.19", "GB", "470.19", "GB"]  # network bytes = the lower bound
    assert "send/recv operations per fast-link domain" in out and "busiest rank" in out
    # The same refit from files: an M2N system config and a config.json.
    sysfile, hf = tmp_path / "system.json", tmp_path / "config.json"
    sysfile.write_text(
        json.dumps(
            {
                "train": {"num_gpus": 8, "tp_size": 2, "pp_size": 2, "dp_size": 2},
                "generation": {"num_gpus": 4, "tp_size": 4},
            }
        )
    )
    hf.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 256,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "intermediate_size": 512,
                "vocab_size": 1000,
                "num_hidden_layers": 4,
            }
        )
    )
    argv = ["plan", "--system-config", str(sysfile), "--hf-config", str(hf), "--domain-size", "4", "--ops-per-rank"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "trainer   ranks 0-7: TP2 CP1 EP1 ETP1 PP2 (DP2, expert DP4; Megatron)" in out
    assert "inference ranks 8-11" in out and "groups: the exchange groups of the engine's rounds" in out
    assert "model_type='gpt2'" in _error_after(capsys, tmp_path, sysfile)


def _error_after(capsys, tmp_path, sysfile) -> str:
    import json

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "gpt2"}))
    return _error(capsys, ["plan", "--system-config", str(sysfile), "--hf-config", str(bad)])


def test_demo_still_runs(capsys):
    """The subcommand takes the demo's own arguments (``make demo`` runs it at full size)."""
    assert main(["demo", "--refits", "1", "--layers", "1", "--d-model", "32", "--vocab", "64"]) == 0
    out = capsys.readouterr().out
    assert "jreshard" in out and "median time" in out


@pytest.mark.parametrize(
    ("command", "says", "same"),
    [
        # simulate: the same predicted time and bound, from the same loads
        ("simulate", "predicted from the planner's layout-pair templates", slice(1, 3)),
        # plan: every column of jreshard's row but the time it took (bytes, loads, messages, stages)
        ("plan", "one\nlayout-pair template at a time", slice(0, -2)),
    ],
)
def test_at_scale_the_cli_answers_from_templates_as_the_whole_plan_does(monkeypatch, capsys, command, says, same):
    """Above WHOLE_PLAN_MAX_RANKS, plan and simulate work one layout pair at a time, skip the baselines,
    and print jreshard's row as the whole plan gives it."""
    from jreshard import cli

    args = [command, "--model", "llama3-70b", "--train-gpus", "16", "--infer-gpus", "16", "--domain-size", "8"]
    assert cli.main(args) == 0
    whole = capsys.readouterr().out
    monkeypatch.setattr(cli, "WHOLE_PLAN_MAX_RANKS", 8)
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert says in out and "gather-broadcast" not in out
    line = next(ln for ln in out.splitlines() if ln.startswith("jreshard "))
    want = next(ln for ln in whole.splitlines() if ln.startswith("jreshard "))
    assert line.split()[same] == want.split()[same]
