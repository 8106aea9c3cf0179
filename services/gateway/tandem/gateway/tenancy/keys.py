"""API keys: minting and hashing. Called by the store (create) and the
authenticator (lookup). A key is ``tdm_<key id>_<secret>``; only the key id and
the SHA-256 of the whole key are stored, so a Redis dump reveals no key."""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "tdm_"


def new_api_key() -> tuple[str, str]:
    """A fresh ``(key_id, key)``. The key id is public (logs, the CLI); the key is shown once."""
    key_id = secrets.token_hex(6)
    return key_id, f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"


def hash_key(key: str) -> str:
    # A fast hash is right for 256-bit random secrets (no dictionary to guard against), and the lookup by
    # hash compares no secret bytes, so it leaks nothing through timing.
    return hashlib.sha256(key.encode()).hexdigest()
