"""Prefill → decode over the workers' own gRPC API, as the gateway calls it (its mTLS role), with LoRA
adapters: the helpers of test_adapters_real.py's worker-level test (handles, refusals, forged handles),
run on that module's stack, whose workers the gateway uses too."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from transformers import AutoTokenizer

from tandem.common import kv_capability
from tandem.local.stack import default_model_dir
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

#: Tokens per answer: enough to compare, few enough to keep the test short.
MAX_TOKENS = 8


@dataclass
class Workers:
    prefill: worker_pb2_grpc.WorkerStub
    decode: worker_pb2_grpc.WorkerStub


@dataclass
class Answer:
    token_ids: list[int]
    text: str
    num_cached_tokens: int
    num_kv_tokens_loaded: int
    block_size_tokens: int
    handle_adapter: str


def chat_prompt(turns: list[tuple[str, str]], new_user: str) -> list[int]:
    """The default model's chat template over ``turns`` and ``new_user``, as prompt token ids."""
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    messages: list[dict[str, str]] = []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages.append({"role": "user", "content": new_user})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(t) for t in ids]


def sampling() -> common_pb2.SamplingOptions:
    return common_pb2.SamplingOptions(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


async def prefill_kept(
    w: Workers, prompt: list[int], adapter: str, request_id: str, capability: str
) -> worker_pb2.PrefillResponse:
    """A prefill that keeps its KV for a decode (its response carries the KV handle)."""
    pre: worker_pb2.PrefillResponse = await w.prefill.Prefill(
        worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=sampling(),
            keep_kv=True,
            kv_capability=capability,
            adapter=adapter,
        )
    )
    assert pre.HasField("kv_handle"), pre
    return pre


def decode_request(
    prompt: list[int], pre: worker_pb2.PrefillResponse, adapter: str, request_id: str, capability: str
) -> worker_pb2.DecodeRequest:
    """The decode of ``pre``'s prompt from its KV handle, with ``adapter``."""
    return worker_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        first_token_id=pre.first_token_id,
        first_text=pre.first_text,
        sampling=sampling(),
        kv_handle=pre.kv_handle,
        kv_capability=capability,
        adapter=adapter,
    )


async def p_to_d(w: Workers, prompt: list[int], adapter: str, *, forge_handle_from: str | None = None) -> Answer:
    """Prefill on the prefill worker, then decode on the decode worker from its KV handle. With
    ``forge_handle_from``: the prefill runs with that adapter and its handle is rewritten to claim ``adapter``."""
    request_id = uuid.uuid4().hex
    capability = kv_capability.mint()
    pre = await prefill_kept(
        w, prompt, adapter if forge_handle_from is None else forge_handle_from, request_id, capability
    )
    if forge_handle_from is not None:
        pre.kv_handle.adapter = adapter
    tokens, text, loaded = [pre.first_token_id], pre.first_text, 0
    async for chunk in w.decode.Decode(decode_request(prompt, pre, adapter, request_id, capability)):
        tokens += list(chunk.token_ids)
        text += chunk.text
        if chunk.finish_reason:
            loaded = chunk.stats.num_kv_tokens_loaded
    return Answer(
        tokens, text, pre.num_cached_tokens, loaded, pre.kv_handle.layout.block_size_tokens, pre.kv_handle.adapter
    )


async def first_token(w: Workers, prompt: list[int], adapter: str) -> int:
    """A prefill alone (no KV kept): its first token."""
    response = await w.prefill.Prefill(
        worker_pb2.PrefillRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingOptions(temperature=0.0, max_tokens=1),
            adapter=adapter,
        )
    )
    return int(response.first_token_id)
