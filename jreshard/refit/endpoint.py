"""The receiving side of a refit group, without jax: a declaration, buffers, a control plane, a pull loop.

A destination program that is not a JAX program (an inference server with its own tensors) joins a
refit group as an :class:`Endpoint`:

- **declaration** (:class:`Declaration`): the tensors it receives (names, global shapes, dtypes) and,
  per tensor, the boxes this process holds, each in one of its ``slots`` (a device, or any memory
  the receiver keeps apart; slot ``i`` is the process's ``i``-th rank of the group);
- **buffers**: per ``(tensor name, slot)``, writable contiguous memory of exactly that box's bytes
  in row-major order: a numpy array, anything with the buffer protocol, or a :class:`RawMemory`
  (an address and a size, for memory another library owns);
- **control plane**: the votes and declarations of the group (an MPI communicator, or the
  authenticated TCP group of ``transport="nixl"``) and its transport for the bytes;
- **pull loop**: :meth:`Endpoint.pull` waits for the source's next version, receives it into the
  buffers through the shared engine, and returns the version once every process of the group has
  committed it.

The bytes land in the caller's buffers; nothing is assembled. :class:`jreshard.RefitGroup`'s destination
runs the same loop (``RefitGroup._receive``): it hands it fresh host buffers and makes its jax arrays over
them, so another framework's receiver needs an endpoint, never a change to the engine.

This module imports no jax (a test imports it, and runs a refit, with jax blocked). CPU memory only:
the engine reads and writes the buffers from the host (GPU memory: not run on GPU).
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from jreshard.errors import LayoutError
from jreshard.options import Options, wait_s
from jreshard.refit.group import RefitGroup, Role
from jreshard.sharding.box import Box
from jreshard.sharding.dtypes import dtype_name, numpy_dtype, packed_bits, storage_bytes
from jreshard.types import ByteBuffer

__all__ = ["Declaration", "Endpoint", "RawMemory", "Tensor", "byte_view"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Tensor:
    """One tensor an endpoint receives.

    Attributes:
      name: its name in the group (the source's key path, ``"['layers'][0]['w']"``).
      shape: its global shape.
      dtype: its dtype's name (``"float32"``, ``"bfloat16"``...); another dtype than the source's is a cast.
      boxes: ``((slot, Box), ...)``: the parts this process holds, at most one per slot.

    Raises:
      LayoutError: a box outside the shape, of another rank, or two boxes in one slot; a packed sub-byte dtype.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    boxes: tuple[tuple[int, Box], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "dtype", dtype_name(numpy_dtype(self.dtype)))
        boxes = tuple((int(s), b if isinstance(b, Box) else Box(*b)) for s, b in self.boxes)
        object.__setattr__(self, "boxes", boxes)
        if not isinstance(self.name, str) or not self.name:
            raise LayoutError(f"Tensor: name={self.name!r} must be a non-empty string")
        bits = packed_bits(numpy_dtype(self.dtype))
        if bits is not None:
            raise LayoutError(
                f"Tensor {self.name}: dtype {self.dtype} is held {8 // bits} values a byte, and a refit moves whole "
                "bytes: declare it uint8, one value a byte, as the source refits it (jax.lax.bitcast_convert_type("
                f"x, jnp.uint{bits}).astype(jnp.uint8))"
            )
        slots = [s for s, _ in boxes]
        if len(set(slots)) != len(slots):
            raise LayoutError(f"Tensor {self.name}: slots {slots} hold two boxes of one tensor")
        for s, b in boxes:
            if s < 0:
                raise LayoutError(f"Tensor {self.name}: slot {s} < 0")
            if len(b.lo) != len(self.shape) or any(h > n for h, n in zip(b.hi, self.shape, strict=True)):
                raise LayoutError(f"Tensor {self.name}: box {b} in slot {s} is not inside shape {self.shape}")

    def nbytes(self, slot: int) -> int:
        """Bytes of the box in ``slot`` (the size its buffer must have)."""
        box = dict(self.boxes)[slot]
        return storage_bytes(numpy_dtype(self.dtype), box.volume)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Declaration:
    """What one receiving process declares to its group.

    Attributes:
      tensors: the tensors it receives (every destination process declares the same names, shapes and
        dtypes; the boxes are each one's own).
      slots: how many ranks this process drives (every box's slot is below it).
      domain: its fast-link domain id (default: its own).
      recipe: ``{tensor name: view}`` for tensors made from the source's parameters by a view (a fused,
        transposed or cast parameter: :mod:`jreshard.views`, its leaves :func:`jreshard.views.param` named
        as the source names its parameters); views or their encoded form. Other tensors take the source
        parameter of their name (cast to their dtype).

    Example:
      >>> w = Tensor(name="['w']", shape=(4, 2), dtype="float32", boxes=((0, Box((0, 0), (2, 2))),))
      >>> Declaration(tensors=(w,), slots=1).message()["params"]
      [["['w']", [4, 2], 'float32', [[0, [0, 0], [2, 2]]]]]
    """

    tensors: tuple[Tensor, ...]
    slots: int
    domain: int | None = None
    recipe: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(self.tensors))
        if self.recipe is not None:
            from jreshard.views.algebra import View
            from jreshard.views.named import encode

            forms = {k: encode(v) if isinstance(v, View) else v for k, v in self.recipe.items()}
            unknown = sorted(set(forms) - {t.name for t in self.tensors})
            if unknown:
                raise LayoutError(f"Declaration: the recipe makes {unknown}, which are not among the tensors")
            object.__setattr__(self, "recipe", forms)
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise LayoutError(f"Declaration: slots={self.slots!r} must be an int >= 1")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise LayoutError(f"Declaration: tensor names repeat: {names}")
        for t in self.tensors:
            over = [s for s, _ in t.boxes if s >= self.slots]
            if over:
                raise LayoutError(f"Declaration: tensor {t.name} has boxes in slots {over}, but slots={self.slots}")

    def message(self, role: str = "destination") -> dict:
        """The declaration as every process of a group exchanges it (:mod:`jreshard.refit.decl`)."""
        params = [
            [t.name, list(t.shape), t.dtype, [[s, list(b.lo), list(b.hi)] for s, b in sorted(t.boxes)]]
            for t in self.tensors
        ]
        out = {"role": role, "ndev": self.slots, "domain": self.domain, "params": params, "errors": []}
        if self.recipe is not None:
            out["recipe"] = dict(self.recipe)
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class RawMemory:
    """Memory another library owns, as an address and a size in bytes (kept alive by the caller)."""

    address: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.address <= 0 or self.nbytes < 0:
            raise LayoutError(f"RawMemory: address={self.address:#x}, nbytes={self.nbytes} must be positive")


