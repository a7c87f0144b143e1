"""Embedding models for tests: the bundled all-MiniLM-L6-v2 (extracted for transformers), and tiny
random BertModels that transformers writes here, in sentence-transformers layout."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import torch

TINY_WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "runs", "fast", "slow", "red", "blue",
              "##s", "##ing", "hello", "world", "embedding", "vector", "model", ",", ".", "!"]


def extract_default_embedding_model(directory: Path) -> Path:
    """The bundled model's zip, unpacked into `directory` (transformers reads directories)."""
    from contracts.default_model import default_embedding_model_path

    with zipfile.ZipFile(default_embedding_model_path()) as archive:
        archive.extractall(directory)
    return directory


def write_tiny_bert(directory: Path, pooling: str = "mean", normalize: bool = True,
                    seed: int = 0) -> Path:
    """A random 2-layer BertModel (hidden 32) saved by transformers, a WordPiece tokenizer.json,
    and the sentence-transformers files for `pooling` ("mean" | "cls") and `normalize`."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece
    from transformers import BertConfig, BertModel

    directory.mkdir(parents=True, exist_ok=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {token: i
             for i, token in enumerate(specials + TINY_WORDS + list("abcdefghijklmnopqrstuvwxyz"))}
    tokenizer = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.save(str(directory / "tokenizer.json"))
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    BertModel(config).eval().save_pretrained(directory, safe_serialization=True)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False}))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48}))
    return directory


def reference_vectors(directory: Path, token_ids: list[list[int]], pooling: str,
                      normalize: bool) -> torch.Tensor:
    """transformers' BertModel on `token_ids` (padded, one batch) + the sentence-transformers
    pooling: the vectors ours must equal."""
    from transformers import BertModel

    model = BertModel.from_pretrained(directory).eval()
    width = max(map(len, token_ids))
    ids = torch.zeros(len(token_ids), width, dtype=torch.long)
    mask = torch.zeros(len(token_ids), width, dtype=torch.long)
    for row, item in enumerate(token_ids):
        ids[row, :len(item)] = torch.tensor(item)
        mask[row, :len(item)] = 1
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    if pooling == "cls":
        vectors = hidden[:, 0]
    else:
        weights = mask[:, :, None].to(hidden.dtype)
        vectors = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(vectors, dim=-1) if normalize else vectors
