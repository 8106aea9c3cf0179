"""One plain vLLM engine with LoRA on (``vllm.LLM(enable_lora=True)``), nothing of Tandem's in it: the
baseline tests/integration/test_worker_adapters.py compares Tandem's prefill → decode answers with.

Run as a process of its own (vLLM spawns its engine core; the test's process stays free of it):
``python tests/integration/plain_lora.py < job.json``; the job names the model folder and a list of
greedy requests (prompt token ids, max_tokens, adapter name and path or none); it prints a JSON list
of each request's output token ids. Engine settings as the workers' (float32 on CPU, eager)."""

from __future__ import annotations

import json
import sys
from typing import Any


def run(job: dict[str, Any]) -> list[list[int]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(
        model=job["model_dir"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=job.get("max_model_len", 4096),
        kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=True,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=2,
        max_lora_rank=job.get("max_lora_rank", 16),
    )
    out = []
    for ix, req in enumerate(job["requests"]):
        lora = (
            LoRARequest(lora_name=req["adapter"], lora_int_id=ix + 1, lora_path=req["adapter_path"])
            if req.get("adapter")
            else None
        )
        params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=req.get("ignore_eos", False))
        (result,) = llm.generate(
            [TokensPrompt(prompt_token_ids=req["prompt_token_ids"])], params, lora_request=lora, use_tqdm=False
        )
        out.append([int(t) for t in result.outputs[0].token_ids])
    return out


if __name__ == "__main__":
    answer = run(json.load(sys.stdin))
    print("PLAIN_LORA_RESULT " + json.dumps(answer), flush=True)
