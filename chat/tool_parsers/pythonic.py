"""Pythonic tool calls: a Python list of calls with keyword arguments (Llama 4, Llama 3.2, ToolACE;
vLLM's `pythonic` and `llama4_pythonic` parsers read the same):

    [get_weather(city="Paris"), search(q='a, b]', filters={"n": [1, -2]}, exact=True)]

The answer is calls when it opens with the list (after whitespace) or after Llama 4's
`<|python_start|>` marker (text before the marker is content; `<|python_end|>` after the list is
dropped). Each element is parsed with Python's `ast` (never evaluated) as a call to a tool name
(`-` and `.` allowed between its parts) with keyword arguments (Python keywords too:
`from="Oslo"`) whose values are literals: strings, numbers, True/False/None (and JSON's
true/false/null), lists, tuples and dicts with string keys. Arguments become a compact JSON object.

Llama 4's JSON spelling, which Meta's own template asks for, is read too (`llama4_pythonic`):

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

Streaming: a call is released whole when its element of the list ends (the `,` or `]` after it),
so calls arrive one by one, as Hermes' do at their end tags. An element that is no call (`[1, 2]`,
`[f(1)]`, `[f(x=g())]`) ends the calls: that element and what follows are content, the calls before
it stay calls (with none before it, the whole answer is text, as it was written). A list cut by
max_tokens keeps its complete calls; a cut first call is text, or nothing when decoding was
constrained to calls (`calls_grammar`).
"""

from __future__ import annotations

import ast
import io
import keyword
import re
import tokenize
from collections.abc import Sequence
from typing import Any

import orjson

from chat.tool_parsers.base import (
    TEMPLATE_JSON_SPACING,
    StreamDelta,
    ToolCall,
    ToolCallStream,
    ToolParser,
    _partial_suffix_len,
    arguments_schema,
)

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
MAX_NESTING = 100  # brackets deep: Python's own parser refuses 200; deeper text is no call
_JSON_NAMES = {"true": True, "false": False, "null": None}
_NAME_CHAR = re.compile(r"[\w\s.-]")  # what may precede an element's "(" (its name)
# a call's head: the tool name (OpenAI's names may hold "-"; MCP clients send "server.tool"), "("
_CALL_HEAD = re.compile(r"\s*([A-Za-z_]\w*(?:[.-]\w+)*)\s*\(", re.ASCII)
_PLACEHOLDER = "_"  # the name ast parses in place of one that is no Python identifier


class NotACall(ValueError):
    """Text that is not a pythonic call (or not a literal argument value)."""


