"""One cache helper for the whole package: bounded, and cleared in one call.

Every memoised function in jreshard is wrapped with :func:`cache`, which is
``functools.lru_cache`` with a required size bound plus registration, so
:func:`clear_caches` (``jreshard.clear_caches()``) empties all of them: plans,
layouts, lowered programs, compiled helpers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["cache", "clear_caches"]

F = TypeVar("F", bound=Callable[..., Any])
_REGISTRY: list[Any] = []


def cache(max_size: int) -> Callable[[F], F]:
    """Memoise a function of hashable arguments, keeping at most ``max_size`` results (least recently used go).

    >>> @cache(max_size=2)
    ... def square(n):
    ...     return n * n
    >>> square(3), square.cache_info().currsize
    (9, 1)
    """
    if not isinstance(max_size, int) or max_size < 1:
        raise ValueError(f"cache: max_size={max_size!r} must be an int >= 1")

    def wrap(fn: F) -> F:
        cached = functools.lru_cache(maxsize=max_size)(fn)
        _REGISTRY.append(cached)
        return cached  # type: ignore[return-value]

    return wrap


def clear_caches() -> None:
    """Empty every cache of jreshard (plans, layouts, lowered programs...).

    Arrays and plans already returned stay valid; the next call recomputes what it needs.
    """
    for fn in _REGISTRY:
        fn.cache_clear()
