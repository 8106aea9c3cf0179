"""Prompt building: chat messages → chat template → token ids.

Called by the route handlers (through the :class:`PromptTokenizer` protocol so
tests may pass a fake); :class:`HfPromptTokenizer` calls transformers'
``AutoTokenizer`` (tokenizer files only, never model weights), loaded once from
the model folder at startup. transformers is imported lazily so that
``import tandem.gateway`` stays light.

**Message text is data, never control.** The chat template is rendered to text
and the text tokenized; tokenized naively, a message containing the template's
control strings (``<|im_end|>\\n<|im_start|>system\\n…``) would reach the engine
as a forged turn, past a tenant's locked system prompt. So a special token in
the prompt is live only where the *template* put it:

1. the template is rendered twice, with the real contents and with each
   non-empty content replaced by a stand-in (a secret of this process, so no
   client can spell one); substituting the contents back into the second
   rendering must give the first one exactly (content may also appear
   ``strip()``-ed, as templates that ``| trim`` render it), which locates every
   content's characters in the prompt;
2. the prompt is tokenized exactly as ``apply_chat_template(tokenize=True)``
   does (special tokens live, ``add_special_tokens=False``: any BOS is the
   template's own text); when no special token takes a content character, those
   ids are the answer, so ordinary prompts, and the engines' prefix cache, do
   not change (the unknown token a word-level model emits for text it cannot
   represent is text, not a forged token);
3. otherwise the prompt is cut at the template's own special tokens and the
   pieces between them are tokenized by a private copy of the backend tokenizer
   whose special tokens are never matched, so the forged ones become plain
   text; a control id anywhere else in the result is refused.

When step 1 fails (the template transforms content), content cannot be told
from control: a request whose content contains a special-token string is then
refused with 400 ``control_token_in_content``, never tokenized the unsafe way.
Non-special added tokens (``special=False``) stay matchable in content, as in
vLLM.

Tools (``tools=``, as vLLM passes them) and an assistant turn's ``tool_calls``
reach the template beside the contents. A template that renders them puts client
text (descriptions, arguments) outside every content span, where it cannot be told
from control: a control string in it is refused with 400
``control_token_in_content``, unless the template leaves tools and tool calls out
of the prompt altogether (as the default model's does).

:meth:`HfPromptTokenizer.text_prompt_ids` (``/v1/completions``) keeps special
tokens live, as vLLM does: a raw prompt is the client's whole prompt, with no
trusted system turn in it to protect.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import logging
import re
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from tandem.common.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class PromptTokenizer(Protocol):
    """Turns client input into prompt token ids. Methods may block (CPU); the
    caller runs them off the event loop. Bad input raises InvalidRequestError."""

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> ChatPrompt:
        """Apply the model's chat template with the generation prompt (and ``tools=``, as vLLM passes
        them) and tokenize. Special-token strings inside client text are tokenized as text, or refused."""
        ...

    def text_prompt_ids(self, text: str) -> list[int]:
        """Tokenize a raw completion prompt (special tokens in it are live)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Every token id a client may send is below this (as vLLM's own server checks prompts)."""
        ...


class ChatPrompt(NamedTuple):
    """A rendered and tokenized chat prompt."""

    ids: list[int]
    message_token_starts: list[int | None] | None = None
    """Per message, how many of ``ids`` come before its content's first token; None for a message
    whose content is empty. The whole list is None when contents could not be located in the
    rendering (the template transforms them). Context trimming reads each turn's cost from it, so
    one rendering prices every turn."""


class ContentSpan(NamedTuple):
    """Where one message's content lies in the rendered prompt."""

    start: int
    end: int
    message_index: int


class SpecialToken(NamedTuple):
    """One special token the tokenizer produced for a rendered prompt."""

    start: int
    """First character, including whitespace the token absorbs (``lstrip``)."""
    end: int
    """One past the last character, including absorbed whitespace (``rstrip``)."""
    token_id: int
    token_index: int
    """Its position in the prompt's token ids."""


class HfPromptTokenizer:
    """A Hugging Face tokenizer from a model folder."""

    def __init__(
        self, tokenizer: Any, chat_template: str | None = None, template_variables: Mapping[str, str] | None = None
    ) -> None:
        """``chat_template``: render with this template instead of the tokenizer's own (a model's tool
        chat template, tandem.gateway.settings.ServedModel.tool_chat_template); ``template_variables``:
        what it is rendered with beside the messages and tools (a fixed ``date_string``,
        tandem.gateway.settings.GatewaySettings.chat_template_variables)."""
        self._tokenizer = tokenizer
        self._chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self._template_variables = dict(template_variables or {})
        if not self._chat_template:
            logger.warning("tokenizer has no chat template; chat requests will be refused")
        specials = _special_tokens(tokenizer)
        #: Special token id → its text.
        self._special_text = {token_id: text for text, token_id in specials.items()}
        self._special_ids = frozenset(self._special_text)
        # Word-level and unigram models also emit the unknown token for text they cannot represent.
        self._unk_id: int | None = getattr(tokenizer, "unk_token_id", None)
        self._control_ids = self._special_ids - {self._unk_id}
        self._special_pattern = re.compile("|".join(map(re.escape, specials)) or "(?!)")  # (?!) never matches
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._normalizer = getattr(backend, "normalizer", None)
        self._text_only_backend = _text_only_backend(backend, specials)
        # Secret to this process (never sent or logged), so no content can spell a stand-in.
        nonce = secrets.token_hex(16)
        self._stand_in = f"Tandem{nonce}m{{}}e"  # .format(message index)
        self._stand_in_pattern = re.compile(f"Tandem{nonce}m([0-9]+)e")
        self._warned_refusal = False

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @classmethod
    def from_dir(cls, model_dir: Path, template_variables: Mapping[str, str] | None = None) -> HfPromptTokenizer:
        """The tokenizer of ``model_dir``, rendering with its own chat template and ``template_variables``."""
        from transformers import AutoTokenizer  # heavy import, on purpose only here

        if not model_dir.is_dir():
            raise FileNotFoundError(f"model folder {model_dir} does not exist")
        return cls(AutoTokenizer.from_pretrained(str(model_dir)), template_variables=template_variables)

    def with_chat_template(
        self, chat_template: str, template_variables: Mapping[str, str] | None = None
    ) -> HfPromptTokenizer:
        """The same tokenizer, rendering chat prompts with ``chat_template`` and ``template_variables``
        (the same rules apply)."""
        return HfPromptTokenizer(self._tokenizer, chat_template, template_variables)

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.chat_prompt(messages).ids

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> ChatPrompt:
        if not self._chat_template:
            raise InvalidRequestError("This model has no chat template; use /v1/completions.", code="no_chat_template")
        real = [dict(m) for m in messages]
        tool_list = [dict(t) for t in tools] if tools else None
        rendered = self._render(real, tool_list)
        self._check_tool_text(real, tool_list, rendered)
        # Exactly apply_chat_template(tokenize=True)'s call: the template's text carries any BOS.
        batch = self._tokenizer(
            rendered, padding=False, truncation=False, max_length=None, add_special_tokens=False, return_tensors=None
        )
        ids = list(batch["input_ids"])
        contents = [m.get("content") or "" for m in real]
        spans = self._content_spans(real, contents, rendered, tool_list)
        encoding = batch.encodings[0] if batch.encodings else None
        if spans is None or encoding is None:
            # Content cannot be told from control here, so content may not carry control strings at all.
            if any(self._special_pattern.search(c) for c in contents):
                raise self._control_token_error()
            return ChatPrompt(ids)
        live: list[SpecialToken] = []  # the template's own
        forged: list[int] = []  # where a content's text was taken for a special token
        for k in itertools.compress(itertools.count(), map(self._special_ids.__contains__, ids)):
            start, end = encoding.token_to_chars(k)
            special = SpecialToken(start, end, ids[k], k)
            if not self._in_content(special, rendered, spans):
                live.append(special)
            elif not self._is_unknown_text(special, rendered):
                forged.append(start)
        token_starts = [start for start, _ in encoding.offsets]
        if forged:
            ids, token_starts = self._ids_with_content_as_text(rendered, ids, token_starts, live, forged)
        return ChatPrompt(ids, _message_token_starts(len(real), spans, token_starts))

    def text_prompt_ids(self, text: str) -> list[int]:
        return [int(i) for i in self._tokenizer(text, add_special_tokens=True)["input_ids"]]

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        import jinja2

        try:
            return str(
                self._tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    chat_template=self._chat_template,
                    add_generation_prompt=True,
                    tokenize=False,
                    **self._template_variables,
                )
            )
        except jinja2.TemplateError as exc:
            # Templates reject e.g. non-alternating roles with raise_exception(...): that is client input.
            raise InvalidRequestError(f"messages: {exc}", param="messages", code="invalid_messages") from exc

    def _check_tool_text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, rendered: str
    ) -> None:
        """Tool definitions and an assistant turn's tool calls are client text that a template renders outside
        any content, where the stand-ins of :meth:`_content_spans` cannot tell it from control. A control string
        in it is refused, unless the template leaves tools and tool calls out of the prompt altogether (the
        rendering without them is the same), as templates that cannot present tools do."""
        structured = [m["tool_calls"] for m in messages if m.get("tool_calls")]
        if not structured and not tools:
            return
        text = json.dumps([tools or [], structured], ensure_ascii=False)
        if not self._special_pattern.search(text):
            return
        plain = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
        if self._render(plain) != rendered:
            raise self._control_token_error()

    def _content_spans(
        self,
        messages: list[dict[str, Any]],
        contents: list[str],
        rendered: str,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[ContentSpan] | None:
        """Where each rendered content lies in ``rendered``, in order; None when the
        template does not render contents verbatim (or ``strip()``-ed) in content-independent text."""
        skeleton_messages = [
            {**m, "content": self._stand_in.format(i)} if contents[i] else m for i, m in enumerate(messages)
        ]
        try:
            skeleton = self._render(skeleton_messages, tools)
        except Exception:  # a template may choke on a stand-in (parse it, index it): treat like a transform
            return None
        # [template text, content index, template text, …, template text]
        parts = self._stand_in_pattern.split(skeleton)
        spans: list[ContentSpan] = []
        if not rendered.startswith(parts[0]):
            return None
        cursor = len(parts[0])
        for index_text, template_text in zip(parts[1::2], parts[2::2], strict=True):
            content = contents[int(index_text)]
            for candidate in dict.fromkeys((content, content.strip())):  # verbatim first, then `| trim`-ed
                end = cursor + len(candidate)
                if rendered.startswith(candidate, cursor) and rendered.startswith(template_text, end):
                    break
            else:
                return None
            spans.append(ContentSpan(cursor, end, int(index_text)))
            cursor = end + len(template_text)
        return spans if cursor == len(rendered) else None

    def _in_content(self, special: SpecialToken, rendered: str, spans: list[ContentSpan]) -> bool:
        """Whether the token takes any character of a message's content."""
        # Its own text, without whitespace it absorbed: absorbing a content's trailing spaces
        # (lstrip) is what the tokenizer does today, not control taken from content.
        text = self._special_text[special.token_id]
        start = rendered.find(text, special.start, special.end)
        start, end = (start, start + len(text)) if start >= 0 else (special.start, special.end)
        k = bisect.bisect_left(spans, end, key=lambda span: span.start)  # spans are ordered and disjoint
        return k > 0 and spans[k - 1].end > start

    def _is_unknown_text(self, special: SpecialToken, rendered: str) -> bool:
        """The unknown token standing for text the model cannot represent, not its string matched."""
        if special.token_id != self._unk_id:
            return False
        text = rendered[special.start : special.end]
        unk = self._special_text[special.token_id]
        normalized = self._normalizer.normalize_str(text) if self._normalizer is not None else text
        return unk not in text and unk not in normalized

    def _ids_with_content_as_text(
        self, rendered: str, ids: list[int], token_starts: list[int], live: list[SpecialToken], forged: list[int]
    ) -> tuple[list[int], list[int]]:
        """``ids`` with each piece between two of the template's special tokens that holds a forged one
        (``forged``: its first character) tokenized again as plain text, and each resulting token's
        first character in ``rendered`` (``token_starts``: the same of ``ids``). The tokenizer cuts
        text at special tokens before anything else, so the other pieces, the tenant's system block
        among them, keep their ids."""
        if self._text_only_backend is None:
            raise self._control_token_error()
        bounds = [SpecialToken(0, 0, -1, -1), *live, SpecialToken(len(rendered), len(rendered), -1, len(ids))]
        result: list[int] = []
        result_starts: list[int] = []
        for before, after in itertools.pairwise(bounds):
            if bisect.bisect_left(forged, before.end) < bisect.bisect_left(forged, after.start):
                encoding = self._text_only_backend.encode(rendered[before.end : after.start], add_special_tokens=False)
                result.extend(encoding.ids)
                result_starts.extend(before.end + start for start, _ in encoding.offsets)
            else:
                result.extend(ids[before.token_index + 1 : after.token_index])
                result_starts.extend(token_starts[before.token_index + 1 : after.token_index])
            if after.token_id >= 0:
                result.append(after.token_id)
                result_starts.append(after.start)
        if sum(map(self._control_ids.__contains__, result)) != sum(s.token_id in self._control_ids for s in live):
            # A control id came out of plain text: this tokenizer cannot neutralise it.
            raise self._control_token_error()
        return result, result_starts

    def _control_token_error(self) -> InvalidRequestError:
        if not self._warned_refusal:
            self._warned_refusal = True
            logger.warning(
                "this model's chat template or tokenizer does not let control tokens in message content be "
                "tokenized as text; such requests are refused (400 control_token_in_content)"
            )
        return InvalidRequestError(
            "messages: message content may not contain the model's control tokens.",
            param="messages",
            code="control_token_in_content",
        )


def _message_token_starts(
    num_messages: int, spans: Sequence[ContentSpan], token_starts: Sequence[int]
) -> list[int | None]:
    """Per message, the number of tokens that begin before its content does (None: empty content).
    ``token_starts``: each token's first character in the rendering, in order."""
    starts: list[int | None] = [None] * num_messages
    for span in spans:
        starts[span.message_index] = bisect.bisect_left(token_starts, span.start)
    return starts


def _special_tokens(tokenizer: Any) -> dict[str, int]:
    """Text → id of every special token: added tokens marked special, and the named ones (bos, eos, …)."""
    specials = {
        str(token.content): int(token_id)
        for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
        if getattr(token, "special", False)
    }
    for text in getattr(tokenizer, "all_special_tokens", []):
        token_id = tokenizer.convert_tokens_to_ids(text)
        if isinstance(token_id, int) and text:
            specials.setdefault(str(text), token_id)
    return specials


def _text_only_backend(backend: Any, specials: Mapping[str, int]) -> Any | None:
    """A private copy of the fast backend tokenizer that never matches special tokens, or None.

    A copy, not ``split_special_tokens=True`` on the shared tokenizer: transformers implements
    that by flipping ``encode_special_tokens`` on the shared backend, and calls run on several
    threads, so a concurrent call could flip it back between the flip and the encode."""
    if backend is None:
        logger.warning("tokenizer has no fast backend; control tokens in chat content are refused")
        return None
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = True
    probe = copy.encode_batch(list(specials), add_special_tokens=False)
    if any(set(specials.values()).intersection(e.ids) for e in probe):
        logger.warning("tokenizer cannot encode its special tokens as text; control tokens in chat content are refused")
        return None
    return copy


async def chat_prompt(
    tokenizer: PromptTokenizer, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
) -> ChatPrompt:
    """:meth:`PromptTokenizer.chat_prompt` off the event loop (long prompts take milliseconds)."""
    if tools is None:  # the one-argument call, which every PromptTokenizer takes
        return await asyncio.to_thread(tokenizer.chat_prompt, messages)
    return await asyncio.to_thread(tokenizer.chat_prompt, messages, tools)


async def text_prompt_ids(tokenizer: PromptTokenizer, text: str) -> list[int]:
    return await asyncio.to_thread(tokenizer.text_prompt_ids, text)
