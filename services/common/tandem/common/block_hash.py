"""Prefix-cache block hashes computed exactly as vLLM 0.32's engine does, without vLLM.

The router (:mod:`tandem.router.kv_index`) hashes a request's prompt with
:class:`BlockHasher` and looks the hashes up in the block sets that the
workers' KV events reported. Simulated workers use it to publish the hashes a
real engine would. It imports only the standard library.

What vLLM does (``vllm/v1/core/kv_cache_utils.py``, ``vllm/utils/hashing.py``):

* only full blocks of ``block_size`` tokens are hashed (the CPU backend's
  default block size is 128, GPUs use 16);
* ``hash(block) = sha256(pickle.dumps((parent, tuple(tokens), extra_keys),
  protocol=HIGHEST_PROTOCOL))``, where ``parent`` is the previous block's
  32-byte digest, or ``NONE_HASH`` for the first block;
* ``NONE_HASH = sha256(pickle(seed))`` with seed ``$PYTHONHASHSEED`` when set
  in the engine's environment, else the fixed ``"vllm-none-hash"``;
* ``extra_keys`` (``generate_block_hash_extra_keys``) is the tuple of LoRA keys,
  then multimodal keys, then the cache salt, then prompt-embeds keys, or ``None``
  when there are none. Tandem uses two of them: for a request with a LoRA adapter,
  ``("lora", lora_name, lora_path)`` in *every* block (``_gen_lora_extra_hash_keys``:
  the path too, so that one name pointed at other files never reuses the old
  blocks), and for the first block of a salted request ``("cache_salt", salt)``
  after it. So a salted adapter request's first block has
  ``(("lora", name, path), ("cache_salt", salt))``, its other blocks
  ``(("lora", name, path),)``. Tandem's engines know an adapter by its engine
  name (``NAME@VERSION``, :mod:`tandem.common.adapters`) and the catalog's path,
  and those are what the gateway passes here. Multimodal and prompt-embeds keys
  are not used by Tandem and are not reproduced;
* KV events carry the low 64 bits of the digest (big-endian) as an int
  (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default), or the raw bytes.

Only the ``sha256`` algorithm (vLLM's default) is reproduced; the router
treats workers with another algorithm as having nothing cached.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field

#: vLLM's NONE_HASH seed when PYTHONHASHSEED is not set (sha256 algorithms).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
#: The one prefix-caching hash algorithm reproduced here.
HASH_ALGO_SHA256 = "sha256"

_LOW_64_BITS = (1 << 64) - 1


def sha256_pickle(value: object) -> bytes:
    """vLLM's ``sha256``: pickle with the highest protocol, then SHA-256."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def external_block_hash(digest: bytes | int) -> int:
    """The 64-bit int a KV event carries for a block digest (ints pass through masked)."""
    if isinstance(digest, int):
        return digest & _LOW_64_BITS
    return int.from_bytes(digest, "big") & _LOW_64_BITS


@dataclass(frozen=True)
class BlockHasher:
    """Chained block hashes of one engine configuration (block size, seed)."""

    block_size_tokens: int
    none_hash_seed: str = DEFAULT_NONE_HASH_SEED
    _none_hash: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size_tokens <= 0:
            raise ValueError("block_size_tokens must be positive")
        object.__setattr__(self, "_none_hash", sha256_pickle(self.none_hash_seed))

    @property
    def none_hash(self) -> bytes:
        return self._none_hash

    def block_digests(
        self, token_ids: Sequence[int], *, cache_salt: str = "", lora_name: str = "", lora_path: str = ""
    ) -> list[bytes]:
        """The 32-byte digest of every full block of ``token_ids``, in order. ``lora_name`` and
        ``lora_path``: the request's LoRA adapter as the engine knows it (``LoRARequest.lora_name``,
        ``.lora_path``); "" for the base model."""
        if bool(lora_name) != bool(lora_path):
            raise ValueError("a LoRA adapter needs both its name and its path")
        size = self.block_size_tokens
        # A tuple of Python ints (not numpy ints, not a list): pickle must see what vLLM hashes.
        ids = tuple(map(int, token_ids))
        digests: list[bytes] = []
        parent = self._none_hash
        dumps, sha256, protocol = pickle.dumps, hashlib.sha256, pickle.HIGHEST_PROTOCOL
        lora_keys: tuple[tuple[str, ...], ...] = (("lora", lora_name, lora_path),) if lora_name else ()
        salt_keys = (("cache_salt", cache_salt),) if cache_salt else ()
        first_keys = (lora_keys + salt_keys) or None
        other_keys = lora_keys or None
        for start in range(0, len(ids) - size + 1, size):
            extra_keys = first_keys if start == 0 else other_keys
            parent = sha256(dumps((parent, ids[start : start + size], extra_keys), protocol=protocol)).digest()
            digests.append(parent)
        return digests

    def block_hashes(
        self, token_ids: Sequence[int], *, cache_salt: str = "", lora_name: str = "", lora_path: str = ""
    ) -> list[int]:
        """The block hashes as KV events carry them (low 64 bits as int)."""
        digests = self.block_digests(token_ids, cache_salt=cache_salt, lora_name=lora_name, lora_path=lora_path)
        return [external_block_hash(d) for d in digests]
