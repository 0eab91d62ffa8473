"""The names of the values every layer passes around, in one place.

They are aliases for readers and type checkers; none of them is checked at run time. Where the
value is a type from a library that ships no annotations jreshard checks against (mpi4py, CuPy,
NIXL) or one jax does not export in a checkable form, the alias stands for ``Any`` and its name
says what the value is. :class:`ControlPlane` is the protocol of the small all-to-all exchanges a
group of processes runs before and beside the weights (MPI's and NIXL's groups).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeAlias, runtime_checkable

__all__ = [
    "Array",
    "ByteBuffer",
    "ControlObject",
    "ControlPlane",
    "CudaEvent",
    "CudaKernel",
    "CudaStream",
    "CupyArray",
    "CupyModule",
    "DLPackCapsule",
    "DType",
    "Device",
    "NumpyIndex",
    "Json",
    "MpiCommunicator",
    "MpiModule",
    "MplAxes",
    "MplFigure",
    "NcclCommunicator",
    "NixlHandle",
    "NixlModule",
    "NvmlHandle",
    "NvmlModule",
    "PyTree",
    "Rank",
    "ShardKey",
    "Sharding",
    "Target",
    "TorchDType",
    "TorchTensor",
    "TreeDef",
    "TreeLeaf",
    "XlaExecutable",
]

PyTree: TypeAlias = Any
"""A jax pytree: nested dicts, lists, tuples (and registered nodes) with arrays, shardings or
``None`` at the leaves."""

Device: TypeAlias = Any
"""A ``jax.Device``."""

Sharding: TypeAlias = Any
"""A ``jax.sharding.Sharding``."""

Array: TypeAlias = Any
"""A ``jax.Array``: a global array of a call, or the single-device array of one shard."""

TreeLeaf: TypeAlias = Any
"""A leaf of a call's pytree as the caller gave it: a ``jax.Array``, a view
(:class:`jreshard.views.algebra.View`), a numpy array or a Python scalar."""

TreeDef: TypeAlias = Any
"""A ``jax.tree_util.PyTreeDef``: the structure of a pytree without its leaves."""

DType: TypeAlias = Any
"""A dtype as callers name one: a ``numpy.dtype``, a jax or ``ml_dtypes`` scalar type, or its name."""

NumpyIndex: TypeAlias = Any
"""A numpy-style index: an int, a slice, ``None``, ``...`` or a tuple of them."""

ByteBuffer: TypeAlias = Any
"""One 1-D ``uint8`` buffer a transport reads or writes: a numpy array on CPU, a CuPy array on GPU."""

DLPackCapsule: TypeAlias = Any
"""A DLPack ``PyCapsule`` (``"dltensor"``)."""

XlaExecutable: TypeAlias = Any
"""A compiled jax program (``jax.stages.Compiled``)."""

Target: TypeAlias = Any
"""What one leaf moves to: a ``Sharding``, a ``jax.ShapeDtypeStruct`` or ``jax.Array`` carrying one, or
``None`` (the leaf stays where it is)."""

ControlObject: TypeAlias = Any
"""A small object a control plane exchanges: JSON over TCP groups, any picklable object over MPI."""

Json: TypeAlias = Any
"""A JSON value (dicts with string keys, lists, numbers, strings, booleans, ``None``): what crosses a
control connection."""

MpiCommunicator: TypeAlias = Any
"""An mpi4py communicator (``MPI.Comm``)."""

MpiModule: TypeAlias = Any
"""The ``mpi4py.MPI`` module."""

CupyModule: TypeAlias = Any
"""The ``cupy`` module, or a stand-in with the same calls (the CPU tests')."""

CupyArray: TypeAlias = Any
"""A CuPy array on one GPU (the GPU buffers' 1-D ``uint8`` buffers)."""

CudaStream: TypeAlias = Any
"""A ``cupy.cuda.Stream``."""

CudaEvent: TypeAlias = Any
"""A ``cupy.cuda.Event``."""

NixlModule: TypeAlias = Any
"""The ``nixl_cu12`` (or ``nixl_cu13``) module."""

NixlHandle: TypeAlias = Any
"""A handle NIXL gives out: an agent, a registration, a prepared descriptor list or a transfer."""

CudaKernel: TypeAlias = Any
"""A compiled ``cupy.RawKernel``."""

NcclCommunicator: TypeAlias = Any
"""A ``cupy.cuda.nccl.NcclCommunicator``."""

NvmlModule: TypeAlias = Any
"""The ``pynvml`` module (or a stand-in with its calls)."""

NvmlHandle: TypeAlias = Any
"""An NVML device handle."""

TorchTensor: TypeAlias = Any
"""A ``torch.Tensor`` (jreshard imports torch only where it is asked to)."""

TorchDType: TypeAlias = Any
"""A ``torch.dtype``."""

MplAxes: TypeAlias = Any
"""A matplotlib ``Axes``."""

MplFigure: TypeAlias = Any
"""A matplotlib ``Figure``."""

Rank = int
"""A device taking part in a transfer (``device.id`` in one jax program)."""

ShardKey = tuple[int, int]
"""``(tensor index, rank)``: one shard of one tensor of a transfer."""


@runtime_checkable
class ControlPlane(Protocol):
    """The control plane of a group of processes: small objects exchanged all-to-all, every wait bounded.

    Implemented by MPI's :class:`jreshard.mpi.control.Control` and by the authenticated TCP group of two
    programs, :class:`jreshard.nixl.group.ProcessGroup`. Every process calls the operations in the same
    order; a peer that closed is reported at once.
    """

    rank: int
    """This process's number in the group."""

    def allgather(
        self,
        obj: ControlObject,
        *,
        timeout_s: float,
        peers: Sequence[int] | None = None,
        stop: Callable[[int, ControlObject], bool] | None = None,
    ) -> dict[int, ControlObject]:
        """Send ``obj`` to every process of ``peers`` (default: all) and collect theirs, by process."""
        ...

    def notify_closed(self) -> None:
        """Tell every peer this process is leaving, without waiting for them."""
        ...

    def close(self) -> None:
        """Leave the group (peers see this process as closed)."""
        ...
