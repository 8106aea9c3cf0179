"""The KV-layout fingerprint: whether two workers' KV blocks can cross from one to the other.

A prefill worker's KV blocks are copied byte for byte into a decode worker's paged cache, so a pair
may exchange them only when everything that decides those bytes is equal: the model and its
revision (new weights give other KV for the same tokens, in the same shapes), the dtype, the block
size, the number of layers, one block's shape (KV heads and head size), the tensor-parallel size and
the place of the block dimension in the cache tensor. :func:`kv_fingerprint` is the one function
that reduces those facts to a short string; each worker computes it once from its engine's own KV
layout (``tandem.worker.kv_connector.layout.KVLayout.fingerprint``) and registers it
(:attr:`tandem.common.registry.WorkerRecord.kv_fingerprint`); the router pairs a prefill worker only
with decode workers of the same fingerprint (``tandem.router.pairing``).

Called by the worker at start; pure and standard-library only, so the router (no torch) reads the
same definition. Two workers of one version of Tandem agree on it exactly when the decode worker's
layout check (``KVLayout.check_compatible``) would pass and the weights are the same revision.

:func:`model_revision` says which weights a folder holds when the deployment declares none.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

#: Bump when the inputs or their encoding change: workers of two versions then never pair by accident.
FINGERPRINT_VERSION = "kv1"
#: Hex characters of the digest kept (64 bits: no two revisions of one deployment collide).
NUM_DIGEST_HEX_CHARS = 16
#: The files of a model folder that say which weights it holds, besides the weights' names and sizes.
_CONFIG_FILES = ("config.json", "generation_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def kv_fingerprint(
    *,
    model: str,
    model_revision: str,
    dtype: str,
    block_size_tokens: int,
    num_layers: int,
    block_shape: Sequence[int],
    tp_size: int,
    block_dim: int,
) -> str:
    """``kv1-`` and 16 hex characters of a SHA-256 over the canonical JSON of every argument.

    Equal fingerprints: the two engines' KV blocks are interchangeable (same bytes for the same
    tokens). Different ones: a handoff would be refused (layout) or silently wrong (revision)."""
    facts = {
        "model": model,
        "model_revision": model_revision,
        "dtype": dtype,
        "block_size_tokens": int(block_size_tokens),
        "num_layers": int(num_layers),
        "block_shape": [int(d) for d in block_shape],
        "tp_size": int(tp_size),
        "block_dim": int(block_dim),
    }
    canonical = json.dumps(facts, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{FINGERPRINT_VERSION}-{hashlib.sha256(canonical.encode()).hexdigest()[:NUM_DIGEST_HEX_CHARS]}"


def model_revision(model_dir: Path, declared: str = "") -> str:
    """The revision of the weights in ``model_dir``: ``declared`` when the deployment names one (a
    Hugging Face commit, a tag of the weights), else ``dir-`` and a digest of the folder's config files
    and its weight files' names and sizes (read at start, no weight byte read).

    The fallback tells apart another architecture, dtype or file layout; weights retrained in the same
    shapes have the same sizes, so a deployment that swaps those declares the revision."""
    if declared:
        return declared
    digest = hashlib.sha256()
    for name in _CONFIG_FILES:
        path = model_dir / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    if model_dir.is_dir():
        for path in sorted(model_dir.iterdir()):
            if path.is_file() and path.name.endswith(_WEIGHT_SUFFIXES):
                digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
    return f"dir-{digest.hexdigest()[:NUM_DIGEST_HEX_CHARS]}"
