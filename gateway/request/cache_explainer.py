"""The cache-miss explainer: where a session's prompt first diverged from its previous turn's.

    explainer = CacheExplainer(max_bytes=16 * 2**20)
    turn = explainer.explain(request)          # None: the request names no session
    ...answer...
    explainer.settle(turn, prompt_tokens, cached_tokens)   # the turn's hit, for the dashboard

A session is the prefix router's affinity key (SESSION_KEY_PRECEDENCE: the body's
prompt_cache_key, else `x-session-id`, else OpenAI `user` / Anthropic metadata.user_id), always
within the caller's project: the store is keyed by (project, session), so a project never sees,
nor compares against, another project's turns, whatever session name it sends.

A prompt is laid out as its parts: the model (each has its own cache: `model changed`, e.g. a
turn served by a fallback model), the fields a template may read (`response_format`,
`tool_choice`, `chat_template_kwargs`, `reasoning_effort`), each tool (`tools[i].name`,
`.description`, `.parameters`), then each message (`messages[i].role`, `.content`,
`.tool_calls`, ...), the order a chat template writes them in; a completion is its `prompt`.
Comparing with the previous turn's parts gives the first one that differs:

    tools[3].description changed at char 17     a value differs (from its first differing char)
    messages[4] removed / tools[2] added        the parts run out of step
    (none)                                      the prompt extends the previous one: a full hit
                                                is possible, a miss is the cache's (eviction)

and the token index of the divergence: the count of leading token ids the two prompts share when
the gateway rendered both with one tokenizer (`CanonicalRequest.rendered_prompt`), else estimated
from the characters before it (~4 a token, `is_exact` false). Nothing of the prompt's text is
kept beyond the previous turn's parts, nor shown: only names of parts and offsets.

The store is one ByteLRU (infra/byte_lru.py) per project, each bounded in bytes of what it holds
(parts, token ids, the last `max_turns` turns' rows) to `max_bytes // PROJECT_SHARES`, and all of
them to `max_bytes` (the least recently used project's sessions go first): one project's sessions
never evict another's while fewer than PROJECT_SHARES projects are active. A session whose entry
is over `max_entry_bytes` is not kept.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.request.canonical import CanonicalRequest
from infra.byte_lru import ByteLRU, str_bytes

SESSION_KEY_PRECEDENCE = ("prompt_cache_key", "session_id", "user")  # the prefix router's
_ROW_BYTES = 200  # a turn's row, roughly (a few ints and short strings)
_FIELDS = ("response_format", "tool_choice", "chat_template_kwargs", "reasoning_effort")


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where the prompt first differs from the previous turn's."""

    where: str  # "messages[0].content changed at char 212", "tools[3] added", ...
    token_index: int  # leading tokens shared with the previous turn's prompt
    is_exact: bool  # token_index from both prompts' token ids, not estimated from characters


@dataclass(frozen=True, slots=True)
class SessionTurn:
    """One turn of a session, as the dashboard lists it."""

    turn: int  # 1 for the session's first request seen
    request_id: str
    at_s: float  # time.time() when it arrived
    divergence: Divergence | None  # None: the first turn, or the prompt extends the previous one
    num_prompt_tokens: int | None = None  # set once answered
    num_cached_tokens: int | None = None

    @property
    def hit_ratio(self) -> float | None:
        if not self.num_prompt_tokens or self.num_cached_tokens is None:
            return None
        return self.num_cached_tokens / self.num_prompt_tokens


@dataclass(slots=True)
class _Session:
    parts: list[tuple[str, str]]
    token_ids: array[int] | None
    tokenizer: str | None
    turns: list[SessionTurn] = field(default_factory=list)
    num_turns: int = 0

    def num_bytes(self) -> int:
        parts = sum(str_bytes(k) + str_bytes(v) + 72 for k, v in self.parts)
        ids = 0 if self.token_ids is None else self.token_ids.itemsize * len(self.token_ids)
        return 200 + parts + ids + _ROW_BYTES * len(self.turns)


def session_of(request: CanonicalRequest) -> str | None:
    """The request's session name (the prefix router's affinity key), or None."""
    for attribute in SESSION_KEY_PRECEDENCE:
        value = getattr(request, attribute, None)
        if isinstance(value, str) and value:
            return value
    return None


def _key(project: str, session: str) -> bytes:
    text = f"{project}\x00{session}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(text, digest_size=16).digest()  # (a session name may be 8 KiB)


def _json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def prompt_parts(request: CanonicalRequest) -> list[tuple[str, str]]:
    """The prompt as (part name, text) in the order it is laid out (module docstring)."""
    parts: list[tuple[str, str]] = [("model", request.model)]  # (the cache is per model)
    if request.kind != "chat":
        first = (request.prompt if request.prompt_token_ids is None
                 else _json(request.prompt_token_ids))
        return [*parts, ("prompt", first)]
    for name in _FIELDS:  # first: a template may write them anywhere (and the history grows last)
        value = getattr(request, name)
        if value is not None:
            parts.append((name, value if isinstance(value, str) else _json(value)))
    for i, tool in enumerate(request.tools):
        parts += [(f"tools[{i}].name", tool.name), (f"tools[{i}].description", tool.description),
                  (f"tools[{i}].parameters", _json(tool.parameters))]
    for i, message in enumerate(request.messages):
        parts += [(f"messages[{i}].role", message.role),
                  (f"messages[{i}].content", message.content)]
        if message.tool_calls:
            parts.append((f"messages[{i}].tool_calls", _json(
                [[c.id, c.name, c.arguments] for c in message.tool_calls])))
        if message.tool_call_id is not None:
            parts.append((f"messages[{i}].tool_call_id", message.tool_call_id))
        if message.name is not None:
            parts.append((f"messages[{i}].name", message.name))
        if message.reasoning:
            parts.append((f"messages[{i}].reasoning", message.reasoning))
    return parts


