"""The admin API's adapter endpoints, beside ``/v1/admin/usage`` and behind the same admin credential:

* ``GET /v1/admin/adapters`` → ``{"object": "list", "data": [adapter, …]}``;
* ``POST /v1/admin/adapters`` with ``{"name", "path", "base_model"?}`` → the adapter loaded (a reload
  when the name is loaded: a new version);
* ``DELETE /v1/admin/adapters/{name}`` → ``{"name", "object": "adapter", "deleted": true}``, or 404.

Called by Starlette (routes in :mod:`tandem.gateway.app`); calls
:class:`tandem.gateway.adapter_admin.AdapterAdmin`, exactly as ``tandem-admin adapter …`` does. Errors
are the OpenAI shape (400 for a bad name, path or base model, which change nothing; 401/403 for the
credential; 503 when Redis is unreachable). After a change this gateway reads the catalog afresh on its
next request; the others within their catalog cache (``adapter_catalog_cache_s``).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.common.errors import InvalidRequestError
from tandem.gateway.adapter_admin import entry_view
from tandem.gateway.api.services import GatewayServices
from tandem.gateway.api.validation import check_content_type, parse_json_object
from tandem.gateway.tenancy.auth import check_admin

#: Largest body of a load (a name, a path and a model name).
_MAX_BODY_BYTES = 16 * 1024
_LOAD_FIELDS = frozenset({"name", "path", "base_model"})


def _admin_services(request: Request) -> GatewayServices:
    services: GatewayServices = request.app.state.services
    check_admin(request.headers.get("authorization"), services.admin_key)
    return services


async def list_adapters(request: Request) -> Response:
    services = _admin_services(request)
    entries = await services.adapter_admin.list()
    return JSONResponse({"object": "list", "data": [entry_view(e) for e in entries]})


async def load_adapter(request: Request) -> Response:
    services = _admin_services(request)
    check_content_type(request.headers.get("content-type"))
    body = await request.body()
    if len(body) > _MAX_BODY_BYTES:
        raise InvalidRequestError(f"Request body is larger than {_MAX_BODY_BYTES} bytes.", code="request_too_large")
    data = parse_json_object(body)
    unknown = sorted(set(data) - _LOAD_FIELDS)
    if unknown:
        raise InvalidRequestError(
            f"Unknown field {unknown[0]!r}; an adapter load takes name, path and base_model.",
            param=unknown[0],
            code="unknown_parameter",
        )
    for field in ("name", "path"):
        if not isinstance(data.get(field), str):
            raise InvalidRequestError(f"{field}: a string is required.", param=field, code="invalid_value")
    base_model = data.get("base_model")
    if base_model is not None and not isinstance(base_model, str):
        raise InvalidRequestError("base_model: a string.", param="base_model", code="invalid_value")
    entry = await services.adapter_admin.load(data["name"], data["path"], base_model)
    services.models.forget()
    return JSONResponse({**entry_view(entry), "object": "adapter"})


async def unload_adapter(request: Request) -> Response:
    services = _admin_services(request)
    name = request.path_params["name"]
    await services.adapter_admin.unload(name)
    services.models.forget()
    return JSONResponse({"name": name, "object": "adapter", "deleted": True})
