"""Bad topology arguments: each raises a TypeError or ValueError naming the argument and the value."""

from __future__ import annotations

import pytest

from jreshard import Topology, TopologyError


def test_uniform_duplicate_rank():
    with pytest.raises(TopologyError, match=r"ranks=\(0, 0, 1\) lists ranks \[0\] more than once"):
        Topology.uniform([0, 0, 1], 2)


def test_uniform_float_domain_size():
    with pytest.raises(TypeError, match=r"domain_size=2\.5 must be an int"):
        Topology.uniform(range(4), domain_size=2.5)


def test_uniform_bool_domain_size():
    with pytest.raises(TypeError, match=r"domain_size=True must be an int"):
        Topology.uniform(range(4), domain_size=True)


def test_uniform_float_rank():
    with pytest.raises(TypeError, match=r"Topology.uniform: ranks: 1\.5 is a float"):
        Topology.uniform([0, 1.5], domain_size=1)


def test_from_domains_float_domain():
    with pytest.raises(TypeError, match=r"domain ids \(values\) of domains: 1\.7 is a float"):
        Topology.from_domains({0: 1.7, 1: 1.2})


def test_from_domains_string_rank():
    with pytest.raises(TypeError, match=r"ranks \(keys\) of domains: '0' is a str"):
        Topology.from_domains({"0": 0})


def test_from_domains_not_a_mapping():
    with pytest.raises(TypeError, match=r"domains=\[0, 1\] is a list"):
        Topology.from_domains([0, 1])


def test_from_domains_float_device():
    with pytest.raises(TypeError, match=r"device keys \(values\) of devices: 0\.5 is a float"):
        Topology.from_domains({0: 0}, devices={0: 0.5})
