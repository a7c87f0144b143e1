"""The embeddings wire (OpenAI `POST /v1/embeddings`), shared by the gateway's dialect and the
replica: what `input` may be, and how a vector is written in each `encoding_format`.

    input            "text" | ["text", ...] | [id, ...] | [[id, ...], ...]   (non-empty, no empty
                     string or id list, at most MAX_NUM_INPUTS inputs)
    encoding_format  "float" (a JSON array of numbers) | "base64" (the float32 little-endian
                     bytes, base64: what the openai SDK asks for by default and decodes itself)
    dimensions       >= 1: the first `dimensions` of each vector (renormalized by the replica
                     when the model's vectors are unit length, as OpenAI's text-embedding-3)

Vectors travel inside the gateway as float32 little-endian bytes (`vector_from_wire`).
Torch- and numpy-free: the gateway runs without either.
"""

from __future__ import annotations

import base64
import binascii
import sys
from array import array
from typing import Any, Literal

MAX_NUM_INPUTS = 2048  # OpenAI's limit per request
MAX_TOKEN_ID = 2**31 - 1
EncodingFormat = Literal["float", "base64"]
ENCODING_FORMATS = ("float", "base64")
EmbeddingInput = str | list[int]


class EmbeddingInputError(ValueError):
    """A malformed `input` (or other field); `param` names it."""

    def __init__(self, message: str, param: str = "input") -> None:
        super().__init__(message)
        self.param = param


def _is_token_id(value: object) -> bool:
    return type(value) is int and 0 <= value <= MAX_TOKEN_ID  # (bool is not an id)


def parse_inputs(value: object) -> list[EmbeddingInput]:
    """`input` as a list of texts and token-id lists; EmbeddingInputError for anything else."""
    if isinstance(value, str):
        inputs: list[EmbeddingInput] = [value]
    elif isinstance(value, list) and value and all(_is_token_id(v) for v in value):
        inputs = [list(value)]
    elif isinstance(value, list) and value:
        inputs = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                inputs.append(item)
            elif isinstance(item, list) and item and all(_is_token_id(v) for v in item):
                inputs.append(list(item))
            else:
                raise EmbeddingInputError(
                    f"input[{i}] must be a non-empty string or a non-empty array of token ids "
                    "(integers >= 0)", param=f"input[{i}]")
    elif isinstance(value, list):
        raise EmbeddingInputError("input must not be an empty array")
    else:
        raise EmbeddingInputError("input must be a string, an array of strings, an array of "
                                  "token ids or an array of token-id arrays")
    if len(inputs) > MAX_NUM_INPUTS:
        raise EmbeddingInputError(f"input has {len(inputs)} items; at most {MAX_NUM_INPUTS}")
    for i, item in enumerate(inputs):
        if isinstance(item, str) and not item:
            raise EmbeddingInputError("input must not contain an empty string",
                                      param="input" if len(inputs) == 1 else f"input[{i}]")
    return inputs


def parse_encoding_format(value: object) -> EncodingFormat:
    if value is None or value == "float":
        return "float"
    if value == "base64":
        return "base64"
    raise EmbeddingInputError(f"encoding_format must be 'float' or 'base64', not {value!r}",
                              param="encoding_format")


def parse_dimensions(value: object) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise EmbeddingInputError(f"dimensions must be an integer >= 1, not {value!r}",
                                  param="dimensions")
    return value


def vector_to_wire(vector: bytes, encoding_format: EncodingFormat) -> list[float] | str:
    """float32 little-endian bytes -> the `embedding` field in `encoding_format`."""
    if encoding_format == "base64":
        return base64.b64encode(vector).decode("ascii")
    floats = array("f")
    floats.frombytes(vector)
    if sys.byteorder != "little":
        floats.byteswap()
    return floats.tolist()


def vector_from_wire(embedding: Any) -> bytes:
    """An upstream's `embedding` field (a list of numbers, or base64 float32) -> float32 LE
    bytes; ValueError when it is neither."""
    if isinstance(embedding, str):
        try:
            raw = base64.b64decode(embedding, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"embedding is not base64: {exc}") from None
        if len(raw) % 4:
            raise ValueError("base64 embedding is not a whole number of float32s")
        return raw
    if isinstance(embedding, list) and all(isinstance(v, int | float) and not isinstance(v, bool)
                                           for v in embedding):
        floats = array("f", embedding)
        if sys.byteorder != "little":
            floats.byteswap()
        return floats.tobytes()
    raise ValueError("embedding is neither an array of numbers nor a base64 string")
