"""Check the prepared test adapters and the merged model with real vLLM engines (CPU or GPU).

Run by ``scripts/prepare_adapters.py`` after it writes anything, or by hand
(``.venv/bin/python scripts/check_adapters_vllm.py``). Two engines, one after the other, each in
a child process of its own (so that the first one's memory is gone before the second starts):

1. the default model with LoRA on (``enable_lora=True``, ``max_lora_rank=8``): the greedy answer
   to :data:`PROMPT` from the base model and from each adapter (``LoRARequest``);
2. the merged model (``SmolLM2-135M-Instruct-tandem-merged``): the same prompt.

It fails unless the four answers of the first engine are pairwise different and the merged
model's differs from the base model's. It prints every answer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PROMPT = "Tell me about the sea in two sentences."
MAX_TOKENS = 40
BASE_MODEL_NAME = "SmolLM2-135M-Instruct"
MERGED_MODEL_NAME = "SmolLM2-135M-Instruct-tandem-merged"
ADAPTER_NAMES = ("tandem-test-a", "tandem-test-b", "tandem-test-c")


def default_cache_dir() -> Path:
    env_dir = os.environ.get("TANDEM_CACHE_DIR")
    return Path(env_dir).expanduser() if env_dir else Path.home() / ".cache" / "tandem"


def answers(model_dir: Path, adapter_dirs: dict[str, Path]) -> dict[str, str]:
    """Greedy answers of one engine: "" for the base model, then one per adapter."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    lora_args: dict[str, Any] = (
        {"enable_lora": True, "max_lora_rank": 8, "max_loras": len(adapter_dirs)} if adapter_dirs else {}
    )
    # float32: vLLM CPU's bfloat16 path answers nonsense for SmolLM2-135M (see check_model_vllm.py).
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=2048, enforce_eager=True, seed=0, **lora_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    messages = [{"role": "user", "content": PROMPT}]
    result = {"": llm.chat(messages, params)[0].outputs[0].text}
    for lora_id, (name, path) in enumerate(adapter_dirs.items(), start=1):
        request = LoRARequest(name, lora_id, str(path))
        result[name] = llm.chat(messages, params, lora_request=request)[0].outputs[0].text
    return result


def answers_in_child(model_dir: Path, adapter_dirs: dict[str, Path]) -> dict[str, str]:
    with tempfile.TemporaryDirectory(prefix="tandem-check-adapters-") as tmp:
        out = Path(tmp) / "answers.json"
        job = {"model_dir": str(model_dir), "adapters": {k: str(v) for k, v in adapter_dirs.items()}}
        command = [sys.executable, __file__, "--child", json.dumps(job), "--out", str(out)]
        subprocess.run(command, check=True)
        result: dict[str, str] = json.loads(out.read_text())
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        job = json.loads(args.child)
        result = answers(Path(job["model_dir"]), {k: Path(v) for k, v in job["adapters"].items()})
        args.out.write_text(json.dumps(result))
        return 0

    cache_dir: Path = args.cache_dir.expanduser()
    adapter_dirs = {name: cache_dir / "adapters" / name for name in ADAPTER_NAMES}
    with_adapters = answers_in_child(cache_dir / "models" / BASE_MODEL_NAME, adapter_dirs)
    merged = answers_in_child(cache_dir / "models" / MERGED_MODEL_NAME, {})[""]
    for name, text in with_adapters.items():
        print(f"[check_adapters] {name or 'base'}: {text!r}", flush=True)
    print(f"[check_adapters] {MERGED_MODEL_NAME}: {merged!r}", flush=True)
    failures = []
    texts = list(with_adapters.items())
    for i, (name, text) in enumerate(texts):
        for other, other_text in texts[i + 1 :]:
            if text == other_text:
                failures.append(f"{name or 'base'} and {other or 'base'} answer the same")
    if merged == with_adapters[""]:
        failures.append(f"{MERGED_MODEL_NAME} answers as the base model does")
    for failure in failures:
        print(f"[check_adapters] FAIL: {failure}", file=sys.stderr)
    if failures:
        return 1
    print("[check_adapters] OK", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
