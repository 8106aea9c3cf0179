"""Agent-like ``previous_response_id`` chains through the real local stack (``make bench-chain``).

A local stack as ``make run`` starts it (Redis, the Ray Serve router, real vLLM prefill and decode
workers, the gateway as a process of its own), and ``--tenants`` tenants (8), each with a key of its own,
running a chain of ``--turns`` turns (20) on ``/v1/responses`` at once, through the real ``openai`` SDK,
streamed. Each turn sends only its new input (a tool result or a user's next request, ~50 tokens) with
``previous_response_id``; the gateway reads the chain from Redis and the router should place the turn
where the previous turn's KV is, so the prompt's prefix is read from the engine's cache.

Each turn also resends the tenant's ``instructions`` (as the OpenAI Agents SDK does; OpenAI's API does not
carry them over), ~1,500 tokens of agent rules, different per tenant. Why so long: the engines cache
whole KV blocks only (vLLM's CPU block is 128 tokens), so a turn can read at most the previous context
less its last partial block from the cache, and 90 % of it needs a context of about 1,350 tokens or
more; agents' system prompts and tool definitions are of that size anyway.

After turn ``--restart-after`` (10) the gateway process is SIGKILLed and started again (the chains live
in Redis, not in the gateway); the chains then go on from the responses stored before the kill.

Each engine gets ``--kv-cache-gib`` (2) of KV cache: every chain's context must stay cached until its
next turn, so the tenants' contexts together (8 × ~2,900 tokens at turn 20, ~46 KB a token for the
default model in float32) must fit with room to spare; with the local stack's 1 GiB (23,296 tokens) the last turns
evict each other's prefixes and wait for budget (``no_capacity``).

Per turn it prints the time to the first text delta (p50 over the tenants) and the share of the previous
context (the previous turn's input and output tokens) that this turn read from the cache
(``usage.input_tokens_details.cached_tokens``). Ends with one line:

    bench-chain: turn20_ttft_p50_ratio_vs_turn2=… cached_share_p50=… restart_survived=yes|no

(the last turn's TTFT p50 over turn 2's, whatever ``--turns``; the cached share over every turn from
the second on; ``restart_survived``: every chain continued after the restart, its next turn answered
with the whole chain in its prompt). A line before it counts the turns that failed (a failed turn ends
its chain; the exit status is then 1). Targets: ratio ≤ 1.2, share ≥ 0.9, yes.

The baseline, in the same run once the stack has stopped (``--no-baseline`` skips it): plain vLLM's own
OpenAI server on the same model with prefix caching and the same engine settings (float32, eager, the
same context length and KV size, one core: what one of Tandem's engines is), driven the same way, the
same tenants and turns at once, each turn sending the whole conversation on ``/v1/chat/completions``
(what a client of a stateless server sends; the same chat turns, so the same prompt tokens as the chain
Tandem read from Redis). Its per-turn TTFT p50 is printed beside Tandem's, and a line before the last
gives its ratio and cached share: how much a turn's TTFT grows with the context on this host when every
earlier block is read from the cache and nothing of Tandem's is in the way.
"""

from __future__ import annotations

import argparse
import copy
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import openai
from openai.types.chat import ChatCompletionMessageParam

from tandem.local.plain_vllm import start_plain_vllm, stop_plain_vllm
from tandem.local.stack import LocalStack, StackConfig, free_port

MAX_OUTPUT_TOKENS = 16
#: Agent rules, ~72 tokens each (SmolLM2's tokenizer): 21 of them make ~1,500 tokens of instructions.
RULE = (
    "Rule {i} for {tenant}: when a tool returns, quote its figure exactly, name the city 🏙 and its "
    "country, answer in one line; never invent a value; règle {i}: sois bref; 规则 {i}: 简短回答."
)
CITIES = ("Zürich", "東京", "São Paulo", "Kraków", "Reykjavík", "Montréal", "İstanbul", "Москва")


