"""Structured output: the grammar's bitmask constrains sampling; the real model's answers parse
and follow the schema; unconstrained neighbours in the batch are unaffected."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from contracts.output_grammar import OutputGrammar, OutputGrammarError
from contracts.sampling_params import SamplingParams, SamplingParamsError
from engine.engine import LLMEngine
from engine.sampler import Sampler, SamplingRow, apply_token_bitmasks
from engine.structured_output import unpack_bitmask

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}


def _bitmask_allowing(allowed: list[int], vocab_size: int) -> torch.Tensor:
    words = [0] * ((vocab_size + 31) // 32)
    for token in allowed:
        words[token // 32] |= 1 << (token % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def _row(params: SamplingParams, bitmask: torch.Tensor | None = None) -> SamplingRow:
    return SamplingRow(params, None, [], 0, (0,), bitmask)


def test_unpack_bitmask_sets_exactly_the_allowed_tokens() -> None:
    allowed = [0, 1, 31, 32, 63, 64, 99]
    bits = unpack_bitmask(_bitmask_allowing(allowed, 100)[None, :], 100)  # [1, 100]
    assert bits.shape == (1, 100)
    assert bits[0].nonzero().squeeze(1).tolist() == allowed


def test_greedy_and_sampled_rows_only_pick_allowed_tokens_and_free_rows_are_untouched() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    original = logits.clone()
    allowed = [7, 42]
    bitmask = _bitmask_allowing(allowed, 100)
    rows = [_row(SamplingParams(temperature=0.0), bitmask),
            _row(SamplingParams(temperature=1.0, seed=3), bitmask),
            _row(SamplingParams(temperature=0.0))]
    out = Sampler(seed=0)(logits, rows)
    assert out.token_ids[0] == max(allowed, key=lambda t: logits[0, t].item())
    assert out.token_ids[1] in allowed
    assert out.token_ids[2] == int(logits[2].argmax())  # no grammar: the plain argmax
    assert torch.equal(logits, original)  # the caller's logits are never modified
    masked = apply_token_bitmasks(logits, rows)
    assert torch.isinf(masked[0]).sum() == 98 and torch.equal(masked[2], logits[2])


def test_invalid_schema_and_min_tokens_with_a_grammar_are_refused() -> None:
    with pytest.raises(OutputGrammarError):
        OutputGrammar.json_schema({"type": "no-such-type"})
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(min_tokens=2, max_tokens=8, grammar=OutputGrammar.json_object())


def _generate(engine: LLMEngine, prompts: dict[str, tuple[list[int], SamplingParams]]
              ) -> dict[str, tuple[str, str | None]]:
    for request_id, (prompt, params) in prompts.items():
        engine.add_request(request_id, prompt, params)
    texts = {request_id: "" for request_id in prompts}
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished_requests:
        for output in engine.step():
            texts[output.request_id] += output.text
            if output.finish_reason is not None:
                reasons[output.request_id] = str(output.finish_reason)
    return {request_id: (texts[request_id], reasons.get(request_id)) for request_id in prompts}


def _chat(engine: LLMEngine, content: str) -> list[int]:
    return list(engine.tokenizer.encode_chat([{"role": "user", "content": content}],
                                             add_generation_prompt=True))


def _follows_person_schema(value: Any) -> bool:
    return (isinstance(value, dict) and list(value) == ["name", "age", "color", "tags"]
            and isinstance(value["name"], str) and isinstance(value["age"], int)
            and value["age"] >= 0 and value["color"] in ("red", "green", "blue")
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3
            and all(isinstance(tag, str) for tag in value["tags"]))


def test_real_model_output_follows_the_schema_greedy_and_sampled(engine: LLMEngine) -> None:
    schema = OutputGrammar.json_schema(PERSON)
    results = _generate(engine, {
        "greedy": (_chat(engine, "Describe Bob, 41, who loves green, as JSON."),
                   SamplingParams(temperature=0.0, max_tokens=80, grammar=schema)),
        "hot": (_chat(engine, "Invent a person."),
                SamplingParams(temperature=1.5, seed=7, max_tokens=80, grammar=schema)),
        "object": (_chat(engine, "List two fruits."),
                   SamplingParams(temperature=0.0, max_tokens=60,
                                  grammar=OutputGrammar.json_object())),
    })
    for request_id in ("greedy", "hot"):
        text, reason = results[request_id]
        assert reason.endswith("stop"), (request_id, text, reason)
        assert _follows_person_schema(json.loads(text)), text
    text, reason = results["object"]
    assert reason.endswith("stop") and isinstance(json.loads(text), dict), text


def test_a_recursive_schema_with_a_way_out_is_followed_and_one_without_is_refused(
        engine: LLMEngine) -> None:
    """llguidance follows a `$ref` back to the root (a tree); a recursion with no way out (the
    object's required property is the object again) compiled too, into a grammar that refused
    the token after `{"child":`, so the answer was cut off with finish_reason "stop"."""
    tree = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        "required": ["name", "children"], "additionalProperties": False}
    text, reason = _generate(engine, {"tree": (
        _chat(engine, "The root is 'a' with no children, as JSON."),
        SamplingParams(temperature=0.0, max_tokens=40, grammar=OutputGrammar.json_schema(tree)))
    })["tree"]
    value = json.loads(text)
    assert reason.endswith("stop") and isinstance(value["name"], str), text
    assert isinstance(value["children"], list), text
    endless = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}
    with pytest.raises(OutputGrammarError, match="admits no finite value") as refused:
        OutputGrammar.json_schema(endless)
    assert refused.value.param == "response_format"


def test_unconstrained_request_is_unchanged_by_a_constrained_neighbour(engine: LLMEngine) -> None:
    free = (_chat(engine, "Write one sentence about rivers."),
            SamplingParams(temperature=0.0, max_tokens=16))
    alone = _generate(engine, {"free": free})["free"]
    together = _generate(engine, {
        "free": free,
        "json": (_chat(engine, "Describe Ann as JSON."),
                 SamplingParams(temperature=0.0, max_tokens=40,
                                grammar=OutputGrammar.json_schema(PERSON))),
    })
    assert together["free"] == alone


def test_ignore_eos_still_stops_when_the_grammar_is_complete(engine: LLMEngine) -> None:
    schema = OutputGrammar.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                        "required": ["ok"], "additionalProperties": False})
    text, reason = _generate(engine, {"done": (_chat(engine, "Is water wet?"), SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, grammar=schema))})["done"]
    assert reason.endswith("stop") and json.loads(text) in ({"ok": True}, {"ok": False}), text
    engine.kv_cache.check_integrity()
    assert engine.kv_cache.pool.num_used_blocks == 0


def test_each_request_gets_its_own_parser_state_from_a_grammar_built_once(
        engine: LLMEngine) -> None:
    """Building a matcher builds its lexer (~40 ms for 40 tools, in the engine thread): the
    compiler builds each grammar once and hands every request a copy of the fresh matcher."""
    import llguidance

    schema = OutputGrammar.json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                                        "required": ["n"], "additionalProperties": False})
    compiler = engine.grammars
    built: list[object] = []
    original = llguidance.LLMatcher

    def counting(*args: Any, **kwargs: Any) -> Any:
        built.append(args)
        return original(*args, **kwargs)

    first = compiler.matcher(schema)
    llguidance.LLMatcher = counting  # type: ignore[misc]
    try:
        second = compiler.matcher(schema)
    finally:
        llguidance.LLMatcher = original  # type: ignore[misc]
    assert built == []
    opening = engine.tokenizer.encode('{"n":')
    for token in opening:
        assert first.accept(token)
    fresh_row, advanced_row = (torch.zeros(compiler.num_words, dtype=torch.int32) for _ in range(2))
    second.fill_bitmask(fresh_row)
    first.fill_bitmask(advanced_row)
    allowed_fresh = unpack_bitmask(fresh_row[None], compiler.vocab_size)[0]
    allowed_advanced = unpack_bitmask(advanced_row[None], compiler.vocab_size)[0]
    assert allowed_fresh[opening[0]] and not torch.equal(allowed_fresh, allowed_advanced)


@contextmanager
def _counted_builds(compiler: Any) -> Iterator[list[OutputGrammar]]:
    """The grammars `compiler` builds (not takes from its cache) inside the block, in order."""
    built: list[OutputGrammar] = []
    build = compiler._build

    def counting(grammar: OutputGrammar) -> Any:
        built.append(grammar)
        return build(grammar)

    compiler._build = counting
    try:
        yield built
    finally:
        del compiler._build


def test_a_grammar_prepared_in_another_thread_is_built_once(engine: LLMEngine) -> None:
    import threading

    spec = OutputGrammar.json_schema({"type": "object", "properties": {"k": {"enum": ["a", "b"]}},
                                      "required": ["k"], "additionalProperties": False})
    compiler = engine.grammars
    with _counted_builds(compiler) as built:
        worker = threading.Thread(target=compiler.prepare, args=(spec,))
        worker.start()
        worker.join()
        first, second = compiler.matcher(spec), compiler.matcher(spec)
    assert built == [spec]
    assert first.accept(engine.tokenizer.encode('{"k":"a"}')[0]) and not second.is_stopped()


def test_a_grammar_built_for_one_cache_salt_is_not_reused_under_another(engine: LLMEngine) -> None:
    """A built grammar answers ~40 ms sooner: one tenant's requests must not warm another's."""
    spec = OutputGrammar.json_schema({"type": "object", "properties": {"t": {"type": "boolean"}},
                                      "required": ["t"], "additionalProperties": False})
    compiler = engine.grammars
    with _counted_builds(compiler) as built:
        compiler.prepare(spec, "tenant-a")
        compiler.matcher(spec, "tenant-a")
        compiler.matcher(spec, "tenant-b")
        compiler.matcher(spec, "tenant-b")
    assert built == [spec, spec]


def test_the_grammar_cache_is_bounded_by_bytes_not_by_count(engine: LLMEngine) -> None:
    from engine.structured_output import GrammarCompiler

    compiler = GrammarCompiler(engine.tokenizer.backend, engine.grammars.vocab_size, [])
    compiler._fresh.max_bytes = compiler._fresh.max_entry_bytes = 4 * compiler.MATCHER_BASE_BYTES
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}
    small = [{"type": "object", "properties": {f"q{i}": {"type": "integer"}}} for i in range(6)]
    for schema in small:
        compiler.prepare(OutputGrammar.json_schema(schema))
    assert 0 < compiler.num_cached_bytes <= 4 * compiler.MATCHER_BASE_BYTES
    assert len(compiler._fresh) < len(small)  # the oldest went: a count bound would keep all 6
    compiler.prepare(OutputGrammar.json_schema(big))  # over the entry cap: built, not kept
    assert compiler.num_cached_bytes <= 4 * compiler.MATCHER_BASE_BYTES
    assert compiler.matcher(OutputGrammar.json_schema(big)) is not None
