"""Compiling the router's hot loops with numba, one way for every module that does.

:mod:`tandem.router.kernels` (the decision's formulas) and :mod:`tandem.router.kv_kernels` (the KV
index's probe) decorate their functions with :func:`native`: compiled when the module is imported
(explicit signatures: nothing compiles during a Schedule), and cached on disk beside the module where
that is writable (numba's own fallback: ``NUMBA_CACHE_DIR`` or the user's cache folder; the router
image compiles them at build time); with no writable place at all they are compiled at every start,
not cached. ``nogil``: they hold no Python object, so another thread may run meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from numba import njit

_F = TypeVar("_F", bound=Callable[..., Any])


def native(signature: Any) -> Callable[[_F], _F]:
    """``njit`` with an explicit signature, cached on disk when numba finds a writable place."""

    def decorate(function: _F) -> _F:
        try:
            return njit(signature, cache=True, nogil=True)(function)  # type: ignore[no-any-return]
        except RuntimeError:  # "cannot cache function ...: no locator available": read-only everywhere
            return njit(signature, cache=False, nogil=True)(function)  # type: ignore[no-any-return]

    return decorate