def byte_view(buffer: ByteBuffer, nbytes: int, what: str) -> np.ndarray:
    """A writable 1-D ``uint8`` view of ``buffer`` (numpy, the buffer protocol, or a :class:`RawMemory`), zero-copy.

    Raises:
      LayoutError: the buffer is read-only, not contiguous, or not ``nbytes`` long (``what`` names it).
    """
    if isinstance(buffer, RawMemory):
        raw = (ctypes.c_uint8 * buffer.nbytes).from_address(buffer.address)
        view = np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8)
    elif isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise LayoutError(f"{what} is not C-contiguous; the fix is np.ascontiguousarray or a buffer of its own")
        view = buffer.reshape(-1).view(np.uint8)
    else:
        try:
            mem = memoryview(buffer)
        except TypeError:
            raise LayoutError(
                f"{what} is {type(buffer).__name__}; expected a numpy array, a buffer or a RawMemory(address, nbytes)"
            ) from None
        if not mem.c_contiguous:
            raise LayoutError(f"{what} is not C-contiguous")
        view = np.frombuffer(mem.cast("B"), dtype=np.uint8)
    if not view.flags.writeable:
        raise LayoutError(f"{what} is read-only; the endpoint writes the received bytes into it")
    if view.nbytes != nbytes:
        raise LayoutError(f"{what} holds {view.nbytes} bytes, but its box takes {nbytes}")
    return view


