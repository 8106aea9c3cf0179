"""Prompt building: chat messages → chat template → token ids.

Called by the route handlers (through the :class:`PromptTokenizer` protocol so
tests may pass a fake); :class:`HfPromptTokenizer` calls transformers'
``AutoTokenizer`` (tokenizer files only, never model weights), loaded once from
the model folder at startup. transformers is imported lazily so that
``import tandem.gateway`` stays light.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from tandem.common.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class PromptTokenizer(Protocol):
    """Turns client input into prompt token ids. Methods may block (CPU); the
    caller runs them off the event loop. Bad input raises InvalidRequestError."""

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Apply the model's chat template with the generation prompt and tokenize."""
        ...

    def text_prompt_ids(self, text: str) -> list[int]:
        """Tokenize a raw completion prompt."""
        ...


class HfPromptTokenizer:
    """A Hugging Face tokenizer from a model folder."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            logger.warning("tokenizer has no chat template; chat requests will be refused")

    @classmethod
    def from_dir(cls, model_dir: Path) -> HfPromptTokenizer:
        from transformers import AutoTokenizer  # heavy import, on purpose only here

        if not model_dir.is_dir():
            raise FileNotFoundError(f"model folder {model_dir} does not exist")
        return cls(AutoTokenizer.from_pretrained(str(model_dir)))

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        import jinja2

        if not getattr(self._tokenizer, "chat_template", None):
            raise InvalidRequestError("This model has no chat template; use /v1/completions.", code="no_chat_template")
        try:
            ids = self._tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except jinja2.TemplateError as exc:
            # Templates reject e.g. non-alternating roles with raise_exception(...): that is client input.
            raise InvalidRequestError(f"messages: {exc}", param="messages", code="invalid_messages") from exc
        return [int(i) for i in ids]

    def text_prompt_ids(self, text: str) -> list[int]:
        return [int(i) for i in self._tokenizer(text, add_special_tokens=True)["input_ids"]]


async def chat_prompt_ids(tokenizer: PromptTokenizer, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """:meth:`PromptTokenizer.chat_prompt_ids` off the event loop (long prompts take milliseconds)."""
    return await asyncio.to_thread(tokenizer.chat_prompt_ids, messages)


async def text_prompt_ids(tokenizer: PromptTokenizer, text: str) -> list[int]:
    return await asyncio.to_thread(tokenizer.text_prompt_ids, text)
