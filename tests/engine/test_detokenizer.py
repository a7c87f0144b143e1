"""IncrementalDetokenizer with real ByteLevel BPE tokenizers: one trained here, one from the
GGUF."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.detokenizer import IncrementalDetokenizer

EOS = "<|endoftext|>"
MULTIBYTE_TEXT = "héllo 🌍 世界世界 wörld 👨‍👩‍👧 naïve 日本語のテキスト end"


def train_byte_level_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "hello world, the quick brown fox jumps over the lazy dog",
        "stop here please. abc abcd ab bc cab",
        "世界世界 日本語のテキスト 🌍🌍 👨‍👩‍👧",  # merges that end inside a character
    ]
    tokenizer.train_from_iterator(corpus * 20, trainer)
    return tokenizer


def smollm2_tokenizer() -> Tokenizer:
    from engine import loader  # (our own module: a failed import fails the test, never a skip)

    wrapper = loader.load_tokenizer(loader.default_model_path())
    return getattr(wrapper, "backend", None) or wrapper._backend


@pytest.fixture(scope="module", params=["trained-bpe", "smollm2-gguf"])
def tokenizer(request) -> Tokenizer:
    return train_byte_level_bpe() if request.param == "trained-bpe" else smollm2_tokenizer()


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def push_in_chunks(
    detokenizer: IncrementalDetokenizer, ids: Sequence[int], chunk_sizes: Sequence[int] = (1,)
) -> list[str]:
    """Pushes ids in chunks of the given sizes (cycled); returns each push's released text."""
    pieces, position, step = [], 0, 0
    while position < len(ids):
        size = chunk_sizes[step % len(chunk_sizes)]
        pieces.append(detokenizer.push(ids[position : position + size]).text)
        position, step = position + size, step + 1
    return pieces


def cut_at_first_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Reference: the text before the stop string that is complete first (ties: starts first)."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    _, start, stop = min(found)
    return text[:start], stop


def test_multibyte_characters_never_come_out_as_replacement_chars(tokenizer):
    ids = encode(tokenizer, MULTIBYTE_TEXT)
    assert len(ids) > len(MULTIBYTE_TEXT.split())  # characters really are split across tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = push_in_chunks(detokenizer, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + detokenizer.finish() == MULTIBYTE_TEXT


@pytest.mark.parametrize("chunk_sizes", [(1,), (2, 3), (5, 1, 7), (1000,)])
def test_concatenated_pushes_equal_the_full_decode(tokenizer, chunk_sizes):
    text = "The quick brown fox 🦊 jumps over 世界 — twice, 12345 times. " + MULTIBYTE_TEXT
    ids = encode(tokenizer, text)
    detokenizer = IncrementalDetokenizer(tokenizer)
    released = "".join(push_in_chunks(detokenizer, ids, chunk_sizes)) + detokenizer.finish()
    assert released == tokenizer.decode(ids, skip_special_tokens=True) == text


def test_stop_string_spanning_tokens_is_cut_and_reported(tokenizer):
    ids = encode(tokenizer, "hello world, stop here please and more")
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["stop here"])
    updates = [detokenizer.push([token_id]) for token_id in ids]
    assert "".join(u.text for u in updates) == "hello world, "
    first_match = next(i for i, u in enumerate(updates) if u.stop_matched is not None)
    assert updates[first_match].stop_matched == "stop here"
    assert all(u.stop_matched is None for u in updates[:first_match])
    assert all(u == updates[-1] for u in updates[first_match + 1 :])  # ("", "stop here")
    assert detokenizer.stop_matched == "stop here"


def test_stop_at_the_very_start_releases_nothing(tokenizer):
    ids = encode(tokenizer, "stop here please")
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["stop"])
    pieces = push_in_chunks(detokenizer, ids)
    assert "".join(pieces) == ""
    assert detokenizer.stop_matched == "stop"
    assert detokenizer.finish() == ""


@pytest.mark.parametrize(
    ("stops", "expected_text", "expected_stop"),
    [
        (["abc", "ab"], "cb x ", "ab"),  # "ab" is complete before "abc"
        (["abcd", "bc"], "cb x a", "bc"),  # the shorter one inside the longer one wins
        (["x abc", "abc"], "cb ", "x abc"),  # same end: the one starting first
    ],
)
def test_overlapping_stop_candidates_first_completed_wins(
    tokenizer, stops, expected_text, expected_stop
):
    ids = encode(tokenizer, "cb x abcd tail")
    for chunk_sizes in [(1,), (len(ids),), (2, 1)]:
        detokenizer = IncrementalDetokenizer(tokenizer, stop=stops)
        released = "".join(push_in_chunks(detokenizer, ids, chunk_sizes)) + detokenizer.finish()
        assert (released, detokenizer.stop_matched) == (expected_text, expected_stop)


