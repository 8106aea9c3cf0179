"""Who is calling: the role in a peer's certificate, and which roles may call each RPC.

Every internal certificate names one role (gateway, router, prefill, decode,
operator) in a URI subject alternative name, ``spiffe://tandem/role/<role>``
(:func:`role_uri`), or in a DNS name ``<role>.role.tandem`` (:func:`role_dns_name`:
Helm's ``genSignedCert``, which the chart uses when there is no cert-manager,
can write DNS names only). The local CA (:mod:`tandem.local.pki`) and
cert-manager write both; a certificate whose names disagree has no role. A gRPC server built with
:func:`tandem.common.tls.add_port` verifies the certificate chain; the server
interceptors here then look up the caller's role and the method's
:data:`ALLOWED_ROLES` before the servicer runs, and answer PERMISSION_DENIED
("not allowed for this caller", naming nothing inside) to any other role.

Used by the worker's gRPC server (``tandem.worker.__main__``), the KV transfer
server (``tandem.worker.kv_connector.kv_server``) and the router's TLS front
(``tandem.router.tls_front``). With internal TLS off there is no certificate
and no check: whoever turned TLS off gets a warning at start
(:func:`tandem.common.tls.warn_if_plaintext`), never a silent pass.

Only the standard library and grpc: the gateway imports it."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar, cast

import grpc
import grpc.aio

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
#: The roles of Tandem's components, one certificate each.
ROLES = ("gateway", "router", "prefill", "decode", "operator")
#: A certificate's role URI starts with this.
ROLE_URI_PREFIX = "spiffe://tandem/role/"
#: A certificate's role DNS name ends with this.
ROLE_DNS_SUFFIX = ".role.tandem"
#: The status message of a refused call: it names no method, role or rule.
DENIED_MESSAGE = "not allowed for this caller"

_ANY_ROLE = frozenset(ROLES)
_GATEWAY = frozenset({"gateway"})
#: Decode workers pull a prompt's KV; another decode worker's KV too, when a replacement decode worker
#: takes over a stream whose KV a dead one had (no other role reads KV).
_DECODE = frozenset({"decode"})

#: Full method name → the roles that may call it. A method missing here is refused to everyone: a new RPC
#: is closed until someone says who may call it.
ALLOWED_ROLES: Mapping[str, frozenset[str]] = {
    # tandem.v1.Worker: the request path is the gateway's alone; load and health are for any component.
    "/tandem.v1.Worker/Prefill": _GATEWAY,
    "/tandem.v1.Worker/Decode": _GATEWAY,
    "/tandem.v1.Worker/PrefetchKV": _GATEWAY,
    "/tandem.v1.Worker/Abort": _GATEWAY,
    "/tandem.v1.Worker/GetLoad": _ANY_ROLE,
    "/tandem.v1.Worker/Health": _ANY_ROLE,
    "/grpc.health.v1.Health/Check": _ANY_ROLE,
    "/grpc.health.v1.Health/Watch": _ANY_ROLE,
    # tandem.v1.KVTransfer: a prompt's KV (which reveals the prompt) and its hold are decode workers' only.
    "/tandem.v1.KVTransfer/Describe": _DECODE,
    "/tandem.v1.KVTransfer/PullBlockBytes": _DECODE,
    "/tandem.v1.KVTransfer/StreamBlockBytes": _DECODE,
    "/tandem.v1.KVTransfer/Release": _DECODE,
    # The data paths a KV server offers, and the pull through shared memory (the same KV as PullBlockBytes).
    "/tandem.v1.KVTransfer/DataPaths": _DECODE,
    "/tandem.v1.KVTransfer/PullBlocksShm": _DECODE,
    "/tandem.v1.KVTransfer/StreamBlocksShm": _DECODE,
    "/tandem.v1.KVTransfer/GetStats": _ANY_ROLE,
    # tandem.v1.Router (through the router's TLS front): placements are the gateway's.
    "/tandem.v1.Router/Schedule": _GATEWAY,
    "/tandem.v1.Router/Release": _GATEWAY,
}


def role_uri(role: str) -> str:
    """The URI SAN that names ``role`` in a certificate."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    return ROLE_URI_PREFIX + role