def literal_value(node: ast.expr) -> Any:
    """The JSON value of a literal expression; NotACall for anything else (names, calls,
    operators, f-strings, bytes, sets)."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, (str, int, float, bool)) or node.value is None:
            return node.value
        raise NotACall(f"{type(node.value).__name__} is not a JSON value")
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant)):
        number = node.operand.value
        if type(number) in (int, float):  # not bool, not complex
            assert isinstance(number, (int, float))
            return -number if isinstance(node.op, ast.USub) else number
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal_value(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise NotACall("dict keys must be strings")
            out[key.value] = literal_value(value)
        return out
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise NotACall(f"{type(node).__name__} is not a literal")


def parse_pythonic_call(text: str) -> ToolCall | None:
    """One element of the list (`get_weather(city="Paris")`) as a call, or None. The name may
    hold "-" and "." (`brave-search(q="x")`, `github.list_issues(...)`): tool names are the
    client's, not Python's."""
    head = _CALL_HEAD.match(text)
    if head is None:
        return None
    source = _PLACEHOLDER + text[head.end(1):].strip()
    renames: dict[str, str] = {}
    try:
        try:
            tree = ast.parse(source, mode="eval")
        except SyntaxError:  # a Python keyword as a parameter name (`from="Oslo"`)?
            source, renames = _keyword_arguments_renamed(source)
            if not renames:
                return None
            tree = ast.parse(source, mode="eval")
        call = tree.body
        if (not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name)
                or call.func.id != _PLACEHOLDER or call.args):
            return None
        arguments = {}
        for kw in call.keywords:
            name = renames.get(kw.arg, kw.arg) if kw.arg is not None else None
            if name is None or name in arguments:  # **kwargs, or a repeated name
                return None
            arguments[name] = literal_value(kw.value)
        return ToolCall(name=head.group(1), arguments=orjson.dumps(arguments).decode())
    except (SyntaxError, ValueError, RecursionError, MemoryError, orjson.JSONEncodeError):
        return None  # NotACall is a ValueError; orjson: an integer past 64 bits


def _keyword_arguments_renamed(source: str) -> tuple[str, dict[str, str]]:
    """`source` with each Python keyword written as an argument name (`from=`, `class=`) renamed
    to a placeholder, and the placeholders' names; ({} when there is none, or no tokens)."""
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
                  if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)]
    except (tokenize.TokenError, SyntaxError):
        return source, {}
    line_starts = [0]
    for line in source.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    renames: dict[str, str] = {}
    pieces, at = [], 0
    for token, following in zip(tokens, tokens[1:], strict=False):
        if (token.type == tokenize.NAME and keyword.iskeyword(token.string)
                and following.type == tokenize.OP and following.string == "="):
            placeholder = f"_aigw_keyword_{len(renames)}"
            renames[placeholder] = token.string
            begin = line_starts[token.start[0] - 1] + token.start[1]
            pieces += [source[at:begin], placeholder]
            at = begin + len(token.string)
    return "".join(pieces) + source[at:], renames


def parse_json_call(text: str) -> ToolCall | None:
    """`{"name": ..., "parameters": {...}}` (or `arguments`) as a call, or None."""
    try:
        payload = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("parameters", payload.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=payload["name"], arguments=orjson.dumps(arguments).decode())


class PythonicToolParser(ToolParser):
    """`[name(key=value, ...), ...]`; Llama 4's markers around it are read when present."""

    start_tag, end_tag = PYTHON_START, PYTHON_END
    reads_json_calls = False  # Llama 4's `{"name": ..., "parameters": ...}` spelling too

    def parse_call(self, body: str) -> ToolCall | None:
        return parse_pythonic_call(body)

    def call_schema(self, name: str, parameters: dict[str, Any] | None,
                    pointer: str = "") -> dict[str, Any]:
        raise NotImplementedError("pythonic calls are no JSON document: see calls_grammar")

    def stream(self, is_calls_only: bool = False) -> ToolCallStream:
        return PythonicCallStream(self, is_calls_only)

    def calls_grammar(self, functions: Sequence[tuple[str, dict[str, Any] | None]],
                      is_parallel: bool = True) -> str:
        """A list of one (or, `is_parallel`, one or more) calls to `functions`: the required
        parameters in order, then any optional ones, each value JSON following its property's
        schema (JSON's strings, numbers and containers are Python literals; true/false/null are
        read as JSON names). A parameter the schema does not list cannot be written."""
        rules = []
        for i, (name, parameters) in enumerate(functions):
            rules.append(f"call{i}: {orjson.dumps(name + '(').decode()} "
                         f"{_arguments_rule(parameters or {})} \")\"")
        calls = '"[" call ("," " " call)* "]"' if is_parallel else '"[" call "]"'
        return (f"start: {calls}\n"
                f"call: {' | '.join(f'call{i}' for i in range(len(functions)))}\n"
                + "\n".join(rules) + "\n")


