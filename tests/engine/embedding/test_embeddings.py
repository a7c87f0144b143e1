"""The embedding path against transformers: the bundled all-MiniLM-L6-v2 and tiny random
BertModels (mean and CLS pooling) give transformers' vectors + the sentence-transformers pooling
within 1e-5 cosine; inputs of several requests share a forward pass; bad checkpoints fail at
load."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.embedding.config import EmbedderConfig
from engine.embedding.embedder import Embedder
from engine.embedding.pooling import shorten
from engine.loader.checkpoint import UnsupportedCheckpointError
from engine.loader.hf_bert import is_encoder_checkpoint, load_encoder_checkpoint
from tests.embedding_models import (
    extract_default_embedding_model,
    reference_vectors,
    write_tiny_bert,
)

# held out: written for this test, not taken from the model's training or card examples
HELD_OUT = [
    "Paged attention keeps each sequence's keys and values in fixed-size blocks.",
    "ok",
    "Le chat dort sur le canapé depuis ce matin, et personne n'ose le réveiller.",
    "1234 5678 — numbers, dashes & symbols: %$#@!",
    "A gateway meters every token, " * 20,  # ~150 tokens: the long end of one pass
    "東京は雨です。",
]


def _cosines(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)


def _embed_each(embedder: Embedder, token_ids: list[list[int]]) -> np.ndarray:
    """Every input as its own request, all in flight at once."""
    async def run() -> list[np.ndarray]:
        return await asyncio.gather(*(embedder.embed([ids]) for ids in token_ids))
    return np.concatenate(asyncio.run(run()))


@pytest.fixture(scope="module")
def minilm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return extract_default_embedding_model(tmp_path_factory.mktemp("minilm"))


def test_minilm_vectors_equal_transformers_with_its_pooling(default_embedder: Any,
                                                            minilm_dir: Path) -> None:
    from transformers import AutoTokenizer

    config = default_embedder.config
    assert (config.pooling, config.normalize, config.max_seq_length, config.dimensions) == (
        "mean", True, 256, 384)
    hf_tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    ids = default_embedder.tokenize(HELD_OUT)
    assert ids == [hf_tokenizer(text)["input_ids"] for text in HELD_OUT]
    ours = _embed_each(default_embedder, ids)
    ref = reference_vectors(minilm_dir, ids, "mean", normalize=True).numpy()
    assert np.all(1 - _cosines(ours, ref) < 1e-5)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize(("pooling", "normalize"), [("mean", False), ("cls", True)])
def test_tiny_random_bert_equals_transformers(tmp_path: Path, pooling: str,
                                              normalize: bool) -> None:
    directory = write_tiny_bert(tmp_path / "tiny", pooling=pooling, normalize=normalize)
    embedder = Embedder.load(directory)
    try:
        assert (embedder.config.pooling, embedder.config.normalize) == (pooling, normalize)
        assert embedder.config.max_seq_length == 48
        texts = ["the cat sat on the mat", "a dog runs fast !", "hello", "blue vectors , red " * 6]
        ids = embedder.tokenize(texts)
        ours = _embed_each(embedder, ids)
        ref = reference_vectors(directory, ids, pooling, normalize).numpy()
        assert np.all(1 - _cosines(ours, ref) < 1e-5)
        if not normalize:  # unnormalized: the vectors themselves match, not only directions
            assert np.allclose(ours, ref, atol=1e-4)
    finally:
        embedder.shutdown()


def test_inputs_of_several_requests_share_one_pass(default_embedder: Any) -> None:
    ids = default_embedder.tokenize([f"request number {i} about caches" for i in range(12)])
    alone = np.concatenate([asyncio.run(default_embedder.embed([row])) for row in ids])
    before = default_embedder.stats().num_passes_total
    together = _embed_each(default_embedder, ids)  # 12 requests in flight at once
    num_passes = default_embedder.stats().num_passes_total - before
    assert num_passes < len(ids)  # batched across requests
    assert np.all(1 - _cosines(together, alone) < 1e-5)  # padding changes nothing


def test_passes_stay_within_the_token_budget(tmp_path: Path) -> None:
    directory = write_tiny_bert(tmp_path / "tiny")
    embedder = Embedder.load(directory, EmbedderConfig(max_num_batched_tokens=64, max_num_inputs=3))
    try:
        ids = embedder.tokenize(["the cat"] * 5 + ["the cat sat on the mat " * 3] * 2)
        vectors = _embed_each(embedder, ids)
        stats = embedder.stats()
        assert stats.num_passes_total >= 3  # 7 inputs, at most 3 a pass
        assert stats.num_prompt_tokens_total == sum(map(len, ids))
        ref = reference_vectors(directory, ids, "mean", normalize=True).numpy()
        assert np.all(1 - _cosines(vectors, ref) < 1e-5)
    finally:
        embedder.shutdown()


def test_shorten_keeps_a_prefix_at_unit_length() -> None:
    vectors = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    short = shorten(vectors, 4, renormalize=True)
    assert short.shape == (3, 4)
    assert np.allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-6)
    assert np.all(1 - _cosines(short, vectors[:, :4]) < 1e-6)
    assert np.array_equal(shorten(vectors, 4, renormalize=False), vectors[:, :4])


def test_an_encoder_is_told_from_a_chat_checkpoint(tmp_path: Path, model_path: str) -> None:
    directory = write_tiny_bert(tmp_path / "tiny")
    assert is_encoder_checkpoint(directory)
    assert not is_encoder_checkpoint(model_path)  # the GGUF chat model
    assert not is_encoder_checkpoint(tmp_path / "missing")


def test_unsupported_pooling_is_one_line_at_load(tmp_path: Path) -> None:
    directory = write_tiny_bert(tmp_path / "tiny")
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_max_tokens": True}))
    with pytest.raises(UnsupportedCheckpointError, match="pooling_mode_max_tokens"):
        load_encoder_checkpoint(directory)


def test_a_checkpoint_with_a_stray_tensor_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from engine.models.bert import BertEncoder
    from engine.models.weights import CheckpointMismatchError

    directory = write_tiny_bert(tmp_path / "tiny")
    weights = load_file(directory / "model.safetensors")
    weights["encoder.layer.0.attention.self.rotary.weight"] = torch.zeros(2)
    save_file(weights, directory / "model.safetensors")
    checkpoint = load_encoder_checkpoint(directory)
    with pytest.raises(CheckpointMismatchError, match="no bert layer uses"):
        BertEncoder(checkpoint.config, dict(checkpoint.weights), torch.device("cpu"))


def test_a_full_queue_refuses_instead_of_growing(tmp_path: Path) -> None:
    from engine.embedding.embedder import EmbedderBusy

    embedder = Embedder.load(write_tiny_bert(tmp_path / "tiny"),
                             EmbedderConfig(max_num_queued_inputs=4, max_num_queued_tokens=20))
    try:
        ids = embedder.tokenize(["the cat sat on the mat"] * 5)  # 8 tokens each
        with pytest.raises(EmbedderBusy):
            asyncio.run(embedder.embed(ids))  # 5 inputs > 4
        with pytest.raises(EmbedderBusy):
            asyncio.run(embedder.embed(ids[:3]))  # 24 tokens > 20
        assert asyncio.run(embedder.embed(ids[:2])).shape == (2, 32)  # and it still serves
    finally:
        embedder.shutdown()
