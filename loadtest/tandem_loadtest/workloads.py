"""Workloads: what each request asks. One instance per tenant, so that each
tenant has its own document, chat sessions and random stream.

Called by :mod:`tandem_loadtest.runner` (``next_request`` before sending,
``on_complete`` after the response ends, both on the event loop); calls
:mod:`tandem_loadtest.text` and numpy.

* ``synthetic``: random prompts from input/output length distributions.
* ``doc-qa``: a long static document per tenant and a different question per
  request. ``order`` is ``static-first`` (document, then question: the prefix
  is shared and cacheable), ``variable-first`` (question, then document: no
  shared prefix) or ``both`` (alternating; the report shows them apart).
* ``chat``: multi-turn sessions whose history (real answers included) grows
  each turn.
* ``mixed``: mostly short prompts with some long ones, to expose prefill
  interference on the short requests' ITL.
* ``file``: replays a JSONL file of ``{"prompt": ..., "output_tokens": N}``.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from tandem_loadtest.distributions import LengthDist
from tandem_loadtest.text import words

Endpoint = Literal["chat", "completions"]

SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. ``label`` names the workload variant in reports."""

    label: str
    max_tokens: int
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    #: Chat sessions: which session this turn belongs to (for on_complete).
    session_id: str | None = None
    #: Rough input size the workload aimed at (words); the report uses usage.prompt_tokens.
    approx_input_tokens: int = 0

    @property
    def endpoint(self) -> Endpoint:
        return "chat" if self.messages is not None else "completions"


class Workload(ABC):
    """Makes requests for one tenant."""

    name: str

    @abstractmethod
    def next_request(self, rng: np.random.Generator) -> RequestSpec | None:
        """The next request, or None when the workload cannot issue one right now
        (every chat session is waiting for its answer and no new one may start)."""

    def on_complete(self, spec: RequestSpec, text: str, ok: bool) -> None:  # noqa: B027
        """The response to ``spec`` ended; ``text`` is what streamed back. Default: nothing."""


@dataclass
class SyntheticWorkload(Workload):
    input_tokens: LengthDist
    output_tokens: LengthDist
    name: str = "synthetic"
    _counter: int = 0

    def next_request(self, rng: np.random.Generator) -> RequestSpec:
        self._counter += 1
        n_in = self.input_tokens.sample(rng)
        # A unique head keeps prompts apart so that prefix caching cannot help.
        head = f"Request {rng.integers(1 << 40)}-{self._counter}:"
        return RequestSpec(
            label=self.name,
            max_tokens=self.output_tokens.sample(rng),
            messages=[{"role": "user", "content": f"{head} {words(rng, max(0, n_in - 4))}"}],
            approx_input_tokens=n_in,
        )


DocOrder = Literal["static-first", "variable-first", "both"]


@dataclass
class DocQAWorkload(Workload):
    """Shared-prefix document Q&A: the document is static per tenant."""

    doc_tokens: int
    question_tokens: LengthDist
    output_tokens: LengthDist
    order: DocOrder = "both"
    tenant_seed: int = 0
    name: str = "doc-qa"
    _document: str = ""
    _counter: int = 0

    def __post_init__(self) -> None:
        doc_rng = np.random.default_rng(self.tenant_seed)
        self._document = f"Document {self.tenant_seed}. " + words(doc_rng, self.doc_tokens)

    @property
    def document(self) -> str:
        return self._document

    def next_request(self, rng: np.random.Generator) -> RequestSpec:
        self._counter += 1
        if self.order == "both":
            order = "static-first" if self._counter % 2 else "variable-first"
        else:
            order = self.order
        question = f"Question {self._counter}: what does the document say about " + words(
            rng, max(1, self.question_tokens.sample(rng) - 8)
        ) + "?"
        if order == "static-first":
            content = f"Document:\n{self._document}\n\n{question}"
        else:
            content = f"{question}\n\nDocument:\n{self._document}"
        return RequestSpec(
            label=f"{self.name}/{order}",
            max_tokens=self.output_tokens.sample(rng),
            messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": content}],
            approx_input_tokens=self.doc_tokens + len(question.split()),
        )


@dataclass
class _Session:
    session_id: str
    messages: list[dict[str, str]]
    turns_left: int
    busy: bool = False


@dataclass
class ChatWorkload(Workload):
    """Multi-turn chat: each turn sends the whole history plus a new user message."""

    turns: LengthDist
    user_tokens: LengthDist
    output_tokens: LengthDist
    #: Sessions open at once; an arrival with every session busy starts a new one up to this.
    max_sessions: int = 8
    name: str = "chat"
    tenant: str = ""
    _sessions: dict[str, _Session] = field(default_factory=dict)
    _num_started: int = 0

    def next_request(self, rng: np.random.Generator) -> RequestSpec | None:
        session = next((s for s in self._sessions.values() if not s.busy), None)
        if session is None:
            if len(self._sessions) >= self.max_sessions:
                return None
            self._num_started += 1
            sid = f"{self.tenant or 'chat'}-s{self._num_started}"
            session = _Session(sid, [{"role": "system", "content": SYSTEM_PROMPT}], self.turns.sample(rng))
            self._sessions[sid] = session
        turn = len(session.messages) // 2 + 1
        user = f"Turn {turn}: tell me about " + words(rng, max(1, self.user_tokens.sample(rng) - 5))
        session.messages.append({"role": "user", "content": user})
        session.busy = True
        session.turns_left -= 1
        return RequestSpec(
            label=self.name,
            max_tokens=self.output_tokens.sample(rng),
            messages=list(session.messages),
            session_id=session.session_id,
            approx_input_tokens=sum(len(m["content"].split()) for m in session.messages),
        )

    def on_complete(self, spec: RequestSpec, text: str, ok: bool) -> None:
        session = self._sessions.get(spec.session_id or "")
        if session is None:
            return
        if not ok or session.turns_left <= 0:
            del self._sessions[session.session_id]  # a broken or finished conversation ends
            return
        session.messages.append({"role": "assistant", "content": text})
        session.busy = False

    def history_lengths(self) -> dict[str, int]:
        """Messages per open session (tests)."""
        return {sid: len(s.messages) for sid, s in self._sessions.items()}