class Llama4PythonicToolParser(PythonicToolParser):
    """Llama 4: pythonic lists, or JSON calls, optionally between `<|python_start|>` and
    `<|python_end|>`."""

    reads_json_calls = True

    def calls_grammar(self, functions: Sequence[tuple[str, dict[str, Any] | None]],
                      is_parallel: bool = True) -> str:
        """The pythonic list (see PythonicToolParser), or, when a function's name or a parameter's
        cannot be written in it (`user-id=`), Llama 4's JSON calls joined by "; ",
        `{"name": NAME, "parameters": {...}}`, the arguments following each schema."""
        if all(_is_pythonic(name, parameters) for name, parameters in functions):
            return super().calls_grammar(functions, is_parallel)
        rules = []
        for i, (name, parameters) in enumerate(functions):
            schema = arguments_schema(parameters, "")
            schema["x-guidance"] = TEMPLATE_JSON_SPACING
            head = orjson.dumps(f'{{"name": {orjson.dumps(name).decode()}, "parameters": ').decode()
            rules.append(f'call{i}: {head} %json {orjson.dumps(schema).decode()} "}}"')
        calls = 'call ("; " call)*' if is_parallel else "call"
        return (f"start: {calls}\n"
                f"call: {' | '.join(f'call{i}' for i in range(len(functions)))}\n"
                + "\n".join(rules) + "\n")


def _is_pythonic(name: str, parameters: dict[str, Any] | None) -> bool:
    """A call to `name` with these parameters can be written as a pythonic call and read back."""
    names = list((parameters or {}).get("properties") or {})
    return (_CALL_HEAD.fullmatch(name + "(") is not None
            and all(k.isidentifier() for k in names))  # keywords (`from=`) are read back


def _arguments_rule(parameters: dict[str, Any]) -> str:
    """The keyword arguments of one call as a Lark expression (may be empty text)."""
    properties = parameters.get("properties") or {}
    required = [k for k in parameters.get("required") or [] if k in properties]
    optional = [k for k in properties if k not in required]
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}

    def argument(key: str) -> str:
        schema = {**properties[key], **defs, "x-guidance": TEMPLATE_JSON_SPACING}
        return f"{orjson.dumps(key + '=').decode()} %json {orjson.dumps(schema).decode()}"

    def tail(keys: list[str]) -> str:
        return " ".join(f'("," " " {argument(k)})?' for k in keys)

    if required:
        head = ' "," " " '.join(argument(k) for k in required)
        return f"{head} {tail(optional)}".strip()
    if not optional:
        return ""
    # no required parameter: whichever optional one comes first has no comma before it
    firsts = [f"{argument(k)} {tail(optional[j + 1:])}".strip() for j, k in enumerate(optional)]
    return "(" + " | ".join(firsts) + ")?"


