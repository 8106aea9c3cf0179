"""The capability that reads or releases one prompt's KV.

A prompt's KV reveals the prompt, and releasing it breaks its request; the
request id names it but is no secret (it is in Redis keys, in the router's
Schedule, on the ledger and in logs). So every call on a prompt's KV
(``PullBlockBytes``, ``StreamBlockBytes``, ``Release`` of ``tandem.v1.KVTransfer``)
must also present the prompt's capability: 128 random bits, hex-encoded, minted
for the request by the gateway (:func:`mint`) and sent only to the prefill
worker that computes the prompt (``PrefillRequest.kv_capability``, kept beside
the blocks by its KV server) and to the decode worker chosen for it
(``PrefetchKVRequest`` / ``DecodeRequest.kv_capability``). It is never logged or
stored, and compared in constant time (:func:`matches`).

The gateway mints it, not the prefill worker: the decode worker starts
streaming the prompt's KV (a prefetch) while the prefill still runs, before the
prefill worker has answered anyone; the gateway is the one party that talks to
both first. The property is the same: only the gateway and the two workers of
the request know it, and nothing else can guess it.
"""

from __future__ import annotations

import hmac
import re
import secrets

#: Hex characters of a capability (128 bits).
NUM_HEX_CHARS = 32
_FORMAT = re.compile(r"[0-9a-f]{32}")


def mint() -> str:
    """A new capability."""
    return secrets.token_hex(NUM_HEX_CHARS // 2)


def well_formed(capability: str) -> bool:
    return bool(_FORMAT.fullmatch(capability))


def matches(expected: str, presented: str) -> bool:
    """Whether ``presented`` is ``expected`` (constant time); never for an empty ``expected``."""
    return bool(expected) and hmac.compare_digest(expected.encode(), presented.encode())
