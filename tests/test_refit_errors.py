"""RefitGroup's messages: a declaration mismatch names each leaf and field that differs, counts its
problems in good English, a peer that closes the group is noticed at once (under mpiexec), and a process
whose declaration or vote cannot be one is named with what is wrong, nothing published (jreshard.refit.votes)."""

import pytest

from jreshard.refit.decl import leaf_differences, problems, validate


def decl(role, params, ndev=1):
    return {"role": role, "ndev": ndev, "domain": None, "params": params, "errors": []}


def test_problem_counts_read_as_english():
    assert problems(1) == "1 problem" and problems(2) == "2 problems" and problems(0) == "0 problems"


def test_leaf_differences_name_every_field_with_both_values():
    declared = [["['w']", [8, 4], "float32", [[0, [0, 0], [8, 4]]]], ["['b']", [4], "float32", [[0, [0], [4]]]]]
    now = [["['w']", [8, 2], "bfloat16", [[0, [0, 0], [8, 2]]]], ["['c']", [4], "float32", [[0, [0], [4]]]]]
    assert leaf_differences(now, declared) == [
        "['c'] is not declared",
        "['b'] is missing",
        "['w']: shape (8, 2) where (8, 4) was declared",
        "['w']: dtype bfloat16 where float32 was declared",
        "['w']: sharding (boxes per device) [[0, [0, 0], [8, 2]]] where [[0, [0, 0], [8, 4]]] was declared",
    ]
    assert leaf_differences(declared, declared) == []


def test_validate_names_the_field_per_leaf_on_both_sides_and_within_a_side():
    src = decl("source", [["['w']", [8, 4], "float32", [[0, [0, 0], [8, 4]]]]])
    dst = decl("destination", [["['w']", [8, 4], "int8", [[0, [0, 0], [8, 4]]]]])
    other = decl("destination", [["['w']", [8, 5], "int8", [[0, [0, 0], [8, 5]]]]])
    assert validate({0: src, 1: dst}) == ["parameter ['w']: source dtype float32 != destination dtype int8"]
    errors = validate({0: src, 1: dst, 2: other})
    assert "process 2 (destination) declares ['w'] with shape (8, 5) (not (8, 4)) unlike process 1" in errors[0]


@pytest.mark.mpi
def test_a_peer_that_closes_is_noticed_at_once(tmp_path):
    from mpi_launch import launch, need_mpi, program, results

    need_mpi()
    launch(
        [program(1, "refit_close_body.py", "source"), program(1, "refit_close_body.py", "destination")],
        tmp_path,
        devices=1,
        timeout_s=100,
    )
    src, dst = results(tmp_path, "close-source"), results(tmp_path, "close-destination")
    assert src[0] == {"versions": [1, 2]}, src
    (d,) = dst.values()
    assert d["versions"] == [1, 2] and d["version"] == 2, d
    assert "process 0 (source) closed the group" in d["error"], d
    assert d["elapsed"] < 5.0  # timeout_s is 30: the notice, not the deadline, ended the wait


def test_a_tree_like_the_last_one_that_matched_is_still_checked_for_what_its_key_cannot_see(tmp_path):
    """tests/mpi_bodies/refit_stale_body.py: after a tree that matched the declaration (checked in full once), a
    tree with a leaf deleted since, then one with a leaf of another dtype, are refused on both sides before
    anything moves (at once: the timeout is 30 s), the destination keeps version 1, and version 2 goes through."""
    from mpi_launch import launch, need_mpi, program, results

    need_mpi()
    launch(
        [program(1, "refit_stale_body.py", "source"), program(1, "refit_stale_body.py", "destination")],
        tmp_path,
        devices=1,
        timeout_s=100,
    )
    (src,) = results(tmp_path, "stale-source").values()
    (dst,) = results(tmp_path, "stale-destination").values()
    assert src["versions"] == [1, 2] and dst["versions"] == [1, 2] and dst["exact"], (src, dst)
    assert dst["held"] == [1.0, 1.0], dst
    for side in (src, dst):
        deleted, cast = side["errors"]
        assert "nothing moved" in deleted and "['b'] has been deleted or donated" in deleted, side
        assert "nothing moved" in cast and "['w']: dtype bfloat16 where float32 was declared" in cast, side
        assert max(side["seconds"]) < 10.0, side


