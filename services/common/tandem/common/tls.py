"""TLS and mutual TLS for Tandem's internal gRPC (gateway → workers, gateway →
router's TLS front, worker → worker KV transfer). On in the chart and in
``make run``; plaintext only when a deployment turns it off explicitly, and
then :func:`warn_if_plaintext` says so at start.

Every gRPC server and client in Tandem builds its credentials here, from one
:class:`TLSSettings` group read at the entry point. Files are PEM; in
Kubernetes they come from a Secret mounted into the pod (cert-manager or the
chart's generated CA), locally from :mod:`tandem.local.pki`. Each component
has its own certificate, whose role (:mod:`tandem.common.identity`) the
servers check per RPC.

Rotation needs no restart: a server reads the files again for the next
handshake once they change (:func:`server_credentials`), and a client's
channel cache asks :class:`CredentialFiles` whether to dial new channels
(connections made before keep their certificate until they close).
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

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


logger = logging.getLogger(__name__)


def _read(path: Path | None) -> bytes:
    assert path is not None
    return path.read_bytes()


def files_version(tls: TLSSettings) -> tuple[int, ...]:
    """What changes when any of the three files is replaced (a Secret's update swaps a symlink: the
    target's mtime and inode change); 0s for a file that is missing."""
    version: list[int] = []
    for path in (tls.cert_file, tls.key_file, tls.ca_file):
        try:
            st = os.stat(path) if path is not None else None
        except OSError:
            st = None
        version += [st.st_mtime_ns, st.st_ino, st.st_size] if st is not None else [0, 0, 0]
    return tuple(version)


#: A client looks at its files at most this often (a stat of three files per call is cheap, but the
#: check sits on every request's path).
CHECK_INTERVAL_S = 1.0


class CredentialFiles:
    """Tells a channel cache when the certificate files were rotated, so that it dials new channels."""

    def __init__(self, tls: TLSSettings, *, check_interval_s: float = CHECK_INTERVAL_S) -> None:
        self._tls = tls
        self._check_interval_s = check_interval_s
        self._version = files_version(tls) if tls.enabled else ()
        self._checked_at = time.monotonic()

    def changed(self) -> bool:
        """True once after the files changed (never with TLS off)."""
        if not self._tls.enabled:
            return False
        now = time.monotonic()
        if now - self._checked_at < self._check_interval_s:
            return False
        self._checked_at = now
        version = files_version(self._tls)
        if version == self._version:
            return False
        self._version = version
        logger.info("internal TLS certificate changed; new channels use it", extra={"cert": str(self._tls.cert_file)})
        return True


def _pair_matches(tls: TLSSettings) -> bool:
    """The key belongs to the certificate (a rotation caught halfway, one file new and one old, does not)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(str(tls.cert_file), str(tls.key_file))
    except (OSError, ssl.SSLError):
        return False
    return True


def _certificate_configuration(tls: TLSSettings) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(_read(tls.key_file), _read(tls.cert_file))], root_certificates=_read(tls.ca_file)
    )


def server_credentials(tls: TLSSettings) -> grpc.ServerCredentials:
    """Credentials that follow the files: each new handshake after a change uses the new certificate,
    key and CA (gRPC asks the fetcher before every handshake; it answers None while nothing changed)."""
    lock = threading.Lock()
    loaded = [files_version(tls)]
    initial = _certificate_configuration(tls)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        with lock:
            version = files_version(tls)
            if version == loaded[0] or not _pair_matches(tls):
                return None
            try:
                config = _certificate_configuration(tls)
            except OSError:
                return None
            loaded[0] = version
        logger.info("internal TLS certificate reloaded", extra={"cert": str(tls.cert_file)})
        return config

    # grpc's stubs type the fetcher as never answering None; gRPC's docs say None keeps the current config.
    fetcher = cast(Callable[[], grpc.ServerCertificateConfiguration], fetch)
    return grpc.dynamic_ssl_server_credentials(initial, fetcher, require_client_authentication=tls.require_client_auth)


def warn_if_plaintext(tls: TLSSettings, component: str) -> None:
    """A loud line at start when internal gRPC runs without TLS: nothing checks who calls."""
    if not tls.enabled:
        logger.warning(
            "INTERNAL TLS IS OFF: %s serves and calls internal gRPC in plaintext, and no call is checked for "
            "its caller's role; anyone who reaches its ports can call it (docs/security.md)",
            component,
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
