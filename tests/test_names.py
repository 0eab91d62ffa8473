"""One meaning per name for "local", "program" and "piece" (docs/architecture.md, "Words").

- **local**: in this process (the ``local`` backend, ``local_ranks``, ``jax.local_devices()``);
- **program**: one launch of processes (a trainer, an inference server);
- **piece**: the intersection of a source box and a destination box.

Every identifier of ``jreshard/`` that holds one of the three words (Python names, C names outside comments
and strings, module and folder names) is listed in :data:`ALLOWED` with the meaning it has, so a new one is
added on purpose, with its reason; the names these words used to carry in another sense (:data:`BANNED`)
never come back. Comments, docstrings and strings are not read here: the glossary is their rule.
"""

from __future__ import annotations

import io
import keyword
import re
import tokenize

from test_imports import ROOT

WORDS = re.compile(r"(?i)local|program|piece")

# Every identifier with one of the three words, and why it fits that word's one meaning.
ALLOWED = {
    # local: in this process
    "local": "the local transport's package (jreshard.local); a comm's ranks, devices or addresses in this process",
    "LOCAL": "Backend.LOCAL: every device of the transfer in this process",
    "_local": "a communicator's own ranks or devices, the ones this process drives",
    "_Local": "NCCL's state for one GPU this process drives",
    "_LocalStore": "the rendezvous store of one process",
    "_local_check": "this process's checks before a refit's begin vote",
    "_local_devices": "jax.local_devices() of this process",
    "_local_ranks": "the ranks this process drives",
    "local_ranks": "the ranks this process drives",
    "local_devices": "jax.local_devices(), jax's name",
    "local_hardware_id": "jax's name for a device's ordinal in this process",
    "local_domain_keys": "the domain keys of this process's GPUs",
    "local_sends": "sends whose receiver is in this process",
    "local_recvs": "receives whose sender is in this process",
    "local_sources": "the source shards this process holds",
    "locals_": "the per-GPU states of this process, of one group",
    "LocalComm": "a loopback communicator: every rank in this process",
    "CupyLocalComm": "the local backend's communicator between the GPUs of this process",
    "lower_local": "a plan lowered to the in-process copies",
    "run_local": "a transfer run in this process (the local backend)",
    "schedule_local": "the schedule of this process's ranks",
    "declare_local": "this process's declaration of its parameters",
    # program: one launch of processes
    "program_transport": "the transport two programs connect over",
    "PROGRAMS": "Reach.PROGRAMS: between two programs",
    # piece: a source box meet a destination box
    "pieces": "pieces (jreshard/sharding/pieces.py), and the pieces of a lowering or a message",
    "piece": "a piece, or the index of the piece a chunk's box comes from",
    "Piece": "one piece of a message of a rank plan",
    "_piece": "one piece of a view's lowering",
    "_pieces": "the pieces of a view's lowering that fill some regions",
    "_pieces_of": "the pieces of a destination box, uncached",
    "pieces_of": "the pieces of a destination box",
    "ViewPiece": "a piece of a view's lowering, with its casts",
    "by_piece": "the stripes of each piece, per domain",
    "chunk_pieces": "a message's pieces cut into chunks",
    "seg_piece": "per segment of a chunk cut, the piece it comes from",
    "npieces": "the number of pieces",
    "piece_bytes": "the bytes of a piece (of a copy class, of a message)",
    "piece_msg": "per piece, its message",
    "copy_pieces": "the compiled strided copy of the pieces of one copy class",
    "py_copy_pieces": "copy_pieces, C side",
    "copy_piece": "one piece of copy_pieces, C side",
    "_copy_piece": "one piece of a view's lowering, copied with its casts",
    "execute_pieces": "the pieces of a views lowering, run on the copy threads",
    "LARGE_PIECE": "pieces at least this big are copied one by one",
}

# Names these words carried in another sense, renamed (CHANGELOG.md, "Changed"); none may come back.
BANNED = {
    # a rank's part of a plan, the engine's compiled schedule, backend xla's computation, the views' copy tasks
    "RankProgram", "ProgramTable", "ProgramStats", "Program", "program", "programs", "prog", "progs",
    "rank_program", "rank_programs", "_rank_program_cached", "build_program", "columns_program", "stamped_program",
    "compile_program", "program_of", "_program_of_rows", "program_for", "plan_program",
    # a copy on one device, a rank's own tensor, a box relative to its shard
    "local_bytes", "local_bw", "local_box", "local_shape", "local_pairs", "_local_tables", "nlocal", "with_local",
    "own_local",
    # a NIXL batch, a GMAC span
    "_Piece", "_GMAC_PIECE",
}  # fmt: skip
# The same families under new spellings.
BANNED_LIKE = re.compile(r"(?i)rank_?programs?|program_?(table|stats)|same_?device.*local|local.*same_?device")


