"""Across processes under mpiexec: multi-controller transfers between random layouts (2, 4 and 8
processes with 1 or 2 CPU devices each), an MPMD trainer + server doing 5 versioned refits, a refit of random
leaves (every dtype, zero-size and scalar shapes, random shardings on each side) between two programs, mismatched
declarations rejected on both sides, and a peer killed mid-refit (two launches: the other program
survives, raises within the timeout and keeps the previous version)."""

import time

import pytest
from mpi_launch import MPIEXEC, launch, need_mpi, program, results, start_and_wait

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(("procs", "devices"), [(2, 2), (4, 1), (8, 1)])
def test_multicontroller_random_layouts(tmp_path, procs, devices):
    need_mpi()
    launch([program(procs, "multi_transfer.py")], tmp_path, devices=devices, timeout_s=150)
    got = results(tmp_path, "multi")
    assert sorted(got) == list(range(procs))
    assert all(r["devices"] == procs * devices for r in got.values())
    assert sum(r["checked"] for r in got.values()) > 0
    # every (case, leaf) has each target shard on exactly one process: 6 cases x 2 leaves
    assert sum(r["empty"] for r in got.values()) > 0  # some process held no target device: empty result


@pytest.mark.parametrize(
    ("trainers", "servers", "devices", "mode"), [(2, 2, 2, "guard"), (4, 4, 1, "ok"), (2, 2, 2, "cast")]
)
def test_mpmd_refits_fsdp_to_tp_dp(tmp_path, trainers, servers, devices, mode):
    """``guard``: every whole-plan function raises; each process must plan only its own ranks. ``cast``: a
    bfloat16 server, every shard the bits of the trainer's ``astype(bfloat16)``, deltas compared in bfloat16."""
    need_mpi()
    launch(
        [program(trainers, "refit_body.py", "source", mode), program(servers, "refit_body.py", "destination", mode)],
        tmp_path,
        devices=devices,
        timeout_s=150,
    )
    src, dst = results(tmp_path, "refit-source"), results(tmp_path, "refit-destination")
    assert len(src) == trainers and len(dst) == servers
    for r in (*src.values(), *dst.values()):
        assert "error" not in r, r.get("error")
        assert r["versions"] == [1, 2, 3, 4, 5]
        if mode == "guard":
            assert r["planned_ranks"] == r["mine"] and len(r["mine"]) == devices
    # every destination shard byte was checked against numpy at every version
    per_version = [sum(r["bytes"][v] for r in dst.values()) for v in range(5)]
    assert len(set(per_version)) == 1 and per_version[0] > 0
    # deltas are on between programs by default: the first refit is full, the later ones send the changes
    for r in src.values():
        assert [m for m, *_ in r["delta"]] == ["full", "delta", "delta", "delta", "delta"], r["delta"]
        full, later = r["delta"][0], r["delta"][1:]
        assert full[1] >= full[2] > 0  # whole chunks and their headers
        assert all(sent < 0.6 * whole for _, sent, whole, _ in later), later


@pytest.mark.parametrize(
    ("seed", "flags"),
    [
        *[(1, ""), (2, "verify"), (3, "x64"), (4, "delta"), (5, "async into"), (6, "delta async into verify")],
        *[(7, "nixl"), (8, "nixl delta async into verify")],
    ],
)
def test_a_refit_of_random_leaves_between_two_programs(tmp_path, seed, flags):
    """Every dtype a refit moves, shapes with sizes of 0 and scalars, each side its own random shardings over
    4 devices (some leaves cast on the destination): two versions, every destination shard's bits checked;
    with ``verify``, and with ``jax_enable_x64`` and the 64-bit dtypes (``complex128`` used to fail); with deltas
    (three versions, a tenth of the elements changed each), a background pull and a pull into the arrays held; and
    the group formed over NIXL instead (prepared NIXL groups between the two programs)."""
    need_mpi()
    args = [str(seed), "40", *flags.split()]
    launch(
        [program(1, "refit_random_body.py", "source", *args), program(1, "refit_random_body.py", "destination", *args)],
        tmp_path,
        devices=4,
        timeout_s=150,
    )
    src, dst = results(tmp_path, "random-source"), results(tmp_path, "random-destination")
    assert len(src) == 1 and len(dst) == 1
    for r in (*src.values(), *dst.values()):
        assert "error" not in r, r.get("error")
        assert r["version"] == (3 if "delta" in flags else 2)
    if "delta" in flags:  # the later versions went as deltas
        ((_, sent),) = src.items()
        assert sent["modes"] == ["full", "delta", "delta"], sent["modes"]
    ((_, got),) = dst.items()
    assert got["leaves"] == 40 and got["bad"] == [], got["bad"]


def test_mismatched_declarations_rejected_on_both_sides(tmp_path):
    need_mpi()
    launch(
        [program(2, "refit_body.py", "source", "mismatch"), program(2, "refit_body.py", "destination", "mismatch")],
        tmp_path,
        devices=2,
        timeout_s=120,
    )
    got = results(tmp_path, "refit-source") | results(tmp_path, "refit-destination")
    assert sorted(got) == [0, 1, 2, 3]
    messages = {r["rejected"] for r in got.values()}
    assert len(messages) == 1 and None not in messages  # the same full report everywhere
    (msg,) = messages
    assert "no weights moved" in msg
    assert "['embed']: source shape (64, 16) != destination shape (65, 16)" in msg
    assert "parameter ['l0_norm'] is declared by the source side only" in msg
    assert "parameter ['extra'] is declared by the destination side only" in msg
    assert "process 3 (destination): declares device CpuDevice(id=0) that it does not have" in msg


