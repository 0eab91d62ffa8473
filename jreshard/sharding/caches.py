"""One cache helper for all of jreshard: bounded, and cleared in one call.

Every memoised function in the package is decorated with :func:`cache`, which
wraps it in a ``functools.lru_cache`` of a fixed size and records it, so that
:func:`clear_caches` empties every one of them (plans, layouts of shardings,
schedules) at once, as ``jax.clear_caches`` does for JAX.

Example:
  >>> from jreshard.sharding.caches import cache, clear_caches
  >>> @cache(max_size=8)
  ... def square(x: int) -> int:
  ...     return x * x
  >>> square(3), square.cache_info().currsize
  (9, 1)
  >>> clear_caches()
  >>> square.cache_info().currsize
  0
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["cache", "clear_caches", "register_clear"]

F = TypeVar("F", bound=Callable[..., Any])

_REGISTRY: list[Any] = []  # every function wrapped by cache(), in definition order


def cache(max_size: int) -> Callable[[F], F]:
    """Memoise a function on its (hashable) arguments, keeping at most ``max_size`` results.

    Args:
      max_size: the most results kept; the least recently used goes first.

    Raises:
      ValueError: ``max_size`` is not a positive int.
    """
    if not isinstance(max_size, int) or isinstance(max_size, bool) or max_size < 1:
        raise ValueError(f"cache: max_size={max_size!r} must be a positive int")

    def wrap(fn: F) -> F:
        wrapped = functools.lru_cache(maxsize=max_size)(fn)
        _REGISTRY.append(wrapped)
        return wrapped  # type: ignore[return-value]

    return wrap


def register_clear(clear: Callable[[], None]) -> None:
    """Have :func:`clear_caches` also call ``clear`` (for a memo that is not a function's cache)."""
    _REGISTRY.append(clear)


def clear_caches() -> None:
    """Empty every cache made by :func:`cache` (plans, layouts, schedules)."""
    for fn in _REGISTRY:
        getattr(fn, "cache_clear", fn)()
