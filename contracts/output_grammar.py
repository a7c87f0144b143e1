"""What a constrained output must match (`OutputGrammar`: a JSON object, a JSON schema or a Lark
grammar) and its validation with llguidance: the part of structured output that request bodies
carry (contracts/replica_protocol.py) and that the gateway may check, without torch. The engine's
token masks are engine/structured_output.py.

    spec = OutputGrammar.json_schema(schema)       # or .json_object(), .lark(); OutputGrammarError
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import orjson

from contracts.sampling_params import SamplingParamsError
from contracts.schema_recursion import endless_ref

GrammarKind = Literal["json_object", "json_schema", "lark"]
_JSON_OPTIONS: Any = {"whitespace_flexible": False}  # llguidance JsonCompileOptions
# llguidance compiles ~100 KiB of schema a second here before its own limits refuse one (a
# 7.9 MB enum: 15 s of a replica's worker thread); a tool set of 100 large tools is ~200 KiB
MAX_GRAMMAR_CHARS = 512 * 1024


class OutputGrammarError(SamplingParamsError):
    """The requested output format cannot be compiled (the message is safe to show)."""


@dataclass(frozen=True)
class OutputGrammar:
    """What the output must match: `kind` and its text, a JSON schema or a Lark grammar
    (llguidance's dialect, which embeds JSON schemas with `%json {...}`). Hashable by (kind, text):
    the engine's matcher cache key. `compiled` is the validated llguidance grammar, kept on the spec
    by the constructors that check it (so no process-wide cache holds one tenant's grammars)."""

    kind: GrammarKind
    text: str
    compiled: str | None = field(default=None, compare=False, repr=False)

    @classmethod
    def json_object(cls) -> OutputGrammar:
        return cls("json_object", '{"type":"object"}')

    @classmethod
    def json_schema(cls, schema: dict[str, Any], param: str = "response_format") -> OutputGrammar:
        """Raises OutputGrammarError (naming `param`) when llguidance cannot compile the schema
        or the schema admits no finite value (check_finite)."""
        check_finite(schema, param)
        try:
            text = orjson.dumps(schema).decode()  # key order = output order
        except orjson.JSONEncodeError:  # orjson writes 254 levels (and reads 1024)
            raise OutputGrammarError(f"{param}: the JSON schema is nested too deeply",
                                     param) from None
        return cls("json_schema", text)._checked(param)

    @classmethod
    def lark(cls, grammar: str, param: str) -> OutputGrammar:
        """Raises OutputGrammarError (naming `param`) when llguidance cannot compile the grammar."""
        return cls("lark", grammar)._checked(param)

    def _checked(self, param: str) -> OutputGrammar:
        if len(self.text) > MAX_GRAMMAR_CHARS:
            what = "grammar" if self.kind == "lark" else "JSON schema"
            raise OutputGrammarError(f"{param}: the {what} is over {MAX_GRAMMAR_CHARS} characters "
                                     f"({len(self.text)})", param)
        try:
            return replace(self, compiled=grammar_of(self))
        except OutputGrammarError as exc:
            raise OutputGrammarError(f"{param}: {exc}", param) from None


def check_finite(schema: Any, param: str) -> None:
    """OutputGrammarError (naming `param`) when `schema` recurses through a local `$ref` with no
    way out: llguidance builds such a grammar, which allows no first token (or none a few tokens
    in), so the answer would be an empty or cut-off 200 (contracts/schema_recursion.py)."""
    ref = endless_ref(schema)
    if ref is not None:
        raise OutputGrammarError(
            f"{param}: unsupported JSON schema: '$ref': {ref!r} admits no finite value (each "
            "value must contain itself again); give the recursion a way out: a property that "
            "is not required, an array that may be empty, or an anyOf alternative without it",
            param)


def grammar_of(spec: OutputGrammar) -> str:
    """The llguidance grammar of `spec`, validated (the one its constructor kept, if it did)."""
    if spec.compiled is not None:
        return spec.compiled
    import llguidance

    if spec.kind == "lark":
        grammar = llguidance.LLMatcher.grammar_from_lark(spec.text)
    else:
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.text,
                                                                    defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise OutputGrammarError(f"invalid JSON schema: {exc}") from exc
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        what = "grammar" if spec.kind == "lark" else "JSON schema"
        raise OutputGrammarError(f"unsupported {what}: {'; '.join(messages)}")
    return grammar