@pytest.mark.parametrize("mode", ["declaration", "begin", "commit"])
def test_a_process_whose_message_cannot_be_one_is_named_and_nothing_is_published(tmp_path, mode):
    """A destination whose declaration, begin vote or commit vote is malformed
    (tests/mpi_bodies/refit_malformed_body.py): both sides raise PeerError naming it (before the checks, a KeyError
    or TypeError out of push and pull), the destination keeps version 1, and after a malformed begin vote the group
    refuses further refits."""
    from mpi_launch import launch, need_mpi, program, results

    need_mpi()
    body = "refit_malformed_body.py"
    launch(
        [program(1, body, "source", mode), program(1, body, "destination", mode)],
        tmp_path,
        devices=1,
        timeout_s=100,
    )
    (src,) = results(tmp_path, f"malformed-{mode}-source").values()
    (dst,) = results(tmp_path, f"malformed-{mode}-destination").values()
    for side in (src, dst):
        assert side["error"].startswith("PeerError"), side
        assert "process 1 (destination)" in side["error"] or "process 1:" in side["error"], side
    if mode == "declaration":
        assert "a declaration that cannot be one" in src["error"] and "it is a list" in src["error"], src
        return
    what = {"begin": "a begin vote that cannot be one (it is a list", "commit": "a commit vote that cannot be one"}
    assert what[mode] in src["error"] and what[mode] in dst["error"], (src, dst)
    assert src["versions"] == [1] and dst["versions"] == [1] and dst["version"] == 1 and dst["held"] == 1.0, dst
    if mode == "begin":
        assert "nothing moved" in src["error"] and "broken" in src["third"] and "broken" in dst["third"], (src, dst)
    else:
        assert "keeps its previous version" in dst["error"], dst


def _begin(role: str, change: dict | None = None) -> dict:
    from jreshard.options import Options
    from jreshard.refit.delta import GroupDelta

    delta = GroupDelta(Options(), 4, {0: 0, 1: 1}, str).vote()  # what a process of a new group votes
    vote = {"role": role, "error": "", "version": 7 if role == "source" else None, **delta}
    if role == "source":
        vote["nonce"] = "0f" * 16
    return vote | (change or {})


def test_the_votes_and_declarations_the_group_sends_pass_its_checks():
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard.refit.decl import declare_local
    from jreshard.refit.votes import begin_problem, commit_problem, declaration_problem

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    params = {
        "w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, P("x"))),
        "s": jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh, P())),
    }
    for role in ("source", "destination"):
        assert declaration_problem(declare_local(role, params, list(mesh.devices.flat), 0)) is None
        assert begin_problem(_begin(role), role) is None
    assert begin_problem(_begin("source", {"delta_dense": [0.8125, 4]}), "source") is None
    numpy_domain = declare_local("source", params, list(mesh.devices.flat), np.int64(3))  # as MPI pickles it
    assert declaration_problem(numpy_domain) is None
    assert commit_problem({"error": ""}) is None and commit_problem({"error": "x", "digests": {}}) is None


