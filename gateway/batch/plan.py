"""Reading a batch's input file into the lines to run, in the order that shares the prompt cache.

Each input line is `{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body"}`. A
line that is not that (not JSON, no custom_id, a repeated custom_id, another URL, `stream`) is
not run: its error goes to the error file. The lines to run are kept as (offset, length) in the
file, not parsed, so a plan weighs ~0.5 KiB a line whatever the bodies weigh; each is re-read
when it runs.

Order: lines sharing a prompt prefix run one after another, so the replica's prefix cache (and
the engine's shared-prefix prefill) serves the common part once. The key is the model, then an
8-byte digest of each 256-byte piece of the prompt's JSON (messages, prompt or input), up to
`_NUM_KEY_PIECES` pieces: sorting by it groups lines by their longest shared prefix.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson

MAX_CUSTOM_ID_CHARS = 512
_PIECE_BYTES = 256
_NUM_KEY_PIECES = 32  # prefixes are told apart over their first 8 KiB
_PROMPT_FIELDS = ("messages", "prompt", "input")


@dataclass(frozen=True, slots=True)
class PlannedLine:
    index: int  # 0-based, among the file's non-blank lines
    offset: int  # bytes into the file
    num_bytes: int
    custom_id: str
    model: str
    order_key: bytes


@dataclass(frozen=True, slots=True)
class InvalidLine:
    index: int
    custom_id: str | None
    code: str
    message: str


@dataclass
class Plan:
    lines: list[PlannedLine]  # in run order
    invalid: list[InvalidLine]
    num_total: int
    model: str | None  # the first valid line's model (the batch object's `model`)


def order_key(model: str, body: dict[str, Any]) -> bytes:
    prompt = next((body[name] for name in _PROMPT_FIELDS if name in body), None)
    text = orjson.dumps(prompt)
    digests = [hashlib.blake2b(text[start:start + _PIECE_BYTES], digest_size=8).digest()
               for start in range(0, min(len(text), _PIECE_BYTES * _NUM_KEY_PIECES), _PIECE_BYTES)]
    return model.encode() + b"\0" + b"".join(digests)


def check_line(raw: bytes, index: int, endpoint: str, seen: set[str],
               line_number: int | None = None) -> tuple[str, str, dict[str, Any]] | InvalidLine:
    """(custom_id, model, body) of a line fit to run, or why it is not. Messages name the line
    by `line_number` (1-based in the file, blank lines counted; default `index + 1`)."""
    number = index + 1 if line_number is None else line_number
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return InvalidLine(index, None, "invalid_json_line",
                           f"line {number} is not valid JSON")
    if not isinstance(line, dict):
        return InvalidLine(index, None, "invalid_json_line",
                           f"line {number} is not a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return InvalidLine(index, None, "missing_custom_id",
                           f"line {number}: custom_id must be a string of 1 to "
                           f"{MAX_CUSTOM_ID_CHARS} characters")
    if custom_id in seen:
        return InvalidLine(index, custom_id, "duplicate_custom_id",
                           f"line {number}: the custom_id {custom_id!r} is used by an "
                           "earlier line")
    seen.add(custom_id)
    if line.get("method") != "POST":
        return InvalidLine(index, custom_id, "invalid_method",
                           f"line {number}: method must be 'POST'")
    if line.get("url") != endpoint:
        return InvalidLine(index, custom_id, "mismatched_endpoint",
                           f"line {number}: url must be the batch's endpoint {endpoint!r}")
    body = line.get("body")
    if not isinstance(body, dict):
        return InvalidLine(index, custom_id, "invalid_body",
                           f"line {number}: body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return InvalidLine(index, custom_id, "missing_model",
                           f"line {number}: body.model must be a string")
    if body.get("stream"):
        return InvalidLine(index, custom_id, "stream_not_supported",
                           f"line {number}: a batch line cannot stream")
    return custom_id, model, body


def read_plan(path: str, endpoint: str, by_prefix: bool = True) -> Plan:
    """The file's plan (blocking: call from a worker thread). Blank lines are skipped; without
    `by_prefix`, lines run in the file's order."""
    planned: list[PlannedLine] = []
    invalid: list[InvalidLine] = []
    seen: set[str] = set()
    model: str | None = None
    index = offset = 0
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, 1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            checked = check_line(raw, index, endpoint, seen, line_number)
            if isinstance(checked, InvalidLine):
                invalid.append(checked)
            else:
                custom_id, line_model, body = checked
                model = model or line_model
                planned.append(PlannedLine(index, start, len(raw), custom_id, line_model,
                                           order_key(line_model, body)))
            index += 1
    if by_prefix:
        planned.sort(key=lambda line: (line.order_key, line.index))
    return Plan(planned, invalid, index, model)


def read_line_body(path: str, line: PlannedLine) -> dict[str, Any]:
    """The line's request body (blocking)."""
    with open(path, "rb") as handle:
        handle.seek(line.offset)
        body: dict[str, Any] = orjson.loads(handle.read(line.num_bytes))["body"]
    return body
