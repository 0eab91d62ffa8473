"""NVML domain discovery against a stand-in NVML module (CPU).

The stand-in answers the few NVML calls jreshard makes with made-up fabric
info; it checks our reading of NVML's answers, not NVML. Its argument lists and
structs are compared with the installed pynvml in ``test_contract_nvml.py``.
"""

from __future__ import annotations

import pytest
from cupy_standins import fake_nvml

from jreshard.cuda.nvml import domain_key, local_domain_keys, topology_from_domain_keys
from jreshard.errors import TopologyError


@pytest.mark.parametrize("versioned", [True, False])
def test_nvlink_clique_else_host(versioned):
    """Fabric info comes back through the struct passed by reference, from the versioned
    call where pynvml has it and the older one otherwise."""
    nvml = fake_nvml(
        {
            "0000:01:00.0": (b"\x11" * 16, 7, 3),
            "0000:02:00.0": (b"\x11" * 16, 7, 3),
            "0000:03:00.0": (b"\x11" * 16, 8, 3),  # another clique of the same cluster
            "0000:04:00.0": (b"\x11" * 16, 7, 1),  # fabric registration not complete
            "0000:05:00.0": (b"", 0, 3),  # no cluster
            "0000:06:00.0": None,  # H100/H200 HGX: NotSupported
        },
        versioned=versioned,
    )
    bus = {i: f"0000:0{i + 1}:00.0" for i in range(6)}
    keys = local_domain_keys(range(6), nvml=nvml, pci_bus_id=bus.__getitem__, hostname="node3")
    assert keys[0] == keys[1] == f"nvlink:{'11' * 16}:7"
    assert keys[2] == f"nvlink:{'11' * 16}:8"
    assert keys[3] == keys[4] == keys[5] == "host:node3"
    assert nvml.log == ["init", "shutdown"]
    assert domain_key("0000:06:00.0", nvml=nvml, hostname="h") == "host:h"


def test_topology_from_keys_with_sparse_ranks_and_overrides():
    keys = {3: "host:b", 17: "nvlink:aa:0", 40: "nvlink:aa:0", 2: "host:a"}
    topo = topology_from_domain_keys(keys, devices={3: 0, 17: 1, 40: 2, 2: 3})
    assert topo.ranks == (2, 3, 17, 40)
    assert topo.domain_of(17) == topo.domain_of(40) != topo.domain_of(2) != topo.domain_of(3)
    again = topology_from_domain_keys(dict(reversed(list(keys.items()))), devices={3: 0, 17: 1, 40: 2, 2: 3})
    assert again == topo  # independent of the order keys arrive in
    moved = topology_from_domain_keys(keys, overrides={3: "host:a"}, network_bw=25e9)
    assert moved.domain_of(3) == moved.domain_of(2) and moved.links.network_bw == 25e9
    with pytest.raises(TopologyError, match=r"ranks \[99\]"):
        topology_from_domain_keys(keys, overrides={99: "host:a"})


def test_missing_pynvml_names_the_package(monkeypatch):
    import sys

    from jreshard.errors import BackendUnavailableError

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with pytest.raises(BackendUnavailableError, match="nvidia-ml-py"):
        local_domain_keys([0])
