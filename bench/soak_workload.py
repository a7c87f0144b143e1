"""The soak's request mix and its clients: what each request sends, and what usage it received.

    kinds = mix(num_requests, seed)                     # one kind per request, deterministic
    outcome = await send(session, gateway_url, i, kind, key, model)

Kinds (weights in MIX): OpenAI chat plain / streamed / aborted after the first content chunk /
with a forced tool call, Anthropic messages plain / streamed, malformed bodies (each a 4xx), and
a prompt far over the context window (400). Every request carries `x-request-id: soak-<i>`, the
prefix of its usage record's id, so the ledger can be matched request by request.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

MIX = {"chat": 28, "stream": 22, "abort": 10, "tools": 10, "anthropic": 10,
       "anthropic_stream": 8, "bad": 10, "oversized": 2}
SYSTEM_PROMPTS = (  # shared prefixes: the prefix cache hits within a project, never across
    "You are a terse assistant for a hardware store. Answer in one short sentence.",
    "You are a travel agent. You name cities and airports, nothing else, in few words.",
    "You are a maths tutor. Reply with a number when you can, words when you must.",
)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
BAD_BODIES = (  # (content type, raw body): each a 4xx in the dialect's envelope
    b'{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}',  # cut-off JSON
    b'{"model": "MODEL"}',  # no messages
    b'{"model": "MODEL", "messages": "hello"}',  # wrong type
    b'{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}',
    b'{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}',
    b'[1, 2, 3]',
    b'\xff\xfe not utf-8',
)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one client saw. `usage` = (prompt, cached, completion) as the answer reported it,
    None when it carried none (an error, an aborted stream)."""

    index: int
    kind: str
    project: str
    status: int  # HTTP status; 0 when the connection failed
    usage: tuple[int, int, int] | None
    error: str = ""

    @property
    def request_id(self) -> str:
        return f"soak-{self.index}"


def mix(num_requests: int, seed: int) -> list[str]:
    """Every kind once (in MIX's order), then kinds drawn by weight."""
    rng = random.Random(seed)
    kinds, weights = zip(*MIX.items(), strict=True)
    drawn = rng.choices(kinds, weights=weights, k=max(0, num_requests - len(kinds)))
    return [*kinds, *drawn][:num_requests]


def _messages(index: int, rng: random.Random) -> list[dict[str, str]]:
    system = SYSTEM_PROMPTS[index % len(SYSTEM_PROMPTS)]
    words = " ".join(rng.choice(("red", "blue", "seven", "Paris", "bolt", "nine", "rain"))
                     for _ in range(rng.randrange(3, 30)))
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"Request {index}: {words}?"}]


async def send(session: aiohttp.ClientSession, url: str, index: int, kind: str, key: str,
               project: str, model: str, context_chars: int) -> Outcome:
    """One request of `kind`; never raises (a failure is an Outcome with status 0)."""
    rng = random.Random(index)
    headers = {"x-request-id": f"soak-{index}", "authorization": f"Bearer {key}"}
    max_tokens = rng.randrange(1, 12)
    try:
        if kind in ("anthropic", "anthropic_stream"):
            body = {"model": model, "max_tokens": max_tokens, "stream": kind == "anthropic_stream",
                    "system": SYSTEM_PROMPTS[index % len(SYSTEM_PROMPTS)],
                    "messages": _messages(index, rng)[1:]}
            async with session.post(url + "/v1/messages", json=body, headers=headers) as response:
                usage = await (_anthropic_stream(response) if body["stream"]
                               else _anthropic_whole(response))
                return Outcome(index, kind, project, response.status, usage)
        if kind == "bad":
            raw = rng.choice(BAD_BODIES).replace(b"MODEL", model.encode())
            async with session.post(url + "/v1/chat/completions", data=raw, headers={
                    **headers, "content-type": "application/json"}) as response:
                await response.read()
                return Outcome(index, kind, project, response.status, None)
        body = {"model": model, "messages": _messages(index, rng), "max_tokens": max_tokens,
                "temperature": rng.choice((0.0, 0.7))}
        if kind == "oversized":
            body["messages"][1]["content"] = "word " * (context_chars // 5 * 4)
        if kind == "tools":
            body.update(tools=[WEATHER_TOOL], max_tokens=24,
                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
        if kind in ("stream", "abort"):
            body.update(stream=True, stream_options={"include_usage": True})
        if kind == "abort":
            body["max_tokens"] = 24  # long enough to hang up mid-way
        async with session.post(url + "/v1/chat/completions", json=body,
                                headers=headers) as response:
            if kind == "abort" and response.status == 200:
                async for line in response.content:  # the first content chunk, then hang up
                    if line.startswith(b"data: {") and b'"content"' in line:
                        break
                response.close()
                return Outcome(index, kind, project, response.status, None)
            usage = await (_openai_stream(response) if kind == "stream"
                           else _openai_whole(response))
            return Outcome(index, kind, project, response.status, usage)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Outcome(index, kind, project, 0, None, f"{type(exc).__name__}: {exc}")


def _openai_usage(usage: dict[str, Any] | None) -> tuple[int, int, int] | None:
    if not usage:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return int(usage["prompt_tokens"]), int(cached), int(usage["completion_tokens"])


async def _openai_whole(response: aiohttp.ClientResponse) -> tuple[int, int, int] | None:
    body = orjson.loads(await response.read())
    return _openai_usage(body.get("usage")) if response.status == 200 else None


async def _openai_stream(response: aiohttp.ClientResponse) -> tuple[int, int, int] | None:
    usage = None
    async for line in response.content:
        if line.startswith(b"data: {"):
            chunk = orjson.loads(line[6:])
            usage = _openai_usage(chunk.get("usage")) or usage
    return usage if response.status == 200 else None


def _anthropic_usage(usage: dict[str, Any]) -> tuple[int, int, int]:
    cached = int(usage.get("cache_read_input_tokens") or 0)
    return int(usage.get("input_tokens") or 0) + cached, cached, int(usage["output_tokens"])


async def _anthropic_whole(response: aiohttp.ClientResponse) -> tuple[int, int, int] | None:
    body = orjson.loads(await response.read())
    return _anthropic_usage(body["usage"]) if response.status == 200 else None


async def _anthropic_stream(response: aiohttp.ClientResponse) -> tuple[int, int, int] | None:
    usage = None
    async for line in response.content:
        if line.startswith(b"data: {"):
            event = orjson.loads(line[6:])
            if event.get("type") == "message_delta":
                usage = _anthropic_usage(event["usage"])
    return usage if response.status == 200 else None
