"""CUDA runtime facts the GPU buffers and every GPU transport read: event status and buffer pointers.

**Event status.** CuPy's ``Event.done`` is ``cudaEventQuery(...) == cudaSuccess``, so a
sticky CUDA error (an illegal address in a kernel) looks like "still running" until a
timeout. :func:`event_done` reads the status itself: success is done, ``NotReady`` is
pending, anything else is raised as ``CUDARuntimeError``. Not run on GPU.
"""

from __future__ import annotations

from jreshard.types import CudaEvent, CupyArray, CupyModule

__all__ = ["CUDA_ERROR_NOT_READY", "CUDA_SUCCESS", "device_pointer", "event_done"]

CUDA_SUCCESS, CUDA_ERROR_NOT_READY = 0, 600  # cudaSuccess, cudaErrorNotReady


def device_pointer(buffer: CupyArray) -> tuple[int, int]:
    """``(device pointer, nbytes)`` of a contiguous 1-D uint8 CUDA buffer.

    Reads ``__cuda_array_interface__`` (CuPy arrays, and anything else that speaks it).

    Raises:
      ValueError: the buffer is not a contiguous 1-D uint8 CUDA array.
    """
    try:
        cai = buffer.__cuda_array_interface__
    except AttributeError:
        raise ValueError(
            f"NcclComm: buffer of type {type(buffer).__name__} is not a CUDA array "
            "(no __cuda_array_interface__); pass CuPy uint8 arrays"
        ) from None
    shape, typestr, strides = tuple(cai["shape"]), cai["typestr"], cai.get("strides")
    if len(shape) != 1 or typestr not in ("|u1", "<u1", ">u1") or strides not in (None, (1,)):
        raise ValueError(
            f"NcclComm: buffer has shape={shape}, typestr={typestr!r}, strides={strides}; "
            "expected a contiguous 1-D uint8 array"
        )
    return int(cai["data"][0]), int(shape[0])


def event_done(event: CudaEvent, runtime: CupyModule) -> bool:
    """Whether a CUDA event has completed, raising a CUDA error instead of calling it pending.

    Args:
      event: a ``cupy.cuda.Event`` (anything with ``ptr``).
      runtime: ``cupy.cuda.runtime`` (``eventQuery`` returns the status, it does not raise).

    Raises:
      runtime.CUDARuntimeError: the event's device reported an error (sticky errors included).
    """
    status = int(runtime.eventQuery(event.ptr))
    if status == CUDA_SUCCESS:
        return True
    if status == CUDA_ERROR_NOT_READY:
        return False
    raise runtime.CUDARuntimeError(status)
