"""The access log: one line per request (method, path, status, model, project, key id, tokens,
ms, request and trace ids), text by default, JSON when AIGW_ACCESS_LOG=json asks; never the key,
a header or a body."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import openai
import orjson
import pytest

from auth.principal import AuthError, Principal, Scope
from bench.mock_upstream import MockConfig
from gateway.telemetry import access_log
from gateway.telemetry.access_log import LOGGER_NAME, format_line
from tests.gateway.conftest import MODEL, GatewayFactory, wait_until

SECRET_KEY = "sk-very-secret-0123456789"
PROMPT = "the words of a private prompt"


class OneKey:
    async def authenticate(self, credential: str | None) -> Principal:
        if credential == SECRET_KEY:
            return Principal("proj-a", "key-17", frozenset({Scope.INVOKE.value}))
        raise AuthError(401, "invalid_api_key", "unknown key")


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def access_lines() -> Iterator[list[str]]:
    handler = Lines()
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def _requests(gateway_url: str) -> None:
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key=SECRET_KEY, max_retries=0)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                   max_tokens=5)
    for _ in client.chat.completions.create(model=MODEL, max_tokens=5, stream=True,
                                            messages=[{"role": "user", "content": PROMPT}],
                                            stream_options={"include_usage": True}):
        pass
    assert httpx.post(gateway_url + "/v1/chat/completions", json={"model": MODEL},
                      headers={"authorization": "Bearer wrong-key"}).status_code == 401


def test_each_request_is_one_text_line_with_its_usage_and_no_secret(
        make_gateway: GatewayFactory, access_lines: list[str]) -> None:
    gateway = make_gateway(authenticator=OneKey())
    _requests(gateway.url)
    assert wait_until(lambda: len(access_lines) >= 3)
    plain, streamed, refused = (dict(pair.split("=", 1) for pair in line.split(" "))
                                for line in access_lines[:3])
    for fields in (plain, streamed):
        assert fields["method"] == "POST" and fields["path"] == "/v1/chat/completions"
        assert fields["status"] == "200" and fields["model"] == MODEL
        assert fields["project"] == "proj-a" and fields["key_id"] == "key-17"
        assert int(fields["prompt_tokens"]) > 0 and 0 < int(fields["completion_tokens"]) <= 5
        assert float(fields["ms"]) > 0 and fields["request_id"]
    assert len(plain["trace_id"]) == 32  # tracing is on by default: the sampled trace's id
    assert refused["status"] == "401" and refused["key_id"] == '""'
    text = "\n".join(access_lines)
    assert SECRET_KEY not in text and "wrong-key" not in text and PROMPT not in text


def test_a_request_whose_client_left_keeps_its_request_id_in_the_line(
        make_gateway: GatewayFactory, access_lines: list[str]) -> None:
    """No answer was sent (the client left first): the line still names the request's id, the
    one its upstream call and usage record carry (it was request_id="")."""
    gateway = make_gateway(authenticator=OneKey(), configs=[MockConfig(latency_ms=3000)])
    with pytest.raises(httpx.TimeoutException):
        httpx.post(gateway.url + "/v1/chat/completions", timeout=0.5,
                   headers={"authorization": f"Bearer {SECRET_KEY}"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert wait_until(lambda: len(access_lines) >= 1, timeout_s=10)
    fields = dict(pair.split("=", 1) for pair in access_lines[0].split(" "))
    assert fields["status"] == "499"
    assert fields["request_id"] == gateway.upstreams[0].state.request_ids[0] != ""


def test_json_when_asked(make_gateway: GatewayFactory, access_lines: list[str],
                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIGW_ACCESS_LOG", "json")
    gateway = make_gateway(authenticator=OneKey())
    _requests(gateway.url)
    assert wait_until(lambda: len(access_lines) >= 3)
    plain, streamed, refused = (orjson.loads(line) for line in access_lines[:3])
    assert (plain["status"], streamed["status"], refused["status"]) == (200, 200, 401)
    assert streamed["key_id"] == "key-17" and streamed["completion_tokens"] > 0
    assert SECRET_KEY not in "".join(access_lines) and PROMPT not in "".join(access_lines)


def test_off_writes_nothing(make_gateway: GatewayFactory, access_lines: list[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIGW_ACCESS_LOG", "off")
    gateway = make_gateway()
    assert httpx.post(gateway.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    assert not access_lines


def test_a_key_pasted_into_a_path_keeps_only_its_id(access_lines: list[str]) -> None:
    """`DELETE /admin/v1/keys/<the whole key>` (the key given where its id belongs) put the
    secret into the log; the line keeps the id, the secret is redacted."""
    key = "sk-aigw-0123456789ab-" + "S3cr3t_" * 6
    for fmt in ("text", "json"):
        access_log.AccessLog(fmt).write("DELETE", f"/admin/v1/keys/{key}/rotate", 404, "", "",
                                        "", (0, 0, 0), 1.0, "req-1", "")
    assert len(access_lines) == 2 and not any("S3cr3t_" in line for line in access_lines)
    assert all("/admin/v1/keys/sk-aigw-0123456789ab-[REDACTED]/rotate" in line
               for line in access_lines)


def test_a_value_the_client_chose_cannot_break_the_line() -> None:
    line = format_line({"model": 'a b\nstatus=200 "x"', "status": 404}, is_json=False)
    assert "\n" not in line and line.endswith(" status=404")
    assert line.startswith('model="a b\\nstatus=200 \\"x\\""')


_LINES = [  # write()'s arguments: plain values, a value that needs quotes, empty ids
    ("POST", "/v1/chat/completions", 200, "m-1", "proj-a", "key-17", (12, 4, 5), 3.14159,
     "req-1", "ab" * 16),
    ("POST", "/v1/messages", 404, 'a b\nstatus=200 "x"', "proj-a", "key-17", (0, 0, 0), 0.5,
     "req-2", "ab" * 16),
    ("GET", "/v1/models", 401, "", "", "", (0, 0, 0), 1.0, "", ""),
]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_the_direct_stderr_write_is_byte_identical_to_logging(
        fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(access_log, "time", SimpleNamespace(time=lambda: 1764637200.123456))
    writer = access_log.AccessLog(fmt)
    own = access_log._own_handler
    assert own is not None and own in logging.getLogger(LOGGER_NAME).handlers
    logger = logging.getLogger(LOGGER_NAME)
    monkeypatch.setattr(logger, "handlers", [own])  # (pytest adds its own)
    logger.info = None  # type: ignore[method-assign]  # (the direct path never calls it)
    direct, via_logging = io.StringIO(), io.StringIO()
    previous = own.setStream(direct)
    try:
        for args in _LINES:
            writer.write(*args)
        del logger.info
        own.setStream(via_logging)
        own.addFilter(lambda record: True)  # (a filter: every line through logger.info)
        for args in _LINES:
            writer.write(*args)
    finally:
        vars(logger).pop("info", None)
        own.filters.clear()
        own.setStream(previous)
    assert direct.getvalue() == via_logging.getvalue()
    lines = direct.getvalue().splitlines()
    assert len(lines) == len(_LINES)
    for line, args in zip(lines, _LINES, strict=True):
        fields = {"ts": 1764637200.123, "method": args[0], "path": args[1], "status": args[2],
                  "model": args[3], "project": args[4], "key_id": args[5],
                  "prompt_tokens": args[6][0], "cached_tokens": args[6][1],
                  "completion_tokens": args[6][2], "ms": round(args[7], 2),
                  "request_id": args[8], "trace_id": args[9]}
        assert line == format_line(fields, fmt == "json")


def test_a_request_refused_after_its_key_was_read_names_its_project_and_key(
        make_gateway: GatewayFactory, access_lines: list[str]) -> None:
    """Refused before a usage record (a bad field, an unknown model, a stored response that is
    not there), or a route without one (the model list): the caller was known, so its line names
    it, as a metered request's does."""
    gateway = make_gateway(authenticator=OneKey())
    headers = {"authorization": f"Bearer {SECRET_KEY}"}
    bad_field = {"model": MODEL, "max_tokens": "3", "messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(gateway.url + "/v1/chat/completions", json=bad_field,
                      headers=headers).status_code == 400
    assert httpx.post(gateway.url + "/v1/chat/completions", headers=headers, json={
        "model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}).status_code == 404
    assert httpx.get(gateway.url + "/v1/responses/resp_0123", headers=headers).status_code == 404
    assert httpx.get(gateway.url + "/v1/models", headers=headers).status_code == 200
    assert httpx.get(gateway.url + "/v1/responses/resp_0123").status_code == 401
    assert wait_until(lambda: len(access_lines) >= 5)
    lines = [dict(pair.split("=", 1) for pair in line.split(" ")) for line in access_lines[:5]]
    assert [f["status"] for f in lines] == ["400", "404", "404", "200", "401"]
    for fields in lines[:4]:
        assert (fields["project"], fields["key_id"]) == ("proj-a", "key-17"), fields
        assert fields["prompt_tokens"] == fields["completion_tokens"] == "0"
    assert (lines[4]["project"], lines[4]["key_id"]) == ('""', '""')  # no credential: nobody
    assert SECRET_KEY not in "\n".join(access_lines)
