"""Checkpoint and tokenizer loading.

    default_model_path()               the bundled SmolLM2-135M-Instruct Q4_1 GGUF
    load_checkpoint(path, dtype, ...)  -> Checkpoint(config, weights, raw)      (imports torch)
    load_tokenizer(path)               -> Tokenizer (encode/decode/chat template; no torch;
                                          re-exported from chat/, where it lives)

`path` is a GGUF file or a Hugging Face directory (config.json + *.safetensors + tokenizer.json).
torch-dependent names are imported lazily so that the gateway can import the tokenizer alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from chat.tokenizer import Tokenizer, load_tokenizer
from contracts.default_model import default_model_path

if TYPE_CHECKING:
    from engine.loader.checkpoint import Checkpoint, RawQuantized, load_checkpoint

_LAZY = {"Checkpoint", "RawQuantized", "load_checkpoint"}

__all__ = ["Checkpoint", "RawQuantized", "Tokenizer", "default_model_path", "load_checkpoint",
           "load_tokenizer"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from engine.loader import checkpoint
        return getattr(checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
