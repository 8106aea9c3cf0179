"""Loading, listing and unloading LoRA adapters: what ``tandem-admin adapter …`` and the admin API's
``/v1/admin/adapters`` both do.

Called by :mod:`tandem.gateway.admin` (the CLI) and :mod:`tandem.gateway.api.admin_adapters` (the HTTP
API); writes through :class:`tandem.common.adapters.AdapterCatalog`, the one record of adapters, which the
workers of the base model read (and load the adapter on demand) and the gateways read to resolve a
request's ``model`` (:mod:`tandem.gateway.adapters`). Nothing here touches an engine: a load is one
version more in the catalog, an unload one entry less; requests already running with an adapter finish
with it (the worker removes it from its engine once they have).

Checks, before anything is written (each an :class:`InvalidRequestError` naming the field, written for
the operator; nothing is written when one fails): the name is an adapter name
(:data:`~tandem.common.adapters.ADAPTER_NAME`: it is the request's ``model``, a metric label and part
of a key) and not a served model's; the base model is one this deployment serves (default: the first);
the path is absolute (every worker of the base model reads the files there; the gateway does not: it
may not see them). Redis unreachable: :class:`~tandem.common.errors.BackendUnavailableError`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any, Protocol

from tandem.common.adapters import ADAPTER_NAME, AdapterEntry
from tandem.common.errors import InvalidRequestError

#: Longest adapter path accepted (Linux's PATH_MAX).
MAX_PATH_BYTES = 4096


class CatalogWriter(Protocol):
    """What administration needs of :class:`tandem.common.adapters.AdapterCatalog`."""

    async def put(self, name: str, *, base_model: str, path: str, now_unix_s: float) -> AdapterEntry: ...

    async def remove(self, name: str) -> bool: ...

    async def entries(self) -> dict[str, AdapterEntry]: ...


class AdapterNotLoadedError(InvalidRequestError):
    """Unloading an adapter that is not loaded (the API answers 404)."""


def entry_view(entry: AdapterEntry) -> dict[str, Any]:
    """An adapter as the admin sees it (the CLI's line, the API's object)."""
    return {
        "name": entry.name,
        "base_model": entry.base_model,
        "path": entry.path,
        "version": entry.version,
        "engine_name": entry.engine_name,
        "loaded_unix_s": entry.loaded_unix_s,
    }


def check_name(name: str, served_models: tuple[str, ...]) -> None:
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        raise InvalidRequestError(
            "name: an adapter name is 1 to 128 characters of A-Z a-z 0-9 _ . : - and starts with a letter or a digit.",
            param="name",
            code="invalid_value",
        )
    if name in served_models:
        raise InvalidRequestError(
            f"name: `{name}` is a served model's name; an adapter needs a name of its own.",
            param="name",
            code="invalid_value",
        )


def check_path(path: str) -> None:
    if (
        not isinstance(path, str)
        or not PurePosixPath(path).is_absolute()
        or len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES
        or any(ch in path for ch in "\0\n\r")
    ):
        raise InvalidRequestError(
            "path: the adapter's folder as an absolute path that every worker of its base model can read "
            f"(at most {MAX_PATH_BYTES} bytes, no control characters).",
            param="path",
            code="invalid_value",
        )


class AdapterAdmin:
    """Checks and writes adapter changes; one per CLI run or gateway process."""

    def __init__(
        self, catalog: CatalogWriter, served_models: tuple[str, ...], *, clock: Callable[[], float] = time.time
    ) -> None:
        if not served_models:
            raise ValueError("a deployment serves at least one model")
        self._catalog = catalog
        self._served_models = served_models
        self._clock = clock

    async def load(self, name: str, path: str, base_model: str | None = None) -> AdapterEntry:
        """Load (or reload: a new version, so no cached block of the old one is ever used) ``name``."""
        check_name(name, self._served_models)
        check_path(path)
        base = self._served_models[0] if base_model is None else base_model
        if base not in self._served_models:
            raise InvalidRequestError(
                f"base_model: this deployment serves {', '.join(f'`{m}`' for m in self._served_models)}.",
                param="base_model",
                code="invalid_value",
            )
        return await self._catalog.put(name, base_model=base, path=path, now_unix_s=self._clock())

    async def unload(self, name: str) -> None:
        """Unload ``name``: new requests naming it get 404 (within the gateways' catalog cache)."""
        if not await self._catalog.remove(name):
            raise AdapterNotLoadedError(f"No adapter `{name}` is loaded.", param="name", code="adapter_not_found")

    async def list(self) -> list[AdapterEntry]:
        return sorted((await self._catalog.entries()).values(), key=lambda e: e.name)
