"""Prepare the test LoRA adapters and the second base model from the default model.

Called by ``scripts/prepare_model.py`` (``make model``) once the default model is in place. Under
the same cache folder (``<cache>/...``, see :func:`prepare_model.default_cache_dir`) it writes:

* ``adapters/tandem-test-a``, ``-b``, ``-c``: three ``peft`` LoRA adapters for
  SmolLM2-135M-Instruct (rank 8, alpha 16, on ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``),
  saved with ``save_pretrained`` as safetensors. PEFT initialises ``lora_B`` to zeros (an adapter
  that changes nothing); here every ``lora_B`` is drawn from N(0, :data:`LORA_B_STD`) with the
  adapter's own seed (``lora_A`` keeps PEFT's initialisation under the same seed), so each adapter
  is a real, different set of weights whose greedy answers differ from the base model's and from
  each other's while staying fluent English (0.06 was picked by reading the answers; at 0.1 some
  answers repeat themselves).
* ``models/SmolLM2-135M-Instruct-tandem-merged``: the default model with ``tandem-test-b``
  merged into its weights (``merge_and_unload``), saved in the default model's dtype with the
  default model's tokenizer, chat template and generation config and a top-level ``rope_theta``.

Each folder carries a marker (``model_folder.MARKER_FILE_NAME``) recording what was written, including
the base model's own marker, so a second run is a no-op and a rebuilt base model rebuilds them.
Folders are written to a temporary sibling and renamed into place (``model_folder.py``, as the
default model's).

After building anything, :func:`prepare` runs ``scripts/check_adapters_vllm.py`` in a child
process (a real vLLM engine, LoRA on): it fails unless each adapter's greedy answer to a fixed
prompt differs from the base model's and the other adapters', and the merged model's from the
base model's. ``--no-check`` skips it.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

try:  # run as a script (make model): this folder is first on sys.path
    from model_folder import has_marker, publish
except ModuleNotFoundError:  # imported as scripts.prepare_adapters (the tests)
    from scripts.model_folder import has_marker, publish

BASE_MODEL_NAME = "SmolLM2-135M-Instruct"
MERGED_MODEL_NAME = "SmolLM2-135M-Instruct-tandem-merged"
#: name -> seed. The seed drives both PEFT's ``lora_A`` initialisation and the ``lora_B`` draw.
ADAPTER_SEEDS: dict[str, int] = {"tandem-test-a": 1, "tandem-test-b": 2, "tandem-test-c": 3}
#: The adapter merged into the second base model.
MERGED_ADAPTER = "tandem-test-b"
LORA_RANK = 8
LORA_ALPHA = 16
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_B_STD = 0.06
#: Bump when what is written changes, so that existing folders are rebuilt.
FORMAT_VERSION = 1
#: Files copied from the default model into the merged one (tokenizer, chat template, sampling).
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def adapters_dir(cache_dir: Path) -> Path:
    return cache_dir / "adapters"


def adapter_marker(name: str, base_marker: dict[str, Any]) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "base_model": BASE_MODEL_NAME,
        "base_marker": base_marker,
        "seed": ADAPTER_SEEDS[name],
        "rank": LORA_RANK,
        "alpha": LORA_ALPHA,
        "target_modules": list(LORA_TARGET_MODULES),
        "lora_b_std": LORA_B_STD,
    }


def merged_marker(base_marker: dict[str, Any]) -> dict[str, Any]:
    return {**adapter_marker(MERGED_ADAPTER, base_marker), "merged_adapter": MERGED_ADAPTER}


#: The mode of the files written: safetensors writes 0600, and nothing here is a secret.
FILE_MODE = 0o644


def lora_model(base_dir: Path, name: str) -> Any:
    """The default model (float32) wrapped in adapter ``name``'s LoRA, with its non-zero B weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    seed = ADAPTER_SEEDS[name]
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        target_modules=list(LORA_TARGET_MODULES),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in peft_model.named_parameters():
            if "lora_B" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * LORA_B_STD)
    return peft_model


def write_adapter(base_dir: Path, name: str, out_dir: Path) -> None:
    peft_model = lora_model(base_dir, name)
    peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    config: dict[str, Any] = json.loads((out_dir / "adapter_config.json").read_text())
    # PEFT records the folder it loaded the base from; vLLM only needs it to exist as a field.
    config["base_model_name_or_path"] = BASE_MODEL_NAME
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if not (out_dir / "adapter_model.safetensors").is_file():
        sys.exit(f"error: peft wrote no adapter_model.safetensors in {out_dir}")


def write_merged(base_dir: Path, out_dir: Path) -> None:
    import torch

    base_config: dict[str, Any] = json.loads((base_dir / "config.json").read_text())
    dtype_name = str(base_config.get("dtype") or base_config.get("torch_dtype") or "bfloat16")
    merged = lora_model(base_dir, MERGED_ADAPTER).merge_and_unload()
    merged = merged.to(getattr(torch, dtype_name))
    merged.config.dtype = dtype_name
    merged.save_pretrained(str(out_dir), safe_serialization=True)
    config: dict[str, Any] = json.loads((out_dir / "config.json").read_text())
    config.pop("_name_or_path", None)
    # vLLM falls back to 10000 without a top-level rope_theta (see prepare_model.fix_config).
    config["rope_theta"] = float(base_config["rope_theta"])
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for file_name in COPIED_FILES:
        if (base_dir / file_name).is_file():
            shutil.copyfile(base_dir / file_name, out_dir / file_name)


def run_vllm_check(cache_dir: Path) -> None:
    script = Path(__file__).with_name("check_adapters_vllm.py")
    print("[prepare_adapters] checking the answers with a real vLLM engine (about a minute)", flush=True)
    result = subprocess.run([sys.executable, str(script), "--cache-dir", str(cache_dir)], check=False)
    if result.returncode != 0:
        sys.exit(f"error: {script.name} failed (exit {result.returncode}); the prepared folders are kept")


def prepare(
    cache_dir: Path, base_dir: Path, base_marker: dict[str, Any], *, check: bool = True, force: bool = False
) -> None:
    """Write whichever adapter and merged-model folders are missing or stale, then check them."""
    started_s = time.monotonic()
    built: list[Path] = []
    for name in ADAPTER_SEEDS:
        folder = adapters_dir(cache_dir) / name
        marker = adapter_marker(name, base_marker)
        if force or not has_marker(folder, marker):
            print(f"[prepare_adapters] writing adapter {name} to {folder}", flush=True)
            publish(folder, marker, functools.partial(write_adapter, base_dir, name), file_mode=FILE_MODE)
            built.append(folder)
    merged_dir = cache_dir / "models" / MERGED_MODEL_NAME
    marker = merged_marker(base_marker)
    if force or not has_marker(merged_dir, marker):
        print(f"[prepare_adapters] writing the merged model to {merged_dir}", flush=True)
        publish(merged_dir, marker, lambda out: write_merged(base_dir, out), file_mode=FILE_MODE)
        built.append(merged_dir)
    if not built:
        print("[prepare_adapters] already prepared: adapters " + ", ".join(ADAPTER_SEEDS) + f", {MERGED_MODEL_NAME}")
        return
    if check:
        run_vllm_check(cache_dir)
    print(f"[prepare_adapters] done in {time.monotonic() - started_s:.1f} s", flush=True)