def _item(part: str) -> str:
    """`tools[3].description` -> `tools[3]`; a field is its own item."""
    return part.split("].", 1)[0] + "]" if "]." in part else part


def _common_prefix(a: str | array[int], b: str | array[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def diverge(previous: list[tuple[str, str]], current: list[tuple[str, str]]
            ) -> tuple[str, int] | None:
    """(what changed, characters of the prompt before it), or None when `current` extends (or
    equals) `previous` part by part (a message appended, or nothing)."""
    num_chars = 0
    for (old_key, old_value), (new_key, new_value) in zip(previous, current, strict=False):
        if old_key == new_key and old_value == new_value:
            num_chars += len(new_value) if new_key != "model" else 0  # (not in the prompt's text)
            continue
        if new_key == "model":
            return "model changed", 0  # another model's cache: nothing of it is shared
        if old_key == new_key:
            at = _common_prefix(old_value, new_value)
            return f"{new_key} changed at char {at}", num_chars + at
        old_item, new_item = _item(old_key), _item(new_key)
        if old_item == new_item:  # the same item, with another field (a tool call added)
            return f"{new_item} changed", num_chars
        if not any(_item(k) == new_item for k, _ in previous):
            return f"{new_item} added", num_chars
        return f"{old_item} removed", num_chars
    if len(current) < len(previous):
        return f"{_item(previous[len(current)][0])} removed", num_chars
    return None


class CacheExplainer:
    """Per (project, session): the previous turn's parts and token ids, and its last turns."""

    PROJECT_SHARES = 8  # a project's sessions hold at most max_bytes / 8

    def __init__(self, max_bytes: int, max_turns: int = 64,
                 max_entry_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_project_bytes = max_bytes // self.PROJECT_SHARES
        self.max_entry_bytes = (max_entry_bytes if max_entry_bytes is not None
                                else self.max_project_bytes)
        self._projects: OrderedDict[str, ByteLRU[bytes, _Session]] = OrderedDict()
        self.max_turns = max_turns

    @property
    def num_bytes(self) -> int:
        return sum(sessions.num_bytes for sessions in self._projects.values())

    def _get(self, project: str, key: bytes) -> _Session | None:
        sessions = self._projects.get(project)
        return sessions.get(key) if sessions is not None else None

    def _put(self, project: str, key: bytes, state: _Session) -> None:
        sessions = self._projects.get(project)
        if sessions is None:
            sessions = self._projects[project] = ByteLRU(self.max_project_bytes,
                                                         self.max_entry_bytes)
        self._projects.move_to_end(project)
        sessions.put(key, state, state.num_bytes())
        while len(self._projects) > 1 and self.num_bytes > self.max_bytes:
            self._projects.popitem(last=False)  # the least recently used project's sessions

    def explain(self, request: CanonicalRequest) -> SessionTurn | None:
        """This request as its session's next turn (compared with the previous one, which it
        replaces), or None when it names no session. `request.project` must be set."""
        session = session_of(request)
        if session is None:
            return None
        project = request.project or ""
        key = _key(project, session)
        parts = prompt_parts(request)
        rendered = request.rendered_prompt
        ids = array("i", rendered[1]) if rendered is not None else None
        tokenizer = rendered[0] if rendered is not None else None
        state = self._get(project, key)
        divergence = None
        if state is not None:
            found = diverge(state.parts, parts)
            if found is not None:
                where, num_chars = found
                if ids is not None and state.token_ids is not None and tokenizer == state.tokenizer:
                    divergence = Divergence(where, _common_prefix(state.token_ids, ids), True)
                else:
                    divergence = Divergence(where, num_chars // 4, False)
        else:
            state = _Session(parts, ids, tokenizer)
        turn = SessionTurn(state.num_turns + 1, request.request_id, time.time(), divergence)
        state.parts, state.token_ids, state.tokenizer = parts, ids, tokenizer
        state.num_turns += 1
        state.turns = [*state.turns[-(self.max_turns - 1):], turn] if self.max_turns else []
        self._put(project, key, state)
        return turn

    def settle(self, turn: SessionTurn, num_prompt_tokens: int, num_cached_tokens: int,
               project: str, session: str) -> SessionTurn:
        """The turn with its answer's prompt and cached tokens (kept for the dashboard)."""
        answered = SessionTurn(turn.turn, turn.request_id, turn.at_s, turn.divergence,
                               num_prompt_tokens, num_cached_tokens)
        state = self._get(project, _key(project, session))
        if state is not None:
            state.turns = [answered if t is turn else t for t in state.turns]
        return answered

    def turns(self, project: str, session: str) -> list[SessionTurn]:
        """The session's last turns (oldest first), [] for a session this project never sent."""
        state = self._get(project, _key(project, session))
        return list(state.turns) if state is not None else []


def describe(turn: SessionTurn) -> dict[str, Any]:
    """A turn as JSON (the dashboard's API and the debug answer)."""
    divergence = turn.divergence
    return {"turn": turn.turn, "request_id": turn.request_id, "at": turn.at_s,
            "prompt_tokens": turn.num_prompt_tokens, "cached_tokens": turn.num_cached_tokens,
            "hit_ratio": turn.hit_ratio,
            "divergence": None if divergence is None else {
                "where": divergence.where, "token_index": divergence.token_index,
                "exact": divergence.is_exact}}
