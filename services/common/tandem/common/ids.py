"""Request and worker ids. One request id travels gateway → router → workers."""

from __future__ import annotations

import os
import secrets
import socket


def new_request_id() -> str:
    """A fresh, URL-safe request id (``chatcmpl-`` style prefix is the gateway's job)."""
    return secrets.token_hex(12)


def new_worker_id(role: str) -> str:
    """A worker id unique across hosts and restarts."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
