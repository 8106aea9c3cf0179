"""``GET``, ``DELETE`` and ``POST …/cancel`` of a stored response (``/v1/responses/{response_id}``), for the
caller's tenant only (another tenant's id is 404, as one that never was).

Wrapped by :mod:`~tandem.gateway.api.routes` (errors in OpenAI's shape); reads and deletes through
:mod:`~tandem.gateway.api.response_chains` and the conversation store.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.common.errors import InvalidRequestError
from tandem.gateway.api.response_chains import read_response, response_of
from tandem.gateway.api.services import GatewayServices
from tandem.gateway.conversations import StoredConversation
from tandem.gateway.tenancy.auth import request_authorization


async def _stored(request: Request) -> tuple[GatewayServices, str, str, StoredConversation]:
    """The caller's stored response named by the path (404 for none, or another tenant's)."""
    services: GatewayServices = request.app.state.services
    principal = await services.authenticator.authenticate(request_authorization(request.headers))
    response_id = request.path_params["response_id"]
    stored = await read_response(services.conversations, principal.tenant.id, response_id)
    return services, principal.tenant.id, response_id, stored


async def get_response(request: Request) -> Response:
    *_, stored = await _stored(request)
    return JSONResponse(response_of(stored))


async def delete_response(request: Request) -> Response:
    services, tenant_id, response_id, _ = await _stored(request)
    await services.conversations.delete(tenant_id, response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def cancel_response(request: Request) -> Response:
    # Only a background response can be cancelled (OpenAI's rule), and this gateway makes none: a stored
    # response is complete by the time it can be read.
    await _stored(request)
    raise InvalidRequestError(
        "Only responses created with background set to true can be cancelled.", param=None, code="invalid_value"
    )
