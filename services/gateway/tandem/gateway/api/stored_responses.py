"""``GET``, ``DELETE`` and ``POST …/cancel`` of a stored response (``/v1/responses/{response_id}``), for the
caller's tenant only (another tenant's id is 404, as one that never was).

Wrapped by :mod:`~tandem.gateway.api.routes` (errors in OpenAI's shape); reads and deletes through
:mod:`~tandem.gateway.api.response_chains` and the conversation store; a background response's status and
its cancel are :mod:`~tandem.gateway.api.background_responses`'.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.gateway.api.response_chains import read_response
from tandem.gateway.api.services import GatewayServices
from tandem.gateway.conversations import StoredConversation
from tandem.gateway.tenancy.auth import request_authorization
from tandem.gateway.tenancy.models import Tenant


async def _stored(request: Request) -> tuple[GatewayServices, Tenant, str, StoredConversation]:
    """The caller's tenant and its stored response named by the path (404 for none, or another tenant's)."""
    services: GatewayServices = request.app.state.services
    principal = await services.authenticator.authenticate(request_authorization(request.headers))
    response_id = request.path_params["response_id"]
    stored = await read_response(services.conversations, principal.tenant.id, response_id)
    return services, principal.tenant, response_id, stored


async def get_response(request: Request) -> Response:
    """The response as it is now: a background one in whatever status it is in (background_responses)."""
    services, tenant, _, stored = await _stored(request)
    limit_bytes = services.storage_quota.limit_bytes(tenant)
    return JSONResponse(await services.background.current(tenant.id, limit_bytes, stored))


async def delete_response(request: Request) -> Response:
    services, tenant, response_id, _ = await _stored(request)
    await services.conversations.delete(tenant.id, response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def cancel_response(request: Request) -> Response:
    """Cancel a background response (400 for one that was not); a finished one is answered as it is."""
    services, tenant, _, stored = await _stored(request)
    limit_bytes = services.storage_quota.limit_bytes(tenant)
    return JSONResponse(await services.background.cancel(tenant.id, limit_bytes, stored))
