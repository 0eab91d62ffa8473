"""The command line's arguments: the layout syntax, argument types that reject bad values up front.

Every check here runs while argparse parses, so a bad argument is one ``error:``
line naming the argument and the value, exit status 2, before any work.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any

from jreshard.types import Json

__all__ = ["LAYOUT_SYNTAX", "add_case_args", "parse_layout", "png_path"]


LAYOUT_SYNTAX = """\
layouts (--src, --dst):  MESH[:SPEC][@FIRST_RANK]
  MESH        mesh axes major to minor, AXIS=SIZE joined by commas: "ep=16", "dp=4,tp=8"
  SPEC        one entry per tensor dimension, joined by commas (missing trailing entries
              replicate): "-" replicates the dimension, "tp" splits it over axis tp,
              "dp+tp" splits it over dp then tp (major to minor), as in a PartitionSpec
  FIRST_RANK  the mesh holds ranks FIRST_RANK, FIRST_RANK+1, ... in row-major order;
              default: 0 for --src, and for --dst the first rank of the next fast-link
              domain after the source's ranks
  example: --shape 256,2048,7168 --src "ep=16:ep" --dst "dp=4,tp=8:-,-,tp"
           is P("ep") on 16 GPUs -> P(None, None, "tp") on a (dp=4, tp=8) mesh
system configs (--system-config): NVIDIA NCCL M2N's format, {"train": {...}, "generation": {...}}
  with num_gpus, tp_size, cp_size, ep_size, pp_size, fsdp_size, dp_size per side, mapped to
  shardings with Megatron's rank order (jreshard.models.megatron); the model comes from
  --model, --hf-config (a Hugging Face config.json) or the file's "model". The published
  rows ship with jreshard: give their names instead of a file (%(published)s).
topology: ranks in consecutive blocks of --domain-size form one fast-link domain
  (trainer ranks first, inference ranks from the next domain on). --cluster sets
  defaults: %(clusters)s.
every time `simulate` prints is predicted by the cost model (jreshard.cost), not measured."""


def parse_layout(text: str, shape: Sequence[int], dtype: str, first_rank: int) -> Any:
    """A Layout from the command-line syntax (``LAYOUT_SYNTAX``); ``first_rank`` unless ``@N`` is given.

    Raises:
      argparse.ArgumentTypeError: the text does not follow the syntax.

    Example:
      >>> lay = parse_layout("dp=2,tp=4:-,tp@8", (6, 16), "float32", 0)
      >>> lay.ranks[:3], lay.box_of(9)
      ((8, 9, 10), Box(lo=(0, 4), hi=(6, 8)))
    """
    import numpy as np

    from jreshard.errors import LayoutError
    from jreshard.sharding.layout import Layout

    body, _, at = text.partition("@")
    mesh_text, _, spec_text = body.partition(":")
    try:
        axes = [(a.strip(), int(n)) for a, n in (item.split("=") for item in mesh_text.split(","))]
        first = int(at) if at else first_rank
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"layout {text!r}: the mesh must read AXIS=SIZE,AXIS=SIZE and the first rank an integer, "
            f"e.g. 'dp=4,tp=8:-,tp@72'"
        ) from None
    if any(n < 1 for _, n in axes):
        raise argparse.ArgumentTypeError(f"layout {text!r}: mesh axis sizes must be >= 1")
    spec: list[Any] = []
    for entry in spec_text.split(",") if spec_text else []:
        entry = entry.strip()
        spec.append(None if entry in ("-", "", "None") else tuple(entry.split("+")))
    names = [a for a, _ in axes]
    ranks = np.arange(first, first + int(np.prod([n for _, n in axes]))).reshape([n for _, n in axes])
    try:
        return Layout.from_mesh(ranks, names, spec, shape, dtype)
    except LayoutError as err:
        raise argparse.ArgumentTypeError(f"layout {text!r}: {err}") from None


def _positive(kind: type, what: str, *, zero: bool = False) -> Callable[[str], Any]:
    """An argparse type: ``kind`` (int or float) > 0 (``>= 0`` with ``zero``); the error shows the value
    (argparse names the argument)."""

    def parse(text: str) -> Json:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if not (v >= 0 if zero else v > 0) or v != v or v in (float("inf"),):
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if zero else '> 0'}, got {text!r}")
        return v

    return parse


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be sizes joined by commas, e.g. 256,2048,7168; got {text!r}") from None
    if any(n < 0 for n in shape):
        raise argparse.ArgumentTypeError(f"sizes must be >= 0, got {text!r}")
    return shape


def _file(what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not os.path.isfile(text):
            raise argparse.ArgumentTypeError(f"{text!r}: no such file")
        return text

    return parse


def _system_config_arg(text: str) -> Any:
    from jreshard.models import published_configs, read_system_config

    shipped = published_configs()
    if not os.path.isfile(text):
        if text in shipped:
            return shipped[text]
        raise argparse.ArgumentTypeError(f"{text!r}: no such file, nor one of the shipped configs {sorted(shipped)}")
    try:
        return read_system_config(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None


def png_path(text: str) -> str:
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {folder!r} does not exist")
    return text


def add_case_args(p: argparse.ArgumentParser) -> None:
    from jreshard.models import CLUSTERS, MODELS

    pos, size = _positive(int, "a GPU count"), _positive
    p.add_argument("--model", choices=sorted(MODELS), help="a model with its trainer and inference layouts")
    p.add_argument(
        "--system-config",
        type=_system_config_arg,
        metavar="FILE",
        help="both sides' parallelism in NCCL M2N's system-config format, or a shipped config's name",
    )
    p.add_argument(
        "--hf-config", type=_file("--hf-config"), metavar="FILE", help="the model from a Hugging Face config.json"
    )
    p.add_argument("--train-gpus", type=pos, default=128, help="trainer GPUs, ranks 0.. (default 128)")
    p.add_argument("--infer-gpus", type=pos, default=128, help="inference GPUs, after the trainer's (default 128)")
    p.add_argument("--shape", type=_shape, help="one tensor instead of a model: its shape, e.g. 256,2048,7168")
    p.add_argument("--dtype", default="bfloat16", help="the tensor's dtype (default bfloat16)")
    p.add_argument("--src", help="the tensor's source layout (syntax below)")
    p.add_argument("--dst", help="the tensor's destination layout (syntax below)")
    p.add_argument(
        "--cluster",
        choices=sorted(CLUSTERS),
        help="link and domain defaults (default: the system config's cluster, else nvl72)",
    )
    p.add_argument(
        "--domain-size", type=size(int, "--domain-size"), help="GPUs per fast-link domain (overrides --cluster)"
    )
    p.add_argument("--nic-gbs", type=size(float, "--nic-gbs"), help="NIC GB/s per GPU, each way (overrides --cluster)")
    p.add_argument(
        "--fast-gbs", type=size(float, "--fast-gbs"), help="fast-link GB/s per GPU, each way (overrides --cluster)"
    )
    p.add_argument(
        "--latency-us",
        type=size(float, "--latency-us", zero=True),
        help="per-message latency, microseconds (default: the cluster's, 5)",
    )
    p.add_argument("--chunk-mib", type=size(int, "--chunk-mib"), default=8, help="pipeline chunk, MiB (default 8)")
    p.add_argument(
        "--max-group-ops",
        type=size(int, "--max-group-ops"),
        help="the most send/recv operations per rank in one exchange group (default: Options' 2048)",
    )
    p.add_argument("--no-relays", action="store_true", help="plan without relays between destination domains")
    p.add_argument(
        "--fused", action="store_true", help="refit into the inference engine's fused format (views), beside the hybrid"
    )
