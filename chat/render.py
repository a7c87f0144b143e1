"""A chat request's prompt, rendered once: the one function the replica's OpenAI server and the
gateway's router both call, so that the gateway may send its ids and the replica use them.

    renderer = PromptRenderer(tokenizer, chat_format_for(architecture, template, token_to_id))
    prompt = renderer.render(chat_request, max_model_len=...)     # ChatPrompt(token_ids, text)
    renderer.render_id                                             # 16 hex digits, see below

Chat: messages become the tokenizer's chat-template dicts (contracts/replica_prompts.py), then go
through the checkpoint's chat format (chat/registry.py): its jinja template with the request's
`chat_template_kwargs` (Qwen3's `enable_thinking`), or harmony for gpt-oss, with
`reasoning_effort` in its system message (chat/harmony.py). `continue_final_message` (vLLM's
extension; the gateway sends it for Anthropic prefill) leaves the last (assistant) message open.

tool_choice "required" or a named function leaves the prompt as "auto" renders it (every tool, no
added instruction) and is enforced while decoding only (a grammar of the tool parser's format), as
vLLM does: an agent that switches tool_choice between turns keeps its prompt prefix cached.

`render_id` names everything that decides a render: the tokenizer (its whole serialized form), the
chat template's source and the chat format. The gateway sends its ids with its render id
(`prompt_token_ids`, `prompt_render_id` in contracts/replica_protocol.py); a replica whose own
render id differs renders the messages itself, so a gateway that loaded another tokenizer or
template costs time, never a wrong prompt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import jinja2

from chat.harmony import HarmonyError
from chat.harmony import load_encoding as load_harmony_encoding
from chat.harmony import render_prompt as render_harmony
from chat.registry import ChatFormat
from contracts.replica_errors import InvalidRequestError
from contracts.replica_prompts import (
    chat_template_messages,
    chat_template_tools,
    refuse_surely_too_long,
)
from contracts.replica_protocol import ChatCompletionRequest

# llama.cpp's GGUF `general.architecture` names -> Hugging Face `model_type` (what
# chat/registry.py and the engine call them) where the two differ
_GGUF_ARCHITECTURES = {"gpt-oss": "gpt_oss", "deepseek2": "deepseek_v3", "qwen3moe": "qwen3_moe",
                       "qwen2moe": "qwen2_moe", "gemma3": "gemma3_text"}


class ChatPrompt(NamedTuple):
    token_ids: list[int]
    text: str  # the rendered template ("" for harmony, which renders ids): where reasoning starts


class RenderTokenizer(Protocol):
    """What rendering needs of a tokenizer (chat/tokenizer.py's Tokenizer has it)."""

    max_token_bytes: int | None  # a text of B UTF-8 bytes has >= B / max_token_bytes tokens

    def apply_chat_template(self, messages: Any, tools: Any = None,
                            add_generation_prompt: bool = True, **extra: Any) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


Encoder = Callable[[str], list[int]]  # rendered text -> ids (add_special_tokens=False)


class PromptRenderer:
    """One checkpoint's renderer. Thread-safe (harmony's encoding is loaded once per process)."""

    def __init__(self, tokenizer: RenderTokenizer, chat_format: ChatFormat) -> None:
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self._render_id: str | None = None

    @property
    def render_id(self) -> str:
        """16 hex digits naming the tokenizer, the template and the format (module docstring);
        computed once (~0.15 s: the tokenizer's serialized form for a 49k vocabulary)."""
        if self._render_id is None:
            digest = hashlib.blake2b(digest_size=8)
            backend = getattr(self.tokenizer, "backend", None)
            digest.update(backend.to_str().encode() if backend is not None else b"")
            template = getattr(self.tokenizer, "chat_template", None)
            source = getattr(template, "source", None)
            digest.update(b"\0" + (source or "").encode() + b"\0" + self.chat_format.name.encode())
            self._render_id = digest.hexdigest()
        return self._render_id

    def harmony(self) -> Any:
        """gpt-oss's harmony encoding, its vocabulary from this tokenizer if need be."""
        backend = getattr(self.tokenizer, "backend", None)
        return load_harmony_encoding(backend.get_vocab() if backend is not None else None)

    def render(self, req: ChatCompletionRequest, *, max_tokens: int | None = None,
               max_model_len: int | None = None, encode: Encoder | None = None) -> ChatPrompt:
        """The prompt in the checkpoint's chat format. Given max_model_len, a prompt sure not to
        fit is refused before it is encoded (`refuse_surely_too_long`). `encode`: the rendered
        text's tokenizer call (the gateway's is cached by segment); InvalidRequestError when the
        template refuses the messages."""
        try:
            if self.chat_format.renderer == "harmony":
                effort = {"none": "low", "minimal": "low"}.get(req.reasoning_effort or "",
                                                               req.reasoning_effort)
                return ChatPrompt(render_harmony(self.harmony(), chat_template_messages(req),
                                                 chat_template_tools(req), reasoning_effort=effort,
                                                 continue_final_message=req.continue_final_message),
                                  "")
            text = self.tokenizer.apply_chat_template(
                chat_template_messages(req), tools=chat_template_tools(req),
                add_generation_prompt=True, continue_final_message=req.continue_final_message,
                **req.template_kwargs())
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, HarmonyError) as exc:
            raise InvalidRequestError(f"messages cannot be rendered by the chat template: {exc}",
                                      param="messages") from exc  # the template refused them
        except RecursionError:  # the body is read up to 1024 levels, the template's JSON dump less
            raise InvalidRequestError("a tool's parameters schema is nested too deeply to render",
                                      param="tools") from None
        refuse_surely_too_long(text, self.tokenizer, max_tokens, max_model_len, "messages")
        ids = encode(text) if encode is not None else self.tokenizer.encode(text)
        return ChatPrompt(ids, text)

    def given(self, token_ids: Sequence[int]) -> ChatPrompt:
        """A prompt rendered elsewhere with this render id: its ids, and the text of its last
        tokens (enough for `ChatFormat.starts_in_reasoning`, which looks at the prompt's end)."""
        if self.chat_format.renderer == "harmony":
            return ChatPrompt(list(token_ids), "")
        return ChatPrompt(list(token_ids), self.tokenizer.decode(token_ids[-8:]))


def checkpoint_architecture(path: str | Path) -> str:
    """The architecture (Hugging Face `model_type`) of a GGUF file or a model directory, "" when
    it says none: what chat/registry.py's `chat_format_for` takes, read as the engine reads it."""
    from chat.gguf_metadata import is_gguf_file, read_gguf_metadata

    path = Path(path)
    if is_gguf_file(path):
        arch = read_gguf_metadata(path).get("general.architecture")
        return _GGUF_ARCHITECTURES.get(arch, arch) if isinstance(arch, str) else ""
    try:
        with open(path / "config.json", encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return ""
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) else ""
