"""Shard buffers: zero-copy DLPack export and import between jax shards and byte buffers.

The engine sees every shard as a contiguous 1-D ``uint8`` buffer (see
``kernels.py``). A :class:`Buffers` says where such buffers live and how bytes
move between them inside one rank; :class:`CpuBuffers` is the numpy one. A GPU
backend (CuPy buffers, a CUDA kernel per descriptor table) implements the same
methods, and the engine and ``api.py`` never look past them.

CPU facts this module is built on (measured with jax 0.10 on CPU devices):

- ``np.from_dlpack(shard)`` is zero-copy and read-only, but numpy rejects
  bfloat16 and float8. The DLPack tensor is therefore re-typed, in the capsule, to
  an unsigned integer of the same width before numpy reads it: the bytes are what
  the engine moves.
- ``jax.dlpack.from_dlpack(buf, device=d)`` copies (at about 1 GB/s) unless ``d``
  is the device the capsule reports, and numpy's capsules always report CPU
  device 0; numpy's own allocations are only 16-byte aligned, and a misaligned
  buffer is copied too. So destination buffers are allocated 64-byte aligned and
  their capsule is handed to jax through a small holder whose
  ``__dlpack_device__`` names the destination device; the capsule's dtype is set
  to the real DLPack type (bfloat16 included). The import is then zero-copy on the
  right device, and :func:`import_shard` checks the dtype it got.
"""

from __future__ import annotations

import abc
import ctypes
import functools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import numpy as np

from jreshard.engine.pool import ALIGN, BufferPool, default_pool, staging_pool
from jreshard.errors import TransferError
from jreshard.schedule import kernels
from jreshard.sharding.dtypes import packed_bits
from jreshard.types import Array, Device, DLPackCapsule

if TYPE_CHECKING:
    import jax

B = TypeVar("B")
"""The buffer type of a :class:`Buffers`: a contiguous 1-D uint8 array."""

__all__ = [
    "ALIGN",
    "KDLCUDA",
    "Buffers",
    "Capsule",
    "CpuBuffers",
    "aligned_empty",
    "dlpack_type",
    "export_source",
    "import_shard",
    "retype_capsule",
]

# DLPack DLDataTypeCode values.
_INT, _UINT, _FLOAT, _BFLOAT, _COMPLEX, _BOOL = 0, 1, 2, 4, 5, 6
_FLOAT8 = {
    "float8_e3m4": 7,
    "float8_e4m3": 8,
    "float8_e4m3b11fnuz": 9,
    "float8_e4m3fn": 10,
    "float8_e4m3fnuz": 11,
    "float8_e5m2": 12,
    "float8_e5m2fnuz": 13,
    "float8_e8m0fnu": 14,
}  # DLPack 1.1 codes
_KDLCPU = 1
KDLCUDA = 2  # DLPack device type of a CUDA GPU


class _DLDevice(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class _DLDataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class _DLTensor(ctypes.Structure):  # the first member of DLManagedTensor
    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)


@functools.lru_cache(maxsize=64)
def dlpack_type(dtype: np.dtype) -> tuple[int, int]:
    """The DLPack ``(type code, bits)`` of a numpy / ml_dtypes dtype.

    >>> import ml_dtypes
    >>> dlpack_type(np.dtype(ml_dtypes.bfloat16)), dlpack_type(np.dtype("bool"))
    ((4, 16), (6, 8))
    """
    bits = dtype.itemsize * 8
    if dtype.name == "bfloat16":
        return _BFLOAT, bits
    if dtype.name in _FLOAT8:
        return _FLOAT8[dtype.name], bits
    code = {"b": _BOOL, "i": _INT, "u": _UINT, "f": _FLOAT, "c": _COMPLEX}.get(dtype.kind)
    if code is None or packed_bits(dtype) is not None or dtype.name.startswith(("float4_", "float6_")):
        raise TransferError(f"dtype {dtype.name} has no DLPack type code jreshard knows; cannot move it zero-copy")
    return code, bits


def carrier(bits: int) -> tuple[int, int, np.dtype]:
    """``(DLPack code, bits, numpy dtype)`` of the plain type an element of ``bits`` bits is viewed as, whatever its
    own type: the unsigned integer of its width, or for 128 bits (``complex128``: numpy has no ``uint128``)
    ``complex128`` itself, which numpy and DLPack both know.

    >>> carrier(16)[::2], carrier(128)[::2]
    ((1, dtype('uint16')), (5, dtype('complex128')))

    Raises:
      TransferError: no such type (a width other than 8, 16, 32, 64 or 128 bits).
    """
    if bits in (8, 16, 32, 64):
        return _UINT, bits, np.dtype(f"uint{bits}")
    if bits == 128:
        return _COMPLEX, bits, np.dtype(np.complex128)
    raise TransferError(f"no plain type of {bits} bits to view an element as")


