"""Backend selection and its error messages; the TransferReport value type.

The importer is a stand-in: it says which module names import, so the tests
cover every branch whether or not CuPy or mpi4py is installed here.
"""

from __future__ import annotations

import dataclasses
import types
import warnings

import pytest

from jreshard.call.routes import Placement, select_backend
from jreshard.errors import BackendUnavailableError, cuda_extra
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder, ReportPhase, TransferReport
from jreshard.sharding.topology import Link

CPU_HERE = Placement(platforms=frozenset({"cpu"}), single_process=True)
CPU_MANY = Placement(platforms=frozenset({"cpu"}), single_process=False)
GPU_HERE = Placement(platforms=frozenset({"gpu"}), single_process=True)
GPU_MANY = Placement(platforms=frozenset({"gpu"}), single_process=False)


def importer(*available: str):
    def import_module(name: str) -> types.ModuleType:
        if name in available:
            mod = types.ModuleType(name)
            mod.available = True  # as cupy.cuda.nccl declares when libnccl loaded
            return mod
        raise ModuleNotFoundError(f"No module named {name!r}")

    return import_module


def no_plugin(name: str) -> None:
    return None


def cuda13_plugin(name: str) -> object | None:
    return object() if name == "jax_cuda13_plugin" else None


ALL = importer("cupy.cuda.nccl", "mpi4py.MPI")
NONE = importer()


@pytest.mark.parametrize(
    ("placement", "available", "expected"),
    [
        (CPU_HERE, NONE, Backend.LOCAL),
        (GPU_HERE, NONE, Backend.LOCAL),  # one process, several GPUs: device-to-device copies
        (GPU_MANY, ALL, Backend.NCCL),
        (GPU_MANY, importer("cupy.cuda.nccl"), Backend.NCCL),
        (CPU_MANY, ALL, Backend.MPI),
        (CPU_MANY, importer("mpi4py.MPI"), Backend.MPI),
    ],
)
def test_auto_picks(placement, available, expected):
    choice = select_backend("auto", placement, import_module=available, find_spec=no_plugin)
    assert choice.backend is expected
    assert choice.reason.startswith("auto:")


def test_auto_on_gpus_without_nccl_raises_instead_of_falling_back_to_mpi():
    with pytest.raises(BackendUnavailableError) as info:
        select_backend(Backend.AUTO, GPU_MANY, import_module=importer("mpi4py.MPI"), find_spec=cuda13_plugin)
    msg = str(info.value)
    assert "cupy.cuda.nccl" in msg and "jreshard[cuda13]" in msg and "backend='mpi'" in msg


def test_auto_on_cpus_without_mpi_names_the_mpi_extra():
    with pytest.raises(BackendUnavailableError, match=r"jreshard\[mpi\]"):
        select_backend("auto", CPU_MANY, import_module=NONE, find_spec=no_plugin)


def test_explicit_backends_never_fall_back():
    with pytest.raises(BackendUnavailableError, match=r"jreshard\[cuda12\]' \(CUDA 12\) or 'jreshard\[cuda13\]"):
        select_backend("nccl", GPU_HERE, import_module=importer("mpi4py.MPI"), find_spec=no_plugin)
    with pytest.raises(BackendUnavailableError, match=r"jreshard\[mpi\]"):
        select_backend(Backend.MPI, CPU_HERE, import_module=importer("cupy.cuda.nccl"), find_spec=no_plugin)
    with pytest.raises(BackendUnavailableError, match="several processes"):
        select_backend("local", CPU_MANY, import_module=ALL, find_spec=no_plugin)
    with pytest.raises(BackendUnavailableError, match="CUDA device buffers"):
        select_backend("nccl", CPU_MANY, import_module=ALL, find_spec=no_plugin)


def test_explicit_backends_that_can_start():
    assert select_backend("local", GPU_HERE, import_module=NONE).backend is Backend.LOCAL
    assert select_backend("mpi", GPU_MANY, import_module=ALL).backend is Backend.MPI  # CUDA-aware MPI: caller's word
    choice = select_backend(Options(backend="nccl").backend, GPU_HERE, import_module=ALL)
    assert choice.backend is Backend.NCCL and choice.reason.startswith("requested:")


