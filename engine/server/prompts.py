"""From request bodies to prompt token ids, and the context-window check.

Chat: messages become the tokenizer's chat-template dicts (contracts/replica_prompts.py, which the
gateway shares to hash prompts exactly as rendered here), then go through the checkpoint's chat
format: its jinja template or harmony.

`continue_final_message` (vLLM's extension; the gateway sends it for Anthropic prefill): the last
(assistant) message is left open and the answer continues its text. `chat_template_kwargs` reach the
jinja template (Qwen3's `enable_thinking`); gpt-oss renders through harmony instead, with
`reasoning_effort` in its system message (chat/harmony.py).

tool_choice "required" or a named function leaves the prompt as "auto" renders it (every tool, no
added instruction) and is enforced while decoding only (ServingContext.sampling_params: a grammar of
the tool parser's format), as vLLM does: an agent that switches tool_choice between turns (the
OpenAI Agents SDK goes from "required" to "auto" after the first call) keeps its prompt prefix,
so the prefix cache still serves it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jinja2

from chat.harmony import HarmonyError
from chat.harmony import render_prompt as render_harmony
from chat.registry import HERMES, ChatFormat
from contracts.replica_errors import InvalidRequestError
from contracts.replica_prompts import (
    chat_template_messages,
    chat_template_tools,
    refuse_surely_too_long,
)
from contracts.replica_protocol import ChatCompletionRequest
from engine.server.typedefs import ServedTokenizer


class ChatPrompt(NamedTuple):
    token_ids: list[int]
    text: str  # the rendered template ("" for harmony, which renders ids): where reasoning starts


def chat_prompt_token_ids(req: ChatCompletionRequest, tokenizer: ServedTokenizer, *,
                          max_tokens: int | None = None, max_model_len: int | None = None
                          ) -> list[int]:
    """The prompt's ids through the checkpoint's jinja template (see `render_chat_prompt`)."""
    return render_chat_prompt(req, tokenizer, max_tokens=max_tokens,
                              max_model_len=max_model_len).token_ids


def render_chat_prompt(req: ChatCompletionRequest, tokenizer: ServedTokenizer,
                       chat_format: ChatFormat = HERMES, *, max_tokens: int | None = None,
                       max_model_len: int | None = None, harmony: Any = None) -> ChatPrompt:
    """The prompt in the checkpoint's chat format (chat/registry.py): its jinja template with
    `req.template_kwargs()`, or harmony (`harmony`: the loaded encoding) with the request's
    reasoning_effort. Given max_model_len, a prompt sure not to fit is refused before it is
    encoded (`refuse_surely_too_long`)."""
    try:
        if chat_format.renderer == "harmony":
            effort = {"none": "low", "minimal": "low"}.get(req.reasoning_effort or "",
                                                           req.reasoning_effort)
            return ChatPrompt(render_harmony(harmony, chat_template_messages(req),
                                             chat_template_tools(req), reasoning_effort=effort,
                                             continue_final_message=req.continue_final_message),
                              "")
        kwargs = req.template_kwargs()
        text = tokenizer.apply_chat_template(chat_template_messages(req),
                                             tools=chat_template_tools(req),
                                             add_generation_prompt=True,
                                             continue_final_message=req.continue_final_message,
                                             **kwargs)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, HarmonyError) as exc:
        raise InvalidRequestError(f"messages cannot be rendered by the chat template: {exc}",
                                  param="messages") from exc  # the template refused them
    except RecursionError:  # the body is read up to 1024 levels, the template's JSON dump less
        raise InvalidRequestError("a tool's parameters schema is nested too deeply to render",
                                  param="tools") from None
    refuse_surely_too_long(text, tokenizer, max_tokens, max_model_len, "messages")
    return ChatPrompt(tokenizer.encode(text, add_special_tokens=False), text)


