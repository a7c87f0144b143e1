"""Guardrails through the real openai and anthropic SDKs: each built-in guard blocks and passes what
it should, on the request, on the answer and on a stream (the stop comes as the dialect's error
event), and a blocked request is metered once. The upstream is scripted (scripted_upstream.py):
a `SAY:<text>` prompt is answered with <text>, and `guard-model` is a Llama-Guard-style
classifier behind the gateway."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.guardrails import (
    GuardContext,
    GuardedRequest,
    Guardrail,
    ResponseScanner,
    TextPart,
    get_guardrail_class,
)
from gateway.guardrails.pii import PiiGuard, find_pii, luhn_ok
from gateway.guardrails.regex_guard import RegexGuard
from tests.gateway.conftest import Gateway, GatewayFactory, LoopThread, start_app, wait_until
from tests.gateway.scripted_upstream import GUARD_MODEL, create_scripted_upstream

MODEL = "chat-model"
CARD = "4111 1111 1111 1111"  # passes the Luhn check
NOT_A_CARD = "4111 1111 1111 1112"


async def _never(*_: Any) -> str:
    raise AssertionError("no model call expected")


CONTEXT = GuardContext(_never)


@pytest.fixture
def scripted(loop_thread: LoopThread) -> Any:
    seen: list[dict[str, Any]] = []
    runner, url = loop_thread.run(start_app(create_scripted_upstream(seen)))
    yield url, seen
    loop_thread.run(runner.cleanup())


DEAD_MODEL = "dead-model"  # its only endpoint refuses connections


def _gateway(make_gateway: GatewayFactory, scripted: Any, guardrails: list[dict[str, Any]]
             ) -> Gateway:
    url, _ = scripted
    models = [{"name": name, "backend": "openai", "endpoints": [url], "context_length": 4096,
               "prices": {"input_per_token": 1e-6, "output_per_token": 2e-6}}
              for name in (MODEL, GUARD_MODEL)]
    models.append({"name": DEAD_MODEL, "backend": "openai", "endpoints": ["http://127.0.0.1:9"],
                   "context_length": 4096})
    return make_gateway(models=models, guardrails=guardrails)


def _openai(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)


def _say(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "SAY:" + text}]


def _one_record(gateway: Gateway, num_classifier_calls: int = 0) -> Any:
    """The request's one usage record (besides one per model-guard classifier call)."""
    assert wait_until(lambda: gateway.meter.num_settle_calls >= 1 + num_classifier_calls)
    assert gateway.meter.num_settle_calls == 1 + num_classifier_calls
    (record,) = [r for r in gateway.meter.settled.values() if "/guard-" not in r.request_id]
    return record


def _classifier_records(gateway: Gateway) -> list[Any]:
    return [r for r in gateway.meter.settled.values() if "/guard-" in r.request_id]


# -- the guards alone ---------------------------------------------------------------------------
def test_pii_finds_emails_phones_and_luhn_valid_cards_only() -> None:
    text = (f"mail bob.smith+x@mail.example.co.uk, call +44 20 7946 0958 or (415) 555-2671; "
            f"card {CARD}; order 2024-01-02, ref {NOT_A_CARD}")
    found = [(text[s:e], kind) for s, e, kind in find_pii(text, ("card", "phone", "email"))]
    assert found == [("bob.smith+x@mail.example.co.uk", "email"), ("+44 20 7946 0958", "phone"),
                     ("(415) 555-2671", "phone"), (CARD, "card")]
    assert luhn_ok("79927398713") and not luhn_ok("79927398710")
    blocking = PiiGuard("pii", {"action": "block"}, CONTEXT)  # (the request log's copy is masked)
    assert blocking.mask_text(f"card {CARD}, a@b.io") == "card [CARD], [EMAIL]"


def test_pii_scanner_masks_a_value_split_across_deltas_and_never_sends_part_of_it() -> None:
    guard = PiiGuard("pii", {"holdback_chars": 24}, CONTEXT)
    text = f"pay with {CARD} or write to a@b.io today, thanks a lot for all of it"

    async def scan(pieces: list[str]) -> list[str]:
        scanner = guard.scan_response(GuardedRequest("m", "p"))
        sent = [await scanner.feed(piece) for piece in pieces]
        return [*sent, await scanner.finish()]

    for size in (1, 2, 5, 100):
        sent = asyncio.run(scan([text[i:i + size] for i in range(0, len(text), size)]))
        assert "".join(sent) == text.replace(CARD, "[CARD]").replace("a@b.io", "[EMAIL]")
        assert not any("4111" in piece or "@" in piece for piece in sent)


