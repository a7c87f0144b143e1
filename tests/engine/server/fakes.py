"""A fake engine and a byte tokenizer that honour the server's engine contract.

FakeTokenizer: ids 0..255 are bytes; three specials follow (<|im_start|>, <|im_end|>,
<|endoftext|>). Its chat template is ChatML with the tools listed in the system turn.

FakeEngine.generate is an async generator like the real one: PromptTooLongError before the first
yield, one token per output, the reply text chosen by `reply` (a string or a function of the
prompt text), stop strings trimmed, max_tokens -> "length", otherwise an eos token -> "stop".
`ignore_eos` repeats the reply up to max_tokens. Closing the generator early (aclose or
cancellation) records the request as aborted. The fake runs on the server's event loop (another
thread); tests read its records from their own thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from contracts.sampling_params import SamplingParams
from engine.config import ModelConfig
from engine.outputs import FinishReason, PromptTooLongError, RequestOutput, TokenLogprob

SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
IM_START, IM_END, ENDOFTEXT = 256, 257, 258
FAKE_LOGPROB = -0.25
BLOCK_SIZE = 16


class FakeTokenizer:
    eos_token_ids = (IM_END, ENDOFTEXT)
    vocab_size = 256 + len(SPECIAL_TOKENS)
    max_token_bytes = max(len(special) for special in SPECIAL_TOKENS)  # a byte, or a special

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        while text:
            for offset, special in enumerate(SPECIAL_TOKENS):
                if text.startswith(special):
                    ids.append(256 + offset)
                    text = text[len(special):]
                    break
            else:
                nxt = min((i for i in (text.find(s) for s in SPECIAL_TOKENS) if i > 0),
                          default=len(text))
                ids.extend(text[:nxt].encode("utf-8"))
                text = text[nxt:]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        parts, raw = [], bytearray()
        for tid in ids:
            if tid >= 256:
                parts.append(raw.decode("utf-8", "replace") + SPECIAL_TOKENS[tid - 256])
                raw = bytearray()
            else:
                raw.append(tid)
        return "".join(parts) + raw.decode("utf-8", "replace")

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.decode([tid]) for tid in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> str:
        turns = []
        if tools:
            listing = "\n".join(orjson.dumps(tool).decode() for tool in tools)
            turns.append(f"<|im_start|>system\nTools:\n{listing}<|im_end|>\n")
        for message in messages:
            if message["role"] not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"unknown role {message['role']!r}")
            body = message.get("content") or ""
            for call in message.get("tool_calls", []):
                body += "<tool_call>" + orjson.dumps(call["function"]).decode() + "</tool_call>"
            turns.append(f"<|im_start|>{message['role']}\n{body}<|im_end|>\n")
        if continue_final_message:  # the last turn left open (prefill)
            return "".join(turns).removesuffix("<|im_end|>\n")
        if add_generation_prompt:
            turns.append("<|im_start|>assistant\n")
        return "".join(turns)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False
                    ) -> list[int]:
        return self.encode(self.apply_chat_template(messages, tools, add_generation_prompt,
                                                    continue_final_message))


@dataclass
class FakeEngineStats:
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_kv_blocks_total: int = 64
    num_kv_blocks_used: int = 0
    num_kv_blocks_cached: int = 0
    num_prefix_cache_queried_tokens: int = 0
    num_prefix_cache_hit_tokens: int = 0
    num_prompt_tokens_total: int = 0
    num_generation_tokens_total: int = 0
    num_preemptions_total: int = 0


@dataclass
class GenerateCall:
    """What the fake was asked to do, for tests to check."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    trace_headers: dict[str, str]
    retention: tuple[float, str | None] = (0.0, None)  # (retain_s, retention_id)
    priority: int = 0  # the scheduling class, lower first


