"""Facts about ``tandem.v1.SamplingOptions`` that both ends of it need, read off
the message itself so that the gateway (which fills it) and the worker (which
turns it into vLLM's ``SamplingParams``) cannot disagree."""

from __future__ import annotations

from tandem.v1 import common_pb2

#: The scalar options a client may leave unset (``optional`` in the proto): unset means
#: "the model's default, else vLLM's", so the gateway sends only what the client set.
OPTIONAL_SCALAR_FIELDS: tuple[str, ...] = tuple(
    f.name for f in common_pb2.SamplingOptions.DESCRIPTOR.fields if f.has_presence and f.message_type is None
)
