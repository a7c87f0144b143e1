"""Token-level workloads for `aigw bench engine` and `aigw bench agent`, and the loop that replays
them.

Every workload is deterministic for a seed. Text is real English (the docstrings of a fixed list of
standard-library modules), tokenized ONCE here; the benchmarks then only move token ids around.

A workload is a list of `Client`s. A client is a closed loop: it plans a request, waits for its
answer, and plans the next one from it (the agent loop appends each answer to its conversation).
One-shot workloads (shared prefix, zero reuse, concurrency batches) are clients of one request each,
so every request of a workload arrives at t=0 unless a client is still waiting for an earlier
answer.

    replay(engine, clients) -> [RequestRecord]  # TTFT, e2e, TPOT, cached/prompt tokens per request
"""

from __future__ import annotations

import functools
import importlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# Fixed so that the corpus (and with it every workload) does not change between runs on one Python.
_CORPUS_MODULES = ("argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses",
                   "datetime", "decimal", "email", "functools", "heapq", "http.client", "itertools",
                   "json", "logging", "pathlib", "pickle", "re", "shutil", "socket", "sqlite3",
                   "statistics", "string", "subprocess", "tarfile", "textwrap", "threading",
                   "typing", "unittest", "urllib.parse", "zipfile")


def corpus_text() -> str:
    """Docstrings of `_CORPUS_MODULES` and their public members, in a fixed order."""
    parts: list[str] = []
    for name in _CORPUS_MODULES:
        module = importlib.import_module(name)
        docs = [module.__doc__ or ""]
        for attr in sorted(a for a in dir(module) if not a.startswith("_")):
            doc = getattr(getattr(module, attr, None), "__doc__", None)
            if isinstance(doc, str) and len(doc) > 200:
                docs.append(doc)
        parts.extend(d.strip() for d in docs if d.strip())
    return "\n\n".join(dict.fromkeys(parts))  # drop repeated docstrings (inherited ones)


@functools.lru_cache(maxsize=4)
def corpus_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """`corpus_text()` through `tokenizer`, once per tokenizer object (a couple of seconds)."""
    return tuple(tokenizer.encode(corpus_text(), add_special_tokens=False))