@pytest.mark.parametrize(
    "role, change, says",
    [
        ("destination", {"role": "source"}, "but the process declared 'destination'"),
        ("source", {"error": None}, "its error is None"),
        ("source", {"version": "7"}, "its version is '7'"),
        ("source", {"version": True}, "its version is True"),
        ("source", {"version": 2**64}, "not an int"),
        ("source", {"nonce": ""}, "its nonce"),
        ("source", {"nonce": "f" * 200}, "its nonce"),
        ("destination", {"version": 3}, "a destination's vote names version 3"),
        ("source", {"delta": "yes"}, "its delta is 'yes'"),
        ("source", {"delta_base": 1.5}, "its delta_base is 1.5"),
        ("source", {"delta_dense": [0.5]}, "its delta_dense"),
        ("source", {"delta_dense": [float("nan"), 1]}, "its delta_dense"),
        ("source", {"delta_dense": [0.5, -1]}, "its delta_dense"),
        ("source", {"delta_dense": [2.0, 1]}, "its delta_dense"),
    ],
)
def test_a_malformed_begin_vote_is_named_with_what_is_wrong(role, change, says):
    from jreshard.refit.votes import begin_problem

    assert says in (begin_problem(_begin(role, change), role) or "")


def test_a_malformed_vote_or_declaration_that_is_not_an_object_or_lacks_fields():
    from jreshard.refit.votes import begin_problem, commit_problem, declaration_problem

    for v in (None, 3, "vote", ["error", ""], []):
        assert "not an object" in begin_problem(v, "source")
        assert "not an object" in commit_problem(v)
        assert "not an object" in declaration_problem(v)
    assert "its error is 1" in commit_problem({"error": 1})
    assert "role" in begin_problem({}, "source")
    good = decl("source", [["w", [8, 4], "float32", [[0, [0, 0], [8, 4]]]]])
    from jreshard.refit.votes import declaration_problem as form

    assert form(good) is None
    bad = {
        "role": "trainer",
        "ndev": -1,
        "domain": "rack",
        "errors": "none",
        "params": {"w": 1},
    }
    for field, value in bad.items():
        assert form(good | {field: value}) is not None, field
    for p in (
        ["w"],
        ["w", [8, 4], "float32"],
        [1, [8, 4], "float32", []],
        ["w", [8, -4], "float32", []],
        ["w", [8, 4], "float32", [[1, [0, 0], [8, 4]]]],
        ["w", [8, 4], "float32", [[0, [0], [8, 4]]]],
        ["w", [8, 4], "float32", [[0, [0, 0], [8, "4"]]]],
        ["w", [8, 4], "float32", {}],
    ):
        assert form(good | {"params": [p]}) is not None, p
    assert form(good | {"recipe": []}) is not None


@pytest.mark.parametrize(
    "recipe, says",
    [
        ({"w": "garbage"}, "recipe leaf w: ValueError"),
        ({"w": [1, 2, 3]}, "recipe leaf w: ValueError"),
        ({"w": {"op": "nope"}}, "recipe leaf w: KeyError"),
        ({"w": ["cast", ["param", "w"], 5]}, "recipe leaf w: TypeError"),
        ({"w": ["leaf", [["a"], 3, "f"]]}, "recipe leaf w: TypeError"),
        ({"w": None}, "recipe leaf w: null is not a view"),
        ({1: ["leaf", ["w", [8, 4], "float32"]]}, "recipe leaf 1 is not a parameter"),
    ],
)
def test_a_recipe_no_encoder_writes_is_a_declaration_problem_not_an_exception(recipe, says):
    """A destination's recipe as another process sends it (JSON or MPI's pickle): what cannot be a view is one of
    the declaration's problems, reported on every process, never an exception out of the group's constructor."""
    src = decl("source", [["w", [8, 4], "float32", [[0, [0, 0], [8, 4]]]]])
    dst = decl("destination", [["w", [8, 4], "float32", [[0, [0, 0], [8, 4]]]]]) | {"recipe": recipe}
    errors = validate({0: src, 1: dst}, views=True)
    assert any(says in e for e in errors), errors


