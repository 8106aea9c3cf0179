"""Smoke-check a prepared model folder with vLLM (CPU or GPU).

Run by hand after ``make model`` (``.venv/bin/python scripts/check_model_vllm.py``):
it starts a vLLM ``LLM`` on the folder, asks the chat-templated question
"What is the capital of France?" greedily and fails unless the answer contains
"Paris". It prints the engine start time and the answer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

QUESTION = "What is the capital of France?"
EXPECTED_WORD = "Paris"


def default_model_dir() -> Path:
    env_dir = os.environ.get("TANDEM_CACHE_DIR")
    cache_dir = Path(env_dir).expanduser() if env_dir else Path.home() / ".cache" / "tandem"
    return cache_dir / "models" / "SmolLM2-135M-Instruct"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=default_model_dir())
    # vLLM's "auto" runs this model in bfloat16, and vLLM CPU's bfloat16 path answers
    # nonsense for SmolLM2-135M (transformers in bfloat16 answers fine); float32 is correct.
    parser.add_argument("--dtype", default="float32", help="vLLM compute dtype (default: float32)")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    # A 135M model needs little KV cache; vLLM CPU reserves 4 GiB by default.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import LLM, SamplingParams

    started_s = time.monotonic()
    llm = LLM(
        model=str(args.model_dir),
        dtype=args.dtype,
        max_model_len=4096,
        enforce_eager=True,
        seed=0,
    )
    engine_start_s = time.monotonic() - started_s
    print(f"[check_model] engine start: {engine_start_s:.1f} s", flush=True)

    started_s = time.monotonic()
    outputs = llm.chat(
        [{"role": "user", "content": QUESTION}],
        SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
    )
    answer = outputs[0].outputs[0].text
    print(f"[check_model] generate: {time.monotonic() - started_s:.2f} s", flush=True)
    print(f"[check_model] answer: {answer!r}", flush=True)
    if EXPECTED_WORD not in answer:
        print(f"[check_model] FAIL: {EXPECTED_WORD!r} not in the answer", file=sys.stderr)
        return 1
    print("[check_model] OK", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