def test_text_that_might_start_a_stop_is_held_then_released_at_finish(tokenizer):
    ids = encode(tokenizer, "hello wor")
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["world!"])
    released = "".join(push_in_chunks(detokenizer, ids))
    assert released == "hello "
    assert detokenizer.finish() == "wor"
    assert detokenizer.stop_matched is None


def test_held_text_is_released_once_it_can_no_longer_match(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["world!"])
    first = "".join(push_in_chunks(detokenizer, encode(tokenizer, "hello wor")))
    later = "".join(push_in_chunks(detokenizer, encode(tokenizer, "ld?")))
    assert first + later == "hello world?"
    assert detokenizer.finish() == ""


def test_nothing_after_the_stop_is_released(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["."])
    update = detokenizer.push(encode(tokenizer, "one. two. three"))
    assert (update.text, update.stop_matched) == ("one", ".")
    later = detokenizer.push(encode(tokenizer, " four"))
    assert (later.text, later.stop_matched) == ("", ".")
    assert detokenizer.finish() == ""


def test_a_huge_stop_string_costs_its_length_not_its_square(tokenizer):
    # every prefix of a 200k-character stop was kept in a set: ~40 GB built on the engine thread,
    # which stalled every request and got the replica OOM-killed
    import tracemalloc

    tracemalloc.start()
    try:
        detokenizer = IncrementalDetokenizer(tokenizer, stop=["é" * 200_000, "world!"])
        released = "".join(push_in_chunks(detokenizer, encode(tokenizer, "hello wor é")))
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 10_000_000
    assert released == "hello wor "  # " é" may start the huge stop: held
    assert detokenizer.finish() == "é"


def test_multibyte_stop_string(tokenizer):
    ids = encode(tokenizer, "hello 世界世界 end")
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["界世"])
    assert "".join(push_in_chunks(detokenizer, ids)) == "hello 世"
    assert detokenizer.stop_matched == "界世"


def test_truncated_character_is_decoded_at_finish_like_the_full_decode(tokenizer):
    ids = encode(tokenizer, "ok 👨‍👩‍👧")[:-1]  # the last emoji loses its final byte(s)
    detokenizer = IncrementalDetokenizer(tokenizer)
    released = "".join(push_in_chunks(detokenizer, ids))
    assert "\ufffd" not in released
    assert released + detokenizer.finish() == tokenizer.decode(ids)


def test_special_tokens_are_skipped_or_kept_as_asked(tokenizer):
    eos_id = tokenizer.token_to_id(EOS)
    ids = [*encode(tokenizer, "done"), eos_id]
    skipping = IncrementalDetokenizer(tokenizer)
    assert "".join(push_in_chunks(skipping, ids)) + skipping.finish() == "done"
    keeping = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(push_in_chunks(keeping, ids)) + keeping.finish() == "done" + EOS


def test_random_texts_match_the_reference_cut_and_hold_at_most_the_longest_stop(tokenizer):
    rng = random.Random(0)
    alphabet = ["a", "b", "c", " ", "ab", "世", "界", "🌍", "."]
    for _ in range(60):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25)))
        stops = ["".join(rng.choice("abc 世界") for _ in range(rng.randint(1, 4))) for _ in "ab"]
        ids = encode(tokenizer, text)
        chunk_sizes = [rng.randint(1, 3) for _ in range(3)]
        detokenizer = IncrementalDetokenizer(tokenizer, stop=stops)
        released, position, step = "", 0, 0
        while position < len(ids):
            end = position + chunk_sizes[step % 3]
            released += detokenizer.push(ids[position:end]).text
            position, step = end, step + 1
            decoded_so_far = tokenizer.decode(ids[:position])
            if detokenizer.stop_matched is None and "\ufffd" not in decoded_so_far:
                assert decoded_so_far.startswith(released)
                assert len(decoded_so_far) - len(released) <= max(map(len, stops)) - 1
        released += detokenizer.finish()
        assert (released, detokenizer.stop_matched) == cut_at_first_stop(text, stops), (
            text,
            stops,
        )
