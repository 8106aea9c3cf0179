"""Failpoints: named places where the fault suite injects a fault into a
running process (in the manner of etcd's gofail and TiKV's fail-rs).

Inert unless the process was started with ``TANDEM_FAILPOINTS_DIR`` set, which
production deployments never do; then :func:`hit` costs one ``stat`` of
``$TANDEM_FAILPOINTS_DIR/<name>``. A test arms a failpoint by writing an action
into that file and disarms it by deleting the file:

* ``sleep <seconds>``: stall here (a hung peer, a slow disk);
* ``error <message>``: raise :class:`FailpointError` here;
* ``once <action>``: the action, once: the first hit deletes the file (a fault in one process, not in
  every process that passes the same place after it).

The names in use are listed in :data:`KNOWN`; :func:`hit` refuses others so a
typo in a test cannot silently arm nothing.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

#: Every failpoint in the code base, with where it sits.
KNOWN = {
    "kv_server.before_pull": "prefill worker's KV server, after the held blocks were found, before sending them",
    "kv_shm.serve": "prefill worker's KV server, a pull through shared memory checked, before its segment is "
    "taken (``error``: the decode worker falls back to gRPC)",
    "kv_server.before_stream": "prefill worker's KV server, a prefetch's stream of a running prefill checked (over "
    "gRPC or through shared memory), before its first piece (``error`` on the shared-memory stream: the decode "
    "worker falls back to the gRPC stream, which hits it too)",
    "engine.step": "every engine step of a worker, in its model-runner process, before the forward pass "
    "(``sleep``: a stuck step; ``error``: a step that raises and kills the engine)",
}

_DIR = os.environ.get("TANDEM_FAILPOINTS_DIR")


class FailpointError(RuntimeError):
    """Raised by an armed ``error`` failpoint."""


def hit(name: str) -> None:
    """Run the action armed for ``name``, if any."""
    if _DIR is None:
        return
    if name not in KNOWN:
        raise ValueError(f"unknown failpoint {name!r}")
    path = Path(_DIR) / name
    try:
        action = path.read_text().strip()
    except FileNotFoundError:
        return
    verb, _, argument = action.partition(" ")
    if verb == "once":
        try:
            path.unlink()
        except FileNotFoundError:
            return  # another hit took it first
        verb, _, argument = argument.partition(" ")
    logger.warning("failpoint %s: %s", name, action)
    if verb == "sleep":
        time.sleep(float(argument))
    elif verb == "error":
        raise FailpointError(argument or name)
    else:
        raise ValueError(f"failpoint {name}: unknown action {action!r}")
