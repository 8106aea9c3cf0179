"""A small async Kubernetes API client for the objects the operator owns.

:mod:`tandem_operator.handlers` builds one :class:`KubeClient` at startup (in
the pod: the service account's token and CA; in tests: an explicit server
URL such as kmock's) and calls :meth:`apply`, :meth:`get`, :meth:`patch`,
:meth:`delete`. kopf itself talks to the API for the TandemDeployment
(watching, status patches); this client covers Deployments and Services.
Errors other than 404 become :class:`KubeError` (kopf retries them).
"""

from __future__ import annotations

import json
import ssl
from pathlib import Path
from typing import Any

import aiohttp

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

_PATHS = {
    ("apps/v1", "Deployment"): "/apis/apps/v1/namespaces/{ns}/deployments",
    ("v1", "Service"): "/api/v1/namespaces/{ns}/services",
    # Listed, and their status patched (the pairing condition, tandem_operator.rollout); never created.
    ("v1", "Pod"): "/api/v1/namespaces/{ns}/pods",
    # Listed only: the router pods' metrics endpoints (tandem_operator.endpoints).
    ("discovery.k8s.io/v1", "EndpointSlice"): "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
    # Deleted by the uninstall hook (tandem_operator.uninstall); kopf handles it everywhere else.
    ("tandem.dev/v1alpha1", "TandemDeployment"): "/apis/tandem.dev/v1alpha1/namespaces/{ns}/tandemdeployments",
}
_MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}
#: Server-side apply: JSON is YAML. With this field manager, a key the operator stops setting is
#: removed from the object (a merge patch would leave it there forever).
_APPLY_PATCH = {"Content-Type": "application/apply-patch+yaml"}
FIELD_MANAGER = "tandem-operator"


class KubeError(RuntimeError):
    """The API server refused a request (other than 404); retryable."""


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    return _PATHS[(api_version, kind)].format(ns=namespace)


class KubeClient:
    def __init__(self, server: str, *, token: str | None = None, ca_path: Path | None = None,
                 insecure: bool = False) -> None:
        self._server = server.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        ssl_ctx: ssl.SSLContext | bool = False if insecure else ssl.create_default_context(
            cafile=str(ca_path) if ca_path else None
        )
        self._session = aiohttp.ClientSession(
            headers=headers, connector=aiohttp.TCPConnector(ssl=ssl_ctx), timeout=aiohttp.ClientTimeout(total=30)
        )

    @classmethod
    def in_cluster(cls, host: str, port: str) -> KubeClient:
        token = (SERVICE_ACCOUNT_DIR / "token").read_text().strip()
        return cls(f"https://{host}:{port}", token=token, ca_path=SERVICE_ACCOUNT_DIR / "ca.crt")

    @property
    def session(self) -> aiohttp.ClientSession:
        return self._session

    async def close(self) -> None:
        await self._session.close()

    async def _request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any] | None:
        try:
            async with self._session.request(method, self._server + path, **kwargs) as resp:
                if resp.status == 404:
                    return None
                if resp.status >= 400:
                    raise KubeError(f"{method} {path}: {resp.status} {(await resp.text())[:300]}")
                body: dict[str, Any] = await resp.json(content_type=None)
                return body
        except aiohttp.ClientError as exc:
            raise KubeError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._request("GET", f"{collection_path(api_version, kind, namespace)}/{name}")

    async def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        body = await self._request(
            "GET", collection_path(api_version, kind, namespace), params={"labelSelector": label_selector}
        )
        return list((body or {}).get("items", []))

    async def patch(self, api_version: str, kind: str, namespace: str, name: str,
                    changes: dict[str, Any]) -> dict[str, Any] | None:
        path = f"{collection_path(api_version, kind, namespace)}/{name}"
        return await self._request("PATCH", path, json=changes, headers=_MERGE_PATCH)

    async def patch_status(self, api_version: str, kind: str, namespace: str, name: str,
                           changes: dict[str, Any]) -> dict[str, Any] | None:
        """A merge patch of the object's ``status`` subresource (None: the object is gone)."""
        path = f"{collection_path(api_version, kind, namespace)}/{name}/status"
        return await self._request("PATCH", path, json=changes, headers=_MERGE_PATCH)

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create ``obj``, or server-side apply it (field manager ``tandem-operator``, forced): what the
        operator set before and no longer sets goes away, what others own (status, HPA-set fields it
        does not send) stays."""
        meta = obj["metadata"]
        api_version, kind, ns, name = obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]
        existing = await self.get(api_version, kind, ns, name)
        if existing is None:
            created = await self._request("POST", collection_path(api_version, kind, ns), json=obj)
            return created or obj
        applied = await self._request(
            "PATCH",
            f"{collection_path(api_version, kind, ns)}/{name}",
            data=json.dumps(obj),
            headers=_APPLY_PATCH,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
        )
        return applied or obj

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """True if it existed. Background propagation: the Deployment's pods drain on SIGTERM."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        path = f"{collection_path(api_version, kind, namespace)}/{name}"
        return await self._request("DELETE", path, json=body) is not None
