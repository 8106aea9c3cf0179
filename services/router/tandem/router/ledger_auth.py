"""Authenticity of the ledger's messages and snapshots: an HMAC-SHA256 tag over their exact bytes,
with a secret every router replica is given (``ledger.secret_file``: a Kubernetes Secret in the
chart, a file in the cache folder for the local stack).

Called by :class:`tandem.router.ledger.Ledger` only: :meth:`LedgerAuth.seal_message` /
:meth:`LedgerAuth.seal_snapshot` on what it publishes and writes, :meth:`LedgerAuth.open_message` /
:meth:`LedgerAuth.open_snapshot` on what it receives and reads (pure, no I/O). Wire: the msgpack
body, then the 32-byte tag. A message and a snapshot are tagged with two keys derived from the
secret, so neither passes for the other.

What the tag protects against: anyone who can publish on the ledger channel or write the router's
Redis keys without the secret (Redis reached without ACLs, another component's Redis user, a
leaked Redis password) can no longer reserve or release budget on real workers, queue or hand off
requests, nor make a replica mirror an invented replica: a message or snapshot whose tag is
missing or wrong is dropped and counted (``tandem_router_ledger_rejected_total{reason="bad_mac"}``).
With the sequence numbers and send times the ledger checks (see :mod:`tandem.router.ledger`), a
genuine message recorded and published again is dropped too (``replayed``, ``stale``).

What it does not protect against: a compromised router replica holds the secret and can say
anything a replica can (the mirrors' bound, ``ledger.max_replicas``, still caps the memory it can
make the others spend); nothing is encrypted (placements and request ids are readable by whoever
can subscribe, as before); a new replica may act on a replayed message younger than
``ledger.max_message_age_s`` before it has heard that sender's newer ones; and a Redis that drops
or delays messages is repaired from snapshots as before, not detected here.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

#: Bytes of the tag appended to every message and snapshot (HMAC-SHA256).
TAG_BYTES = 32
#: A secret shorter than this is refused: 128 bits of a random secret.
MIN_SECRET_BYTES = 16

#: ``reason`` tag values of ``tandem_router_ledger_rejected_total``.
REJECT_BAD_MAC = "bad_mac"
REJECT_MALFORMED = "malformed"
REJECT_STALE = "stale"
REJECT_REPLAYED = "replayed"
REJECT_TOO_MANY_REPLICAS = "too_many_replicas"


class LedgerSecretError(ValueError):
    """The ledger secret is missing or too short (permanent: a configuration error)."""


def read_secret(path: Path) -> bytes:
    """The secret in ``path`` (a mounted Secret; surrounding whitespace ignored)."""
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise LedgerSecretError(f"cannot read the ledger secret {path}: {exc}") from exc
    if len(secret) < MIN_SECRET_BYTES:
        raise LedgerSecretError(f"the ledger secret in {path} has {len(secret)} bytes; at least {MIN_SECRET_BYTES}")
    return secret


def check_secret_file(path: Path | None, *, num_replicas: int) -> None:
    """Raise :class:`LedgerSecretError` when ``num_replicas`` replicas could not authenticate each other
    with ``path``: none given for several replicas, or one that cannot be read or is too short."""
    if path is not None:
        read_secret(path)
    elif num_replicas > 1:
        raise LedgerSecretError(
            f"{num_replicas} router replicas need ledger.secret_file (TANDEM_ROUTER_LEDGER__SECRET_FILE): a file "
            f"with a random secret of at least {MIN_SECRET_BYTES} bytes, the same for every replica"
        )


class LedgerAuth:
    """Tags and checks the ledger's messages and snapshots with keys derived from one secret."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise LedgerSecretError(f"the ledger secret has {len(secret)} bytes; at least {MIN_SECRET_BYTES}")
        self._message_key = hmac.digest(secret, b"tandem router ledger message", hashlib.sha256)
        self._snapshot_key = hmac.digest(secret, b"tandem router ledger snapshot", hashlib.sha256)

    def seal_message(self, body: bytes) -> bytes:
        return body + hmac.digest(self._message_key, body, hashlib.sha256)

    def seal_snapshot(self, body: bytes) -> bytes:
        return body + hmac.digest(self._snapshot_key, body, hashlib.sha256)

    def open_message(self, payload: bytes) -> bytes | None:
        """The body of ``payload`` when its tag is right, else None."""
        return _open(self._message_key, payload)

    def open_snapshot(self, payload: bytes) -> bytes | None:
        return _open(self._snapshot_key, payload)


def _open(key: bytes, payload: bytes) -> bytes | None:
    if len(payload) <= TAG_BYTES:
        return None
    body, tag = payload[:-TAG_BYTES], payload[-TAG_BYTES:]
    if not hmac.compare_digest(hmac.digest(key, body, hashlib.sha256), tag):
        return None
    return body
