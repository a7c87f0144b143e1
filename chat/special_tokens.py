"""Which token ids end a generation.

A checkpoint names one eos id (GGUF `tokenizer.ggml.eos_token_id`, HF `eos_token_id`), but chat
models also stop on their end-of-turn token, and the base model's end-of-text token may appear
too. The stop set is the declared ids, in order, then every token of `END_OF_TURN_TOKENS` that the
vocabulary holds. Both `ModelConfig.eos_token_ids` and `Tokenizer.eos_token_ids` come from here, so
the engine and the gateway agree.

gpt-oss's harmony format is the exception: `<|end|>` ends a message, not the turn (the analysis
message comes before the final one), so a vocabulary with `<|channel|>` stops on `<|return|>`
and `<|call|>` (openai-harmony's stop tokens for assistant actions) and never on `<|end|>`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>",
                      # ... Gemma's, Llama 4's (a GGUF declares one eos)
                      "<end_of_turn>", "<|eot|>")
# harmony (gpt-oss): `<|end|>` closes one message of a turn (the analysis before the answer), so
# the turn ends on `<|return|>` (answered) or `<|call|>` (a tool call) instead
HARMONY_CHANNEL_TOKEN = "<|channel|>"
HARMONY_END_OF_TURN_TOKENS = ("<|return|>", "<|call|>", "<|endoftext|>")


def as_id_list(value: object) -> list[int]:
    """An HF `eos_token_id` field (int, list of ints, or absent) as a list."""
    if value is None:
        return []
    if isinstance(value, bool):
        raise TypeError(f"token id must be an int, got {value!r}")
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    raise TypeError(f"token id must be an int or a list of ints, got {value!r}")


def collect_eos_token_ids(
    declared_ids: Iterable[int], token_to_id: Callable[[str], int | None]
) -> tuple[int, ...]:
    """`declared_ids` (deduplicated, order kept) followed by the end-of-turn tokens in the vocab
    (a harmony vocabulary's own, without `<|end|>`, even where a checkpoint declares it)."""
    is_harmony = token_to_id(HARMONY_CHANNEL_TOKEN) is not None
    message_end = token_to_id("<|end|>") if is_harmony else None
    ids: list[int] = []
    for token_id in declared_ids:
        if token_id not in ids and token_id != message_end:
            ids.append(token_id)
    for token in HARMONY_END_OF_TURN_TOKENS if is_harmony else END_OF_TURN_TOKENS:
        found = token_to_id(token)
        if found is not None and found not in ids:
            ids.append(found)
    return tuple(ids)
