"""The LoRA adapter catalog: which adapters the platform serves, on which base model, from where.

The admin loads and unloads adapters (``python -m tandem.gateway.admin adapter load NAME PATH``);
the catalog in Redis is the one record of them. Workers of the adapter's base model read it and
load or unload the adapter in their engine (vLLM's ``add_lora`` / ``remove_lora``); the gateway
reads it to resolve a request's ``model`` (vLLM's convention: the adapter's name) to its base model
and adapter.

Every load gets a new version from one counter, and the engine knows the adapter by its
**engine name**, ``NAME@VERSION`` (:func:`engine_name`). vLLM mixes the LoRA's name and path into
every block hash (``("lora", lora_name, lora_path)``, ``vllm/v1/core/kv_cache_utils.py``), so a
reload under the same name, even of new weights at the same path, never meets the old weights'
cached blocks, and two adapters never share one.

Layout: one hash ``<prefix>:adapters`` (field = adapter name, value = the entry's JSON) and one
counter ``<prefix>:adapters:version``.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tandem.common import redis_retry
from tandem.common.errors import BackendUnavailableError

#: What an adapter's name may be: it is the request's ``model``, a metric label and part of a key.
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
_SEPARATOR = "@"


def engine_name(name: str, version: int) -> str:
    """The name the engine knows one load of an adapter by (and hashes its blocks with)."""
    return f"{name}{_SEPARATOR}{version}"


def split_engine_name(engine: str) -> tuple[str, int]:
    """``(name, version)`` of an engine name; ValueError when it is not one."""
    name, sep, version = engine.rpartition(_SEPARATOR)
    if not sep or not ADAPTER_NAME.fullmatch(name) or not version.isdigit():
        raise ValueError(f"not an adapter engine name: {engine!r}")
    return name, int(version)


@dataclass(frozen=True)
class AdapterEntry:
    """One loaded adapter."""

    name: str
    #: The model it adapts (a served model's name).
    base_model: str
    #: Where every worker of the base model reads its files (a path they all see).
    path: str
    version: int
    loaded_unix_s: float = 0.0

    @property
    def engine_name(self) -> str:
        return engine_name(self.name, self.version)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> AdapterEntry:
        data = json.loads(raw)
        return cls(
            name=str(data["name"]),
            base_model=str(data["base_model"]),
            path=str(data["path"]),
            version=int(data["version"]),
            loaded_unix_s=float(data.get("loaded_unix_s", 0.0)),
        )


class AdapterCatalog:
    """The catalog in Redis. Safe to share across tasks."""

    def __init__(self, redis: aioredis.Redis, *, key_prefix: str = "tandem") -> None:
        self._redis = redis
        self._key = f"{key_prefix}:adapters"
        self._version_key = f"{key_prefix}:adapters:version"

    @classmethod
    def connect(cls, redis_url: str, *, key_prefix: str = "tandem", timeout_s: float = 2.0) -> AdapterCatalog:
        return cls(redis_retry.connect(redis_url, timeout_s=timeout_s), key_prefix=key_prefix)

    async def put(self, name: str, *, base_model: str, path: str, now_unix_s: float) -> AdapterEntry:
        """Load (or reload) ``name``: a new version, whatever was there before."""
        if not ADAPTER_NAME.fullmatch(name):
            raise ValueError(f"adapter name {name!r} must match {ADAPTER_NAME.pattern}")
        try:
            version = int(await self._redis.incr(self._version_key))
            entry = AdapterEntry(name, base_model, path, version, now_unix_s)
            await self._redis.hset(self._key, name, entry.to_json())
        except (RedisError, OSError) as exc:
            raise BackendUnavailableError(f"adapter catalog unreachable: {exc}") from exc
        return entry

    async def remove(self, name: str) -> bool:
        """Unload ``name``; False when it was not loaded."""
        try:
            return bool(await self._redis.hdel(self._key, name))
        except (RedisError, OSError) as exc:
            raise BackendUnavailableError(f"adapter catalog unreachable: {exc}") from exc

    async def entries(self) -> dict[str, AdapterEntry]:
        """Every loaded adapter by name (one HGETALL); an entry that does not parse is skipped."""
        try:
            raw = await self._redis.hgetall(self._key)
        except (RedisError, OSError) as exc:
            raise BackendUnavailableError(f"adapter catalog unreachable: {exc}") from exc
        out: dict[str, AdapterEntry] = {}
        for key, value in raw.items():
            try:
                entry = AdapterEntry.from_json(value)
            except (ValueError, KeyError, TypeError):
                continue
            name = key.decode() if isinstance(key, bytes) else str(key)
            if entry.name == name:
                out[name] = entry
        return out

    async def aclose(self) -> None:
        await self._redis.aclose()
