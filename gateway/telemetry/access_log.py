"""The access log: one line per request the gateway answers (the telemetry middleware writes it
when the request's metrics are taken, so a stream's line comes after its last event).

    AIGW_ACCESS_LOG=text   (default)  ts=... method=POST path=/v1/chat/completions status=200
                                      model=m project=p key_id=k1 prompt_tokens=12 ...
    AIGW_ACCESS_LOG=json              {"ts": ..., "method": "POST", "path": ..., ...}
    AIGW_ACCESS_LOG=off               no line

Fields: ts (unix seconds), method, path (no query string), status (the client's: 499 when it
left), model, project, key_id (the key's id, never the key), prompt_tokens, cached_tokens,
completion_tokens, ms (the whole request), request_id, trace_id ("" when the request was not
traced). Never a credential (a key pasted into a URL's path keeps its id, its secret becomes
[REDACTED]), a header or a body. A value a client chose (model, path) is quoted
in the text form when it holds a space, a quote, `=` or a control character, so one request is
always one line.

The lines go to the `aigw.access` logger at INFO, which writes them to stderr as they are (its
own handler, not propagated); /health, /metrics, the dashboard and unknown paths are not logged.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import Any

import orjson

ACCESS_LOG_FORMATS = ("text", "json", "off")
LOGGER_NAME = "aigw.access"
_NEEDS_QUOTES = re.compile(r'[\s"=\\\x00-\x1f\x7f]')
# an API key pasted into a URL (`DELETE /admin/v1/keys/<the whole key>`): its secret goes
_KEY_IN_PATH = re.compile(r"(sk-aigw-[0-9a-f]{0,12}-?)[^/]*")
_FORMATTER = logging.Formatter("%(message)s")
_own_handler: logging.StreamHandler[Any] | None = None  # the stderr handler this module added


class AccessLog:
    """Writes access lines in `fmt` ("text" or "json") to the `aigw.access` logger.

    While the logger is as this module set it up (its one stderr handler, no filters, not
    propagated), a line goes straight to that handler's stream, the bytes `logger.info` would
    have written, without logging's ~45 calls a record; a handler or filter added (tests, an
    operator's logging config) sends each line through `logger.info` again."""

    def __init__(self, fmt: str) -> None:
        global _own_handler
        if fmt not in ("text", "json"):
            raise ValueError(f"AIGW_ACCESS_LOG must be one of {', '.join(ACCESS_LOG_FORMATS)}")
        self.is_json = fmt == "json"
        self.logger = logging.getLogger(LOGGER_NAME)
        if not self.logger.handlers:  # (once per process: every app of it shares the logger)
            _own_handler = logging.StreamHandler(sys.stderr)
            _own_handler.setFormatter(_FORMATTER)
            self.logger.addHandler(_own_handler)
            self.logger.propagate = False
        if self.logger.level == logging.NOTSET:
            self.logger.setLevel(logging.INFO)
        self._only_own = [_own_handler]  # what logger.handlers is while the fast path holds

    def write(self, method: str, path: str, status: int, model: str, project: str, key_id: str,
              tokens: tuple[int, int, int], latency_ms: float, request_id: str,
              trace_id: str) -> None:
        """One request's line; `tokens` is (prompt, cached, completion)."""
        logger = self.logger
        if not logger.isEnabledFor(logging.INFO):
            return
        ts, ms = round(time.time(), 3), round(latency_ms, 2)
        if "sk-aigw-" in path:
            path = _KEY_IN_PATH.sub(r"\1[REDACTED]", path)
        if self.is_json:
            line = orjson.dumps({
                "ts": ts, "method": method, "path": path, "status": status, "model": model,
                "project": project, "key_id": key_id, "prompt_tokens": tokens[0],
                "cached_tokens": tokens[1], "completion_tokens": tokens[2], "ms": ms,
                "request_id": request_id, "trace_id": trace_id}).decode()
        elif ("" in (method, path, model, project, key_id, request_id, trace_id)
              or _NEEDS_QUOTES.search(method + path + model + project + key_id + request_id
                                      + trace_id)):  # (one search for all the strings)
            line = format_line({
                "ts": ts, "method": method, "path": path, "status": status, "model": model,
                "project": project, "key_id": key_id, "prompt_tokens": tokens[0],
                "cached_tokens": tokens[1], "completion_tokens": tokens[2], "ms": ms,
                "request_id": request_id, "trace_id": trace_id}, False)
        else:  # (no value needs quotes: format_line's bytes in one f-string)
            line = (f"ts={ts} method={method} path={path} status={status} model={model} "
                    f"project={project} key_id={key_id} prompt_tokens={tokens[0]} "
                    f"cached_tokens={tokens[1]} completion_tokens={tokens[2]} ms={ms} "
                    f"request_id={request_id} trace_id={trace_id}")
        own = _own_handler
        if (own is None or logger.handlers != self._only_own or logger.filters or own.filters
                or own.formatter is not _FORMATTER or own.level > logging.INFO
                or logger.propagate):
            logger.info(line)
            return
        try:  # (StreamHandler.emit's bytes: the message and its terminator, then a flush)
            stream = own.stream
            stream.write(line + own.terminator)
            stream.flush()
        except Exception:  # noqa: BLE001 - as logging would: reported, never raised
            own.handleError(logging.makeLogRecord({"msg": line, "levelno": logging.INFO}))


def format_line(fields: dict[str, Any], is_json: bool) -> str:
    """`fields` as one JSON object, or as `key=value` pairs (a value quoted when it must be)."""
    if is_json:
        return orjson.dumps(fields).decode()
    return " ".join(f"{key}={_text_value(value)}" for key, value in fields.items())


def _text_value(value: Any) -> str:
    text = str(value)
    if text == "" or _NEEDS_QUOTES.search(text):
        return orjson.dumps(text).decode()  # escapes quotes, backslashes, control characters
    return text
