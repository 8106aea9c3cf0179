"""Authentication of a request: the ``Authorization: Bearer`` key (or ``x-api-key``) → the tenant.

Called by the route handlers before anything else; calls the
:class:`~tandem.gateway.tenancy.store.TenantStore`, with a short in-process
cache so that a busy replica asks Redis once per key every ``cache_s``. Keys
never leave this module except hashed; logs carry the public key id only.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tandem.common.errors import BackendUnavailableError
from tandem.gateway.errors import AuthenticationError, PermissionDeniedError
from tandem.gateway.tenancy.keys import hash_key
from tandem.gateway.tenancy.models import ANONYMOUS_TENANT_ID, Tenant
from tandem.gateway.tenancy.store import TenantStore

_MAX_CACHED_KEYS = 10_000


@dataclass(frozen=True)
class Principal:
    tenant: Tenant
    #: Public id of the key used ("" when auth is disabled).
    key_id: str


def request_authorization(headers: Mapping[str, str]) -> str | None:
    """The request's credentials as an ``Authorization`` value: that header, or else Anthropic's
    ``x-api-key: <key>`` (the same tenant keys, for the ``anthropic`` SDK) as ``Bearer <key>``."""
    authorization = headers.get("authorization")
    if authorization:
        return authorization
    api_key = headers.get("x-api-key", "").strip()
    return f"Bearer {api_key}" if api_key else None


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class Authenticator:
    def __init__(
        self,
        store: TenantStore | None,
        *,
        mode: str,
        cache_s: float,
        fail_open: bool = False,
        anonymous: Tenant | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode == "api_key" and store is None:
            raise ValueError("api_key auth needs a tenant store")
        self._store = store
        self._mode = mode
        self._cache_s = cache_s
        self._fail_open = fail_open
        self._anonymous = anonymous or Tenant(id=ANONYMOUS_TENANT_ID, name="anonymous (auth disabled)")
        self._clock = clock
        # hash → (fetched at, principal or None for unknown/revoked)
        self._cache: dict[str, tuple[float, Principal | None]] = {}

    @property
    def enabled(self) -> bool:
        return self._mode == "api_key"

    async def authenticate(self, authorization: str | None) -> Principal:
        """The caller's principal; AuthenticationError (401) or BackendUnavailableError (503)."""
        if not self.enabled:
            return Principal(self._anonymous, "")
        key = bearer_token(authorization)
        if key is None:
            raise AuthenticationError("Missing API key: send `Authorization: Bearer <key>`.")
        digest = hash_key(key)
        now = self._clock()
        cached = self._cache.get(digest)
        if cached is not None and now - cached[0] < self._cache_s:
            principal = cached[1]
        else:
            try:
                principal = await self._lookup(key)
            except BackendUnavailableError:
                if self._fail_open and cached is not None and cached[1] is not None:
                    return cached[1]
                raise
            if len(self._cache) >= _MAX_CACHED_KEYS:
                self._cache.clear()
            self._cache[digest] = (now, principal)
        if principal is None:
            raise AuthenticationError("Incorrect API key provided.")
        return principal

    async def _lookup(self, key: str) -> Principal | None:
        assert self._store is not None
        found = await self._store.lookup_key(key)
        if found is None:
            return None
        record, tenant = found
        if record.revoked or tenant.disabled:
            return None
        return Principal(tenant, record.key_id)


def check_admin(authorization: str | None, admin_key: str | None) -> None:
    """Admin endpoints: the configured admin credential, compared in constant time."""
    if not admin_key:
        raise PermissionDeniedError("The admin API is not enabled on this gateway.", code="admin_disabled")
    token = bearer_token(authorization)
    if token is None or not hmac.compare_digest(hash_key(token), hash_key(admin_key)):
        raise AuthenticationError("Incorrect admin credential.")
