"""TLS and mutual TLS for Tandem's internal gRPC (gateway → workers, worker →
worker KV transfer). Off by default: inside a cluster the chart's
NetworkPolicies are the fence; with TLS on, each side also proves who it is.

Every gRPC server and client in Tandem builds its credentials here, from one
:class:`TLSSettings` group read at the entry point. Files are PEM; in
Kubernetes they come from a Secret mounted into the pod (cert-manager works).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import grpc.aio
from pydantic import BaseModel, model_validator


class TLSSettings(BaseModel):
    """Certificates for internal gRPC."""

    #: Serve and call internal gRPC over TLS.
    enabled: bool = False
    #: This component's certificate chain (PEM), presented as server and as client.
    cert_file: Path | None = None
    #: Its private key (PEM).
    key_file: Path | None = None
    #: CA bundle that peers' certificates must chain to (PEM).
    ca_file: Path | None = None
    #: Servers demand a client certificate signed by ``ca_file`` (mutual TLS).
    require_client_auth: bool = True
    #: Expected server name when it differs from the dialled host (e.g. a shared service name).
    server_name_override: str = ""

    @model_validator(mode="after")
    def _files_when_enabled(self) -> TLSSettings:
        if self.enabled:
            missing = [n for n in ("cert_file", "key_file", "ca_file") if getattr(self, n) is None]
            if missing:
                raise ValueError(f"TLS is enabled but {', '.join(missing)} is not set")
        return self

    def to_dict(self) -> dict[str, object]:
        """Plain data, for passing through vLLM's kv_connector_extra_config."""
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.model_dump().items()}


def _read(path: Path | None) -> bytes:
    assert path is not None
    return path.read_bytes()


def server_credentials(tls: TLSSettings) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(_read(tls.key_file), _read(tls.cert_file))],
        root_certificates=_read(tls.ca_file),
        require_client_auth=tls.require_client_auth,
    )


def channel_credentials(tls: TLSSettings) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca_file),
        private_key=_read(tls.key_file),
        certificate_chain=_read(tls.cert_file),
    )


#: Options of every client channel to a peer that may restart on the same address (a container restart
#: keeps its pod's IP): it is dialled again within two seconds. gRPC's default backoff grows to two
#: minutes, and a call made while a channel backs off fails at once with UNAVAILABLE.
RECONNECT_BACKOFF_OPTIONS: list[tuple[str, object]] = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


def _options(tls: TLSSettings, options: list[tuple[str, object]] | None) -> list[tuple[str, object]]:
    opts = list(options or [])
    if tls.enabled and tls.server_name_override:
        opts.append(("grpc.ssl_target_name_override", tls.server_name_override))
    return opts


def add_port(server: grpc.Server | grpc.aio.Server, address: str, tls: TLSSettings) -> int:
    """Bind ``address`` on ``server``, with TLS when enabled. Returns the port (0 = failed)."""
    if tls.enabled:
        return server.add_secure_port(address, server_credentials(tls))
    return server.add_insecure_port(address)


def channel(address: str, tls: TLSSettings, options: list[tuple[str, object]] | None = None) -> grpc.Channel:
    """A blocking channel to ``address``."""
    if tls.enabled:
        return grpc.secure_channel(address, channel_credentials(tls), options=_options(tls, options))
    return grpc.insecure_channel(address, options=options)


def aio_channel(address: str, tls: TLSSettings, options: list[tuple[str, object]] | None = None) -> grpc.aio.Channel:
    """An asyncio channel to ``address``."""
    if tls.enabled:
        return grpc.aio.secure_channel(address, channel_credentials(tls), options=_options(tls, options))
    return grpc.aio.insecure_channel(address, options=options)
