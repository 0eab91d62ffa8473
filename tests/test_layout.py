"""Layout, Box and Topology: construction, jax agreement, JSON, errors, import rules."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from strategies import factorizations

import jreshard
from jreshard.errors import IndivisibleError, LayoutError, LayoutJSONError, LayoutMismatchError, TopologyError
from jreshard.sharding.box import Box, intersect
from jreshard.sharding.layout import Layout
from jreshard.sharding.planner import plan_layouts
from jreshard.sharding.topology import Link, Topology

ROOT = pathlib.Path(__file__).resolve().parents[1]


@st.composite
def named_sharding_case(draw):
    n = draw(st.sampled_from([1, 2, 4, 8]))
    devices = draw(st.permutations(jax.devices()[:8]))[:n] if n < 8 else draw(st.permutations(jax.devices()))
    mesh_shape = draw(st.sampled_from(factorizations(n)))
    names = tuple(f"m{i}" for i in range(len(mesh_shape)))
    mesh = jax.sharding.Mesh(np.array(devices).reshape(mesh_shape), names)
    ndim = draw(st.integers(0, 3))
    free = list(names)
    spec, shape = [], []
    for _ in range(ndim):
        k = draw(st.integers(0, min(2, len(free))))
        axes = tuple(draw(st.permutations(free))[:k])
        free = [a for a in free if a not in axes]
        spec.append(None if not axes else axes[0] if len(axes) == 1 and draw(st.booleans()) else axes)
        shape.append(int(np.prod([mesh.shape[a] for a in axes])) * draw(st.integers(1, 3)))
    return NamedSharding(mesh, P(*spec)), tuple(shape), draw(st.sampled_from(["float32", "bfloat16", "int8", "bool"]))


def _agrees(layout: Layout, sharding, shape):
    index_map = sharding.devices_indices_map(shape)
    assert sorted(layout.ranks) == sorted(d.id for d in index_map)
    for d, idx in index_map.items():
        assert layout.box_of(d.id) == Box.from_slices(idx, shape), (d, idx)


@given(named_sharding_case())
def test_from_sharding_agrees_with_devices_indices_map(case):
    sharding, shape, dtype = case
    lay = Layout.from_sharding(sharding, shape, dtype)
    _agrees(lay, sharding, shape)
    assert lay.dtype == np.dtype(jax.numpy.dtype(dtype)).name


def test_from_sharding_general_path_and_rank_of():
    dev = jax.devices()[3]
    lay = Layout.from_sharding(SingleDeviceSharding(dev), (5, 3), "float32")
    assert lay.ranks == (3,) and lay.box_of(3) == Box((0, 0), (5, 3))
    mesh = jax.make_mesh((2, 4), ("x", "y"), devices=jax.devices())
    s = NamedSharding(mesh, P("y", "x"))
    shifted = Layout.from_sharding(s, (8, 8), "float32", rank_of=lambda d: d.id + 100)
    base = Layout.from_sharding(s, (8, 8), "float32")
    assert shifted == Layout(base.shape, base.dtype, tuple(r + 100 for r in base.ranks), base.boxes)


def test_multi_axis_dimension_is_major_to_minor():
    lay = Layout.from_mesh(np.arange(8).reshape(2, 4), ("x", "y"), (("x", "y"), None), (16, 3), "float32")
    # rank at (i, j) holds block i*4 + j.
    assert lay.box_of(6) == Box((12, 0), (14, 3))  # (1, 2) -> block 6
    lay2 = Layout.from_mesh(np.arange(8).reshape(2, 4), ("x", "y"), (("y", "x"), None), (16, 3), "float32")
    assert lay2.box_of(6) == Box((10, 0), (12, 3))  # (1, 2) -> block 2*2 + 1 = 5
    assert [
        rs for _, rs in Layout.from_mesh(np.arange(8).reshape(2, 4), ("x", "y"), ("x",), (4,), "int8").replica_groups()
    ] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_errors_name_the_argument_and_values():
    mesh = np.arange(4).reshape(2, 2)
    with pytest.raises(LayoutError, match=r"names mesh axis 'z'.*mesh axes are \('x', 'y'\)"):
        Layout.from_mesh(mesh, ("x", "y"), ("z",), (4,), "float32")
    with pytest.raises(LayoutError, match=r"uses mesh axis 'x' twice"):
        Layout.from_mesh(mesh, ("x", "y"), ("x", "x"), (4, 4), "float32")
    with pytest.raises(IndivisibleError, match="size 5, not divisible by the 2 blocks"):
        Layout.from_mesh(mesh, ("x", "y"), ("x",), (5,), "float32")
    with pytest.raises(LayoutError, match="lists ranks \\[1\\] more than once"):
        Layout.from_mesh(np.array([[0, 1], [1, 2]]), ("x", "y"), (), (4,), "float32")
    with pytest.raises(LayoutError, match="has 2 entries but the tensor has rank 1"):
        Layout.from_mesh(mesh, ("x", "y"), ("x", "y"), (4,), "float32")
    with pytest.raises(LayoutError, match="does not fit in shape"):
        Layout.from_boxes((4,), "float32", {0: Box((0,), (5,))})
    with pytest.raises(LayoutError, match="dtype='nope'"):
        Layout.from_boxes((4,), "nope", {0: Box((0,), (4,))})
    for e in (LayoutError, IndivisibleError, LayoutMismatchError, LayoutJSONError, TopologyError):
        assert issubclass(e, ValueError)


def test_mismatched_pairs_and_missing_ranks():
    a = Layout.from_mesh(np.arange(2), ("x",), ("x",), (4, 2), "float32")
    with pytest.raises(LayoutMismatchError, match=r"source shape \(4, 2\) != destination shape \(4, 4\)") as e:
        plan_layouts([(a, Layout.replicated([3], (4, 4), "float32"))])
    assert e.value.src == (4, 2) and e.value.dst == (4, 4) and e.value.what == "shape"
    with pytest.raises(LayoutMismatchError, match="source dtype float32 != destination dtype bfloat16"):
        plan_layouts([(a, Layout.replicated([3], (4, 2), "bfloat16"))])
    with pytest.raises(TopologyError, match=r"uses ranks \(3,\) that are not in the topology"):
        plan_layouts([(a, Layout.replicated([3], (4, 2), "float32"))], Topology.uniform(range(2), 2))
    with pytest.raises(TopologyError, match="listed more than once"):
        Topology((0, 0), (0, 0), (0, 1))
    with pytest.raises(TopologyError, match="must be in one domain"):
        Topology.from_domains({0: 0, 1: 1}, devices={0: 7, 1: 7})


def test_json_round_trips_and_bad_json():
    lay = Layout.from_mesh(np.arange(6).reshape(3, 2)[:, ::-1], ("a", "b"), ("b", None, "a"), (4, 1, 9), "bfloat16")
    assert Layout.from_json(lay.to_json()) == lay
    assert hash(Layout.from_json(lay.to_json())) == hash(lay)
    topo = Topology.from_domains({0: 0, 1: 0, 5: 1}, devices={0: 0, 1: 0}, network_bw=1e9)
    assert Topology.from_json(topo.to_json()) == topo
    for bad in ("{", '{"shape": [2]}', '{"shape": [2], "dtype": "float32", "ranks": [0], "boxes": [[[0], [3]]]}'):
        with pytest.raises(LayoutJSONError):
            Layout.from_json(bad)


def test_box_algebra():
    a, b = Box((0, 0), (4, 4)), Box((2, 3), (6, 9))
    assert intersect(a, b) == Box((2, 3), (4, 4)) and intersect(a, Box((4, 0), (5, 4))) is None
    assert Box((), ()).volume == 1 and intersect(Box((), ()), Box((), ())) == Box((), ())
    assert Box((1, 0, 0), (2, 3, 4)).is_contiguous_in((5, 3, 4))
    assert Box((1, 0, 0), (3, 3, 4)).is_contiguous_in((5, 3, 4))
    assert not Box((1, 0, 0), (3, 2, 4)).is_contiguous_in((5, 3, 4))
    assert Box((1, 1, 0), (2, 2, 4)).is_contiguous_in((5, 3, 4))
    with pytest.raises(ValueError, match="lo <= hi"):
        Box((3,), (2,))


def test_topology_constructors():
    topo = Topology.uniform([7, 3, 5, 1], domain_size=2)
    assert [topo.domain_of(r) for r in (7, 3, 5, 1)] == [0, 0, 1, 1]
    assert topo.link(7, 3) == Link.FAST and topo.link(3, 5) == Link.NETWORK
    dt = Topology.from_devices(jax.devices())
    assert dt.ranks == tuple(d.id for d in jax.devices()) and set(dt.domains) == {0}
    assert dt.link(0, 1) == Link.FAST


SHARDING = sorted((ROOT / "jreshard" / "sharding").glob("*.py"))


@pytest.mark.parametrize("path", SHARDING, ids=lambda p: p.name)
def test_sharding_imports_no_transport(path):
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    banned = {
        n for n in names if n.split(".")[0] in {"cupy", "mpi4py", "cupyx", "pynvml"} or n.startswith("jreshard.nccl")
    }
    assert not banned, f"{path.name} imports {banned}"
    if path.name not in ("jax.py", "trees.py"):  # the two adapters of jax values; both import jax lazily
        assert not {n for n in names if n.split(".")[0] in {"jax", "jaxlib"}}, f"{path.name} imports jax"


def test_sharding_runs_without_jax_loaded():
    code = (
        "import sys, numpy as np\n"
        "import jreshard.sharding.plan, jreshard.sharding.baselines\n"
        "from jreshard.sharding.layout import Layout\n"
        "from jreshard.sharding.planner import plan_layouts\n"
        "a = Layout.from_mesh(np.arange(4), ('x',), ('x',), (8,), 'bfloat16')\n"
        "b = Layout.from_mesh(np.arange(4, 6), ('x',), ('x',), (8,), 'bfloat16')\n"
        "plan_layouts([(a, b)]).stats()\n"
        "bad = [m for m in ('jax', 'jaxlib', 'cupy', 'mpi4py') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_public_api_names():
    for name in ("plan", "Layout", "Topology", "Options", "Plan", "PlanStats", "baselines"):
        assert hasattr(jreshard, name)
    assert callable(jreshard.baselines.gather_broadcast) and callable(jreshard.baselines.flat_direct)


def test_topology_json_with_the_old_name_of_same_device_bw_names_the_new_one():
    """``local_bw`` was renamed ``same_device_bw`` ("local" means in this process): old JSON says how to fix it."""
    text = Topology.uniform(range(2), 2).to_json()
    assert '"same_device_bw"' in text
    old = text.replace('"same_device_bw"', '"local_bw"')
    with pytest.raises(LayoutJSONError, match=r"local_bw=1500000000000\.0, now named same_device_bw"):
        Topology.from_json(old)
    with pytest.raises(TypeError, match="local_bw"):
        Topology.uniform(range(2), 2, local_bw=1e9)
