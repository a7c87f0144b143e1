"""`RequestState`: one admitted request as the pipeline carries it from dispatch to settle.

Made once the meter admitted the request (gateway/request/pipeline.py); the dispatch step sets
who answers (`endpoint`, `replica`, a fallback's `route`), the answer steps
(gateway/request/answer.py) fill `accumulator` and `status`, and the request's `Settlement`
(gateway/request/settlement.py) builds its one usage record from it. Plain fields, no behaviour
beyond reading them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.request.canonical import Accumulator

if TYPE_CHECKING:
    from aiohttp import web

    from auth.principal import Principal
    from gateway.dialects.base import Dialect
    from gateway.fleet.endpoints import Endpoint, ModelRoute
    from gateway.guardrails.chain import RequestGuards
    from gateway.metering.contract import Admission
    from gateway.request.cache_explainer import SessionTurn
    from gateway.request.canonical import CanonicalRequest, PromptUsage
    from gateway.request.dispatch import Timing
    from gateway.request.keeper import AnswerKeeper
    from gateway.request.settlement import Settlement


class RequestState:
    __slots__ = ("accumulator", "admission", "announced", "canonical", "debug", "dialect",
                 "endpoint", "error", "explain_route", "guards", "is_logged", "keeper",
                 "num_prompt_tokens", "principal", "replica", "request", "route", "settlement",
                 "settles_before_answer", "show_overhead", "status", "timing", "turn", "usage_id")

    def __init__(self, request: web.Request, dialect: Dialect, canonical: CanonicalRequest,
                 principal: Principal, route: ModelRoute, admission: Admission, usage_id: str,
                 timing: Timing) -> None:
        self.request = request
        self.dialect = dialect
        self.canonical = canonical
        self.principal = principal
        self.admission = admission
        self.usage_id = usage_id  # the usage record's id (unique per gateway request)
        self.timing = timing
        self.route = route  # the model that serves: the requested one, or a fallback after a hop
        self.debug = False  # x-aigw-debug: 1
        self.turn: SessionTurn | None = None  # this request as its session's turn
        self.announced: PromptUsage | None = None  # a stream's first event: the prompt's usage
        self.accumulator = Accumulator()
        self.replica = "none"
        self.endpoint: Endpoint | None = None  # the endpoint that answered, once one did
        self.num_prompt_tokens: int | None = None  # counted here when the upstream sent no usage
        self.status = 502
        self.explain_route = False
        self.settlement: Settlement  # set at once by the pipeline: the one settle of this request
        self.settles_before_answer = admission.counts_against_limits  # limited: settled first
        self.show_overhead = False  # x-aigw-overhead-ms: admin callers only
        self.keeper: AnswerKeeper | None = None  # stores the answer before it is sent
        self.guards: RequestGuards | None = None  # the guardrails that apply to this request
        self.is_logged = False  # sampled for the request log
        self.error: tuple[str, str] | None = None  # (code, message) answered, for the log

    def needs_prompt_count(self) -> bool:
        """An endpoint answered (so it processed the prompt) but no usage arrived, not even the
        prompt's count at its start; or the client left a non-streamed request while an
        endpoint computed its answer (after `adopt_abandoned_attempt`)."""
        return (self.endpoint is not None and self.accumulator.usage is None
                and self.accumulator.prompt_usage is None
                and (self.accumulator.num_events > 0 or self.timing.abandoned_at is not None))

    def adopt_abandoned_attempt(self) -> None:
        """A non-streamed request whose client left while an endpoint was computing its whole
        answer (one body: no event had come, `Timing.abandoned_at`): that endpoint had the
        prompt, so it is the one that served, and the record bills the prompt it was given
        (a stream's first event, the prompt's count, comes before its first token)."""
        abandoned = self.timing.abandoned_at
        if self.endpoint is None and abandoned is not None and not self.canonical.stream:
            self.route, self.endpoint = abandoned
            self.replica = self.endpoint.name