def identifiers(files: dict[str, str]) -> dict[str, set[str]]:
    """``{identifier: the files it is in}`` for the identifiers that hold one of the three words.

    Args:
      files: path (``jreshard/engine/rounds.py``) -> its text. Python files (``.py``, ``.pyi``) are read as
        tokens, C files (``.c``, ``.h``) with comments and strings taken out; every folder and module name of a
        path counts too.
    """
    out: dict[str, set[str]] = {}

    def add(name: str, path: str) -> None:
        if WORDS.search(name) and not keyword.iskeyword(name):
            out.setdefault(name, set()).add(path)

    for path, text in files.items():
        for part in path.split("/")[1:]:
            add(part.split(".")[0], path)
        if path.endswith((".py", ".pyi")):
            for tok in tokenize.generate_tokens(io.StringIO(text).readline):
                if tok.type == tokenize.NAME:
                    add(tok.string, path)
        elif path.endswith((".c", ".h")):
            code = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
            code = re.sub(r"\"(\\.|[^\"\\\n])*\"|'(\\.|[^'\\\n])*'", " ", code)
            for name in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code):
                add(name, path)
    return out


def misnamed(found: dict[str, set[str]]) -> list[str]:
    """Every identifier of ``found`` that is not in :data:`ALLOWED` or is a :data:`BANNED` name, with its files."""
    out = []
    for name in sorted(found):
        if name not in ALLOWED:
            why = "a name renamed for its other sense" if _banned(name) else "not in ALLOWED"
            out.append(f"{name} ({why}): {', '.join(sorted(found[name]))}")
    return out


def _banned(name: str) -> bool:
    return name in BANNED or bool(BANNED_LIKE.search(name))


def _library() -> dict[str, str]:
    return {
        p.relative_to(ROOT.parent).as_posix(): p.read_text()
        for p in sorted(ROOT.rglob("*"))
        if p.suffix in (".py", ".pyi", ".c", ".h")
    }


def test_the_checker_finds_planted_names():
    files = {
        "jreshard/sharding/program.py": "class RankProgram:\n    local_bytes = 0\n",
        "jreshard/net/auth.py": (
            "_GMAC_PIECE = 1 << 30\nlocal_ranks = ()\n# a local copy, in a comment\ns = 'one program'\n"
            "def f():\n    x = 0\n    def g():\n        nonlocal x\n"
        ),
        "jreshard/engine/_replay.c": 'typedef struct { int n; } program; /* local */ static const char *s = "piece";\n',
        "jreshard/schedule/steps.py": "def _local_tables(prog, shapes): ...\nchunk_pieces = 1\n",
        "jreshard/xla/plan_program.py": "",
    }
    found = identifiers(files)
    assert set(found) == {
        "program", "RankProgram", "local_bytes", "_GMAC_PIECE", "local_ranks", "_local_tables", "chunk_pieces",
        "plan_program",
    }  # fmt: skip
    assert misnamed(found) == [
        "RankProgram (a name renamed for its other sense): jreshard/sharding/program.py",
        "_GMAC_PIECE (a name renamed for its other sense): jreshard/net/auth.py",
        "_local_tables (a name renamed for its other sense): jreshard/schedule/steps.py",
        "local_bytes (a name renamed for its other sense): jreshard/sharding/program.py",
        "plan_program (a name renamed for its other sense): jreshard/xla/plan_program.py",
        "program (a name renamed for its other sense): jreshard/engine/_replay.c, jreshard/sharding/program.py",
    ]
    assert misnamed({"local_thing": {"jreshard/x.py"}}) == ["local_thing (not in ALLOWED): jreshard/x.py"]


def test_no_allowed_name_is_a_banned_one():
    assert not [n for n in ALLOWED if _banned(n)]
    assert _banned("RankPrograms") and _banned("local_same_device_bytes") and not _banned("local_ranks")


def test_link_kinds_and_cost_ports_are_not_named_local():
    """``Link.LOCAL`` and ``Port.LOCAL`` were a copy on one device; ``Backend.LOCAL`` is the one ``LOCAL``."""
    from jreshard.options import Backend
    from jreshard.sharding.cost import Port
    from jreshard.sharding.topology import Link

    assert not [m.name for m in (*Link, *Port) if WORDS.search(m.name)]
    assert Link.SAME_DEVICE.name == Port.SAME_DEVICE.name == "SAME_DEVICE" and Backend.LOCAL.value == "local"


def test_every_identifier_with_the_three_words_has_their_one_meaning():
    found = identifiers(_library())
    wrong = misnamed(found)
    assert not wrong, (
        "identifiers using 'local', 'program' or 'piece' outside ALLOWED (docs/architecture.md, 'Words': local = in "
        "this process, program = one launch of processes, piece = a source box meet a destination box; rename the "
        "name, or add it to ALLOWED with the meaning it has):\n" + "\n".join(wrong)
    )
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"in ALLOWED but no longer in jreshard/, drop them: {stale}"


def test_the_glossary_states_the_three_meanings_and_no_exception():
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    words = text.split("## Words", 1)[1].split("\n## ", 1)[0]
    assert "- A **program** is one launch of processes" in words
    assert "- **Local** means in this process" in words
    assert "- A **piece** is the intersection of a source box and a destination box" in words
    assert "exception" not in words.lower()