class Endpoint:
    """A receiving process of a refit group that holds its tensors in its own buffers, without jax (final).

    Args:
      declaration: what this process receives (:class:`Declaration`).
      comm: an MPI intracommunicator spanning both sides (default ``MPI.COMM_WORLD``), as for
        :class:`jreshard.RefitGroup`; the source processes form their side with ``RefitGroup``.
      options: chunking, staging and ``timeout_s`` (every wait on a peer).
      links: link speeds for the plan's topology (``Topology.from_domains`` keywords).

    Raises:
      LayoutMismatchError: the declarations of the group disagree (same message on every process).
      TransferTimeoutError: a process of the group did not join within ``options.timeout_s`` (one that failed
        or exited before making its side).
    """

    def __init__(
        self,
        declaration: Declaration,
        *,
        comm: Any = None,
        options: Options | None = None,
        links: dict[str, float] | None = None,
        _group: Any = None,
    ):
        if not isinstance(declaration, Declaration):
            raise TypeError(f"Endpoint: declaration is {type(declaration).__name__}; expected a Declaration")
        self.declaration = declaration
        self._group = RefitGroup(
            Role.DESTINATION,
            None,
            _declared=declaration.message(Role.DESTINATION.value),
            comm=comm,
            devices=list(range(declaration.slots)),
            options=options,
            links=links,
            _group=_group,
        )
        self._names = {t.name: t for t in declaration.tensors}

    @classmethod
    def connect(
        cls,
        declaration: Declaration,
        *,
        address: str,
        index: int = 0,
        count: int = 1,
        host: str = "127.0.0.1",
        options: Options | None = None,
        links: dict[str, float] | None = None,
    ) -> Endpoint:
        """Join the source's group at ``address`` over ``transport="nixl"`` (``RefitGroup.connect`` on the
        source side): authenticated TCP for the control plane, NIXL WRITEs for the bytes.

        Args:
          index, count: this process's place among the receiving processes, and their number.
        """
        from jreshard.call.routes import kit
        from jreshard.net.auth import resolve_secret

        ProcessGroup = kit("nixl").group

        options = Options.of(options)
        key = resolve_secret(options.secret, who="Endpoint.connect")
        group = ProcessGroup.join(
            Role.DESTINATION.value, address, index=index, count=count, key=key, timeout_s=options.timeout_s, host=host
        )
        try:
            return cls(declaration, options=options, links=links, _group=group)
        except BaseException:
            group.close()
            raise

    @property
    def version(self) -> int | None:
        """The last version every process of the group committed (``None`` before the first)."""
        return self._group.version

    def pull(self, buffers: Mapping[tuple[str, int], Any], *, timeout_s: float | None = None) -> int:
        """Receive the next version into ``buffers`` and return it.

        Args:
          buffers: ``{(tensor name, slot): buffer}`` for every box of the declaration: writable,
            C-contiguous, exactly the box's bytes (``Tensor.nbytes(slot)``), row-major.
          timeout_s: how long to wait for the source side to start (default ``options.timeout_s``).

        Raises:
          LayoutError: a buffer is missing, extra, read-only or of another size: checked here and
            voted, so the source side hears of it and nothing moves.
          PeerError, TransferTimeoutError: the refit failed (every process says why); nothing committed.
        """
        wait_s(timeout_s, self._group.options.timeout_s, "Endpoint.pull")
        error = ""
        flat: dict[tuple[int, int], np.ndarray] = {}
        try:
            flat = self._flat(buffers)
        except LayoutError as err:
            error = f"LayoutError: {err}"
        try:
            return self._group._receive(error, flat, timeout_s)
        except Exception as err:
            if error:
                raise LayoutError(f"Endpoint.pull: {error[len('LayoutError: ') :]}") from err
            raise

    def _flat(self, buffers: Mapping[tuple[str, int], Any]) -> dict[tuple[int, int], np.ndarray]:
        """``{(tensor, rank): 1-D uint8 view}`` of ``buffers``, every one checked."""
        want = {(t.name, s) for t in self.declaration.tensors for s, _ in t.boxes}
        have = set(buffers)
        if want != have:
            missing, extra = sorted(want - have), sorted(have - want, key=repr)
            raise LayoutError(f"buffers: missing {missing}, not declared {extra}")
        out = {}
        for (name, slot), buf in buffers.items():
            t = self._names[name]
            view = byte_view(buf, t.nbytes(slot), f"buffers[{(name, slot)!r}]")
            out[(self._group._index[name], self._group._base + slot)] = view
        return out

    def close(self) -> None:
        """Leave the group (every other process hears of it at once)."""
        self._group.close()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
