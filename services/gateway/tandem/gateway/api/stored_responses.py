"""``GET``, ``DELETE`` and ``POST …/cancel`` of a stored response (``/v1/responses/{response_id}``), for the
caller's tenant only (another tenant's id is 404, as one that never was).

Wrapped by :mod:`~tandem.gateway.api.routes` (errors in OpenAI's shape); reads and deletes through
:mod:`~tandem.gateway.api.response_chains` and the conversation store; a background response's status and
its cancel are :mod:`~tandem.gateway.api.background_responses`', and so is a ``GET`` with ``stream=true`` (a
streamed background response's events again, after ``starting_after``).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.common.errors import InvalidRequestError
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
    """The response as it is now: a background one in whatever status it is in (background_responses); with
    ``stream=true``, a streamed background one's events after ``starting_after`` and the ones still to come."""
    services, tenant, _, stored = await _stored(request)
    stream, starting_after = _stream_params(request)
    limit_bytes = services.storage_quota.limit_bytes(tenant)
    if stream:
        return await services.background.resume(tenant.id, limit_bytes, stored, starting_after)
    return JSONResponse(await services.background.current(tenant.id, limit_bytes, stored))


#: The largest ``starting_after`` read (beyond any stream's length: a stream has one event per token or so).
MAX_STARTING_AFTER = 10**9


def _stream_params(request: Request) -> tuple[bool, int | None]:
    """``stream`` (``true`` / ``false``, as the SDKs send it) and ``starting_after`` (an integer ≥ 0) of a
    ``GET``; InvalidRequestError for anything else."""
    query = request.query_params
    raw_stream = query.get("stream", "false")
    if raw_stream not in ("true", "false"):
        raise InvalidRequestError("stream: use true or false.", param="stream", code="invalid_value")
    raw_after = query.get("starting_after")
    if raw_after is None:
        return raw_stream == "true", None
    if len(raw_after) > 10 or not raw_after.isascii() or not raw_after.isdigit() or int(raw_after) > MAX_STARTING_AFTER:
        raise InvalidRequestError(
            f"starting_after: use a sequence_number of this response's stream (an integer from 0), not "
            f"{raw_after[:40]!r}.",
            param="starting_after",
            code="invalid_value",
        )
    return raw_stream == "true", int(raw_after)


async def delete_response(request: Request) -> Response:
    services, tenant, response_id, _ = await _stored(request)
    await services.conversations.delete(tenant.id, response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def cancel_response(request: Request) -> Response:
    """Cancel a background response (400 for one that was not); a finished one is answered as it is."""
    services, tenant, _, stored = await _stored(request)
    limit_bytes = services.storage_quota.limit_bytes(tenant)
    return JSONResponse(await services.background.cancel(tenant.id, limit_bytes, stored))
