"""TransferReport and ReportBuilder: the phases of the in-process path, fresh bytes, the backend choice."""

from __future__ import annotations

import pytest

from jreshard.options import Backend
from jreshard.report import ReportBuilder, ReportPhase, TransferReport
from jreshard.sharding.topology import Link


def test_builder_records_the_choice_copy_and_buffer_phases_and_fresh_bytes():
    clock = iter([0.0, 0.0, 0.5, 0.5, 0.75, 2.0])
    b = ReportBuilder(Backend.LOCAL, clock=lambda: next(clock))
    b.choose(Backend.MPI, "requested: arrays on ['cpu'], one process")
    with b.timed(ReportPhase.COPY):
        b.add_bytes(Link.FAST, 1000)
    with b.timed(ReportPhase.BUFFERS):
        b.add_fresh(600)
    r = b.build()
    assert r.backend is Backend.MPI and r.backend_reason.startswith("requested")
    assert (r.copy_s, r.buffers_s, r.total_s, r.fresh_bytes) == (0.5, 0.25, 2.0, 600)
    assert r.seconds_by_phase()[ReportPhase.COPY] == 0.5 and set(r.seconds_by_phase()) == set(ReportPhase)
    line = r.summary()
    assert "copy 500.0 ms" in line and "fresh 600 B" in line and "pack" not in line and "requested" in line


def test_report_validates_the_new_fields():
    with pytest.raises(ValueError, match="fresh_bytes=-1"):
        TransferReport(backend=Backend.LOCAL, fresh_bytes=-1)
    with pytest.raises(ValueError, match=r"copy_s=-1"):
        TransferReport(backend=Backend.LOCAL, copy_s=-1.0)
    assert "no phase timed" in TransferReport(backend=Backend.LOCAL).summary()
