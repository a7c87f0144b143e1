"""transformers' own reading of a GGUF file (`from_pretrained(..., gguf_file=...)`), the reference
the loader, tokenizer and engine tests compare against, without its repeated set-up work.

transformers builds a `gguf.GGUFReader` (which parses every metadata array element by element:
SmolLM2's 49,152 tokens and 48,900 merges) each time it reads the file: twice for a model (config,
then weights), once more for each tokenizer; and it builds the same `gguf.TensorNameMap` once per
module of the model (~400 times for SmolLM2). Inside `quick_gguf_reading()` both are built once
per process: a reader per (path, mode), shared (it memory-maps the file read-only, so nobody can
write through it), and the name map per (architecture, number of blocks). What transformers reads
and computes from them is unchanged: the same weights and tokenizer, bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_READERS: dict[tuple[str, str], Any] = {}


@contextmanager
def quick_gguf_reading() -> Iterator[None]:
    """Within the block, `gguf.GGUFReader` and `gguf.get_tensor_name_map` (which transformers
    imports from `gguf` at each call) return the process's shared instances."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def shared_reader(path: Any, mode: str = "r") -> Any:
        key = (str(path), mode)
        if key not in _READERS:
            _READERS[key] = reader_class(path, mode)
        return _READERS[key]

    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = _cached_name_map(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


@functools.cache
def _cached_name_map(name_map: Any) -> Any:
    return functools.cache(name_map)
