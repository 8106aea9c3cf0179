"""Sockets for tests: free ports, addresses where nothing listens, an ASGI app on a real uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from tandem.local.stack import free_port as stack_free_port


def free_port() -> int:
    """A port free right now, outside the kernel's ephemeral range and never handed out before by this
    process (:func:`tandem.local.stack.free_port`). A port the kernel picks for ``bind(0)`` comes from
    the ephemeral range, where any outgoing connection (Ray opens many) may take it before the server
    under test binds it: one CI run failed so ("Failed to bind to address '127.0.0.1:37085'")."""
    return stack_free_port()


def dead_address() -> str:
    """An address where nothing listens (connecting gives UNAVAILABLE at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@contextlib.asynccontextmanager
async def serving(app: Any, **config: Any) -> AsyncIterator[int]:
    """``app`` on a real uvicorn on a free loopback port (yields the port); ``config`` goes to uvicorn.Config."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    options: dict[str, Any] = {"log_config": None, "lifespan": "off", "timeout_graceful_shutdown": 2, **config}
    server = uvicorn.Server(uvicorn.Config(app, **options))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(500):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    assert server.started
    try:
        yield port
    finally:
        server.should_exit = True
        await task
        sock.close()


def http_scope(path: str, headers: dict[str, str] | None = None, *, method: str = "POST") -> dict[str, Any]:
    """The ASGI scope a server builds for one HTTP/1.1 request to ``path`` (JSON body), for tests
    that drive an app by hand (``await app(scope, receive, send)``) to control each message."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"gateway"), (b"content-type", b"application/json")]
        + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 80),
    }


async def start_stream_then_stop_reading(
    host: str, port: int, path: str, body: bytes, headers: dict[str, str] | None = None
) -> socket.socket:
    """POSTs ``body`` over a socket with a 4 KiB receive buffer, waits for the ``200 OK``, and
    returns the socket for the caller to close: a client that stopped reading its stream."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, port))
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    await loop.sock_sendall(
        sock,
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}".encode()
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body,
    )
    assert b"200 OK" in await asyncio.wait_for(loop.sock_recv(sock, 1024), 10)
    return sock