@dataclass
class FakeEngine:
    max_model_len: int = 1024
    reply: str | Callable[[str], str] = "Hello! I am a fake engine."
    token_delay_s: float = 0.0  # sleep before each token (lets tests disconnect mid-stream)
    fail_after_num_tokens: int | None = None  # raise RuntimeError after this many tokens
    kv_capacity_tokens: int | None = None  # prompts longer than this never fit the KV cache
    replica_id: str = "fake-replica"
    tokenizer: Any = field(default_factory=FakeTokenizer)  # or a real engine.loader Tokenizer
    calls: list[GenerateCall] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    aborted_event: threading.Event = field(default_factory=threading.Event)
    prepared_grammars: list[Any] = field(default_factory=list)  # prepare_grammar calls
    num_prefix_cache_resets: int = 0
    is_alive: bool = True
    _stats: FakeEngineStats = field(default_factory=FakeEngineStats)
    _seen_prompts: dict[str | None, list[list[int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.model_config = ModelConfig(
            architecture="llama", vocab_size=self.tokenizer.vocab_size, hidden_size=8,
            intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
            max_position_embeddings=self.max_model_len,
            eos_token_ids=tuple(self.tokenizer.eos_token_ids), model_id="fake-model")
        self.eos_token_id = self.model_config.eos_token_ids[0]

    def prompt_text(self, call: GenerateCall) -> str:
        return self.tokenizer.decode(call.prompt_token_ids)

    def prepare_grammar(self, grammar: Any, cache_salt: str | None = None) -> None:
        self.prepared_grammars.append(grammar)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       *, cache_salt: str | None = None,
                       trace_headers: Mapping[str, str] | None = None,
                       retain_s: float = 0.0, retention_id: str | None = None, priority: int = 0
                       ) -> AsyncIterator[RequestOutput]:
        num_prompt_tokens = len(prompt_token_ids)
        if num_prompt_tokens + 1 > self.max_model_len:
            raise PromptTooLongError(num_prompt_tokens, self.max_model_len)
        if self.kv_capacity_tokens is not None and num_prompt_tokens >= self.kv_capacity_tokens:
            raise PromptTooLongError(num_prompt_tokens, self.kv_capacity_tokens, "KV cache size")
        call = GenerateCall(request_id, list(prompt_token_ids), params, cache_salt,
                            dict(trace_headers or {}), (retain_s, retention_id), priority)
        self.calls.append(call)
        num_cached_tokens = self._lookup_prefix(prompt_token_ids, cache_salt)
        reply = self.reply if isinstance(self.reply, str) else self.reply(self.prompt_text(call))
        limit = params.max_tokens or self.max_model_len - num_prompt_tokens
        finished = False
        self._stats.num_running_requests += 1
        try:
            num_output_tokens = 0
            for tid, piece, finish in self._script(reply, params, limit):
                await asyncio.sleep(self.token_delay_s)
                if num_output_tokens == self.fail_after_num_tokens:
                    raise RuntimeError("fake engine failure")
                num_output_tokens += 1
                self._stats.num_generation_tokens_total += 1
                logprobs = None
                if params.logprobs:
                    top = tuple((tid if k == 0 else 97 + k, FAKE_LOGPROB - 2 * k)
                                for k in range(params.top_logprobs))
                    logprobs = [TokenLogprob(tid, FAKE_LOGPROB, top)]
                finished = finish is not None
                yield RequestOutput(
                    request_id=request_id, new_token_ids=[tid], text=piece,
                    finish_reason=finish, logprobs=logprobs, num_prompt_tokens=num_prompt_tokens,
                    num_cached_tokens=num_cached_tokens, num_output_tokens=num_output_tokens)
                if finished:
                    return
        finally:
            self._stats.num_running_requests -= 1
            if not finished:
                self.aborted.append(request_id)
                self.aborted_event.set()

    def _script(self, reply: str, params: SamplingParams, limit: int
                ) -> list[tuple[int, str, FinishReason | None]]:
        """(token id, text, finish) per output: the reply cut at the first stop string (whose
        first token ends the request with no text), else the reply (repeated up to the limit
        when ignore_eos) and an eos token; cut at `limit` tokens with "length"."""
        cuts = [reply.index(stop) for stop in params.stop if stop in reply]
        end_id, end_reason = self.eos_token_id, FinishReason.STOP
        if cuts:
            end_id = self.tokenizer.encode(reply[min(cuts):])[0]
            reply = reply[:min(cuts)]
        reply_ids = self.tokenizer.encode(reply)
        if params.ignore_eos and not cuts:  # repeat the reply until max_tokens
            reply_ids = (reply_ids * (limit // len(reply_ids) + 1))[:limit]
        steps: list[tuple[int, str, FinishReason | None]] = [
            (tid, self.tokenizer.decode([tid]), None) for tid in reply_ids]
        steps.append((end_id, "", end_reason))
        if len(steps) > limit:
            tid, piece, _ = steps[limit - 1]
            steps = steps[:limit - 1] + [(tid, piece, FinishReason.LENGTH)]
        return steps

    def _lookup_prefix(self, prompt: list[int], cache_salt: str | None) -> int:
        seen = self._seen_prompts.setdefault(cache_salt, [])
        best = 0
        for other in seen:
            common = 0
            while common < min(len(other), len(prompt)) and other[common] == prompt[common]:
                common += 1
            best = max(best, common)
        seen.append(list(prompt))
        num_cached_tokens = min(best, len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
        self._stats.num_prompt_tokens_total += len(prompt)
        self._stats.num_prefix_cache_queried_tokens += len(prompt)
        self._stats.num_prefix_cache_hit_tokens += num_cached_tokens
        return num_cached_tokens

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.aborted_event.set()

    def stats(self) -> FakeEngineStats:
        return self._stats

    async def reset_prefix_cache(self) -> bool:
        self._seen_prompts.clear()
        self.num_prefix_cache_resets += 1
        return True

    def kv_events_since(self, seq: int) -> dict[str, Any]:
        return {"events": [], "next_seq": seq, "replica_id": self.replica_id}

    def kv_snapshot(self) -> dict[str, Any]:
        return {"block_hashes": [], "replica_id": self.replica_id}
