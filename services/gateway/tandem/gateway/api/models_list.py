"""``GET /v1/models`` and ``GET /v1/models/{model}``: the served models and loaded adapters a caller's
tenant may use, as vLLM's model cards.

Wrapped by :mod:`~tandem.gateway.api.routes` (errors in OpenAI's shape); reads the model resolver.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.gateway.adapters import ResolvedModel
from tandem.gateway.api.prepare import may_use, resolve_model
from tandem.gateway.api.services import GatewayServices
from tandem.gateway.tenancy.auth import request_authorization


def model_card(services: GatewayServices, model: ResolvedModel) -> dict[str, object]:
    """vLLM's model card (``show_available_models``): an adapter's has ``parent``, its base model. vLLM
    puts a model's path in ``root``; Tandem puts the model's name there, for the paths are the
    deployment's own business."""
    return {
        "id": model.requested,
        "object": "model",
        "created": services.started_unix_s,
        "owned_by": "tandem",
        "root": model.requested,
        "parent": model.base_model if model.adapter else None,
        "max_model_len": services.for_model(model.base_model).limits.max_model_len,
    }


async def list_models(request: Request) -> Response:
    """The served models and the loaded adapters that the caller's tenant may use."""
    services: GatewayServices = request.app.state.services
    principal = await services.authenticator.authenticate(request_authorization(request.headers))
    models = [ResolvedModel(m, m) for m in services.models.served_models]
    models += [ResolvedModel.of_entry(e) for _, e in sorted((await services.models.adapters()).items())]
    cards = [model_card(services, m) for m in models if may_use(principal.tenant, m)]
    return JSONResponse({"object": "list", "data": cards})


async def get_model(request: Request) -> Response:
    services: GatewayServices = request.app.state.services
    principal = await services.authenticator.authenticate(request_authorization(request.headers))
    model = await resolve_model(request.path_params["model"], services.models, principal.tenant)
    return JSONResponse(model_card(services, model))