class PythonicCallStream(ToolCallStream):
    """Incremental reading of one answer (see the module docstring); `feed` in order, then
    `finish` once. Linear in the answer: each character is scanned once, each list element and
    JSON call parsed once.

    States: LEAD (only whitespace so far), TEXT (content; a marker may open calls), MARKED
    (after `<|python_start|>`: whitespace, then calls), LIST / JSON (scanning a list or a JSON
    call; `_pending` starts at its "[" or "{"), AFTER (a list or JSON call ended)."""

    LEAD, TEXT, MARKED, LIST, JSON, AFTER = range(6)

    def __init__(self, parser: PythonicToolParser, is_calls_only: bool = False) -> None:
        super().__init__(parser, is_calls_only)
        self._reads_json = parser.reads_json_calls
        self._state = self.LEAD
        self._marker = ""  # the marker (and whitespace) before the calls text, for a fall back
        self._scan_at = 0  # the next index of _pending to scan
        self._element_at = 0  # where the list's current element (or the JSON call) starts
        self._stack: list[str] = []  # open brackets, and an open string's quote
        self._after_call = False  # the element's call closed: only "," or "]" may follow
        self._in_name = False  # the element's name has begun (before its "(")
        self._calls: list[ToolCall] = []
        self._content: list[str] = []

    def feed(self, text: str) -> StreamDelta:
        self._pending += text
        self._content, self._calls = [], []
        self._advance(is_final=False)
        self.num_calls += len(self._calls)
        return StreamDelta(self._shown("".join(self._content)), tuple(self._calls))

    def finish(self) -> StreamDelta:
        self._content, self._calls = [], []
        self._advance(is_final=True)
        has_calls = bool(self.num_calls or self._calls)
        if self._state in (self.LIST, self.JSON):  # cut by max_tokens inside the calls
            body = self._pending[self._element_at:]
            call = (parse_pythonic_call(body) if self._state == self.LIST
                    else parse_json_call(body))
            if call is not None:
                self._calls.append(call)
            elif not has_calls and not self._ends_with_call:
                self._text(self._marker + self._pending)
        elif self._state == self.MARKED:
            if not has_calls and not self._ends_with_call:
                self._text(self._marker + self._pending)
        elif self._state == self.TEXT or (self._state == self.LEAD and not self._ends_with_call):
            self._text(self._pending)
        # AFTER: whitespace, a cut `<|python_end|>` or a `;` with nothing after it is dropped
        self._pending = ""
        self.num_calls += len(self._calls)
        content = self._shown("".join(self._content))
        if not self._has_text and not self.num_calls:  # a blank answer without calls is content
            content, self._blank = self._blank, ""
        return StreamDelta(content, tuple(self._calls))

    def _text(self, text: str) -> None:
        self._content.append(text)
        if text.strip():
            self._ends_with_call = False

    @property
    def _has_calls(self) -> bool:
        return bool(self.num_calls or self._calls)

    def _advance(self, is_final: bool) -> None:
        """Run the state machine over the pending text as far as the text decides it."""
        steps = {self.LEAD: self._lead, self.TEXT: self._in_text, self.MARKED: self._marked,
                 self.LIST: self._scan, self.JSON: self._scan, self.AFTER: self._after}
        while steps[self._state](is_final):
            pass

    def _lead(self, is_final: bool) -> bool:
        """Only whitespace so far: a list, a JSON call, the marker, or text comes next."""
        stripped = self._pending.lstrip()
        if not stripped or (PYTHON_START.startswith(stripped) and not is_final
                            and stripped != PYTHON_START):
            return False  # whitespace, or the marker may be forming
        self._state = self.TEXT
        if stripped.startswith(PYTHON_START) or self._opens_calls(stripped):
            self._text(self._pending[: len(self._pending) - len(stripped)])
            self._pending = stripped
            self._state = self.MARKED
        return True

    def _opens_calls(self, text: str) -> bool:
        return text[0] == "[" or (text[0] == "{" and self._reads_json)

    def _in_text(self, is_final: bool) -> bool:
        """Content: released, but for a marker that may be forming at its end."""
        at = self._pending.find(PYTHON_START)
        if at >= 0:
            self._text(self._pending[:at])
            self._pending = self._pending[at:]
            self._state = self.MARKED
            return True
        keep = 0 if is_final else _partial_suffix_len(self._pending, PYTHON_START)
        self._text(self._pending[: len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]
        return False

    def _marked(self, is_final: bool) -> bool:
        """`_pending` starts at the marker, or at a "[" / "{" that may open calls."""
        del is_final
        marker = ""
        if self._pending.startswith(PYTHON_START):
            marker = PYTHON_START
        stripped = self._pending[len(marker):].lstrip()
        if not stripped:
            return False
        self._marker = self._pending[: len(self._pending) - len(stripped)]
        self._pending = stripped
        if not self._opens_calls(stripped):  # the marker, then no call: it is text
            self._text(self._marker)
            self._marker = ""
            self._state = self.TEXT
            return True
        self._state = self.LIST if stripped[0] == "[" else self.JSON
        self._stack, self._scan_at, self._after_call, self._in_name = [], 0, False, False
        self._element_at = 1 if self._state == self.LIST else 0
        return True

    def _fall_back(self) -> bool:
        """The calls text is no call from the current element on. With calls released before
        it, that element and what follows are content; with none, the whole calls text is
        (up to where the scan stopped; what follows is read as text again)."""
        if self._has_calls:
            self._pending = self._pending[self._element_at:]
        else:
            self._text(self._marker + self._pending[: self._scan_at])
            self._pending = self._pending[self._scan_at:]
        self._marker, self._stack = "", []
        self._state = self.TEXT
        return True

    def _scan(self, is_final: bool) -> bool:
        """Scan the calls text; False when it needs more text."""
        text, stack, is_list = self._pending, self._stack, self._state == self.LIST
        while self._scan_at < len(text):
            i, char = self._scan_at, text[self._scan_at]
            if stack and stack[-1] in _QUOTES:
                quote = stack[-1]
                if char == "\\":
                    if i + 1 >= len(text) and not is_final:
                        return False
                    self._scan_at += 2
                elif text.startswith(quote, i):
                    stack.pop()
                    self._scan_at += len(quote)
                elif len(quote) == 3 and quote.startswith(text[i:]) and not is_final:
                    return False  # a closing triple quote may be forming
                else:
                    self._scan_at += 1
                continue
            if char in "'\"" and is_list and len(stack) == 1:
                return self._fall_back()  # a string where a call's name belongs: text
            if char in "'\"":
                if text[i:] == char * (len(text) - i) and len(text) - i < 3 and not is_final:
                    return False  # a triple quote may be forming
                quote = char * 3 if text.startswith(char * 3, i) else char
                stack.append(quote)
                self._scan_at += len(quote)
                continue
            self._scan_at += 1
            at_element = is_list and len(stack) == 1
            if char in "[({":
                if (at_element and (char != "(" or self._after_call)) or len(stack) >= MAX_NESTING:
                    return self._fall_back()
                stack.append(char)
            elif char in "])}":
                if not stack or _OPENER[char] != stack[-1]:
                    return self._fall_back()
                stack.pop()
                if at_element and char == ")":
                    self._after_call = True
                if not stack:
                    return self._end_calls(i)
            elif at_element:
                if char == ",":
                    if not self._element_done(i):
                        return self._fall_back()
                elif not char.isspace():
                    if self._after_call or not _NAME_CHAR.match(char):
                        return self._fall_back()
                    if self._in_name and text[i - 1].isspace():  # "[Two words": prose, no name
                        return self._fall_back()
                    self._in_name = True
        return False

    def _element_done(self, at: int) -> bool:
        """The list element before `at` (its "," or the "]") ended: a call is released (True),
        anything else is no call (False). An empty element after calls (a trailing comma) is
        skipped."""
        body = self._pending[self._element_at:at]
        if not body.strip() and self._has_calls:
            self._element_at, self._after_call, self._in_name = at + 1, False, False
            return True
        call = parse_pythonic_call(body)
        if call is None:
            return False
        self._calls.append(call)
        self._ends_with_call = True
        self._element_at, self._after_call, self._in_name = at + 1, False, False
        return True

    def _end_calls(self, at: int) -> bool:
        """The list's "]" (or a JSON call's "}") at `at` closed it."""
        if self._state == self.LIST:
            if not self._element_done(at):
                return self._fall_back()
        else:
            call = parse_json_call(self._pending[: at + 1])
            if call is None:
                return self._fall_back()
            self._calls.append(call)
            self._ends_with_call = True
        self._pending = self._pending[at + 1:]
        self._marker, self._stack = "", []
        self._state = self.AFTER
        return True

    def _after(self, is_final: bool) -> bool:
        """After a list or JSON call: `<|python_end|>`, `;` and another JSON call, or text."""
        del is_final
        stripped = self._pending.lstrip()
        if not stripped:
            return False
        if stripped.startswith(PYTHON_END):
            self._pending = stripped[len(PYTHON_END):]
            return True
        if PYTHON_END.startswith(stripped):
            return False
        if self._reads_json and stripped[0] == ";":
            rest = stripped[1:].lstrip()
            if not rest:
                return False
            if rest[0] == "{":
                self._pending = rest
                self._state = self.MARKED
                return True
        self._state = self.TEXT
        return True


_QUOTES = frozenset({"'", '"', "'''", '"""'})
_OPENER = {"]": "[", ")": "(", "}": "{"}
