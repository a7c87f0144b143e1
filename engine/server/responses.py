"""OpenAI response shapes, built from plain values (no I/O): the only place JSON layouts live.

Chat:        chat.completion / chat.completion.chunk, logprobs {content: [{token, logprob, bytes,
             top_logprobs}]}, tool calls {id, type: "function", function: {name, arguments}}.
Completions: text_completion (also for chunks), logprobs {tokens, token_logprobs, top_logprobs,
             text_offset}.
Usage:       {prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details{cached_tokens},
             completion_tokens_details{reasoning_tokens} (families that reason)}.
Reasoning:   the message's (and a delta's) `reasoning_content`, as vLLM and DeepSeek name it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from chat.tool_parsers import ToolCall
from engine.outputs import TokenLogprob
from engine.server.token_bytes import TokenBytes, token_string


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int,
          num_reasoning_tokens: int | None = None) -> dict[str, Any]:
    """`num_reasoning_tokens` None (a family without reasoning): no completion_tokens_details."""
    body: dict[str, Any] = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }
    if num_reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": num_reasoning_tokens}
    return body


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """A tool call as in a message; with `index` as in a streaming delta."""
    body: dict[str, Any] = {"id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}}
    return body if index is None else {"index": index, **body}


NO_REASONING = object()  # chat_message's `reasoning` for a family that has none: no field


def chat_message(content: str | None, tool_calls: Sequence[ToolCall],
                 reasoning: str | None | object = NO_REASONING) -> dict[str, Any]:
    """`reasoning`: the answer's `reasoning_content` (None: this answer had none)."""
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if reasoning is not NO_REASONING:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = [tool_call_json(call) for call in tool_calls]
    return message


def chat_completion(id_: str, created: int, model: str, choices: list[dict[str, Any]],
                    usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": id_, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def chat_choice(index: int, message: dict[str, Any], logprobs: dict[str, Any] | None,
                finish_reason: str | None, stop_reason: str | int | None = None) -> dict[str, Any]:
    """`stop_reason` as vLLM: the stop string or stop token id that ended the choice, else null."""
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_chunk(id_: str, created: int, model: str, choices: list[dict[str, Any]], *,
               with_usage_field: bool, usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": id_, "object": "chat.completion.chunk", "created": created,
                             "model": model, "choices": choices}
    if with_usage_field:  # OpenAI sends "usage": null on every chunk but the last when asked
        chunk["usage"] = usage_
    return chunk


def chat_chunk_choice(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
                      finish_reason: str | None = None, stop_reason: str | int | None = None
                      ) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return choice


def chat_logprobs(entries: Sequence[TokenLogprob], token_bytes: TokenBytes) -> dict[str, Any]:
    """`bytes` are the token's own (part of a UTF-8 character for some tokens; see token_bytes)."""
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(token_id)
        return {"token": token_string(raw), "logprob": logprob, "bytes": list(raw)}

    return {"content": [
        {**one(e.token_id, e.logprob), "top_logprobs": [one(tid, lp) for tid, lp in e.top]}
        for e in entries
    ], "refusal": None}


def completion(id_: str, created: int, model: str, choices: list[dict[str, Any]],
               usage_: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": id_, "object": "text_completion", "created": created,
                            "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def completion_choice(index: int, text: str, logprobs: dict[str, Any] | None,
                      finish_reason: str | None, stop_reason: str | int | None = None
                      ) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def completion_logprobs(entries: Sequence[TokenLogprob], token_bytes: TokenBytes,
                        first_offset: int = 0, leading_token_id: int | None = None
                        ) -> tuple[dict[str, Any], int]:
    """The legacy form and the text offset just past its last token. `text_offset` counts
    characters from the start of the choice's text (a token that holds part of a character
    counts as one), over the tokens' own text, so a stream (which passes the previous end as
    `first_offset`) gives the offsets a whole answer gives, also where a stop string cut the text.
    Each `top_logprobs` entry holds the sampled token too (OpenAI: "up to logprobs+1 elements";
    vLLM the same). `leading_token_id`: an echoed prompt's first token, which has no logprob
    (null, as OpenAI sends it), before `entries`."""
    tokens, offsets = [], []
    offset = first_offset
    token_ids = [entry.token_id for entry in entries]
    if leading_token_id is not None:
        token_ids.insert(0, leading_token_id)
    for token_id in token_ids:
        raw = token_bytes(token_id)
        tokens.append(token_string(raw))
        offsets.append(offset)
        offset += len(raw.decode("utf-8", "replace"))
    lead: list[Any] = [None] if leading_token_id is not None else []
    top_logprobs: list[Any] = list(lead)
    for entry in entries:
        top = {token_string(token_bytes(tid)): lp for tid, lp in entry.top}
        top.setdefault(token_string(token_bytes(entry.token_id)), entry.logprob)
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": lead + [e.logprob for e in entries],
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }, offset


def model_list(model_ids: Sequence[str], root: str, created: int, max_model_len: int,
               compute: dict[str, Any] | None = None) -> dict[str, Any]:
    """`compute`: how the replica computes (ModelRunner.compute_info), as each model's
    `metadata`."""
    extra = {"metadata": dict(compute)} if compute else {}
    return {"object": "list", "data": [
        {"id": model_id, "object": "model", "created": created, "owned_by": "aigw",
         "root": root, "max_model_len": max_model_len, **extra}
        for model_id in model_ids
    ]}
