"""Where ``make model`` put the test LoRA adapters and the second base model.

``scripts/prepare_adapters.py`` (run by ``make model``) writes, under the cache folder
(``$TANDEM_CACHE_DIR``, else ``~/.cache/tandem``):

* ``adapters/tandem-test-a``, ``-b``, ``-c``: peft LoRA adapters (rank 8, q/k/v/o projections,
  non-zero weights) for SmolLM2-135M-Instruct; at temperature 0 each answers differently from
  the base model and from the others;
* ``models/SmolLM2-135M-Instruct-tandem-merged``: the default model with ``tandem-test-b``
  merged into its weights, a second base model (it answers as the base model with
  ``tandem-test-b`` does, up to bfloat16 rounding of the merged weights).

Both functions raise :class:`FileNotFoundError` saying "run make model" when a folder is missing
or incomplete.
"""

from __future__ import annotations

import os
from pathlib import Path

ADAPTER_NAMES = ("tandem-test-a", "tandem-test-b", "tandem-test-c")
#: The adapter whose weights are merged into :func:`second_model_path`.
MERGED_ADAPTER = "tandem-test-b"
BASE_MODEL_NAME = "SmolLM2-135M-Instruct"
SECOND_MODEL_NAME = "SmolLM2-135M-Instruct-tandem-merged"
#: The LoRA rank of the test adapters (vLLM's ``max_lora_rank`` must be at least this).
ADAPTER_RANK = 8


def cache_dir() -> Path:
    env_dir = os.environ.get("TANDEM_CACHE_DIR")
    return Path(env_dir).expanduser() if env_dir else Path.home() / ".cache" / "tandem"


def _require(folder: Path, needed_file: str, what: str) -> Path:
    if not (folder / needed_file).is_file():
        raise FileNotFoundError(f"{what} is not prepared at {folder} (no {needed_file}): run make model")
    return folder


def adapter_path(name: str) -> Path:
    """The folder of test adapter ``name`` (one of :data:`ADAPTER_NAMES`)."""
    if name not in ADAPTER_NAMES:
        raise ValueError(f"unknown test adapter {name!r}; make model prepares {', '.join(ADAPTER_NAMES)}")
    folder = cache_dir() / "adapters" / name
    _require(folder, "adapter_config.json", f"the test adapter {name!r}")
    return _require(folder, "adapter_model.safetensors", f"the test adapter {name!r}")


def second_model_path() -> Path:
    """The folder of the second base model, :data:`SECOND_MODEL_NAME`."""
    folder = cache_dir() / "models" / SECOND_MODEL_NAME
    _require(folder, "config.json", "the second model")
    return _require(folder, "model.safetensors", "the second model")
