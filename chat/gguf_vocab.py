"""A `tokenizers.Tokenizer` rebuilt from GGUF metadata (no tokenizer.json in a GGUF).

Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`: GPT-2, Llama 3, Qwen2,
SmolLM...) are supported; sentencepiece ("llama") GGUFs need their Hugging Face directory.

  - model: BPE over `tokenizer.ggml.tokens` and `tokenizer.ggml.merges`, configured as
    transformers' GPT2Tokenizer (no subword prefix or suffix, no byte fallback). A token not
    spelled in the byte alphabet is respelled byte-wise, as transformers does.
  - pre-tokenizer: llama.cpp's split for `tokenizer.ggml.pre` (table below), then ByteLevel.
    "smollm" (like "starcoder") isolates every digit and then applies GPT-2's regex: exactly the
    `Digits(individual_digits=True) + ByteLevel` of SmolLM2's own tokenizer.json.
    Unknown names fall back to GPT-2's regex.
  - special tokens: CONTROL tokens (type 3) are added as special, USER_DEFINED (type 4) as plain
    added tokens, both unnormalised, so `<|im_start|>` in text is matched whole.
  - post-processor: prepends the bos token when `tokenizer.ggml.add_bos_token` is true (and
    appends eos for `add_eos_token`), applied by `encode(..., add_special_tokens=True)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "megrez": _QWEN2_SPLIT,
    "gpt-4o": _GPT4O_SPLIT, "llama4": _GPT4O_SPLIT,
}
_DIGIT_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva-7b"}


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character table."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre in _DIGIT_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _post_processor(tokens: list[str], metadata: Mapping[str, object]) -> processors.PostProcessor:
    prefix: list[tuple[str, int]] = []
    suffix: list[tuple[str, int]] = []
    bos, eos = (metadata.get("tokenizer.ggml.bos_token_id"),
                metadata.get("tokenizer.ggml.eos_token_id"))
    if metadata.get("tokenizer.ggml.add_bos_token") and isinstance(bos, int):
        prefix.append((tokens[bos], bos))
    if metadata.get("tokenizer.ggml.add_eos_token") and isinstance(eos, int):
        suffix.append((tokens[eos], eos))
    single = [t for t, _ in prefix] + ["$A"] + [t for t, _ in suffix]
    pair = single + [t for t, _ in prefix] + ["$B:1"] + [t for t, _ in suffix]
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=sorted(set(prefix + suffix)))


def build_gguf_tokenizer(metadata: Mapping[str, object]) -> Tokenizer:
    """The tokenizer described by a GGUF file's metadata (see the module docstring)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2'); "
            "load the model's Hugging Face directory instead")
    tokens = list(metadata["tokenizer.ggml.tokens"])  # type: ignore[call-overload]
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [])  # type: ignore[call-overload]
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]  # type: ignore[attr-defined]

    alphabet = byte_alphabet()
    allowed = set(alphabet.values())
    spelled = [t if set(t) <= allowed else "".join(alphabet[b] for b in t.encode("utf-8"))
               for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    bpe = models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                     end_of_word_suffix="", fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre"))  # type: ignore[arg-type]
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(tokens, metadata)

    control = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, token_types, strict=False)
               if kind == TOKEN_TYPE_CONTROL and set(t) <= allowed]
    user_defined = [AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, token_types, strict=False)
                    if kind == TOKEN_TYPE_USER_DEFINED and t in vocab]
    if control:
        tokenizer.add_special_tokens(control)
    if user_defined:
        tokenizer.add_tokens(user_defined)
    return tokenizer
