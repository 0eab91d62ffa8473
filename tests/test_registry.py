"""The transport registry (jreshard.call.routes): one record per transport, looked up by name.

A transport is one module with a ``RECORD`` plus one registry line: the loopback and recording
transports (engine/) run a transfer through the same path as NCCL and MPI, and a transport this
test defines runs after one ``REGISTRY`` line.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard.call import routes
from jreshard.call.routes import Placement, select_backend
from jreshard.engine.loopback import LocalComm
from jreshard.engine.record import Opened, Reach, TransportRecord
from jreshard.engine.recording import RecordingComm
from jreshard.errors import BackendUnavailableError
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder
from jreshard.sharding.topology import Link

DEVS = np.array(jax.devices())
SRC = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x"))
DST = NamedSharding(Mesh(DEVS[4:].reshape(2, 2), ("a", "b")), P("b", "a"))
CPU_HERE = Placement(platforms=frozenset({"cpu"}), single_process=True)


def test_every_backend_value_and_transport_folder_has_a_record():
    for name in routes.REGISTRY:
        record = routes.transport(name)
        assert isinstance(record, TransportRecord) and record.name == name
        assert record.auto <= record.serves and record.serves
        assert (record.open is None) != (record.run is None) or name == "nixl"  # nixl runs no call
    assert {b.value for b in Backend} - {"auto"} <= set(routes.REGISTRY)
    # every reach of one program has exactly one transport auto picks; two programs have none
    for reach in Reach:
        picked = [n for n in routes.REGISTRY if reach in routes.transport(n).auto]
        assert len(picked) == (reach is not Reach.PROGRAMS), (reach, picked)


def test_an_unknown_name_is_refused_with_the_registered_ones():
    with pytest.raises(ValueError, match=r"name='gloo' is not registered; registered: \['local'"):
        routes.transport("gloo")
    with pytest.raises(ValueError, match="forms no groups between programs"):
        routes.kit("xla")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="runs the engine's rounds"):
        routes.runner("mpi")


def test_program_transports_are_the_records_that_serve_two_programs():
    assert routes.program_transport("mpi", "RefitGroup.connect") == "mpi"
    with pytest.raises(ValueError, match=r"RefitGroup.connect: transport='xla'; expected one of \['mpi', 'nixl'\]"):
        routes.program_transport("xla", "RefitGroup.connect")
    with pytest.raises(
        BackendUnavailableError, match=r"transport 'nixl' cannot start: importing NIXL failed.*nixl-cu12"
    ):
        routes.program_transport("nixl", "RefitGroup.connect", import_module=_none)


def _none(name: str) -> types.ModuleType:
    raise ModuleNotFoundError(f"No module named {name!r}")


def test_nixl_is_a_backend_value_that_refuses_a_transfer_call_before_any_byte_moves():
    assert Options(backend="nixl").backend is Backend.NIXL
    with pytest.raises(BackendUnavailableError, match=r"backend 'nixl' cannot start: it serves between two programs"):
        select_backend("nixl", CPU_HERE)
    x = jax.device_put(jnp.arange(16.0).reshape(4, 4), SRC)
    dst = jax.device_put(jnp.zeros((4, 4)), DST)
    with pytest.raises(BackendUnavailableError, match="backend='local' or backend='mpi' or backend='xla'"):
        jreshard.transfer_into(x, dst, options=Options(backend="nixl"))
    assert not dst.is_deleted()  # refused before the donation


def _run(name: str, x: jax.Array, target: NamedSharding, builder: ReportBuilder | None = None) -> jax.Array:
    builder = builder or ReportBuilder(Backend.LOCAL)
    (out,) = routes.run_engine([x], [target], name, True, None, Options(), builder)
    return out


@pytest.mark.parametrize("name", ["loopback", "recording", "local"])
def test_the_engine_runs_over_a_transport_named_in_the_registry(name):
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), SRC)
    out = _run(name, x, DST)
    want = jax.device_put(x, DST)
    assert out.sharding == DST
    for a, b in zip(out.addressable_shards, want.addressable_shards, strict=True):
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


def test_the_recording_transport_counts_the_bytes_of_the_plan(monkeypatch):
    seen: list[RecordingComm] = []
    real = routes.transport("recording")

    def record_open(devices, single_process, options, topology):
        opened = real.open(devices, single_process, options, topology)
        seen.append(opened.comm)
        return opened

    counted = dataclasses.replace(real, open=record_open)
    registered = routes.transport
    monkeypatch.setattr(routes, "transport", lambda n: counted if n == "recording" else registered(n))
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), SRC)
    builder = ReportBuilder(Backend.LOCAL)
    _run("recording", x, DST, builder)
    stats = jreshard.plan(x, DST).stats()
    moved = builder.build().bytes_by_link()
    assert (moved[Link.FAST], moved[Link.NETWORK]) == (stats.fast_bytes, stats.network_bytes) != (0, 0)
    recorded = seen[0].bytes_by_link()  # the data, and the pair-paced schedule's mail between the same ranks
    assert recorded[Link.FAST] >= stats.fast_bytes and recorded[Link.NETWORK] == stats.network_bytes


def test_a_new_transport_is_one_record_and_one_registry_line(monkeypatch):
    opened: list[int] = []

    def _open(devices, single_process, options, topology):
        opened.append(len(devices))
        return Opened(comm=LocalComm(sorted(devices)), close=lambda: opened.append(-1))

    module = types.ModuleType("jreshard_test_transport")
    module.RECORD = TransportRecord(  # type: ignore[attr-defined]
        name="pigeon", summary="a test transport", serves=frozenset({Reach.CPU_ONE_PROCESS}), open=_open
    )
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(routes.REGISTRY, "pigeon", module.__name__)  # the one line
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), SRC)
    out = _run("pigeon", x, DST)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    assert opened == [8, -1]  # opened over the 8 devices of the call, closed after it
    routes._record.cache_clear()


def test_a_record_must_be_registered_under_its_own_name(monkeypatch):
    module = types.ModuleType("jreshard_test_misnamed")
    module.RECORD = TransportRecord(name="a", summary="", serves=frozenset({Reach.PROGRAMS}))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(routes.REGISTRY, "b", module.__name__)
    with pytest.raises(ValueError, match="registers 'a' under the name 'b'"):
        routes.transport("b")
    routes._record.cache_clear()


def test_records_check_their_fields():
    with pytest.raises(ValueError, match="not a subset of serves"):
        TransportRecord(name="x", summary="", serves=frozenset({Reach.PROGRAMS}), auto=frozenset({Reach.CPU_PROCESSES}))
    with pytest.raises(ValueError, match="lower-case"):
        TransportRecord(name="X", summary="", serves=frozenset(Reach))