@pytest.mark.parametrize("dtype", ["int4", "uint4", "int2", "uint2", "float4_e2m1fn", "key"])
def test_a_leaf_a_refit_cannot_move_is_a_declaration_problem_that_says_how(dtype):
    """Packed sub-byte arrays and typed PRNG keys do not cross between programs (the declarations describe
    whole bytes of plain arrays): each is a problem of its declaration, named by its leaf with the way to
    refit it, on every process before any byte moves; it used to raise TypeError (keys) or a LayoutError
    that named neither the leaf nor the fix."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard.refit.decl import declare_local

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    rows = NamedSharding(mesh, P("x"))
    if dtype == "key":
        odd = jax.device_put(jax.random.split(jax.random.key(0), 4), rows)
        fix = "jax.random.key_data"
    else:
        odd = jax.ShapeDtypeStruct((4, 6), jnp.dtype(dtype), sharding=rows)
        fix = "jax.lax.bitcast_convert_type"
    params = {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=rows), "odd": odd}
    decls = {
        p: declare_local(role, params, list(mesh.devices.flat), 0) for p, role in enumerate(("source", "destination"))
    }
    for d in decls.values():
        assert [name for name, *_ in d["params"]] == ["['w']"]
        (error,) = d["errors"]
        assert error.startswith("leaf ['odd'] is") and fix in error
    found = validate(decls)
    assert len(found) == 2 and all("['odd']" in e for e in found)


@pytest.mark.parametrize("kind", ["unreduced", "manual"])
def test_a_sharding_no_array_lives_on_is_a_declaration_problem_named_by_its_leaf(kind):
    """A leaf whose sharding has unreduced axes (partial sums) or lies on a mesh of Manual axes (only inside
    shard_map) has no boxes to move: a problem of its declaration, reported on every process before any byte
    moves; it used to raise in this process alone, before the group formed (the manual mesh with jax's own
    AssertionError), leaving the other side to wait."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard.refit.decl import declare_local

    devices = jax.devices()[:2]
    if kind == "manual":
        mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Manual,), devices=devices)
        odd = NamedSharding(mesh, P("x"))
        says = "are Manual"
    else:
        mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,), devices=devices)
        odd = NamedSharding(mesh, P(None, unreduced={"x"}))
        says = "unreduced axes ['x']"
    rows = NamedSharding(jax.sharding.Mesh(np.array(devices), ("x",)), P("x"))
    params = {
        "w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=rows),
        "odd": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=odd),
    }
    decl = declare_local("destination", params, list(devices), 0)
    assert [name for name, *_ in decl["params"]] == ["['w']"]
    (error,) = decl["errors"]
    assert error.startswith("leaf ['odd']: ") and says in error, error


def test_connect_names_a_bad_role_and_its_own_problems_when_no_peer_comes(tmp_path):
    """Alone, a destination whose tree is not on the devices it declares times out naming that problem too."""
    pytest.importorskip("nixl_cu12", reason="the NIXL transport needs nixl-cu12")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard import Options, RefitGroup
    from jreshard.errors import TransferTimeoutError

    devs = jax.devices()
    like = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(Mesh(np.array(devs[:1]), "x"), P()))}
    opts = Options(timeout_s=0.5, secret=b"k" * 32)
    where = str(tmp_path / "address")
    with pytest.raises(
        ValueError, match=r"RefitGroup\.connect: role='dest'; expected one of \['source', 'destination'\]"
    ):
        RefitGroup.connect("dest", like, address=where, transport="nixl", options=opts)
    with pytest.raises(TransferTimeoutError, match=r"did not appear within .*and this process could not have taken "
                       r"part: leaf \['w'\] has a shard on"):  # fmt: skip
        RefitGroup.connect("destination", like, address=where, transport="nixl", devices=devs[1:2], options=opts)
    with pytest.raises(TransferTimeoutError) as plain:  # nothing wrong here: the timeout alone
        RefitGroup.connect("destination", like, address=where, transport="nixl", devices=devs[:1], options=opts)
    assert "could not have taken part" not in str(plain.value)
