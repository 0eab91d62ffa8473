"""RefitGroup's messages: a declaration mismatch names each leaf and field that differs, counts its
problems in good English, and a peer that closes the group is noticed at once (under mpiexec)."""

import pytest

from jreshard.refit.decl import leaf_differences, problems, validate


def decl(role, params, ndev=1):
    return {"role": role, "ndev": ndev, "domain": None, "params": params, "errors": []}


def test_problem_counts_read_as_english():
    assert problems(1) == "1 problem" and problems(2) == "2 problems" and problems(0) == "0 problems"


def test_leaf_differences_name_every_field_with_both_values():
    declared = [["['w']", [8, 4], "float32", [[0, [0, 0], [8, 4]]]], ["['b']", [4], "float32", [[0, [0], [4]]]]]
    now = [["['w']", [8, 2], "bfloat16", [[0, [0, 0], [8, 2]]]], ["['c']", [4], "float32", [[0, [0], [4]]]]]
    assert leaf_differences(now, declared) == [
        "['c'] is not declared",
        "['b'] is missing",
        "['w']: shape (8, 2) where (8, 4) was declared",
        "['w']: dtype bfloat16 where float32 was declared",
        "['w']: sharding (boxes per device) [[0, [0, 0], [8, 2]]] where [[0, [0, 0], [8, 4]]] was declared",
    ]
    assert leaf_differences(declared, declared) == []


def test_validate_names_the_field_per_leaf_on_both_sides_and_within_a_side():
    src = decl("source", [["['w']", [8, 4], "float32", [[0, [0, 0], [8, 4]]]]])
    dst = decl("destination", [["['w']", [8, 4], "int8", [[0, [0, 0], [8, 4]]]]])
    other = decl("destination", [["['w']", [8, 5], "int8", [[0, [0, 0], [8, 5]]]]])
    assert validate({0: src, 1: dst}) == ["parameter ['w']: source dtype float32 != destination dtype int8"]
    errors = validate({0: src, 1: dst, 2: other})
    assert "process 2 (destination) declares ['w'] with shape (8, 5) (not (8, 4)) unlike process 1" in errors[0]


@pytest.mark.mpi
def test_a_peer_that_closes_is_noticed_at_once(tmp_path):
    from mpi_launch import launch, need_mpi, program, results

    need_mpi()
    launch(
        [program(1, "refit_close_body.py", "source"), program(1, "refit_close_body.py", "destination")],
        tmp_path,
        devices=1,
        timeout_s=100,
    )
    src, dst = results(tmp_path, "close-source"), results(tmp_path, "close-destination")
    assert src[0] == {"versions": [1, 2]}, src
    (d,) = dst.values()
    assert d["versions"] == [1, 2] and d["version"] == 2, d
    assert "process 0 (source) closed the group" in d["error"], d
    assert d["elapsed"] < 5.0  # timeout_s is 30: the notice, not the deadline, ended the wait
