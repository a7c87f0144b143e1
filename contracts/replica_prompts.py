"""From the replica's request bodies to chat-template input and prompt token ids, and the
context-window check: the part of prompt rendering that the gateway repeats exactly to hash a
prompt's blocks and count its tokens (gateway/routing/prompt_hashing.py), and the replica runs
(engine/server/prompts.py adds the chat formats: jinja templates and harmony). Torch-free.

Chat: messages become the tokenizer's chat-template dicts. `developer` is sent as `system` (open
chat templates know no developer role); text parts are joined with newlines; an assistant
message's tool-call `arguments` are parsed back into objects when they are JSON objects (chat
templates render them with `tojson`). Tools go into the template unless tool_choice is "none".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import orjson

from contracts.replica_errors import ContextLengthExceeded, InvalidRequestError
from contracts.replica_protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    CompletionRequest,
    Content,
    SystemMessage,
    ToolMessage,
)


class PromptTokenizer(Protocol):
    """What rendering needs of a tokenizer (chat/tokenizer.py's Tokenizer has it)."""

    max_token_bytes: int | None  # a text of B UTF-8 bytes has >= B / max_token_bytes tokens

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _text(content: Content | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def _arguments(arguments: str) -> Any:
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


def chat_template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for message in req.messages:
        if isinstance(message, SystemMessage):
            messages.append({"role": "system", "content": _text(message.content)})
        elif isinstance(message, ToolMessage):
            messages.append({"role": "tool", "content": _text(message.content),
                             "tool_call_id": message.tool_call_id})
        elif isinstance(message, AssistantMessage):
            entry: dict[str, Any] = {"role": "assistant", "content": _text(message.content)}
            if message.reasoning_content:
                entry["reasoning_content"] = message.reasoning_content
            if message.tool_calls:
                entry["tool_calls"] = [
                    {"id": call.id, "type": "function",
                     "function": {"name": call.function.name,
                                  "arguments": _arguments(call.function.arguments)}}
                    for call in message.tool_calls
                ]
            messages.append(entry)
        else:
            messages.append({"role": "user", "content": _text(message.content)})
    return messages


def chat_template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """Every tool, whatever tool_choice demands (the grammar enforces it); none for "none"."""
    if not req.uses_tools or req.tools is None:
        return None
    return [tool.model_dump(exclude_none=True) for tool in req.tools]


def refuse_surely_too_long(text: str, tokenizer: PromptTokenizer, max_tokens: int | None,
                           max_model_len: int | None, param: str) -> None:
    """400 context_length_exceeded, before encoding, for a text whose byte length alone proves it
    cannot fit: encoding megabytes takes seconds, and the tokenizer may hold the GIL meanwhile,
    which stalled every running stream of the replica (an 8 MB prompt: 20 s)."""
    if (max_model_len is None or tokenizer.max_token_bytes is None
            or len(text) * 4 <= tokenizer.max_token_bytes * max_model_len):
        return  # (a character is at most 4 UTF-8 bytes: short texts skip the encode below)
    num_tokens_at_least = len(text.encode("utf-8", "surrogatepass")) // tokenizer.max_token_bytes
    check_context_length(num_tokens_at_least, max_tokens, max_model_len, param, at_least=True)


def completion_prompts(req: CompletionRequest, tokenizer: PromptTokenizer, vocab_size: int, *,
                       max_tokens: int | None = None, max_model_len: int | None = None
                       ) -> list[list[int]]:
    """One token-id list per prompt; token ids are checked against the vocabulary. Given
    max_model_len, a text sure not to fit is refused before it is encoded."""
    prompt = req.prompt
    texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
    if texts:
        for text in texts:
            refuse_surely_too_long(text, tokenizer, max_tokens, max_model_len, "prompt")
        encoded = [tokenizer.encode(text, add_special_tokens=True) for text in texts]
        if not all(encoded):
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return encoded
    flat = [p for p in prompt if isinstance(p, int)]
    prompts = [flat] if flat else [list(p) for p in prompt if isinstance(p, list)]
    for ids in prompts:
        if any(not 0 <= tid < vocab_size for tid in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})",
                                      param="prompt")
    return prompts


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                         param: str, *, at_least: bool = False) -> None:
    """400 context_length_exceeded when the prompt (+ max_tokens, if given) cannot fit.
    `at_least`: num_prompt_tokens is a lower bound (the prompt was not encoded)."""
    num_requested = num_prompt_tokens + (max_tokens or 1)
    if num_requested <= max_model_len:
        return
    completion = f"{max_tokens} in the completion" if max_tokens else "at least 1 to generate"
    bound = "at least " if at_least else ""
    raise ContextLengthExceeded(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{bound}{num_requested} tokens ({bound}{num_prompt_tokens} in the {param}, {completion}). "
        f"Please reduce the length of the {param} or completion.", param=param)