def test_regex_scanner_stops_on_the_delta_that_completes_a_match() -> None:
    guard = RegexGuard("deny", {"words": ["project zeus"]}, CONTEXT)

    async def run() -> list[str]:
        scanner = guard.scan_response(GuardedRequest("m", "p"))
        sent = []
        for piece in ["the pro", "ject ze", "us plan"]:
            sent.append(await scanner.feed(piece))
        return sent

    with pytest.raises(Exception, match="denied pattern") as blocked:
        asyncio.run(run())
    assert getattr(blocked.value, "code", None) == "guardrail_blocked"
    assert asyncio.run(_request_passes(guard, "project zeusx and zeus project"))
    with pytest.raises(ValueError, match="unknown guardrail type"):
        get_guardrail_class("no-such-guard")


async def _request_passes(guard: RegexGuard, text: str) -> bool:
    await guard.check_request(GuardedRequest("m", "p", [TextPart("user", text)]))
    return True


# -- through the SDKs ---------------------------------------------------------------------------
def test_denied_request_is_a_400_guardrail_blocked_metered_once_and_never_sent(
        make_gateway: GatewayFactory, scripted: Any) -> None:
    gateway = _gateway(make_gateway, scripted, [
        {"name": "deny", "type": "regex", "stages": ["request"],
         "options": {"words": ["project zeus"]}}])
    client = _openai(gateway)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=_say("about Project Zeus"))
    assert refused.value.code == "guardrail_blocked" and "'deny'" in refused.value.message
    assert scripted[1] == []
    record = _one_record(gateway)
    assert (record.status, record.prompt_tokens, record.completion_tokens) == (400, 0, 0)
    ok = client.chat.completions.create(model=MODEL, messages=_say("about zeus"))
    assert ok.choices[0].message.content == "about zeus"
    blocks = httpx.get(gateway.url + "/metrics").text
    assert 'aigw_guardrail_blocks_total{guardrail="deny",stage="request"} 1.0' in blocks


def test_pii_request_guard_masks_what_the_upstream_sees(make_gateway: GatewayFactory,
                                                        scripted: Any) -> None:
    gateway = _gateway(make_gateway, scripted, [{"name": "pii", "type": "pii",
                                                 "stages": ["request"]}])
    answer = _openai(gateway).chat.completions.create(
        model=MODEL, messages=_say(f"card {CARD}, mail me at jo@example.com"))
    assert answer.choices[0].message.content == "card [CARD], mail me at [EMAIL]"
    assert scripted[1][-1]["messages"][-1]["content"] == "SAY:card [CARD], mail me at [EMAIL]"


def test_pii_response_guard_masks_a_stream_and_the_whole_answer(make_gateway: GatewayFactory,
                                                                 scripted: Any) -> None:
    gateway = _gateway(make_gateway, scripted, [{"name": "pii", "type": "pii",
                                                 "stages": ["response"]}])
    client = _openai(gateway)
    said = f"my card is {CARD} and my phone +1 415 555 2671, bye"
    masked = "my card is [CARD] and my phone [PHONE], bye"
    deltas = [c.choices[0].delta.content for c in client.chat.completions.create(
        model=MODEL, messages=_say(said), stream=True) if c.choices and c.choices[0].delta.content]
    assert "".join(deltas) == masked and not any("1111" in d for d in deltas)
    assert client.chat.completions.create(model=MODEL, messages=_say(said)
                                          ).choices[0].message.content == masked
    anthropic_client = anthropic.Anthropic(base_url=gateway.url + "/anthropic", api_key="x",
                                           max_retries=0)
    with anthropic_client.messages.stream(model=MODEL, max_tokens=50,
                                          messages=_say(said)) as stream:  # type: ignore[arg-type]
        assert "".join(stream.text_stream) == masked


