"""Ray Serve application builder for KubeRay's RayService.

``serveConfigV2`` names it as ``import_path: tandem_router_app:app``; Serve
calls :func:`app` with the ``args`` mapping once, in the Ray cluster, and
deploys what it returns. Serve requires a one-argument builder, while
:func:`tandem.router.deployment.build_app` takes the router config and the
replica count, so this adapter reads the router's settings from the Ray
pods' environment (``TANDEM_ROUTER_*``, the Redis URL from the chart's
Secret) — the same settings ``python -m tandem.router`` reads — and passes
them on. Installed into the router image only.
"""

from __future__ import annotations

from typing import Any

from tandem.router.deployment import build_app
from tandem.router.settings import TandemRouterSettings


def app(args: dict[str, Any]) -> Any:
    settings = TandemRouterSettings()
    num_replicas = int(args.get("num_replicas", settings.num_replicas))
    return build_app(settings.router_config(), num_replicas=num_replicas)