def retype_capsule(capsule: DLPackCapsule, code: int, bits: int, device_id: int | None = None) -> DLPackCapsule:
    """Rewrite the dtype (and device id) of an unconsumed legacy DLPack capsule in place; returns it.

    Args:
      capsule: a ``dltensor`` capsule nobody has consumed yet (``x.__dlpack__()``).
      code, bits: the DLPack type code and width to write (:func:`dlpack_type`).
      device_id: the device id to write, or ``None`` to keep it.

    Example:
      >>> x = np.arange(3, dtype=np.int16)
      >>> y = np.from_dlpack(Capsule(retype_capsule(x.__dlpack__(), _UINT, 16), 0))
      >>> y.dtype, y.tolist()
      (dtype('uint16'), [0, 1, 2])
    """
    t = _DLTensor.from_address(_get_pointer(capsule, b"dltensor"))
    t.dtype.code, t.dtype.bits = code, bits
    if device_id is not None:
        t.device.device_id = device_id
    return capsule


class Capsule:
    """Hands one already-made capsule to a DLPack consumer, reporting device ``device_id`` of DLPack
    device type ``device_type`` (CPU by default; :data:`KDLCUDA` for a CUDA device) as its location."""

    __slots__ = ("_capsule", "_device")

    def __init__(self, capsule: DLPackCapsule, device_id: int, device_type: int = _KDLCPU):
        self._capsule, self._device = capsule, (device_type, device_id)

    def __dlpack__(self, *args: Any, **kwargs: Any) -> DLPackCapsule:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


def export_source(shard: Array) -> np.ndarray:
    """A read-only, zero-copy 1-D uint8 view of one single-device jax array (a shard's ``.data``).

    The export waits until the array is ready (DLPack with no stream). The view holds a DLPack reference to
    the buffer: while it lives, jax does not hand the buffer to a computation that donates the array (it
    copies instead), so what the view reads is never overwritten under it.
    """
    if shard.size == 0:
        return np.zeros(0, np.uint8)
    retype = _export_retype(shard.dtype)
    if retype is None:
        _refuse_packed(shard, "export_source")
        raise AssertionError("unreachable: a dtype with no export type is a packed one")  # pragma: no cover
    capsule = _EXPORT(shard) if not shard.is_deleted() else shard.__dlpack__()  # (jax's own error for a deleted one)
    if retype:
        capsule = retype_capsule(capsule, *retype)
    return np.from_dlpack(Capsule(capsule, 0)).reshape(-1).view(np.uint8)


def _find_export() -> Any:
    """jax's own export of a single-device array as a DLPack capsule (``_jax.buffer_to_dlpack_managed_tensor``, which
    ``__dlpack__`` calls after checks that cost several times the export: its device, its dtype, and the array
    rebuilt from its buffer); ``__dlpack__`` itself where this jax has no such function."""
    try:
        from jax._src.lib import _jax

        export = _jax.buffer_to_dlpack_managed_tensor
    except (ImportError, AttributeError):  # pragma: no cover - another jax
        return lambda shard: shard.__dlpack__()
    return lambda shard: export(shard, stream=None)


_EXPORT = _find_export()


@functools.lru_cache(maxsize=64)
def _export_retype(dtype: np.dtype) -> tuple[int, int] | tuple[()] | None:
    """How :func:`export_source` types a capsule of ``dtype``: ``()`` as it is (numpy reads it), ``(code, bits)``
    retyped to the plain type of its width (numpy has no bfloat16 or float8), ``None`` for a packed sub-byte one."""
    dtype = np.dtype(dtype)
    if packed_bits(dtype) is not None:
        return None
    code, bits, _ = carrier(dtype.itemsize * 8)
    if dtype.kind in "iufc" and dtype.isbuiltin == 1:  # numpy's own types, which its DLPack import takes
        return ()
    return code, bits


def _refuse_packed(array: Array, what: str) -> None:
    """A view sized ``size * itemsize`` would run past a packed sub-byte buffer (it holds two or four values
    a byte, while jax reports one byte a value): such arrays reach the engine widened (jreshard.call.repack)."""
    if packed_bits(np.dtype(array.dtype)) is not None:
        raise TransferError(
            f"{what}: a {array.dtype}{list(array.shape)} buffer packs values below a byte, and its byte views "
            "would be sized one byte a value; the fix is jreshard.call.repack.encode first (transfer does it)"
        )


