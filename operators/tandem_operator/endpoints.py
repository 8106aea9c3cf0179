"""Every router pod's metrics URL, from the EndpointSlices of the router's metrics Service.

:class:`tandem_operator.signals.RouterSource` calls :func:`ready_metrics_urls` on every autoscaling
tick with the slices the API server lists for ``kubernetes.io/service-name=<service>``
(discovery.k8s.io/v1; the chart's Role grants ``list`` on them and nothing more). A Service URL
would land on one pod per request, so the sum over the router's replicas would be one pod's share.

Pure: slices in, URLs out. Which endpoints count:

* ``conditions.ready`` true, or absent (the API's "unknown", which consumers are told to read as
  ready); a pod that is starting or terminating is left out (a starting router holds no queue; a
  terminating one drains what it holds and leaves);
* the slice's port named ``port_name`` (the Service's port name), or its only port;
* each address once, though two slices (or a slice being replaced) list it;
* only slices labelled with ``service`` (the API server filters by the label selector already; checked
  again so that a release never reads another's router pods, whatever answered the list).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The label the EndpointSlice controller sets to the Service's name.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


@dataclass(frozen=True)
class MetricsEndpoint:
    """One router pod's metrics endpoint."""

    url: str
    #: How logs and conditions name it: the pod (``targetRef``), else the address.
    name: str


def _port(ports: list[dict[str, Any]], port_name: str) -> int | None:
    named = [p for p in ports if p.get("name") == port_name]
    chosen = named or (ports if len(ports) == 1 else [])
    port = chosen[0].get("port") if chosen else None
    return port if isinstance(port, int) else None


def ready_metrics_urls(
    slices: list[dict[str, Any]], service: str, *, port_name: str = "metrics", path: str = "/metrics"
) -> list[MetricsEndpoint]:
    """The metrics URLs of ``service``'s ready endpoints, in a stable order (address, port)."""
    found: dict[tuple[str, int], MetricsEndpoint] = {}
    for eps in slices:
        if ((eps.get("metadata") or {}).get("labels") or {}).get(SERVICE_NAME_LABEL) != service:
            continue
        port = _port(list(eps.get("ports") or []), port_name)
        if port is None or eps.get("addressType") not in ("IPv4", "IPv6"):
            continue  # FQDN slices name no pod; a slice without the port has nothing to scrape
        for endpoint in eps.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            address = str(addresses[0])  # every address of one endpoint is the same pod
            host = f"[{address}]" if ":" in address else address
            target = endpoint.get("targetRef") or {}
            name = str(target.get("name") or address)
            found[(address, port)] = MetricsEndpoint(url=f"http://{host}:{port}{path}", name=name)
    return [found[key] for key in sorted(found)]
