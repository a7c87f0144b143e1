"""Encoding a long text releases the GIL (chat.tokenizer.encode_ids): a multi-MB prompt
encoded in a worker thread must not stall the event loop's thread (a 25 MB count_tokens body froze
the gateway, /health included, for 54 s)."""

from __future__ import annotations

import threading
import time

from chat.tokenizer import GIL_FREE_MIN_CHARS, encode_ids, load_tokenizer
from contracts.default_model import default_model_path


def test_long_and_short_texts_encode_to_the_same_ids_either_way() -> None:
    backend = load_tokenizer(default_model_path()).backend
    for text in ("Hello, world! ", "naïve café 🙂 <|im_start|>user\n" * 300):
        assert encode_ids(backend, text) == list(backend.encode(text).ids)
    assert len("naïve café 🙂 <|im_start|>user\n" * 300) >= GIL_FREE_MIN_CHARS


def test_encoding_a_long_text_in_a_thread_lets_other_threads_run() -> None:
    tokenizer = load_tokenizer(default_model_path())
    text = "The quick brown fox jumps over the lazy dog. " * 40_000  # 1.8 MB, ~1-2 s to encode
    done = threading.Event()
    worker = threading.Thread(target=lambda: (tokenizer.encode(text), done.set()))
    ticks = 0
    started = time.perf_counter()
    worker.start()
    while not done.is_set():
        time.sleep(0.001)
        ticks += 1
    worker.join()
    elapsed = time.perf_counter() - started
    # with the GIL held for the whole encode this thread wakes once or twice; released, every ms
    assert elapsed < 0.05 or ticks >= 20, (ticks, elapsed)