def test_blocked_stream_ends_with_each_dialects_error_event_and_one_usage_record(
        make_gateway: GatewayFactory, scripted: Any) -> None:
    gateway = _gateway(make_gateway, scripted, [
        {"name": "no-cards", "type": "pii", "stages": ["response"],
         "options": {"action": "block", "kinds": ["card"]}}])
    said = "here is a long answer before it: " + CARD + " and more text after"
    client = _openai(gateway)
    received = []
    with pytest.raises(openai.APIError, match="no-cards"):
        for chunk in client.chat.completions.create(model=MODEL, messages=_say(said), stream=True):
            received += [c.delta.content for c in chunk.choices if c.delta.content]
    assert "".join(received) == said[:len("".join(received))] and "4111" not in "".join(received)
    record = _one_record(gateway)
    assert record.status == 200 and record.finish_reason == "content_filter"
    assert record.prompt_tokens > 0  # the prompt the upstream processed is billed

    anthropic_client = anthropic.Anthropic(base_url=gateway.url + "/anthropic", api_key="x",
                                           max_retries=0)
    with pytest.raises(anthropic.APIStatusError, match="no-cards"):
        with anthropic_client.messages.stream(model=MODEL, max_tokens=50,
                                              messages=_say(said)) as stream:  # type: ignore[arg-type]
            list(stream.text_stream)
    raw = httpx.post(gateway.url + "/v1/responses", json={"model": MODEL, "input": "SAY:" + said,
                                                          "stream": True})
    assert "event: error" in raw.text and "guardrail_blocked" in raw.text
    assert "response.completed" not in raw.text
    events = []
    with pytest.raises(openai.APIError, match="no-cards"):  # the SDK raises on the error event
        for event in client.responses.create(model=MODEL, input="SAY:" + said, stream=True):
            events.append(event.type)
    assert "response.created" in events and "response.completed" not in events
    with pytest.raises(openai.BadRequestError) as whole:  # not streamed: a 400
        client.chat.completions.create(model=MODEL, messages=_say(said))
    assert whole.value.code == "guardrail_blocked"


def test_model_guard_asks_the_classifier_behind_the_gateway(make_gateway: GatewayFactory,
                                                            scripted: Any) -> None:
    gateway = _gateway(make_gateway, scripted, [
        {"name": "llama-guard", "type": "model", "models": [MODEL],
         "options": {"model": GUARD_MODEL}}])
    client = _openai(gateway)
    assert client.chat.completions.create(model=MODEL, messages=_say("hello")
                                          ).choices[0].message.content == "hello"
    classified = [b for b in scripted[1] if b["model"] == GUARD_MODEL]
    assert [m["role"] for m in classified[-1]["messages"]] == ["user", "assistant"]
    assert classified[-1]["messages"][-1]["content"] == "hello"
    with pytest.raises(openai.BadRequestError, match=r"unsafe \(S9\)") as refused:
        client.chat.completions.create(model=MODEL, messages=_say("the forbidden-topic"))
    assert refused.value.code == "guardrail_blocked" and "(request)" in refused.value.message
    # on the answer only: the stream ends with the error event after the text, metered once
    # with the upstream's own usage
    answers = _gateway(make_gateway, scripted, [
        {"name": "llama-guard", "type": "model", "stages": ["response"],
         "options": {"model": GUARD_MODEL}}])
    received = []
    with pytest.raises(openai.APIError, match=r"\(response\)"):
        for chunk in _openai(answers).chat.completions.create(
                model=MODEL, messages=_say("forbidden-topic"), stream=True):
            received += [c.delta.content for c in chunk.choices if c.delta.content]
    assert "".join(received) == "forbidden-topic"
    record = _one_record(answers, num_classifier_calls=1)
    assert record.finish_reason == "content_filter" and record.completion_tokens == 3
    # the classifier's tokens are metered too: to the caller, at the classifier's model, named
    # after the request they guarded
    (classified_call,) = _classifier_records(answers)
    assert classified_call.model == GUARD_MODEL and classified_call.tags == ("guardrail",)
    assert classified_call.request_id.startswith(record.request_id + "/guard-")
    assert classified_call.project == record.project and classified_call.prompt_tokens > 0