T = TypeVar("T", bound="Turn")


def instructions_for(tenant: str, num_rules: int) -> str:
    return " ".join(RULE.format(i=i, tenant=tenant) for i in range(num_rules))


def input_for(tenant_index: int, turn: int) -> str:
    """A turn's new input: a tool's result (odd turns) or the user's next request (even turns)."""
    city = CITIES[(tenant_index + turn) % len(CITIES)]
    if turn % 2:
        return (
            f'Tool get_weather returned {{"city": "{city}", "temp_c": {turn - 5}, "wind_kmh": {3 * turn}, '
            f'"sky": "nuageux ☁️"}} for call {turn}. Summarise it.'
        )
    return f"Turn {turn}: now check the weather in {city} and tell me whether to take an umbrella ☔."


@dataclass
class Turn:
    ok: bool
    ttft_s: float = float("nan")
    #: The previous turn's context read from the cache (None on a chain's first turn, or on a failure).
    cached_share: float | None = None
    #: Input and output tokens: the context the next turn should find cached.
    context_tokens: int = 0
    #: This turn's prompt held the whole previous context (the chain was read, not cut).
    chain_whole: bool = False
    response_id: str = ""
    error: str = ""


def run_turn(client: openai.OpenAI, model: str, instructions: str, text: str, previous: Turn | None) -> Turn:
    start = time.perf_counter()
    ttft_s = float("nan")
    final = None
    try:
        stream = client.responses.create(
            model=model,
            instructions=instructions,
            input=text,
            previous_response_id=previous.response_id if previous is not None else None,
            max_output_tokens=MAX_OUTPUT_TOKENS,
            temperature=0,
            stream=True,
        )
        for event in stream:
            if event.type == "response.output_text.delta" and ttft_s != ttft_s:
                ttft_s = time.perf_counter() - start
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
            elif event.type == "response.failed":
                error = event.response.error
                return Turn(
                    ok=False, error=f"response.failed: {error.code if error else ''} {error.message if error else ''}"
                )
    except openai.APIError as exc:
        return Turn(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
    if final is None or final.usage is None:
        return Turn(ok=False, error="no final response")
    usage = final.usage
    turn = Turn(
        ok=final.previous_response_id == (previous.response_id if previous is not None else None),
        ttft_s=ttft_s,
        context_tokens=usage.input_tokens + usage.output_tokens,
        response_id=final.id,
    )
    if previous is not None:
        turn.cached_share = usage.input_tokens_details.cached_tokens / previous.context_tokens
        turn.chain_whole = usage.input_tokens > previous.context_tokens
    return turn


@dataclass
class ChatTurn(Turn):
    """A turn of the baseline: the whole conversation so far, sent again (``messages``, answer included)."""

    messages: list[ChatCompletionMessageParam] | None = None


def run_chat_turn(
    client: openai.OpenAI, model: str, instructions: str, text: str, previous: ChatTurn | None
) -> ChatTurn:
    """The baseline's turn: the conversation so far and ``text`` on ``/v1/chat/completions``, streamed."""
    history: list[ChatCompletionMessageParam] = (
        [{"role": "system", "content": instructions}] if previous is None else previous.messages or []
    )
    messages: list[ChatCompletionMessageParam] = [*history, {"role": "user", "content": text}]
    start = time.perf_counter()
    ttft_s = float("nan")
    answer = ""
    usage = None
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=MAX_OUTPUT_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft_s != ttft_s:
                    ttft_s = time.perf_counter() - start
                answer += chunk.choices[0].delta.content
    except openai.APIError as exc:
        return ChatTurn(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
    if usage is None:
        return ChatTurn(ok=False, error="no usage")
    turn = ChatTurn(
        ok=True,
        ttft_s=ttft_s,
        context_tokens=usage.prompt_tokens + usage.completion_tokens,
        messages=[*messages, {"role": "assistant", "content": answer}],
    )
    if previous is not None:
        details = usage.prompt_tokens_details
        turn.cached_share = (details.cached_tokens or 0 if details is not None else 0) / previous.context_tokens
        turn.chain_whole = usage.prompt_tokens > previous.context_tokens
    return turn


def p50(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def run_chains(
    label: str,
    num_tenants: int,
    num_turns: int,
    run_one: Callable[[int, int, T | None], T],
    after_turn: Callable[[int], str] = lambda turn: "",
) -> list[list[T]]:
    """Every tenant's chain, turn by turn, the tenants' turns at once; a line per turn. ``run_one(k, turn,
    previous)`` runs tenant ``k``'s turn; ``after_turn(turn)`` may act between turns (its note goes on the
    next turn's line)."""
    chains: list[list[T]] = [[] for _ in range(num_tenants)]
    note = ""
    with ThreadPoolExecutor(max_workers=num_tenants) as pool:
        for turn in range(1, num_turns + 1):

            def step(k: int, turn: int = turn) -> T:
                previous = chains[k][-1] if chains[k] else None
                if previous is not None and not previous.ok:
                    broken = copy.copy(previous)
                    broken.error = "chain broken earlier"
                    return broken
                return run_one(k, turn, previous)

            results = list(pool.map(step, range(num_tenants)))
            for k, result in enumerate(results):
                chains[k].append(result)
                if result.error:
                    print(f"[bench-chain] {label} tenant {k} turn {turn}: {result.error}", flush=True)
            shares = [r.cached_share for r in results if r.cached_share is not None]
            print(
                f"{label} turn {turn:2d}: ok {sum(r.ok for r in results)}/{len(results)}"
                f" ttft_p50_ms={p50([r.ttft_s for r in results]) * 1000:7.0f}"
                f" context_p50_tokens={p50([float(r.context_tokens) for r in results]):5.0f}"
                f" cached_share_p50={p50(shares) if shares else float('nan'):.3f}"
                f" cached_share_min={min(shares) if shares else float('nan'):.3f}" + note,
                flush=True,
            )
            note = after_turn(turn)
    return chains


def ttft_p50_per_turn(chains: Sequence[Sequence[Turn]]) -> list[float]:
    return [p50([chain[i].ttft_s for chain in chains if chain[i].ok]) for i in range(len(chains[0]))]


def cached_share_p50(chains: Sequence[Sequence[Turn]]) -> float:
    shares = [t.cached_share for chain in chains for t in chain[1:] if t.cached_share is not None]
    return p50(shares) if shares else float("nan")


def run_baseline(
    config: StackConfig, tenants: list[str], instructions: list[str], num_turns: int
) -> list[list[ChatTurn]]:
    """The same chains on plain vLLM (see the module's docstring), once the stack has stopped."""
    port = free_port()
    print("[bench-chain] starting plain vLLM (prefix caching, the same engine settings) for the baseline", flush=True)
    proc, start_s = start_plain_vllm(
        config.model_dir,
        config.served_model_name,
        port,
        config.log_dir / "plain-vllm.log",
        max_model_len=config.max_model_len,
        kv_cache_bytes=config.kv_cache_bytes,
        extra_args=("--enable-prompt-tokens-details",),
    )
    print(f"[bench-chain] plain vLLM ready after {start_s:.1f} s", flush=True)
    try:
        # Plain vLLM has no keys; one client per tenant as above.
        clients = [
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=2, timeout=300)
            for _ in tenants
        ]
        return run_chains(
            "plain-vllm",
            len(tenants),
            num_turns,
            lambda k, turn, previous: run_chat_turn(
                clients[k], config.served_model_name, instructions[k], input_for(k, turn), previous
            ),
        )
    finally:
        stop_plain_vllm(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--restart-after", type=int, default=10, help="restart the gateway after this turn")
    parser.add_argument("--rules", type=int, default=21, help="agent rules in the instructions (~72 tokens each)")
    parser.add_argument("--prefill-workers", type=int, default=1)
    parser.add_argument("--decode-workers", type=int, default=1)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache of each engine")
    parser.add_argument("--no-baseline", action="store_true", help="skip the plain-vLLM baseline")
    args = parser.parse_args()
    if args.turns < 2 or not 1 <= args.restart_after < args.turns:
        parser.error("need --turns >= 2 and 1 <= --restart-after < --turns")
    config = StackConfig.with_free_ports(
        num_prefill_workers=args.prefill_workers,
        num_decode_workers=args.decode_workers,
        key_prefix=f"tandem-bench-chain-{uuid.uuid4().hex[:6]}",
        log_dir=Path(".run/bench-chain"),
        kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
    )
    tenants = [f"bench-chain-{k}" for k in range(args.tenants)]
    instructions = [instructions_for(t, args.rules) for t in tenants]
    stack = LocalStack(config, progress=lambda m: print(f"[bench-chain] {m}", flush=True))
    stack.start()
    restarted = False
    try:
        model = config.served_model_name
        clients = [
            openai.OpenAI(
                # The SDK's own retries (2): a 503 before the stream (no capacity yet) is retried after its
                # Retry-After, as any client of it would.
                base_url=f"{config.gateway_url}/v1",
                api_key=stack.create_tenant_key(t),
                max_retries=2,
                timeout=300,
            )
            for t in tenants
        ]

        def restart_gateway(turn: int) -> str:
            nonlocal restarted
            if turn != args.restart_after:
                return ""
            pid = stack.pid("gateway")
            stack.kill("gateway", signal.SIGKILL)
            stack.restart("gateway")
            restarted = True
            print(f"[bench-chain] gateway SIGKILLed (pid {pid}) and started again (pid {stack.pid('gateway')})")
            return " (after the gateway restart)"

        chains = run_chains(
            "tandem",
            len(tenants),
            args.turns,
            lambda k, turn, previous: run_turn(clients[k], model, instructions[k], input_for(k, turn), previous),
            restart_gateway,
        )
    finally:
        stack.stop()
    baseline = None if args.no_baseline else run_baseline(config, tenants, instructions, args.turns)
    at_restart = [chain for chain in chains if chain[args.restart_after - 1].ok]
    survived = (
        restarted
        and bool(at_restart)
        and all(c[args.restart_after].ok and c[args.restart_after].chain_whole for c in at_restart)
    )
    failed = [
        (tenants[k], i + 1)
        for k, chain in enumerate(chains)
        for i, t in enumerate(chain)
        if t.error and "earlier" not in t.error
    ]
    print(f"[bench-chain] failed turns: {len(failed)} {failed}")
    ttft = ttft_p50_per_turn(chains)
    ratio = ttft[-1] / ttft[1]
    if baseline is not None:
        plain = ttft_p50_per_turn(baseline)
        print("turn  tandem_ttft_p50_ms  plain_vllm_ttft_p50_ms  tandem/plain")
        for i, (ours, theirs) in enumerate(zip(ttft, plain, strict=True)):
            print(f"{i + 1:4d}  {ours * 1000:18.0f}  {theirs * 1000:22.0f}  {ours / theirs:12.2f}")
        print(
            f"bench-chain baseline: plain vLLM (prefix caching, one engine, the same chains at once) "
            f"turn{args.turns}_ttft_p50_ratio_vs_turn2={plain[-1] / plain[1]:.2f} "
            f"cached_share_p50={cached_share_p50(baseline):.3f}"
        )
    print(
        f"bench-chain: turn{args.turns}_ttft_p50_ratio_vs_turn2={ratio:.2f} "
        f"cached_share_p50={cached_share_p50(chains):.3f} "
        f"restart_survived={'yes' if survived else 'no'}"
    )
    if not all(t.ok for chain in chains for t in chain):
        sys.exit(1)


if __name__ == "__main__":
    main()
