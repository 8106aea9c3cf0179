"""Redis for tests: a private server, and clean-up of one test's keys."""

from __future__ import annotations

import socket
import subprocess
import time
from typing import Any


def start_redis(port: int, *args: str) -> subprocess.Popen[bytes]:
    """A private redis-server on 127.0.0.1:``port`` (``args``: more of its options), once it accepts connections."""
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("redis-server did not start")


async def delete_prefix(client: Any, prefix: str) -> None:
    async for key in client.scan_iter(match=f"{prefix}:*", count=500):
        await client.delete(key)
