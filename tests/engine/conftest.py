"""Session fixtures for engine tests that run the real default model (SmolLM2-135M, float32, 1
thread).

The checkpoint is read ONCE per session; every engine built here shares its weight tensors
(read-only). Engines are cached per configuration (`make_engine`), so a test must leave its engine
idle (no unfinished requests) — `drive()` in fakes.py always runs requests to completion.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine

MiB = 1 << 20


@pytest.fixture(scope="session")
def model_path() -> str:
    from engine.loader import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="session")
def checkpoint(model_path: str) -> Any:
    from engine.loader import load_checkpoint

    torch.set_num_threads(1)
    return load_checkpoint(model_path, dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def tokenizer(model_path: str) -> Any:
    from engine.loader import load_tokenizer

    return load_tokenizer(model_path)


EngineFactory = Callable[..., LLMEngine]


@pytest.fixture(scope="session")
def make_engine(model_path: str, checkpoint: Any, tokenizer: Any) -> EngineFactory:
    """make_engine(kv_cache_memory_bytes=..., max_num_batched_tokens=..., max_num_seqs=...,
    enable_prefix_caching=..., fresh=False) -> an LLMEngine over the shared weights.

    Engines with equal settings are shared between tests unless `fresh=True` (then the prefix cache
    and the event log start empty)."""
    from engine.model_runner import ModelRunner

    engines: dict[tuple, LLMEngine] = {}  # type: ignore[type-arg]

    def make(kv_cache_memory_bytes: int = 256 * MiB, max_num_batched_tokens: int = 512,
             max_num_seqs: int = 64, enable_prefix_caching: bool = True,
             fresh: bool = False) -> LLMEngine:
        key = (kv_cache_memory_bytes, max_num_batched_tokens, max_num_seqs, enable_prefix_caching)
        if not fresh and key in engines:
            engine = engines[key]
            assert not engine.has_unfinished_requests, ("a previous test left requests in this "
                                                        "engine")
            return engine
        config = EngineConfig(
            model_path=model_path, num_threads=1, dtype="float32",
            cache=CacheConfig(kv_cache_memory_bytes=kv_cache_memory_bytes,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                      max_num_seqs=max_num_seqs))
        runner = ModelRunner(config, checkpoint.config, dict(checkpoint.weights),
                             dict(checkpoint.raw))
        engine = LLMEngine(config, checkpoint.config, runner, tokenizer)
        if not fresh:
            engines[key] = engine
        return engine

    return make


@pytest.fixture(scope="session")
def engine(make_engine: EngineFactory) -> LLMEngine:
    """The default test engine: 256 MiB of KV (364 blocks of 16 tokens), 512 tokens per step."""
    return make_engine()


@pytest.fixture(scope="session")
def hf_model(model_path: str) -> Any:
    """Hugging Face transformers' own reading of the same GGUF file (slow: ~30 s; load once;
    tests/transformers_gguf.py takes out its repeated set-up)."""
    from pathlib import Path

    import transformers

    from tests.transformers_gguf import quick_gguf_reading

    torch.set_num_threads(1)
    path = Path(model_path)
    with quick_gguf_reading():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()