def test_model_guard_fails_closed_or_open_when_the_classifier_is_down(
        make_gateway: GatewayFactory, scripted: Any) -> None:
    closed = _gateway(make_gateway, scripted, [
        {"name": "g", "type": "model", "stages": ["request"],
         "options": {"model": DEAD_MODEL}}])
    with pytest.raises(openai.BadRequestError, match="unavailable"):
        _openai(closed).chat.completions.create(model=MODEL, messages=_say("hi"))
    opened = _gateway(make_gateway, scripted, [
        {"name": "g", "type": "model", "stages": ["request"],
         "options": {"model": DEAD_MODEL, "on_error": "allow"}}])
    assert _openai(opened).chat.completions.create(model=MODEL, messages=_say("hi")
                                                   ).choices[0].message.content == "hi"


def test_guards_apply_per_model_and_project_and_bad_options_fail_at_start(
        make_gateway: GatewayFactory, scripted: Any) -> None:
    gateway = _gateway(make_gateway, scripted, [
        {"name": "only-guard-model", "type": "regex", "models": [GUARD_MODEL],
         "options": {"words": ["zeus"]}},
        {"name": "other-project", "type": "regex", "projects": ["someone-else"],
         "options": {"words": ["zeus"]}}])
    assert _openai(gateway).chat.completions.create(model=MODEL, messages=_say("zeus")
                                                    ).choices[0].message.content == "zeus"
    for bad in ({"name": "x", "type": "regex", "options": {"words": [], "patterns": []}},
                {"name": "x", "type": "regex", "options": {"patterns": ["("]}},
                {"name": "x", "type": "pii", "options": {"action": "shout"}},
                {"name": "x", "type": "pii", "options": {"colour": 1}},
                {"name": "x", "type": "regex", "models": ["nope"], "options": {"words": ["a"]}},
                {"name": "x", "type": "model", "options": {"model": "nope"}},
                {"name": "x", "type": "no-such-type"}):
        with pytest.raises(ValueError):
            _gateway(make_gateway, scripted, [bad])


class UpperGuard(Guardrail):
    """A plugin for the entry point test: answers in upper case, refuses "no-upper"."""

    rewrites_response = True

    async def check_request(self, request: GuardedRequest) -> None:
        if any("no-upper" in part.text for part in request.parts):
            raise self.block("request", "asked not to")

    def scan_response(self, request: GuardedRequest) -> ResponseScanner:
        class Upper(ResponseScanner):
            async def feed(self, text: str) -> str:
                return text.upper()

            async def finish(self) -> str:
                return ""
        return Upper()


