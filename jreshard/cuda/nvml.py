"""Fast-link domains of GPUs, from NVML. The NVML calls are not run on GPU yet.

A GPU's domain key is its NVLink fabric clique where NVML reports one (the
``clusterUuid`` and ``cliqueId`` of ``nvmlDeviceGetGpuFabricInfo``, as on
GB200/GB300 NVL72 racks, whose 72 GPUs span 18 hosts), otherwise its host: the
GPUs of one DGX/HGX node share NVSwitch, and GPUs of one host share at least PCIe
and host memory. Keys are strings, equal on every process that sees the same
fabric, so processes can exchange them and build one :class:`Topology`.

Ranks need not be contiguous or aligned: :func:`topology_from_domain_keys` maps
any ranks to domain ids by their keys. Every discovered key can be overridden
explicitly, rank by rank.

This module imports neither NVML nor CuPy at import time: the ``nvml`` module
(``pynvml``, from the ``nvidia-ml-py`` package) and the PCI bus id lookup are
arguments.
"""

from __future__ import annotations

import ctypes
import importlib
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from jreshard.errors import BackendUnavailableError, TopologyError
from jreshard.sharding.topology import Topology
from jreshard.types import NvmlHandle, NvmlModule

__all__ = ["domain_key", "local_domain_keys", "topology_from_domain_keys"]

FABRIC_STATE_COMPLETED = 3  # NVML_GPU_FABRIC_STATE_COMPLETED: the GPU has joined its NVLink fabric


def _pynvml() -> NvmlModule:
    try:
        return importlib.import_module("pynvml")
    except ImportError as err:
        raise BackendUnavailableError(
            f"NVML topology discovery: pynvml does not import ({err}); the fix is pip install nvidia-ml-py, "
            "or pass the domains explicitly with Topology.from_domains"
        ) from err


def _cuda_pci_bus_id(ordinal: int) -> str:
    cupy = importlib.import_module("cupy")
    return str(cupy.cuda.runtime.deviceGetPCIBusId(ordinal))


def _fabric_info(handle: NvmlHandle, nvml: NvmlModule) -> Any:
    """NVML's fabric info of one GPU, filled into the struct NVML writes through a pointer.

    ``nvmlDeviceGetGpuFabricInfoV`` (versioned struct) where this pynvml has it, else
    the older ``nvmlDeviceGetGpuFabricInfo``; both take ``(handle, byref(struct))``.
    """
    if hasattr(nvml, "nvmlDeviceGetGpuFabricInfoV"):
        info = nvml.c_nvmlGpuFabricInfoV_t()  # sets its own version field
        nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
    else:
        info = nvml.c_nvmlGpuFabricInfo_t()
        nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
    return info


def domain_key(handle: NvmlHandle, *, nvml: NvmlModule, hostname: str) -> str:
    """The fast-link domain key of one GPU (an NVML device handle). Not run on GPU.

    Returns ``"nvlink:<cluster uuid hex>:<clique id>"`` when the GPU reports a
    completed NVLink fabric registration, else ``"host:<hostname>"`` (also when
    NVML answers NotSupported or lacks the call, as on GPUs without a multi-node
    NVLink fabric).
    """
    try:
        info = _fabric_info(handle, nvml)
    except nvml.NVMLError:  # NotSupported, FunctionNotFound
        return f"host:{hostname}"
    uuid = bytes(info.clusterUuid)
    if int(info.state) != FABRIC_STATE_COMPLETED or not any(uuid):
        return f"host:{hostname}"
    return f"nvlink:{uuid.hex()}:{int(info.cliqueId)}"


def local_domain_keys(
    ordinals: Iterable[int],
    *,
    nvml: NvmlModule = None,
    pci_bus_id: Callable[[int], str] | None = None,
    hostname: str | None = None,
) -> dict[int, str]:
    """Domain keys of this process's GPUs, by CUDA ordinal. Not run on GPU.

    Args:
      ordinals: CUDA device ordinals (``jax_device.local_hardware_id``).
      nvml: the NVML module (``pynvml`` by default).
      pci_bus_id: maps a CUDA ordinal to its PCI bus id, so the NVML handle is the
        same GPU whatever ``CUDA_VISIBLE_DEVICES`` says (CuPy's by default).
      hostname: this host's name (``socket.gethostname()`` by default).

    Raises:
      BackendUnavailableError: pynvml does not import, or NVML does not start (no driver).
    """
    nvml = nvml if nvml is not None else _pynvml()
    pci_bus_id = pci_bus_id or _cuda_pci_bus_id
    hostname = hostname or socket.gethostname()
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as err:  # no driver, or no libnvidia-ml
        raise BackendUnavailableError(
            f"NVML topology discovery: nvmlInit failed ({type(err).__name__}: {err}); NVML needs the NVIDIA "
            "driver. The fix is to run on a GPU host, or pass the domains explicitly with Topology.from_domains"
        ) from err
    try:
        return {
            int(o): domain_key(nvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id(int(o))), nvml=nvml, hostname=hostname)
            for o in ordinals
        }
    finally:
        nvml.nvmlShutdown()


def topology_from_domain_keys(
    keys: Mapping[int, str],
    *,
    devices: Mapping[int, int] | None = None,
    overrides: Mapping[int, str] | None = None,
    **links: float,
) -> Topology:
    """A :class:`Topology` whose domains are the ranks' domain keys.

    Domain ids number the distinct keys in sorted order, so every process that
    holds the same ``{rank: key}`` builds the same topology.

    Args:
      keys: ``{rank: domain key}`` for every rank (gathered from every process).
      devices: ``{rank: device key}``; ranks with one key share a device.
      overrides: ``{rank: domain key}`` replacing discovered keys.
      **links: :class:`~jreshard.sharding.topology.Links` overrides.

    Raises:
      TopologyError: an override names a rank without a key.

    Example:
      >>> keys = {0: "host:a", 5: "nvlink:ab:1", 9: "nvlink:ab:1", 12: "host:b"}
      >>> topo = topology_from_domain_keys(keys, overrides={12: "host:a"})
      >>> [topo.domain_of(r) for r in (0, 5, 9, 12)]
      [0, 1, 1, 0]
    """
    merged = {int(r): str(k) for r, k in keys.items()}
    extra = sorted(set(overrides or {}) - set(merged))
    if extra:
        raise TopologyError(f"topology_from_domain_keys: overrides name ranks {extra} that have no domain key")
    merged.update({int(r): str(k) for r, k in (overrides or {}).items()})
    ids = {k: i for i, k in enumerate(sorted(set(merged.values())))}
    return Topology.from_domains({r: ids[k] for r, k in sorted(merged.items())}, devices=devices, **links)
