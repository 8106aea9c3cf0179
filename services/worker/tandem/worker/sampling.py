"""Maps ``tandem.v1.SamplingOptions`` to vLLM ``SamplingParams``. Called by
:mod:`service` for both roles."""

from __future__ import annotations

from typing import Any

from tandem.v1 import common_pb2


def sampling_kwargs(options: common_pb2.SamplingOptions, *, max_tokens: int) -> dict[str, Any]:
    """Keyword arguments for ``SamplingParams``; unset options keep vLLM's defaults."""
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": options.ignore_eos}
    for name in ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "seed"):
        if options.HasField(name):
            kwargs[name] = getattr(options, name)
    if options.stop:
        kwargs["stop"] = list(options.stop)
    return kwargs
