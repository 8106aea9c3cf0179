"""The browser playground served at ``/``: one static HTML page with its script
inline (``static/playground.html``), read once from the package. It calls the
gateway's own ``/v1/chat/completions`` with the key the user pastes, and sends
``temperature`` and ``max_tokens`` only when their controls are filled in, so
that an empty control means the server's default (for temperature, the model's
``generation_config.json``, applied by the worker)."""

from __future__ import annotations

import functools
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@functools.cache
def _html() -> str:
    return resources.files("tandem.gateway").joinpath("static/playground.html").read_text(encoding="utf-8")


async def page(request: Request) -> Response:
    return HTMLResponse(
        _html(),
        headers={
            "Content-Security-Policy": _CSP,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-cache",
        },
    )