@dataclass
class MixedWorkload(Workload):
    """Short interactive prompts with a share of long ones."""

    long_fraction: float
    long_input_tokens: LengthDist
    long_output_tokens: LengthDist
    short_input_tokens: LengthDist
    short_output_tokens: LengthDist
    name: str = "mixed"
    _counter: int = 0

    def next_request(self, rng: np.random.Generator) -> RequestSpec:
        self._counter += 1
        is_long = bool(rng.random() < self.long_fraction)
        n_in = (self.long_input_tokens if is_long else self.short_input_tokens).sample(rng)
        n_out = (self.long_output_tokens if is_long else self.short_output_tokens).sample(rng)
        head = f"Request {rng.integers(1 << 40)}-{self._counter}:"
        return RequestSpec(
            label=f"{self.name}/{'long' if is_long else 'short'}",
            max_tokens=n_out,
            messages=[{"role": "user", "content": f"{head} {words(rng, max(0, n_in - 4))}"}],
            approx_input_tokens=n_in,
        )


@dataclass
class FileWorkload(Workload):
    """Replays prompts from a JSONL file in order, cycling."""

    path: Path
    default_output_tokens: int = 64
    endpoint: Endpoint = "chat"
    name: str = "file"
    _items: list[dict[str, Any]] = field(default_factory=list)
    _next: int = 0

    def __post_init__(self) -> None:
        lines = Path(self.path).read_text().splitlines()
        self._items = [json.loads(line) for line in lines if line.strip()]
        if not self._items or any("prompt" not in item for item in self._items):
            raise ValueError(f"{self.path}: every line needs a 'prompt'")

    def next_request(self, rng: np.random.Generator) -> RequestSpec:
        item = self._items[self._next % len(self._items)]
        self._next += 1
        max_tokens = int(item.get("output_tokens") or item.get("max_tokens") or self.default_output_tokens)
        prompt = str(item["prompt"])
        if self.endpoint == "chat":
            return RequestSpec(self.name, max_tokens, messages=[{"role": "user", "content": prompt}],
                               approx_input_tokens=len(prompt.split()))
        return RequestSpec(self.name, max_tokens, prompt=prompt, approx_input_tokens=len(prompt.split()))


_IN_256 = LengthDist("fixed", 256)
_OUT_64 = LengthDist("fixed", 64)
_QUESTION_24 = LengthDist("fixed", 24)
_CHAT_TURNS = LengthDist("uniform", 3, 6)
_CHAT_USER_32 = LengthDist("fixed", 32)
_LONG_IN_2000 = LengthDist("fixed", 2000)
_LONG_OUT_16 = LengthDist("fixed", 16)


@dataclass(frozen=True)
class WorkloadOptions:
    """Knobs of every workload kind (CLI flags); one set per run."""

    input_tokens: LengthDist = _IN_256
    output_tokens: LengthDist = _OUT_64
    doc_tokens: int = 1500
    doc_order: DocOrder = "both"
    question_tokens: LengthDist = _QUESTION_24
    chat_turns: LengthDist = _CHAT_TURNS
    chat_user_tokens: LengthDist = _CHAT_USER_32
    chat_max_sessions: int = 8
    long_fraction: float = 0.2
    long_input_tokens: LengthDist = _LONG_IN_2000
    long_output_tokens: LengthDist = _LONG_OUT_16
    prompts_file: Path | None = None
    prompts_endpoint: Endpoint = "chat"


WORKLOAD_KINDS = ("synthetic", "doc-qa", "chat", "mixed", "file")


def make_workload(kind: str, options: WorkloadOptions, *, tenant: str, tenant_seed: int) -> Workload:
    """Build one tenant's workload of ``kind`` from the run's options."""
    o = options
    if kind == "synthetic":
        return SyntheticWorkload(o.input_tokens, o.output_tokens)
    if kind == "doc-qa":
        return DocQAWorkload(o.doc_tokens, o.question_tokens, o.output_tokens, o.doc_order, tenant_seed)
    if kind == "chat":
        return ChatWorkload(o.chat_turns, o.chat_user_tokens, o.output_tokens, o.chat_max_sessions, tenant=tenant)
    if kind == "mixed":
        return MixedWorkload(o.long_fraction, o.long_input_tokens, o.long_output_tokens, o.input_tokens,
                             o.output_tokens)
    if kind == "file":
        if o.prompts_file is None:
            raise ValueError("the 'file' workload needs --prompts-file")
        return FileWorkload(o.prompts_file, int(o.output_tokens.mean), o.prompts_endpoint)
    raise ValueError(f"unknown workload {kind!r}; choose from {', '.join(WORKLOAD_KINDS)}")
