"""BERT-style encoder checkpoints (sentence-transformers layout) -> `EncoderCheckpoint`.

A checkpoint is a directory, or a zip of one (read in place: the default embedding model ships
as a zip), holding:

    config.json                  model_type "bert" (BertModel: all-MiniLM, BGE, GTE)
    model.safetensors            tensors under BertModel's names (a "bert." prefix is dropped)
    tokenizer.json               the fast tokenizer; its own truncation and padding are turned off
    modules.json                 optional: a `...Normalize` module turns on L2 normalization
    1_Pooling/config.json        optional: pooling_mode_cls_token / pooling_mode_mean_tokens
                                 (the folder modules.json names for its Pooling module)
    sentence_bert_config.json    optional: max_seq_length

Without sentence-transformers files the model pools by mean, unnormalized, up to
max_position_embeddings tokens. Pooling modes other than mean and CLS (max, mean-sqrt-len,
weighted) and a second segment (token_type 1) are refused or unused: one
`UnsupportedCheckpointError` line.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from contracts.default_model import DEFAULT_EMBEDDING_MODEL_NAME, default_embedding_model_path
from engine.embedding.config import EncoderConfig, Pooling
from engine.loader.checkpoint import UnsupportedCheckpointError
from engine.models.bert import ACTIVATIONS

ENCODER_MODEL_TYPES = ("bert",)
_UNSUPPORTED_POOLING = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")


@dataclass(frozen=True)
class EncoderCheckpoint:
    config: EncoderConfig
    weights: dict[str, torch.Tensor]
    tokenizer_json: str  # tokenizer.json's text


class _Files:
    """Reads a checkpoint's files from a directory or a zip (entries at its root or under one
    top folder)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._zip: zipfile.ZipFile | None = None
        self._prefix = ""
        if path.is_file() and zipfile.is_zipfile(path):
            self._zip = zipfile.ZipFile(path)
            names = self._zip.namelist()
            if "config.json" not in names:
                tops = {n.split("/", 1)[0] for n in names if "/" in n}
                if len(tops) == 1 and f"{next(iter(tops))}/config.json" in names:
                    self._prefix = next(iter(tops)) + "/"

    def read(self, name: str) -> bytes | None:
        if self._zip is not None:
            try:
                return self._zip.read(self._prefix + name)
            except KeyError:
                return None
        file = self.path / name
        return file.read_bytes() if file.is_file() else None

    def json(self, name: str) -> Any:
        raw = self.read(name)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise UnsupportedCheckpointError(f"{self.path}: {name} is not JSON: {exc}") from None

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()


def is_encoder_checkpoint(path: str | Path) -> bool:
    """True for a directory or zip whose config.json has an encoder `model_type` (bert)."""
    path = Path(path)
    if not (path.is_dir() or (path.is_file() and zipfile.is_zipfile(path))):
        return False
    files = _Files(path)
    try:
        config = files.json("config.json")
    except UnsupportedCheckpointError:
        return False
    finally:
        files.close()
    return isinstance(config, dict) and config.get("model_type") in ENCODER_MODEL_TYPES


def model_id_of(path: Path) -> str:
    """The served name: the bundled model's own name, else the directory's (or zip's stem)."""
    try:
        if path.resolve() == default_embedding_model_path().resolve():
            return DEFAULT_EMBEDDING_MODEL_NAME
    except FileNotFoundError:
        pass
    return path.stem if path.is_file() else path.name


def load_encoder_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32
                            ) -> EncoderCheckpoint:
    """Read the checkpoint at `path` (directory or zip); weights cast to `dtype` on CPU."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    files = _Files(path)
    try:
        raw_config = files.json("config.json")
        if not isinstance(raw_config, dict):
            raise FileNotFoundError(f"{path} has no config.json")
        config = encoder_config(raw_config, files, model_id_of(path))
        weights = _read_weights(files, dtype)
        tokenizer = files.read("tokenizer.json")
        if tokenizer is None:
            raise UnsupportedCheckpointError(f"{path} has no tokenizer.json")
    finally:
        files.close()
    return EncoderCheckpoint(config, weights, tokenizer.decode("utf-8"))


def encoder_config(raw: dict[str, Any], files: _Files, model_id: str) -> EncoderConfig:
    model_type = raw.get("model_type")
    if model_type not in ENCODER_MODEL_TYPES:
        raise UnsupportedCheckpointError(
            f"model_type {model_type!r} is not an encoder this engine embeds with "
            f"(supported: {list(ENCODER_MODEL_TYPES)})")
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedCheckpointError(
            f"position_embedding_type {raw['position_embedding_type']!r} (absolute only)")
    pooling, normalize = _pooling(files)
    st_config = files.json("sentence_bert_config.json") or {}
    max_position = int(raw["max_position_embeddings"])
    max_seq_length = int(st_config.get("max_seq_length") or max_position)
    hidden_act = str(raw.get("hidden_act", "gelu"))
    if hidden_act not in ACTIVATIONS:
        raise UnsupportedCheckpointError(f"hidden_act {hidden_act!r} (supported: "
                                         f"{sorted(ACTIVATIONS)})")
    try:
        return EncoderConfig(
            model_id=model_id, vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]), num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            max_position_embeddings=max_position,
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)), hidden_act=hidden_act,
            pad_token_id=int(raw.get("pad_token_id") or 0),
            max_seq_length=min(max_seq_length, max_position), pooling=pooling,
            normalize=normalize)
    except KeyError as exc:
        raise UnsupportedCheckpointError(f"config.json has no {exc.args[0]!r}") from None


def _pooling(files: _Files) -> tuple[Pooling, bool]:
    """(pooling, normalize) from modules.json and the Pooling
    module's config; mean and unnormalized without them."""
    modules = files.json("modules.json")
    pooling_dir, normalize = "1_Pooling", False
    if isinstance(modules, list):
        for module in modules:
            kind = str(module.get("type", "")) if isinstance(module, dict) else ""
            if kind.endswith(".Pooling"):
                pooling_dir = str(module.get("path") or pooling_dir)
            elif kind.endswith(".Normalize"):
                normalize = True
    folder = str(PurePosixPath(pooling_dir))
    config = files.json(f"{folder}/config.json") or {}
    for mode in _UNSUPPORTED_POOLING:
        if config.get(mode):
            raise UnsupportedCheckpointError(f"{folder}/config.json: {mode} is not supported "
                                             "(mean or cls pooling)")
    if config.get("pooling_mode_cls_token") and config.get("pooling_mode_mean_tokens"):
        raise UnsupportedCheckpointError(f"{folder}/config.json: both cls and mean pooling "
                                         "(concatenated) is not supported")
    return ("cls" if config.get("pooling_mode_cls_token") else "mean"), normalize


def _read_weights(files: _Files, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load as load_safetensors

    raw = files.read("model.safetensors")
    if raw is None:
        raise UnsupportedCheckpointError(f"{files.path} has no model.safetensors")
    tensors = load_safetensors(raw)
    del raw
    weights = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("bert.")
        weights[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return weights