def role_dns_name(role: str) -> str:
    """The DNS SAN that names ``role`` in a certificate."""
    role_uri(role)  # the same check
    return role + ROLE_DNS_SUFFIX


def role_from_auth_context(auth_context: Mapping[str, Iterable[bytes]] | Mapping[str, Any]) -> str:
    """The role named by a verified peer's certificate; "" when it names none or several."""
    roles = set()
    for value in auth_context.get("x509_subject_alternative_name", ()):
        name = value.decode(errors="replace")
        if name.startswith(ROLE_URI_PREFIX):
            roles.add(name[len(ROLE_URI_PREFIX) :])
        elif name.endswith(ROLE_DNS_SUFFIX):
            roles.add(name[: -len(ROLE_DNS_SUFFIX)])
    if len(roles) != 1:
        return ""
    (role,) = roles
    return role if role in ROLES else ""


def caller_role(context: grpc.ServicerContext | grpc.aio.ServicerContext[Any, Any]) -> str:
    """The calling component's role, from its (already verified) client certificate; "" without one."""
    return role_from_auth_context(context.auth_context())


def allowed(method: str, role: str) -> bool:
    return role in ALLOWED_ROLES.get(method, frozenset())


def _aio_guard(handler: grpc.RpcMethodHandler[_Req, _Resp], method: str) -> grpc.RpcMethodHandler[_Req, _Resp]:
    async def deny(context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, DENIED_MESSAGE)

    def guard(behavior: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):

            async def guarded_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
                if not allowed(method, caller_role(context)):
                    await deny(context)
                async for item in behavior(request, context):
                    yield item

            return guarded_stream

        async def guarded(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if not allowed(method, caller_role(context)):
                await deny(context)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result

        return guarded

    return _rewrap(handler, guard)


def _sync_guard(handler: grpc.RpcMethodHandler[_Req, _Resp], method: str) -> grpc.RpcMethodHandler[_Req, _Resp]:
    def guard(behavior: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            if not allowed(method, caller_role(context)):
                context.abort(grpc.StatusCode.PERMISSION_DENIED, DENIED_MESSAGE)
            return behavior(request, context)

        return guarded

    return _rewrap(handler, guard)


def _rewrap(
    handler: grpc.RpcMethodHandler[_Req, _Resp], guard: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> grpc.RpcMethodHandler[_Req, _Resp]:
    # grpc's method handlers are namedtuples: replace the one behaviour the handler has.
    for name in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        behavior = getattr(handler, name)
        if behavior is not None:
            replaced: Any = cast(Any, handler)._replace(**{name: guard(behavior)})
            return cast("grpc.RpcMethodHandler[_Req, _Resp]", replaced)
    return handler


class RoleCheck(grpc.aio.ServerInterceptor):
    """Refuses, before the servicer runs, a caller whose role may not call the method (grpc.aio servers)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[_Req, _Resp] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        handler = await continuation(handler_call_details)
        if handler is None:  # no such method: gRPC answers UNIMPLEMENTED
            return None
        return _aio_guard(handler, handler_call_details.method)


class SyncRoleCheck(grpc.ServerInterceptor):
    """The same check for thread-pool servers (the KV transfer server)."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[_Req, _Resp] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return _sync_guard(handler, handler_call_details.method)


def role_checks(tls_enabled: bool) -> list[grpc.aio.ServerInterceptor]:
    """Interceptors of a grpc.aio server: the role check with TLS on, none without (no certificate to read)."""
    return [RoleCheck()] if tls_enabled else []


def sync_role_checks(tls_enabled: bool) -> list[grpc.ServerInterceptor]:
    return [SyncRoleCheck()] if tls_enabled else []


__all__ = [
    "ALLOWED_ROLES",
    "DENIED_MESSAGE",
    "ROLES",
    "RoleCheck",
    "SyncRoleCheck",
    "allowed",
    "caller_role",
    "role_checks",
    "role_dns_name",
    "role_from_auth_context",
    "role_uri",
    "sync_role_checks",
]
