"""The model's tokenizer and chat template, from a GGUF file or a Hugging Face directory.

Sources:
  - GGUF: vocabulary, merges, token types, special ids and `tokenizer.chat_template` from the
    metadata (see gguf_vocab.py for how the BPE is rebuilt; ids match transformers'
    `AutoTokenizer.from_pretrained(dir, gguf_file=...)`).
  - HF directory: `tokenizer.json`; `tokenizer_config.json` for the special tokens and the chat
    template (or `chat_template.jinja` / `chat_template.json`, as newer transformers save it);
    `config.json` / `generation_config.json` for extra eos ids.

This module imports no torch: the gateway builds a `Tokenizer` to hash prompts. Construction
reads only metadata (tens of milliseconds for a 49k vocabulary) and may be done repeatedly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _BackendTokenizer

from chat.chat_template import ChatTemplate, Message
from chat.gguf_metadata import is_gguf_file, read_gguf_metadata
from chat.gguf_vocab import build_gguf_tokenizer
from chat.special_tokens import as_id_list, collect_eos_token_ids

# Used when a checkpoint has no chat template at all.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class Tokenizer:
    """Text <-> token ids, plus the chat template. Immutable after construction."""

    def __init__(self, backend: _BackendTokenizer, *, chat_template: str | None,
                 bos_token_id: int | None, eos_token_id: int | None,
                 extra_eos_token_ids: Sequence[int] = (),
                 unk_token_id: int | None = None, pad_token_id: int | None = None) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        declared = ([eos_token_id] if eos_token_id is not None else []) + list(extra_eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = collect_eos_token_ids(declared, backend.token_to_id)
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, token in backend.get_added_tokens_decoder().items() if token.special)
        self.chat_template = ChatTemplate(chat_template or CHATML_TEMPLATE)
        self.max_token_bytes = _max_token_bytes(backend)
        names = {"bos_token": bos_token_id, "eos_token": eos_token_id,
                 "unk_token": unk_token_id, "pad_token": pad_token_id}
        self._special_token_strings: dict[str, str] = {}
        for name, token_id in names.items():
            token = backend.id_to_token(token_id) if token_id is not None else None
            if token is not None:
                self._special_token_strings[name] = token

    @property
    def backend(self) -> _BackendTokenizer:
        """The raw `tokenizers.Tokenizer` (for incremental detokenization)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text are matched whole.

        `add_special_tokens` applies the checkpoint's post-processor (e.g. a bos prefix when the
        checkpoint asks for one; SmolLM2 asks for none).
        """
        return encode_ids(self._backend, text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [str(self._backend.id_to_token(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[Message],
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for `messages` (see chat_template.py for normalisation and tools)."""
        return self.chat_template.render(messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt,
                                         special_tokens=self._special_token_strings, **extra)

    def encode_chat(self, messages: Sequence[Message],
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[int]:
        """Render, then encode without added special tokens (the template writes them).
        `continue_final_message`: see ChatTemplate.render (raises ValueError)."""
        text = self.apply_chat_template(messages, tools=tools,
                                        add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message)
        return self.encode(text, add_special_tokens=False)


GIL_FREE_MIN_CHARS = 4096  # from this length `encode_ids` encodes with the GIL released


def encode_ids(backend: _BackendTokenizer, text: str,
               add_special_tokens: bool = False) -> list[int]:
    """`backend.encode(text).ids`, but a long text goes through `encode_batch`, which releases the
    GIL while Rust encodes (`encode` holds it throughout): encoding a multi-MB prompt in a worker
    thread then no longer stalls the event loop and every other thread of the process for seconds
    (a 25 MB count_tokens body froze the gateway, /health included, for 54 s). Same ids."""
    if len(text) < GIL_FREE_MIN_CHARS:
        return list(backend.encode(text, add_special_tokens=add_special_tokens).ids)
    return list(backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)


def _max_token_bytes(backend: _BackendTokenizer) -> int | None:
    """The most bytes of UTF-8 text one token can stand for, so that a text of B bytes has at
    least B / max_token_bytes tokens; None where no such bound holds.

    A BPE token's spelling is at least as long in UTF-8 as the text it stands for (byte-level
    `Ġ` is 2 bytes for a space, metaspace `▁` 3, byte fallback `<0x0A>` 6, an added token is its
    text). It does not hold with a normalizer (it may shrink the text first), with fused unknown
    tokens (one `<unk>` for a whole run), or for WordPiece / WordLevel / Unigram models.
    """
    model = backend.model
    if (backend.normalizer is not None or type(model).__name__ != "BPE"
            or (model.unk_token is not None and model.fuse_unk)):
        return None
    return max((len(token.encode("utf-8")) for token in backend.get_vocab(with_added_tokens=True)),
               default=None)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a GGUF file or a Hugging Face directory."""
    path = Path(path)
    if is_gguf_file(path):
        return _tokenizer_from_gguf(path)
    if path.is_dir():
        return _tokenizer_from_hf_dir(path)
    raise FileNotFoundError(f"{path} is neither a GGUF file nor a model directory")


def _tokenizer_from_gguf(path: Path) -> Tokenizer:
    metadata = read_gguf_metadata(path)

    def token_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        return value if isinstance(value, int) else None

    template = metadata.get("tokenizer.chat_template")
    return Tokenizer(build_gguf_tokenizer(metadata),
                     chat_template=template if isinstance(template, str) else None,
                     bos_token_id=token_id("bos_token_id"), eos_token_id=token_id("eos_token_id"),
                     unk_token_id=token_id("unknown_token_id"),
                     pad_token_id=token_id("padding_token_id"))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _hf_chat_template(directory: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str):
        return template
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(directory / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None


def _tokenizer_from_hf_dir(directory: Path) -> Tokenizer:
    if not (directory / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{directory} has no tokenizer.json")
    backend = _BackendTokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer_config = _read_json(directory / "tokenizer_config.json")

    def special_id(name: str) -> int | None:
        token = tokenizer_config.get(name)
        if isinstance(token, Mapping):
            token = token.get("content")
        return backend.token_to_id(token) if isinstance(token, str) else None

    model_config = _read_json(directory / "config.json")
    generation_config = _read_json(directory / "generation_config.json")
    extra_eos = (as_id_list(model_config.get("eos_token_id"))
                 + as_id_list(generation_config.get("eos_token_id")))
    eos_token_id = special_id("eos_token")
    if eos_token_id is None and extra_eos:
        eos_token_id = extra_eos[0]
    bos_token_id = special_id("bos_token")
    if bos_token_id is None:
        bos_ids = as_id_list(generation_config.get("bos_token_id",
                                                   model_config.get("bos_token_id")))
        bos_token_id = bos_ids[0] if bos_ids else None
    return Tokenizer(backend, chat_template=_hf_chat_template(directory, tokenizer_config),
                     bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                     extra_eos_token_ids=extra_eos, unk_token_id=special_id("unk_token"),
                     pad_token_id=special_id("pad_token"))