def test_a_guardrail_from_an_aigw_guardrails_entry_point_runs_on_requests_and_streams(
        make_gateway: GatewayFactory, scripted: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "aigw_upper_guard-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: aigw-upper-guard\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[aigw.guardrails]\nupper = tests.gateway.guardrails.test_guardrails:UpperGuard\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    gateway = _gateway(make_gateway, scripted, [{"name": "upper", "type": "upper"}])
    client = _openai(gateway)
    deltas = [c.choices[0].delta.content for c in client.chat.completions.create(
        model=MODEL, messages=_say("quiet words"), stream=True)
        if c.choices and c.choices[0].delta.content]
    assert "".join(deltas) == "QUIET WORDS"
    with pytest.raises(openai.BadRequestError, match="asked not to"):
        client.chat.completions.create(model=MODEL, messages=_say("no-upper"))


def test_a_block_mid_stream_cuts_the_upstream_and_bills_the_prompt_and_what_came(
        make_gateway: GatewayFactory, scripted: Any) -> None:
    gateway = _gateway(make_gateway, scripted, [
        {"name": "deny", "type": "regex", "stages": ["response"],
         "options": {"words": ["project zeus"]}}])
    said = "first part of the answer, then project zeus, " + "and a long tail " * 40
    received = []
    with pytest.raises(openai.APIError, match="'deny' \\(response\\)"):
        for chunk in _openai(gateway).chat.completions.create(model=MODEL, messages=_say(said),
                                                              stream=True):
            received += [c.delta.content for c in chunk.choices if c.delta.content]
    sent = "".join(received)
    assert said.startswith(sent) and "project zeus" not in sent and len(sent) > 20
    record = _one_record(gateway)
    assert record.finish_reason == "content_filter"
    assert record.prompt_tokens > 0 and 0 < record.completion_tokens < len(said) // 4


class BrokenGuard(Guardrail):
    """A plugin with a bug on both sides."""

    async def check_request(self, request: GuardedRequest) -> None:
        if "SAY:break" in request.parts[-1].text:
            raise RuntimeError("bug")

    def scan_response(self, request: GuardedRequest) -> ResponseScanner:
        class Broken(ResponseScanner):
            async def feed(self, text: str) -> str:
                raise KeyError(text)

            async def finish(self) -> str:
                return ""
        return Broken()


def test_a_guardrail_that_raises_fails_closed_with_a_400_or_the_error_event(
        make_gateway: GatewayFactory, scripted: Any) -> None:
    from gateway.guardrails import register_guardrail

    register_guardrail("broken", BrokenGuard)
    gateway = _gateway(make_gateway, scripted, [{"name": "broken", "type": "broken"}])
    client = _openai(gateway)
    with pytest.raises(openai.BadRequestError, match="the guardrail failed"):
        client.chat.completions.create(model=MODEL, messages=_say("break"))
    with pytest.raises(openai.BadRequestError, match="the guardrail failed"):
        client.chat.completions.create(model=MODEL, messages=_say("fine"))  # the first delta
    assert wait_until(lambda: gateway.meter.num_settle_calls == 2)


def test_held_text_goes_out_before_a_tool_call_and_finish_waits_for_it() -> None:
    from gateway.guardrails.chain import Guardrails
    from gateway.guardrails.settings import GuardrailSettings
    from gateway.request.canonical import (
        CanonicalRequest,
        Finish,
        TextDelta,
        ToolCallDelta,
        Usage,
    )
    from gateway.request.dispatch import Attempt

    settings = GuardrailSettings(name="pii", type="pii", stages=("response",))
    guards = Guardrails([(settings, PiiGuard("pii", {}, CONTEXT))]).for_request(
        CanonicalRequest("r", MODEL))
    assert guards is not None
    upstream = [TextDelta("call me at "), TextDelta("+1 415 555 "), ToolCallDelta(0, "c1", "f"),
                TextDelta("2671 later"), Finish("tool_calls"), Usage(5, 7)]

    async def run() -> list[Any]:
        async def events() -> Any:
            for event in upstream[1:]:
                yield event
        attempt = Attempt(None, None, events(), upstream[0])  # type: ignore[arg-type]
        await guards.guard_attempt(attempt, CanonicalRequest("r", MODEL))
        return [attempt.first_event] + [event async for event in attempt.events]

    out = asyncio.run(run())
    kinds = [type(e).__name__ for e in out]
    assert kinds == ["TextDelta", "ToolCallDelta", "TextDelta", "Finish", "Usage"]
    before = "".join(e.text for e in out[:kinds.index("ToolCallDelta")] if isinstance(e, TextDelta))
    after = "".join(e.text for e in out[kinds.index("ToolCallDelta"):] if isinstance(e, TextDelta))
    assert before == "call me at +1 415 555 " and after == "2671 later"  # (split by the call)


def test_request_guards_check_every_text_of_an_embeddings_request() -> None:
    from gateway.dialects.openai_embeddings import OpenAIEmbeddings
    from gateway.guardrails.base import GuardrailBlocked
    from gateway.guardrails.chain import Guardrails
    from gateway.guardrails.settings import GuardrailSettings

    def parsed(texts: Any) -> Any:
        return OpenAIEmbeddings().parse({"model": MODEL, "input": texts}, "r")

    masking = Guardrails([(GuardrailSettings(name="pii", type="pii", stages=("request",)),
                           PiiGuard("pii", {}, CONTEXT))])
    request = parsed(["mail bob@example.com", "plain", "or ann@example.org"])
    guards = masking.for_request(request)
    assert guards is not None
    asyncio.run(guards.check_request(request))
    assert [request.prompt, *request.extra_prompts] == ["mail [EMAIL]", "plain", "or [EMAIL]"]
    tokens = parsed([[1, 2, 3]])  # token ids: nothing to read, passed as they are
    asyncio.run(masking.for_request(tokens).check_request(tokens))  # type: ignore[union-attr]
    assert tokens.prompt_token_ids == [1, 2, 3]

    words = {"words": ["project zeus"]}
    denying = Guardrails([(GuardrailSettings(name="deny", type="regex", stages=("request",),
                                             options=words),
                           RegexGuard("deny", words, CONTEXT))])
    request = parsed(["fine", "all about Project Zeus"])
    with pytest.raises(GuardrailBlocked):
        asyncio.run(denying.for_request(request).check_request(request))  # type: ignore[union-attr]