def test_a_library_that_fails_to_load_is_reported_too():
    def broken(name: str) -> types.ModuleType:
        raise OSError("libnccl.so.2: cannot open shared object file")

    with pytest.raises(BackendUnavailableError, match=r"libnccl\.so\.2.*jreshard\[cuda12\]"):
        select_backend("nccl", GPU_MANY, import_module=broken, find_spec=lambda n: n == "jax_cuda12_plugin" or None)


def test_cupy_without_libnccl_is_unavailable_and_says_why():
    def cupy_without_nccl(name: str) -> types.ModuleType:
        warnings.warn("nccl library could not be loaded. Reason: ImportError (libnccl.so.2)", UserWarning, stacklevel=1)
        mod = types.ModuleType(name)
        mod.available = False
        return mod

    with pytest.raises(BackendUnavailableError, match=r"available is False \(nccl library could not be loaded.*cuda13"):
        select_backend("auto", GPU_MANY, import_module=cupy_without_nccl, find_spec=cuda13_plugin)


def test_bad_backend_name():
    with pytest.raises(ValueError, match="requested='gloo'"):
        select_backend("gloo", CPU_HERE)


def test_cuda_extra_names():
    assert "cuda13" in cuda_extra(cuda13_plugin) and "cuda12" not in cuda_extra(cuda13_plugin)
    assert "cuda12" in cuda_extra(no_plugin) and "cuda13" in cuda_extra(no_plugin)


def test_placement_of_devices():
    dev = types.SimpleNamespace
    devices = [dev(platform="gpu", process_index=0), dev(platform="gpu", process_index=1)]
    assert Placement.of_devices(devices, process_index=0) == GPU_MANY
    assert Placement.of_devices(devices[:1], process_index=0) == GPU_HERE
    mixed = Placement.of_devices([dev(platform="cpu", process_index=0), *devices[:1]], process_index=0)
    assert not mixed.on_gpus
    with pytest.raises(ValueError, match="platforms is empty"):
        Placement.of_devices([], process_index=0)


def test_real_probe_agrees_with_installed_modules():
    # Whatever is installed here, select_backend either picks MPI or names the extra.
    try:
        choice = select_backend("mpi", CPU_MANY)
    except BackendUnavailableError as err:
        assert "jreshard[mpi]" in str(err)
    else:
        assert choice.backend is Backend.MPI


# ---- TransferReport --------------------------------------------------------


def test_report_builder_accumulates_phases_bytes_and_peak_staging():
    clock = iter([10.0, 10.0, 10.25, 11.0, 11.5, 12.0])
    b = ReportBuilder(Backend.NCCL, "auto: test", clock=lambda: next(clock))
    with b.timed(ReportPhase.PACK):
        b.staging(1000)
    with b.timed(ReportPhase.NETWORK):
        b.add_bytes(Link.NETWORK, 4000, messages=2)
        b.staging(500)
        b.staging(-1500)
    b.add_bytes(Link.FAST, 1000, messages=1)
    b.add_bytes(Link.SAME_DEVICE, 1000)
    b.add_seconds(ReportPhase.UNPACK, 0.125)
    r = b.build()
    assert r.pack_s == 0.25 and r.network_s == 0.5 and r.unpack_s == 0.125 and r.total_s == 2.0
    assert r.peak_staging_bytes == 1500 and r.messages == 3
    assert r.bytes_by_link() == {Link.SAME_DEVICE: 1000, Link.FAST: 1000, Link.NETWORK: 4000}
    assert r.achieved_gbps == pytest.approx(6000 / 2.0 / 1e9)
    assert r.network_gbps == pytest.approx(4000 / 0.5 / 1e9)
    assert set(r.seconds_by_phase()) == set(ReportPhase)
    assert r.summary().startswith("nccl: 6000 B")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.total_s = 3.0  # type: ignore[misc]


def test_report_validates():
    with pytest.raises(ValueError, match=r"backend=<Backend\.AUTO"):
        TransferReport(backend=Backend.AUTO)
    with pytest.raises(ValueError, match=r"network_bytes=-1"):
        TransferReport(backend=Backend.LOCAL, network_bytes=-1)
    with pytest.raises(ValueError, match=r"pack_s=-0\.5"):
        TransferReport(backend=Backend.LOCAL, pack_s=-0.5)
    assert TransferReport(backend=Backend.LOCAL).achieved_gbps == 0.0
