"""``spec.adapters`` of a TandemDeployment, kept in the adapter catalog (``<keyPrefix>:adapters``).

:mod:`tandem_operator.handlers` calls :func:`sync_adapters` on every reconcile and, every
``TANDEM_OPERATOR_ADAPTER_RESYNC_S`` (30 s), from its timer. It writes through
:class:`tandem.common.adapters.AdapterCatalog` exactly as ``python -m tandem.gateway.admin adapter
load|unload`` does:

* an adapter of the spec that the catalog lacks, or holds with another path or base model →
  ``put`` (a new version: the workers load the new files under a new engine name, and no cached
  block of the old weights is ever reused);
* an adapter the catalog holds exactly as the spec says → nothing. Its version is never bumped by a
  reconcile (a bump makes every worker reload it and discards its cached KV);
* an adapter this resource put before (``status.adapters.managed``) and the spec no longer lists →
  ``remove``. An entry the resource never managed (loaded with the admin CLI) is left alone.

Redis unreachable or answering garbage: :class:`tandem.common.errors.BackendUnavailableError` from
the catalog is caught by the handler, which sets ``AdaptersReconciled=False`` with the reason and
tries again on its timer; the pools are reconciled regardless. A catalog entry that does not parse is
skipped by the catalog (it reads as absent), so the next sync overwrites it with a fresh ``put``.
Calls already made stay made (each is one Redis command): a sync cut short by a dead Redis finishes on
the next try without bumping what it already wrote.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tandem.common.adapters import AdapterCatalog, AdapterEntry
from tandem_operator.spec import AdapterSpec


@dataclass(frozen=True)
class AdapterSync:
    """What one sync did."""

    #: Name → version of every adapter of the spec, as the catalog now holds it.
    versions: dict[str, int]
    put: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    @property
    def managed(self) -> list[str]:
        return sorted(self.versions)


def _same(entry: AdapterEntry, adapter: AdapterSpec) -> bool:
    return entry.path == adapter.path and entry.base_model == adapter.base_model


async def sync_adapters(
    catalog: AdapterCatalog, wanted: Iterable[AdapterSpec], previously_managed: Iterable[str], *, now_unix_s: float
) -> AdapterSync:
    """Make the catalog hold ``wanted``; remove what was managed before and is no longer wanted."""
    wanted = list(wanted)
    current = await catalog.entries()
    versions: dict[str, int] = {}
    put: list[str] = []
    for adapter in wanted:
        entry = current.get(adapter.name)
        if entry is None or not _same(entry, adapter):
            entry = await catalog.put(adapter.name, base_model=adapter.base_model, path=adapter.path,
                                      now_unix_s=now_unix_s)
            put.append(adapter.name)
        versions[adapter.name] = entry.version
    wanted_names = {a.name for a in wanted}
    removed: list[str] = []
    for name in sorted(set(previously_managed) - wanted_names):
        if name in current and await catalog.remove(name):
            removed.append(name)
    return AdapterSync(versions, put, removed)


async def remove_managed(catalog: AdapterCatalog, managed: Iterable[str]) -> list[str]:
    """Remove every adapter the resource managed (it is being deleted); the names actually removed."""
    return [name for name in sorted(set(managed)) if await catalog.remove(name)]