class TokenSource:
    """Slices of real text as token ids. `take(n)` is a random contiguous slice (seeded)."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        self.tokenizer = tokenizer
        self.token_ids = corpus_token_ids(tokenizer)
        self.rng = random.Random(seed)

    def take(self, num_tokens: int) -> list[int]:
        if num_tokens > len(self.token_ids):
            raise ValueError(f"the corpus has only {len(self.token_ids)} tokens")
        start = self.rng.randrange(len(self.token_ids) - num_tokens + 1)
        return list(self.token_ids[start: start + num_tokens])

    def text(self, num_tokens: int) -> str:
        return str(self.tokenizer.decode(self.take(num_tokens)))


@dataclass(frozen=True)
class PlannedRequest:
    prompt_token_ids: list[int]
    max_tokens: int  # exactly this many tokens are generated (ignore_eos)


class Client(Protocol):
    def next_request(self, previous_output_ids: list[int] | None) -> PlannedRequest | None:
        """The next request given the answer to the previous one (None on the first call); None:
        done."""


@dataclass
class OneShotClient:
    request: PlannedRequest
    _sent: bool = False

    def next_request(self, previous_output_ids: list[int] | None) -> PlannedRequest | None:
        if self._sent:
            return None
        self._sent = True
        return self.request


def one_shot(prompts: Sequence[list[int]], max_tokens: int) -> list[Client]:
    return [OneShotClient(PlannedRequest(list(p), max_tokens)) for p in prompts]


# ---- the replay loop -----------------------------------------------------------------------------
@dataclass
class RequestRecord:
    """One request's timings (perf_counter seconds) and token counts."""

    client_index: int
    num_prompt_tokens: int
    arrival_s: float
    first_token_s: float | None = None
    finish_s: float | None = None
    num_cached_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        assert self.finish_s is not None
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (tokens - 1); None for a one-token answer."""
        if self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


def replay(engine: Any, clients: Sequence[Client], *,
           timeout_s: float = 3600.0) -> list[RequestRecord]:
    """Drive `engine` (an idle LLMEngine) until every client is done; greedy, ignore_eos.

    A client's first request is added at once; each later one right after the step that finished
    its predecessor. Raises TimeoutError after `timeout_s` (the engine is then left with requests).
    """
    from contracts.sampling_params import SamplingParams

    assert not engine.has_unfinished_requests, "replay needs an idle engine"
    records: list[RequestRecord] = []
    active: dict[str, RequestRecord] = {}
    counter = 0

    def submit(index: int, previous_output_ids: list[int] | None) -> None:
        nonlocal counter
        planned = clients[index].next_request(previous_output_ids)
        if planned is None:
            return
        request_id = f"bench-{counter}"
        counter += 1
        record = RequestRecord(index, len(planned.prompt_token_ids), time.perf_counter())
        params = SamplingParams(temperature=0.0, max_tokens=planned.max_tokens, ignore_eos=True)
        engine.add_request(request_id, planned.prompt_token_ids, params)
        active[request_id] = record
        records.append(record)

    for i in range(len(clients)):
        submit(i, None)
    deadline = time.perf_counter() + timeout_s
    while active:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"replay: {len(active)} requests unfinished after {timeout_s:.0f} s")
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            record = active[output.request_id]
            if output.new_token_ids and record.first_token_s is None:
                record.first_token_s = now
            record.output_token_ids.extend(output.new_token_ids)
            if output.finished:
                record.finish_s = now
                record.num_cached_tokens = output.num_cached_tokens
                del active[output.request_id]
                submit(record.client_index, record.output_token_ids)
    return records


# ---- agent loop ----------------------------------------------------------------------------------
class ChatSegments:
    """Token ids of the pieces of a chat, cut out of the tokenizer's own template renderings.

    prompt of turn t = system + sum_{k<t}(message_k + generation_prompt + answer_k + end_of_turn)
                       + message_t + generation_prompt
    """

    def __init__(self, tokenizer: Any, system_text: str, tools: list[dict[str, Any]]) -> None:
        self.tokenizer, self.tools = tokenizer, tools
        self.system = [{"role": "system", "content": system_text}]
        system_rendered = self._render(self.system, False)
        self.system_ids: list[int] = tokenizer.encode(system_rendered)
        probe = self.system + [{"role": "user", "content": "hello"}]
        head = self._render(probe, False)
        self.generation_prompt_ids: list[int] = tokenizer.encode(
            self._render(probe, True)[len(head):])
        marker = "ANSWER"
        full = self._render(probe + [{"role": "assistant", "content": marker}], False)
        tail = full[len(self._render(probe, True)):]
        self.end_of_turn_ids: list[int] = tokenizer.encode(tail[tail.index(marker) + len(marker):])

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tools=self.tools,
                                                      add_generation_prompt=add_generation_prompt))

    def message_ids(self, role: str, content: str) -> list[int]:
        """The segment one message adds after the system prompt (a user turn or a tool result)."""
        before = self._render(self.system, False)
        after = self._render(self.system + [{"role": role, "content": content}], False)
        if not after.startswith(before):
            raise ValueError("the chat template does not render messages as appended segments")
        return list(self.tokenizer.encode(after[len(before):]))


def tool_schema(source: TokenSource, rng: random.Random, index: int) -> dict[str, Any]:
    words = [w.strip(".,:;()`'\"").lower() for w in source.text(24).split()]
    words = [w for w in words if w.isalpha()] or ["item"]
    properties = {}
    for k in range(rng.randint(2, 4)):
        properties[f"{rng.choice(words)}_{k}"] = {
            "type": rng.choice(["string", "integer", "boolean", "number"]),
            "description": source.text(rng.randint(12, 24)).replace("\n", " ")}
    return {"type": "function", "function": {
        "name": f"{rng.choice(words)}_{index}",
        "description": source.text(rng.randint(20, 40)).replace("\n", " "),
        "parameters": {"type": "object", "properties": properties,
                       "required": sorted(properties)[:1]}}}


@dataclass
class AgentSession:
    """One agent conversation: T turns in sequence, each answer appended to the next prompt."""

    segments: ChatSegments
    turn_message_ids: list[list[int]]
    answer_lengths: list[int]
    _context: list[int] = field(default_factory=list)
    _turn: int = 0

    def fresh(self) -> AgentSession:
        """The same conversation plan, not started."""
        return AgentSession(self.segments, self.turn_message_ids, self.answer_lengths)

    def next_request(self, previous_output_ids: list[int] | None) -> PlannedRequest | None:
        if self._turn == 0:
            self._context = list(self.segments.system_ids)
        else:
            assert previous_output_ids is not None
            self._context += previous_output_ids + self.segments.end_of_turn_ids
        if self._turn >= len(self.turn_message_ids):
            return None
        self._context += self.turn_message_ids[self._turn] + self.segments.generation_prompt_ids
        self._turn += 1
        return PlannedRequest(list(self._context), self.answer_lengths[self._turn - 1])


def agent_sessions(tokenizer: Any, *, num_sessions: int, num_turns: int, system_tokens: int = 1500,
                   message_tokens: tuple[int, int] = (100, 200),
                   answer_tokens: tuple[int, int] = (32, 64), seed: int = 0) -> list[AgentSession]:
    """S sessions x T turns sharing one system prompt with a JSON tool schema of
    ~`system_tokens`."""
    source, rng = TokenSource(tokenizer, seed), random.Random(seed)
    intro = ("You are a careful software agent. Use the tools when they help, one call at a time, "
             "and answer briefly once you have what you need.")
    tools: list[dict[str, Any]] = []
    while True:  # grow the tool list until the rendered system prompt reaches the target
        segments = ChatSegments(tokenizer, intro, tools)
        if len(segments.system_ids) >= system_tokens or len(tools) >= 64:
            break
        tools.append(tool_schema(source, rng, len(tools)))
    sessions: list[AgentSession] = []
    for _ in range(num_sessions):
        messages = []
        for turn in range(num_turns):
            role = "user" if turn == 0 or rng.random() < 0.5 else "tool"
            content = source.text(rng.randint(*message_tokens))
            messages.append(segments.message_ids(role, content))
        lengths = [rng.randint(*answer_tokens) for _ in range(num_turns)]
        sessions.append(AgentSession(segments, messages, lengths))
    return sessions


# ---- one-shot workloads --------------------------------------------------------------------------
def shared_prefix_prompts(source: TokenSource, *, num_groups: int, prompts_per_group: int,
                          system_tokens: int, question_tokens: int) -> list[list[int]]:
    """SGLang's generated-shared-prefix shape: each group shares a system prompt; group-major
    order."""
    prompts: list[list[int]] = []
    for _ in range(num_groups):
        system = source.take(system_tokens)
        prompts.extend(system + source.take(question_tokens) for _ in range(prompts_per_group))
    return prompts


def hit_ratio_prompts(source: TokenSource, *, num_prompts: int, prompt_tokens: int,
                      hit_ratio: float, block_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(primers, prompts): after the primers ran, each prompt finds `hit_ratio` of its tokens
    cached.

    The shared prefix is rounded to whole KV blocks (only full blocks are cached), so pick sizes
    where `hit_ratio * prompt_tokens` is a multiple of `block_size` to hit the ratio exactly.
    """
    num_prefix = round(hit_ratio * prompt_tokens / block_size) * block_size
    prefix = source.take(num_prefix)
    prompts = [prefix + source.take(prompt_tokens - num_prefix) for _ in range(num_prompts)]
    return [prefix], prompts


def unique_prompts(source: TokenSource, *, num_prompts: int, prompt_tokens: int) -> list[list[int]]:
    """Prompts that share no first block (the zero-reuse control)."""
    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    while len(prompts) < num_prompts:
        prompt = source.take(prompt_tokens)
        if tuple(prompt[:16]) not in seen:
            seen.add(tuple(prompt[:16]))
            prompts.append(prompt)
    return prompts