@pytest.mark.parametrize("delta", ["off", "on"])
@pytest.mark.parametrize("victim", ["source", "destination"])
def test_peer_killed_mid_refit(tmp_path, victim, delta):
    """A SIGKILLed process in the data phase of version 3: its peers raise within the timeout and keep version 2
    (with deltas on too: the killed refit's chunks travel as deltas, and what survives is still version 2)."""
    need_mpi()
    timeout = 3.0
    env = {
        "JRESHARD_TIMEOUT": str(timeout),
        "JRESHARD_ADDRESS": str(tmp_path / "address"),
        "JRESHARD_EXPECT": "2",
        "JRESHARD_DELTA": delta,
    }
    mode = f"kill-{victim}"
    cmds = [
        [str(MPIEXEC), *program(2, "refit_body.py", "source", mode)],
        [str(MPIEXEC), *program(2, "refit_body.py", "destination", mode)],
    ]
    t0 = time.monotonic()
    start_and_wait(cmds, tmp_path, devices=2, timeout_s=120, env=env, check=False)
    assert time.monotonic() - t0 < 60
    survivors = results(tmp_path, "refit-destination" if victim == "source" else "refit-source")
    assert len(survivors) == 2  # the victim's own program is torn down by its launcher
    for r in survivors.values():
        assert r["failed_at"] == 3 and r["versions"] == [1, 2], r
        if delta == "off":  # versions 1 and 2, then 3: waiting in the compiled replay when it failed
            assert r["native_steps"] >= 3, r
        else:  # version 2 went as a delta, version 3 was one when the peer died
            assert [m for m, *_ in r["delta"]] == ["full", "delta"], r
        # a silent peer is timed out; a dead one is seen at once, its connection to the control plane closed
        said = ("Timeout", "did not answer", "no answer", "closed the group", "is gone")
        assert any(s in r["error"] for s in said), r
        assert r["elapsed"] < timeout + 2.0, r  # raised within the configured timeout (+ polling slack)
        assert r["version_after_failure"] == 2
        if victim == "source":
            assert r["previous_intact_bytes"] > 0  # the destination still holds version 2, byte for byte


@pytest.mark.parametrize(("procs", "devices"), [(2, 2), (4, 1)])
def test_report_over_mpi_counts_the_plans_bytes_and_messages(tmp_path, procs, devices):
    need_mpi()
    launch([program(procs, "report_transfer.py")], tmp_path, devices=devices, timeout_s=120)
    got = results(tmp_path, "report")
    assert sorted(got) == list(range(procs)), got
    for r in got.values():
        assert "error" not in r, r
        assert r["backend"] == "mpi"
    network, fast, same, messages = (
        sum(r[k] for r in got.values()) for k in ("network", "fast", "same_device", "messages")
    )
    (plan,) = {tuple(r["plan"]) for r in got.values()}
    assert (network, fast, same, messages) == plan and network > 0


def test_refit_groups_one_after_another_on_the_same_processes(tmp_path):
    """A group's close notice stays with that group: three groups in a row each move their version."""
    need_mpi()
    launch(
        [program(2, "refit_twice_body.py", "source"), program(2, "refit_twice_body.py", "destination")],
        tmp_path,
        devices=1,
        timeout_s=120,
    )
    got = results(tmp_path, "twice-source") | results(tmp_path, "twice-destination")
    assert len(got) == 4 and all("error" not in r for r in got.values()), got
    dst = [r["got"] for r in got.values() if r["got"]]
    assert dst and all(g == [[1, 0.0], [2, 1.0], [3, 2.0]] for g in dst)


@pytest.mark.parametrize(("procs", "devices"), [(2, 2), (4, 1)])
def test_views_across_processes(tmp_path, procs, devices):
    """jreshard.transfer of fused, cast and block-FP8 views over global arrays: every target shard equals
    numpy on the global arrays; the network bytes all processes sent equal the lowering's."""
    need_mpi()
    launch([program(procs, "views_transfer.py")], tmp_path, devices=devices, timeout_s=150)
    got = results(tmp_path, "views")
    assert sorted(got) == list(range(procs))
    for r in got.values():
        assert "error" not in r, r
        assert r["backend"] == "mpi"
        assert "transfer_into of views runs in one process" in r["refused"]
    assert sum(r["checked"] for r in got.values()) == 7 * procs * devices  # every target shard, once
    (expect,) = {r["expect_network"] for r in got.values()}
    assert sum(r["network"] for r in got.values()) == expect > 0
    (moved,) = {r["expect_moved"] for r in got.values()}
    assert sum(r["network"] + r["fast"] + r["same_device"] for r in got.values()) == moved
    assert sum(r["messages"] for r in got.values()) > 0
    assert all(0 < r["peak_staging"] <= 256 * devices for r in got.values())  # the bound, per rank


def test_senders_pack_the_next_round_while_mpi_moves_the_one_before(tmp_path):
    need_mpi()
    launch([program(2, "pack_ahead.py")], tmp_path, devices=2, timeout_s=120)
    got = results(tmp_path, "ahead")
    assert sorted(got) == [0, 1] and all("error" not in r for r in got.values()), got
    sender, receiver = (next(r for r in got.values() if r["process"] == p) for p in (0, 1))
    assert receiver["checked"] == 64 * 256  # every destination element, bit for bit against numpy's cast
    assert sender["ahead"] >= 3 and sender["starts"] >= sender["ahead"]  # rounds packed while one was posted
