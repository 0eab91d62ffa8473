"""A receiving process with PyTorch and no jax: each refit lands in the caller's tensors.

:class:`Receiver` joins a refit group whose source is a JAX program (:class:`jreshard.RefitGroup` as
``"source"``), declares the tensors this process holds (each a box of a global tensor, or a view of the
source's parameters through a recipe), and :meth:`Receiver.pull` brings every tensor to the source's next
version through the shared engine (:class:`jreshard.refit.Endpoint`), versioned as ``RefitGroup`` is:

- ``in_place=False`` (the default): the bytes land in host staging of the tensors' size; only once every
  process of the group has committed the version are they copied into the tensors (one ``memcpy`` per
  tensor). A refit that fails anywhere leaves every tensor on its previous version.
- ``in_place=True``: the bytes land straight in the tensors' memory (no second copy, no staging memory).
  A refit that fails midway leaves them part old, part new, and the error says so
  (``destination_intact=False``); pull again before using them.

CPU tensors here. CUDA tensors are staged on the host and copied to the device with ``torch`` at the commit
(``in_place=True`` refuses them: the engine writes host memory); not run on GPU.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from jreshard.errors import LayoutError, TransferError
from jreshard.options import Options
from jreshard.refit.endpoint import Declaration, Endpoint, RawMemory, Tensor
from jreshard.sharding.box import Box
from jreshard.torch.tensors import tensor_dtype, tensor_region
from jreshard.types import Target

__all__ = ["Receiver", "Shard"]


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
    """One tensor this process receives.

    Attributes:
      tensor: the ``torch.Tensor`` written (contiguous).
      shape: the global shape it is a part of.
      box: the part of the global tensor it holds (empty: it holds none of it, only padding; a tensor of no
        element is held, empty, by every process that names it).
      tensor_box: where ``box`` lands in ``tensor`` (default: all of it); one contiguous run of its memory.
    """

    tensor: Any
    shape: tuple[int, ...]
    box: Box
    tensor_box: Box | None = None


class Receiver:
    """A process of a refit group's receiving side that holds its parameters as PyTorch tensors (final).

    Build it with :meth:`connect` (NIXL, between programs on any hosts) or :meth:`over_mpi` (one MPI launch).

    Args:
      endpoint: the group's receiving endpoint.
      shards: ``{tensor name: Shard}``, as declared.
      in_place: write straight into the tensors (see the module docstring).
    """

    def __init__(self, endpoint: Endpoint, shards: Mapping[str, Shard], *, in_place: bool = False):
        self.endpoint, self.in_place = endpoint, bool(in_place)
        self._targets: dict[tuple[str, int], tuple[int, int]] = {}
        self._device: dict[tuple[str, int], Any] = {}  # tensors off the host: copied with torch at the commit
        for name, s in shards.items():
            if not _declares(s):
                continue
            self._targets[(name, 0)] = tensor_region(s.tensor, s.tensor_box or _whole(s.tensor), what=name)
            if str(s.tensor.device) != "cpu":
                if self.in_place:
                    raise ValueError(
                        f"{name}: in_place=True writes host memory, but the tensor is on {s.tensor.device}; "
                        "use the staged default (the bytes land on the host and are copied to the device)"
                    )
                self._device[(name, 0)] = s.tensor
        self._buffers: dict[tuple[str, int], Any]
        if self.in_place:
            # (a tensor of no element has no memory to name: an empty buffer, which no byte reaches)
            self._buffers = {k: RawMemory(a, n) if n else np.empty(0, np.uint8) for k, (a, n) in self._targets.items()}
        else:
            self._buffers = {k: np.empty(n, np.uint8) for k, (_, n) in self._targets.items()}
        self._tensors = {name: s.tensor for name, s in shards.items()}  # kept alive with their memory

    @staticmethod
    def declaration(
        shards: Mapping[str, Shard], *, recipe: Mapping[str, Any] | None = None, domain: int | None = None
    ) -> Declaration:
        """The declaration of ``shards`` (one slot: this process), checked before any connection.

        Raises:
          LayoutError: a box outside its shape, or of another volume than its ``tensor_box``;
          TypeError, ValueError: a tensor of an unsupported dtype, not contiguous, or a ``tensor_box``
            that is not one run of its memory (each names the tensor).
        """
        tensors = []
        for name, s in shards.items():
            box = s.box if isinstance(s.box, Box) else Box(*s.box)
            region = s.tensor_box or _whole(s.tensor)
            if region.volume != box.volume:
                raise LayoutError(
                    f"{name}: its box {box} has {box.volume} elements, its tensor_box {region} {region.volume}"
                )
            tensor_region(s.tensor, region, what=name)
            boxes = ((0, box),) if _declares(s) else ()
            tensors.append(Tensor(name=name, shape=tuple(s.shape), dtype=tensor_dtype(s.tensor), boxes=boxes))
        return Declaration(tensors=tuple(tensors), slots=1, domain=domain, recipe=recipe)

    @classmethod
    def connect(
        cls,
        shards: Mapping[str, Shard],
        *,
        address: str,
        index: int = 0,
        count: int = 1,
        recipe: Mapping[str, Any] | None = None,
        host: str = "127.0.0.1",
        options: Options | None = None,
        links: dict[str, float] | None = None,
        in_place: bool = False,
    ) -> Receiver:
        """Join the source's group at ``address`` (NIXL; ``RefitGroup.connect(..., transport="nixl")`` on the
        source side), as receiving process ``index`` of ``count``. The shared secret is required
        (``Options.secret`` or ``$JRESHARD_SECRET``)."""
        decl = cls.declaration(shards, recipe=recipe)
        endpoint = Endpoint.connect(decl, address=address, index=index, count=count, host=host, options=options,
                                    links=links)  # fmt: skip
        return cls._made(endpoint, shards, in_place)

    @classmethod
    def over_mpi(
        cls,
        shards: Mapping[str, Shard],
        *,
        comm: Any = None,
        recipe: Mapping[str, Any] | None = None,
        options: Options | None = None,
        links: dict[str, float] | None = None,
        in_place: bool = False,
    ) -> Receiver:
        """Join the group of one MPI launch (``comm`` spans both sides; default ``MPI.COMM_WORLD``)."""
        endpoint = Endpoint(cls.declaration(shards, recipe=recipe), comm=comm, options=options, links=links)
        return cls._made(endpoint, shards, in_place)

    @classmethod
    def _made(cls, endpoint: Endpoint, shards: Mapping[str, Shard], in_place: bool) -> Receiver:
        try:
            return cls(endpoint, shards, in_place=in_place)
        except BaseException:  # leave the group at once: its other processes must not wait for this one
            endpoint.close()
            raise

    @property
    def version(self) -> int | None:
        """The version the tensors hold (``None`` before the first pull)."""
        return self.endpoint.version

    def pull(self, *, timeout_s: float | None = None) -> int:
        """Bring every tensor to the source's next version; returns the version.

        Raises:
          PeerError, TransferTimeoutError: the refit failed. With ``in_place=False`` the tensors keep their
            previous version; with ``in_place=True`` they may hold a mix (``destination_intact=False``).
        """
        try:
            version = self.endpoint.pull(self._buffers, timeout_s=timeout_s)
        except TransferError as err:
            if self.in_place:
                err.destination_intact = False
                text = str(err.args[0]) if err.args else str(err)
                keeps = "the destination keeps its previous version"
                says = "in_place=True: the tensors may hold part of the failed version; pull again before using them"
                err.args = (text.replace(keeps, says) if keeps in text else f"{text}\n({says})",)
            else:
                err.destination_intact = True
            raise
        if not self.in_place:
            for key, (address, nbytes) in self._targets.items():
                src = self._buffers[key]
                if key in self._device:
                    _to_device(self._device[key], address, src)
                else:
                    ctypes.memmove(address, src.ctypes.data, nbytes)
        return version

    def close(self) -> None:
        """Leave the group."""
        self.endpoint.close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _to_device(t: Target, address: int, src: np.ndarray) -> None:
    """Copy the host bytes ``src`` into device tensor ``t`` at ``address`` (inside it). Not run on GPU."""
    import torch

    flat = t.detach().reshape(-1).view(torch.uint8)
    start = address - int(t.data_ptr())
    flat[start : start + src.size].copy_(torch.from_numpy(src))


def _declares(s: Shard) -> bool:
    """Whether this process declares ``s``: an empty box holds nothing (padding only), except of a tensor of no
    element, which every process declares (as jax declares a zero-size array on each of its devices)."""
    box = s.box if isinstance(s.box, Box) else Box(*s.box)
    return bool(box.volume) or 0 in tuple(s.shape)


def _whole(t: Target) -> Box:
    shape = tuple(int(n) for n in t.shape)
    return Box((0,) * len(shape), shape)
