"""MpiComm under mpiexec at 2, 4 and 8 processes (1 or 2 ranks each): random message groups
checked byte for byte (sized ones too), and a silent peer turned into a TransferTimeoutError naming it."""

import pytest
from mpi_launch import launch, need_mpi, program, results

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(("procs", "ranks_per_proc"), [(2, 2), (4, 1), (8, 1)])
def test_exchange_random_groups(tmp_path, procs, ranks_per_proc):
    need_mpi()
    launch(
        [program(procs, "comm_exchange.py")],
        tmp_path,
        timeout_s=120,
        env={"JRESHARD_RANKS_PER_PROC": str(ranks_per_proc)},
    )
    got = results(tmp_path, "comm")
    assert sorted(got) == list(range(procs))
    assert all("error" not in r for r in got.values()), got
    assert sum(r["received"] for r in got.values()) > 0
    assert sum(r["sized"] for r in got.values()) > 0  # exchange_sized: every message in one group, checked
    err, elapsed = got[0]["timed_out"], got[0]["elapsed"]
    assert err is not None and "timeout_s=1.0" in err
    last_rank = procs * ranks_per_proc - 1
    assert f"ranks [{last_rank}] did not send" in err and f"MPI processes [{procs - 1}]" in err
    assert 1.0 <= elapsed < 5.0  # the 1 s timeout, with a loaded host's slack
    # A casting sender's messages are cut finer only where each process has a core, and all agree.
    (cores,) = {r["cores"] for r in got.values()}
    assert {r["pipelines_packs"] for r in got.values()} == {procs <= cores}