def writable_view(array: Array) -> np.ndarray:
    """A writable 1-D uint8 view of a single-device jax array's memory (for ``transfer_into``,
    whose destinations the caller donates). The caller keeps ``array`` alive while the view is used."""
    _refuse_packed(array, "writable_view")
    array.block_until_ready()
    nbytes = array.size * array.dtype.itemsize
    if nbytes == 0:
        return np.zeros(0, np.uint8)
    raw = (ctypes.c_uint8 * nbytes).from_address(array.unsafe_buffer_pointer())
    return np.frombuffer(raw, dtype=np.uint8)


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """An uninitialised 1-D uint8 array of ``nbytes`` whose first byte is ``align``-aligned."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    skip = (-raw.ctypes.data) % align
    return raw[skip : skip + nbytes]


def import_shard(region: np.ndarray, shape: Sequence[int], dtype: np.dtype, device: Device) -> Array:
    """A jax array on ``device`` that aliases ``region`` (1-D uint8, ``ALIGN``-aligned), zero-copy.

    Raises:
      TransferError: the buffer is misaligned or jax did not produce the dtype asked for.
    """
    import jax

    shape = tuple(int(n) for n in shape)
    if region.size == 0:
        return jax.device_put(np.zeros(shape, dtype), device)
    if region.ctypes.data % ALIGN:
        raise TransferError(f"import_shard: buffer at {region.ctypes.data:#x} is not {ALIGN}-byte aligned")
    if device.platform == "cpu" and packed_bits(np.dtype(dtype)) is None:  # about 8 us, where DLPack takes 60-100
        from jreshard.engine.put import put_one

        out = put_one(region.view(np.dtype(dtype)).reshape(shape), device)
        if out is not None and out.dtype == dtype and out.unsafe_buffer_pointer() == region.ctypes.data:
            return out  # (else, a copy or another dtype: DLPack below aliases or says why not)
    code, bits = dlpack_type(dtype)
    typed = region.view(carrier(bits)[2]).reshape(shape)
    hw = device.local_hardware_id
    out = jax.dlpack.from_dlpack(Capsule(retype_capsule(typed.__dlpack__(), code, bits, hw), hw))
    if out.dtype != dtype:
        raise TransferError(f"import_shard: asked jax for {dtype} and got {out.dtype}")
    # The engine may import a destination before its bytes are written: a copy here would
    # silently freeze the unwritten bytes, so insist on the alias.
    if out.unsafe_buffer_pointer() != region.ctypes.data:
        raise TransferError(
            f"import_shard: jax copied the buffer at {region.ctypes.data:#x} (got {out.unsafe_buffer_pointer():#x}) "
            f"instead of aliasing it on {device}"
        )
    return out


class Buffers(abc.ABC, Generic[B]):
    """Where shard and staging buffers live and how bytes move inside one rank (abstract).

    Generic in the buffer type ``B``: 1-D uint8 arrays (numpy on CPU, CuPy on GPU); byte movements are
    descriptor tables (``kernels.py``). Final implementations: :class:`CpuBuffers`
    here, and a CuPy one for GPUs.

    ``staging_buffers`` is how many staging arenas a rank wants the engine to alternate
    between by round (2: double-buffered, so a round's pack overlaps the round before it on
    the wire); the engine gives one where two would not fit ``Options.staging_bytes``.

    ``host_ordered``: every pack, unpack and exchange has finished when its call returns, so a send
    may read a staging arena that a receive of the round before wrote (the engine's forwards from
    landed staging). Buffers whose work is queued on streams set it false.
    """

    staging_buffers: int = 1
    host_ordered: bool = True
    native_rows: bool = False
    """Whether the buffers are host memory with the buffer protocol whose packs and unpacks are exactly the
    compiled byte rows (``jreshard/schedule/_rows.c``), so a prepared refit may run them in its compiled replay
    (:mod:`jreshard.engine.replay`) instead of calling :meth:`pack` and :meth:`unpack`."""

    def prepare(self, jobs: Iterable[tuple[str, np.ndarray, Sequence[B | None], B]]) -> None:
        """Before a schedule's first round: every ``("pack" | "unpack", table, buffers, staging)`` it
        will run, lazily (default: nothing to prepare, and ``jobs`` is not read)."""

    @abc.abstractmethod
    def export_source(self, shard: jax.Array) -> B:
        """A zero-copy, read-only 1-D uint8 view of one single-device jax array."""

    @abc.abstractmethod
    def writable_view(self, array: jax.Array) -> B:
        """A zero-copy, writable 1-D uint8 view of a donated single-device jax array."""

    @abc.abstractmethod
    def allocate(self, sizes: Sequence[int], device: Device) -> list[B]:
        """Uninitialised, ``ALIGN``-aligned 1-D uint8 buffers of ``sizes`` bytes on ``device``."""

    @abc.abstractmethod
    def import_shard(self, buffer: B, shape: Sequence[int], dtype: np.dtype, device: Device) -> jax.Array:
        """A jax array on ``device`` aliasing ``buffer`` (from :meth:`allocate`), zero-copy."""

    @abc.abstractmethod
    def staging(self, nbytes: int, device: Device | None = None) -> B:
        """A 1-D uint8 staging buffer of ``nbytes`` on ``device`` (a jax device; ``None``: the current one).

        A process that drives several GPUs needs one arena per GPU, so the engine
        passes the device of the rank the arena serves.
        """

    @abc.abstractmethod
    def pack(self, table: np.ndarray, buffers: Sequence[B | None], staging: B) -> None:
        """Gather the pieces of ``table`` into ``staging``."""

    @abc.abstractmethod
    def unpack(self, table: np.ndarray, staging: B, buffers: Sequence[B | None]) -> None:
        """Scatter ``staging`` into the pieces of ``table``."""

    @abc.abstractmethod
    def copy(
        self, src_table: np.ndarray, src: Sequence[B | None], dst_table: np.ndarray, dst: Sequence[B | None]
    ) -> None:
        """Copy piece ``i`` of ``src_table`` into piece ``i`` of ``dst_table``."""

    @abc.abstractmethod
    def upload(self, data: np.ndarray, device: Device | None) -> B:
        """A 1-D uint8 buffer on ``device`` holding the host bytes ``data`` (a few integers: the
        scheduling mail), ready for the next exchange after :meth:`fence`."""

    @abc.abstractmethod
    def download(self, buffer: B) -> np.ndarray:
        """The bytes of ``buffer`` (any buffer this backend gave out or exported: uploads, staging, shard
        views, destination blocks) as a host uint8 array, after everything issued so far has landed (call
        :meth:`synchronize` first)."""

    def synchronize(self) -> None:
        """Wait for every copy issued so far (default: copies are synchronous)."""
        return None

    def fence(self) -> None:
        """Order the copies issued so far before the next exchange, without waiting if the
        backend can (default: :meth:`synchronize`)."""
        self.synchronize()


class CpuBuffers(Buffers[np.ndarray]):
    """numpy buffers on jax CPU devices (final).

    Args:
      pool: where destination buffers come from (default: the process-wide
        :func:`~jreshard.engine.pool.default_pool`, which hands out blocks that jax
        has released, warm). ``BufferPool(max_bytes=0)`` keeps nothing: every
        buffer is allocated fresh. Staging arenas come from
        :func:`~jreshard.engine.pool.staging_pool`.

    Example:
      >>> import jax
      >>> cpu = CpuBuffers()
      >>> (buf,) = cpu.allocate([16], jax.devices()[3])
      >>> buf.view(np.float32)[:] = [1, 2, 3, 4]
      >>> x = cpu.import_shard(buf, (2, 2), np.dtype("float32"), jax.devices()[3])
      >>> x.devices() == {jax.devices()[3]}, x.unsafe_buffer_pointer() == buf.ctypes.data
      (True, True)
      >>> cpu.export_source(x).view(np.float32).tolist()
      [1.0, 2.0, 3.0, 4.0]
    """

    __slots__ = ("pool",)
    native_rows = kernels.compiled_rows()

    def __init__(self, pool: BufferPool | None = None):
        self.pool = default_pool() if pool is None else pool

    def export_source(self, shard: Array) -> np.ndarray:
        return export_source(shard)

    def writable_view(self, array: Array) -> np.ndarray:
        return writable_view(array)

    def allocate(self, sizes: Sequence[int], device: Device) -> list[np.ndarray]:
        # The small buffers share one lease (one block of the pool per call), each large one has its own: it
        # goes back to the pool on its own when jax lets it go (BufferPool.take_many).
        return self.pool.take_many(sizes)

    def import_shard(self, buffer: np.ndarray, shape: Sequence[int], dtype: np.dtype, device: Device) -> Array:
        return import_shard(buffer, shape, dtype, device)

    def staging(self, nbytes: int, device: Device = None) -> np.ndarray:
        return staging_pool().take(nbytes)  # warm, and where the last refit's arena was

    def upload(self, data: np.ndarray, device: Device) -> np.ndarray:
        return np.ascontiguousarray(data, np.uint8)  # already host memory: no copy

    def download(self, buffer: np.ndarray) -> np.ndarray:
        return buffer

    def pack(self, table: np.ndarray, buffers: Sequence[np.ndarray | None], staging: np.ndarray) -> None:
        kernels.pack_cpu(table, cast(Sequence[np.ndarray], buffers), staging)  # the rows name no missing shard

    def unpack(self, table: np.ndarray, staging: np.ndarray, buffers: Sequence[np.ndarray | None]) -> None:
        kernels.unpack_cpu(table, staging, cast(Sequence[np.ndarray], buffers))

    def copy(self, src_table: np.ndarray, src: Sequence[Any], dst_table: np.ndarray, dst: Sequence[Any]) -> None:
        kernels.copy_cpu(src_table, src, dst_table, dst)
