"""Every field of every internal call, checked against the model and the
engine before anything reaches the engine.

Called by :class:`tandem.worker.service.WorkerService` for Prefill, Decode,
PrefetchKV and Abort, after the admission checks (role, drain, a dead engine)
and before the role's handler; the caller answers INVALID_ARGUMENT with the
message returned. Pure code: no vLLM import, so it is tested without an engine
(and with hypothesis against a real one, ``tests/integration``).

Why the worker checks what the gateway already checked: anything on the worker
network can call these RPCs, and one value the engine does not expect can kill
it for every request it serves. ``first_token_id=4000000000`` did: vLLM
validates a prompt's token ids but not a logits processor's arguments, and the
replay of the first token (``tandem.worker.first_token``) indexed the logits
with it inside the model runner. So each field gets the bound the engine
really has (the model's vocabulary, the context length, vLLM's ``max_logprobs``)
or, where the engine has none, a generous one that keeps a single call small.
NaN passes vLLM's own range checks (every comparison with it is false), so
every float must be finite.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tandem.common import kv_capability
from tandem.common.adapters import split_engine_name
from tandem.v1 import common_pb2, worker_pb2

#: Request ids: what Tandem's gateway mints (hex) and what a person types into grpcurl, never a path or
#: a line break (the id names log lines, engine requests and KV holds).
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
_HOST_PORT = re.compile(r"[A-Za-z0-9.\-\[\]:]{1,253}:[0-9]{1,5}")
MAX_CACHE_SALT_CHARS = 256
#: The text of one token (``first_text``): a token is a few bytes; the stop buffer may hold a few more.
MAX_FIRST_TEXT_CHARS = 1024
#: A migrated stream's text so far (``resume_text``), per resumed token: a token is a few characters.
MAX_CHARS_PER_TOKEN = 64
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
#: OpenAI's range for a logit bias.
MAX_ABS_LOGIT_BIAS = 100.0
MAX_TEMPERATURE = 100.0
MAX_ABS_PENALTY = 2.0
MAX_REPETITION_PENALTY = 100.0
#: Above zero (vLLM's own bound) by enough that dividing a logit by it stays finite in float32.
MIN_REPETITION_PENALTY = 1e-3
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024


@dataclass(frozen=True)
class ModelLimits:
    """What the engine can take: read from it once at start (``VLLMEngine.limits``)."""

    #: Rows of the model's logits: every token id must be below this.
    vocab_size: int
    max_model_len: int
    #: vLLM's ``max_logprobs``: the most alternatives one position may ask for.
    max_logprobs: int
    #: Tokens per KV block.
    block_size_tokens: int


def check_request_id(request_id: str) -> str:
    if not _REQUEST_ID.fullmatch(request_id):
        return "request_id must be 1-128 characters of A-Z a-z 0-9 . _ : @ -"
    return ""


def check_prompt(token_ids: list[int], limits: ModelLimits, *, num_more_tokens: int = 0) -> str:
    if not token_ids:
        return "prompt_token_ids is empty"
    if len(token_ids) + num_more_tokens >= limits.max_model_len:
        return f"prompt of {len(token_ids) + num_more_tokens} tokens does not fit max_model_len {limits.max_model_len}"
    if max(token_ids) >= limits.vocab_size:
        return f"prompt_token_ids holds a token id >= the vocabulary size {limits.vocab_size}"
    return ""


def _finite(name: str, value: float, low: float, high: float) -> str:
    if not math.isfinite(value) or not low <= value <= high:
        return f"{name} must be a finite number in [{low:g}, {high:g}]"
    return ""


def check_sampling(options: common_pb2.SamplingOptions, limits: ModelLimits) -> str:
    """The sampling options of a Prefill or a Decode (``max_tokens`` is checked by each role)."""
    if options.max_tokens > limits.max_model_len:
        return f"max_tokens must be at most max_model_len {limits.max_model_len}"
    if options.min_tokens > limits.max_model_len:
        return f"min_tokens must be at most max_model_len {limits.max_model_len}"
    checks = [
        ("temperature", 0.0, MAX_TEMPERATURE),
        ("top_p", 0.0, 1.0),
        ("min_p", 0.0, 1.0),
        ("presence_penalty", -MAX_ABS_PENALTY, MAX_ABS_PENALTY),
        ("frequency_penalty", -MAX_ABS_PENALTY, MAX_ABS_PENALTY),
        ("repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
    ]
    for name, low, high in checks:
        if options.HasField(name):
            error = _finite(name, getattr(options, name), low, high)
            if error:
                return error
    if options.HasField("top_k") and not (options.top_k == -1 or 0 <= options.top_k <= limits.vocab_size):
        return f"top_k must be -1 or in [0, {limits.vocab_size}]"
    if options.HasField("logprobs") and options.logprobs > limits.max_logprobs:
        return f"logprobs must be at most {limits.max_logprobs}"
    if len(options.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_STRING_CHARS for s in options.stop):
        return f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_STRING_CHARS} characters"
    if any(t >= limits.vocab_size for t in options.stop_token_ids) or len(options.stop_token_ids) > MAX_STOP_STRINGS:
        return f"stop_token_ids takes at most {MAX_STOP_STRINGS} ids below the vocabulary size {limits.vocab_size}"
    if len(options.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        return f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} entries"
    for token_id, bias in options.logit_bias.items():
        if token_id >= limits.vocab_size:
            return f"logit_bias names a token id >= the vocabulary size {limits.vocab_size}"
        if not math.isfinite(bias) or abs(bias) > MAX_ABS_LOGIT_BIAS:
            return f"logit_bias values must be finite numbers in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]"
    return _check_structured(options)


def _check_structured(options: common_pb2.SamplingOptions) -> str:
    if not options.HasField("structured_output"):
        return ""
    spec = options.structured_output
    kind = spec.WhichOneof("kind")
    if kind == "choice":
        choices = spec.choice.choices
        if not choices or len(choices) > MAX_CHOICES or sum(len(c) for c in choices) > MAX_GRAMMAR_CHARS:
            return f"structured_output.choice takes 1-{MAX_CHOICES} choices"
    elif kind in ("json_schema", "regex", "grammar"):
        text = getattr(spec, kind)
        if not text or len(text) > MAX_GRAMMAR_CHARS:
            return f"structured_output.{kind} must be 1-{MAX_GRAMMAR_CHARS} characters"
    return ""


def check_kv_handle(handle: common_pb2.KVHandle, num_prompt_tokens: int, limits: ModelLimits) -> str:
    """A handle is the prefill worker's answer passed through the gateway: its numbers must describe
    whole blocks of this prompt (the KV server checks the blocks against what it holds). The KV is the
    request's own, by its request id (checked with the request)."""
    if not (handle.engine_id and _HOST_PORT.fullmatch(handle.kv_address)):
        return "kv_handle needs engine_id and a host:port kv_address"
    if not 0 < handle.num_tokens <= num_prompt_tokens:
        return "kv_handle.num_tokens must be in [1, the prompt's length]"
    # The prefill engine's blocks of the request: its prompt's, and the one its first token went into.
    block_size = max(1, limits.block_size_tokens)
    num_blocks = -(-handle.num_tokens // block_size)
    max_blocks = -(-limits.max_model_len // block_size) + 1
    if not num_blocks <= len(handle.block_ids) <= max_blocks:
        return f"kv_handle.block_ids must hold {num_blocks}-{max_blocks} ids for {handle.num_tokens} tokens"
    if not math.isfinite(handle.lease_expires_unix_s):
        return "kv_handle.lease_expires_unix_s must be finite"
    return ""


def check_prefill(request: worker_pb2.PrefillRequest, limits: ModelLimits) -> str:
    return (
        check_request_id(request.request_id)
        or check_prompt(list(request.prompt_token_ids), limits)
        or check_sampling(request.sampling, limits)
        or _check_salt(request.cache_salt)
        or (_check_capability(request.kv_capability) if request.keep_kv else "")
        or _check_adapter(request.adapter)
    )


def check_decode(request: worker_pb2.DecodeRequest, limits: ModelLimits) -> str:
    prompt_ids = list(request.prompt_token_ids)
    resumed = list(request.resume_token_ids)
    error = (
        check_request_id(request.request_id)
        or check_prompt(prompt_ids, limits, num_more_tokens=len(resumed))
        or check_sampling(request.sampling, limits)
        or _check_salt(request.cache_salt)
        or _check_shape(request)
        or _check_adapter(request.adapter)
    )
    if error:
        return error
    if resumed and max(resumed) >= limits.vocab_size:
        return f"resume_token_ids holds a token id >= the vocabulary size {limits.vocab_size}"
    if len(request.resume_text) > MAX_CHARS_PER_TOKEN * len(resumed):
        return f"resume_text must be at most {MAX_CHARS_PER_TOKEN} characters a resumed token"
    if request.first_token_id >= limits.vocab_size:
        return f"first_token_id must be below the vocabulary size {limits.vocab_size}"
    if len(request.first_text) > MAX_FIRST_TEXT_CHARS:
        return f"first_text must be at most {MAX_FIRST_TEXT_CHARS} characters"
    if request.HasField("kv_handle"):
        return check_kv_handle(request.kv_handle, len(prompt_ids), limits) or _check_capability(request.kv_capability)
    return ""


def _check_shape(request: worker_pb2.DecodeRequest) -> str:
    """A decode continues a prefill worker's first token (with or without its KV), or runs here from the
    prompt (``local_prefill``), possibly resuming a migrated stream; max_tokens counts every token."""
    num_resumed = len(request.resume_token_ids)
    if request.local_prefill:
        if request.HasField("kv_handle") or request.first_token_id or request.first_text:
            return "a local prefill carries no kv_handle, first_token_id or first_text (no prefill worker ran)"
        if request.sampling.max_tokens < num_resumed + 1:
            return "max_tokens must be at least 1" + (" more than resume_token_ids" if num_resumed else "")
        return ""
    if num_resumed or request.resume_text:
        return "resume_token_ids and resume_text come with local_prefill (the resuming engine computes the prompt)"
    if request.sampling.max_tokens < 2:
        return "max_tokens must be at least 2 (the first token came from the prefill worker)"
    return ""


def check_prefetch(request: worker_pb2.PrefetchKVRequest, limits: ModelLimits) -> str:
    error = check_request_id(request.request_id)
    if error:
        return error
    if not _HOST_PORT.fullmatch(request.kv_address):
        return "kv_address must be host:port"
    if not 0 < request.num_prompt_tokens < limits.max_model_len:
        return f"num_prompt_tokens must be in [1, {limits.max_model_len - 1}]"
    if request.num_decode_cached_tokens > request.num_prompt_tokens:
        return "num_decode_cached_tokens must be at most num_prompt_tokens"
    return _check_capability(request.kv_capability) or _check_adapter(request.adapter)


def _check_capability(capability: str) -> str:
    if not kv_capability.well_formed(capability):
        return f"kv_capability must be {kv_capability.NUM_HEX_CHARS} lowercase hex characters"
    return ""


def check_abort(request: worker_pb2.AbortRequest) -> str:
    return check_request_id(request.request_id)


def _check_adapter(adapter: str) -> str:
    """Empty (the base model) or an engine name, ``NAME@VERSION`` (tandem.common.adapters)."""
    if not adapter:
        return ""
    try:
        split_engine_name(adapter)
    except ValueError:
        return "adapter must be an adapter's engine name, NAME@VERSION"
    return ""


def _check_salt(cache_salt: str) -> str:
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        return f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters"
    return ""
