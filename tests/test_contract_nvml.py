"""Contract tests against the installed pynvml (marker ``cupy_contract``; no GPU needed).

The NVML calls jreshard makes are driven with the real module: on a machine without
the NVIDIA driver they fail inside NVML (``NVMLError``), never with a ``TypeError``;
the stand-in of ``tests/cupy_standins.py`` is compared with pynvml's functions,
structs and constants. Skips, with the reason, where pynvml is not installed.
"""

from __future__ import annotations

import ctypes
import inspect

import pytest
from cupy_standins import GpuFabricInfo, GpuFabricInfoV, fake_nvml

from jreshard.cuda import nvml as jnvml
from jreshard.errors import BackendUnavailableError

pytestmark = pytest.mark.cupy_contract


@pytest.fixture(scope="module")
def pynvml():
    return pytest.importorskip("pynvml", reason="pynvml is not installed (make test installs jreshard[cuda12])")


def fields(struct) -> list[tuple[str, int]]:
    return [(name, ctypes.sizeof(kind)) for name, kind in struct._fields_]


def test_stand_in_matches_pynvml(pynvml):
    fake = fake_nvml({})
    names = ("nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetHandleByPciBusId",
             "nvmlDeviceGetCount", "nvmlInit", "nvmlShutdown")  # fmt: skip
    for name in names:  # what jreshard and gpu_check's nvml stage call
        real = list(inspect.signature(getattr(pynvml, name)).parameters)
        assert list(inspect.signature(getattr(fake, name)).parameters) == real, name
    assert fields(GpuFabricInfo) == fields(pynvml.c_nvmlGpuFabricInfo_t)
    assert fields(GpuFabricInfoV) == fields(pynvml.c_nvmlGpuFabricInfoV_t)
    assert GpuFabricInfoV().version == pynvml.c_nvmlGpuFabricInfoV_t().version
    assert (
        jnvml.FABRIC_STATE_COMPLETED == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED == fake.NVML_GPU_FABRIC_STATE_COMPLETED
    )
    assert issubclass(pynvml.NVMLError, Exception)


def test_fabric_info_call_reaches_nvml(pynvml):
    """jreshard's call shape (handle, byref(struct)) gets past Python into pynvml, which fails
    without a driver (NVMLError, caught: the GPU's domain is its host)."""
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("NVML starts here: a GPU host (the gpu tests cover it)")
    except pynvml.NVMLError:
        pass
    with pytest.raises(pynvml.NVMLError):
        jnvml._fabric_info(ctypes.c_void_p(0), pynvml)
    assert jnvml.domain_key(ctypes.c_void_p(0), nvml=pynvml, hostname="h") == "host:h"


def test_nvml_without_a_driver_is_backend_unavailable(pynvml):
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("NVML starts here: a GPU host")
    except pynvml.NVMLError:
        pass
    with pytest.raises(BackendUnavailableError, match=r"nvmlInit failed.*Topology\.from_domains"):
        jnvml.local_domain_keys([0], nvml=pynvml, pci_bus_id=lambda o: "0000:00:00.0", hostname="h")
