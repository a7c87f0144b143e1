"""Gateway settings: environment (prefix `AIGW_`, nested with `__`) over a TOML or YAML file.

    # gateway.toml  (AIGW_CONFIG=gateway.toml or `aigw serve --config gateway.toml`)
    auth_enabled = true
    [[models]]
    name = "smollm2"
    backend = "replica"                       # or "openai", or a plugin from `aigw.backends`
    endpoints = ["http://10.0.0.5:8001", "http://10.0.0.6:8001"]
    # or, instead of a hand-kept list, every A/AAAA record of a name (a Kubernetes headless
    # Service), re-resolved every `health_interval_s` (gateway/fleet/discovery.py):
    # discover = "dns://aigw-replica.aigw.svc.cluster.local:8001"
    context_length = 8192
    prices = { input_per_token = 1e-7, cached_input_per_token = 2.5e-8, output_per_token = 4e-7 }

Precedence: explicit arguments > environment > config file > defaults. With no `models`, `aigw
serve` starts embedded replicas (gateway/fleet/embedded.py) and fills them in.
"""

from __future__ import annotations

import contextvars
import tomllib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.batch.settings import BatchSettings
from gateway.guardrails.settings import GuardrailSettings
from gateway.metering.budgets import Budget
from gateway.request_logs.settings import RequestLogSettings

_config_path: contextvars.ContextVar[Path | None] = contextvars.ContextVar("aigw_config",
                                                                           default=None)


class Prices(BaseModel):
    """US dollars per token."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    input_per_token: float = Field(default=0.0, ge=0)
    cached_input_per_token: float = Field(default=0.0, ge=0)
    output_per_token: float = Field(default=0.0, ge=0)

    def cost_usd(self, num_prompt_tokens: int, num_cached_tokens: int,
                 num_completion_tokens: int) -> float:
        num_uncached = max(0, num_prompt_tokens - num_cached_tokens)
        return (num_uncached * self.input_per_token
                + num_cached_tokens * self.cached_input_per_token
                + num_completion_tokens * self.output_per_token)


class ModelSettings(BaseModel):
    """One client-visible model: which backend serves it and on which endpoints."""

    # (unknown keys are errors, as at the top level: `upstream_modle = ...` was ignored)
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(min_length=1)
    backend: str = "replica"
    endpoints: tuple[str, ...] = ()  # required unless `discover` is set (then: the first set)
    discover: str | None = None  # "dns://<name>:<port>": endpoints from the name's A/AAAA records
    upstream_model: str | None = None  # the name sent upstream; defaults to `name`
    api_key: str | None = None  # for hosted OpenAI-compatible upstreams
    # else read from the upstream's /v1/models
    context_length: int | None = Field(default=None, gt=0)
    prices: Prices = Prices()
    share_cache_across_projects: bool = False  # replica: omit the per-project cache_salt
    # openai backend: send the tenant's cache_salt (a digest of it) as vLLM's `cache_salt`, so a
    # shared vLLM keeps each tenant's prefix cache apart; false for an upstream that refuses
    # unknown fields (OpenAI's own API answers 400 "Unrecognized request argument")
    send_cache_salt: bool = True
    tokenizer: str | None = None  # tokenizer.json path, to count tokens when usage is missing
    owned_by: str = "aigw"
    # Other configured models to try, in order, when this one throttles (429), fails (5xx,
    # timeout), has no endpoint that can serve (breakers open), or refuses a prompt as too long
    # for its context (then only models with a longer one): before the client sees a token,
    # within the retry budget. A fallback's own fallbacks follow it (gateway/request/fallback.py).
    fallbacks: tuple[str, ...] = ()
    # `aigw serve` starts its embedded replicas for this model (`--replicas`, `--model`, ...) and
    # fills in `endpoints` (and `upstream_model`, `context_length` if unset) once they are healthy
    embedded: bool = False
    # Latency targets of our replicas (backend "replica"; engine/slo.py): the p90 time to first
    # token and time per output token their scheduler holds, refusing (429, Retry-After) what
    # would break the TTFT target; `reserved_shares`: project -> the fraction of each replica's
    # capacity it holds while it has work. Embedded replicas get them as `--ttft-p90-ms`,
    # `--tpot-p90-ms`, `--reserved-share P=F`; replicas run elsewhere need the same flags. The
    # dashboard compares each class's percentiles with these targets.
    ttft_p90_ms: float | None = Field(default=None, gt=0, lt=3_600_000)
    tpot_p90_ms: float | None = Field(default=None, gt=0, lt=3_600_000)
    reserved_shares: dict[str, float] = {}
    # A flex request waiting longer than this is scheduled as default (`--flex-max-wait-ms`;
    # none: the replica's default, 2x flex's TTFT bound or 60 s without a target)
    flex_max_wait_ms: float | None = Field(default=None, gt=0)
    # Embedded replicas of this model split it across this many processes (`--tensor-parallel-size`:
    # one per CUDA device, or per share of the CPU cores); each such replica is still one endpoint
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)

    @field_validator("reserved_shares")
    @classmethod
    def _check_shares(cls, shares: dict[str, float]) -> dict[str, float]:
        """As the replica checks them (engine/config.py SchedulerConfig): a start-up error here
        rather than replicas that exit."""
        if not all(project and "=" not in project for project in shares):
            raise ValueError("reserved_shares: project names must be non-empty, without '='")
        if not all(0.0 < share < 1.0 for share in shares.values()):
            raise ValueError("reserved_shares: every share must be in (0, 1)")
        if sum(shares.values()) > 0.9:
            raise ValueError("reserved_shares: the shares may hold at most 0.9 of a replica "
                             "together")
        return shares

    def replica_args(self) -> list[str]:
        """This model's latency targets, reserved shares and tensor-parallel size as `aigw replica`
        flags."""
        args: list[str] = []
        if self.ttft_p90_ms is not None:
            args += ["--ttft-p90-ms", f"{self.ttft_p90_ms:g}"]
        if self.tpot_p90_ms is not None:
            args += ["--tpot-p90-ms", f"{self.tpot_p90_ms:g}"]
        for project, share in sorted(self.reserved_shares.items()):
            args += ["--reserved-share", f"{project}={share:g}"]
        if self.flex_max_wait_ms is not None:
            args += ["--flex-max-wait-ms", f"{self.flex_max_wait_ms:g}"]
        if self.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        return args

    @field_validator("endpoints")
    @classmethod
    def _strip_slash(cls, endpoints: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(url.rstrip("/") for url in endpoints)

    @model_validator(mode="after")
    def _check_endpoint_urls(self) -> ModelSettings:
        """A built-in backend's endpoints are http(s) base URLs with a host: one without a
        scheme (`replica-0:8001`) would only ever fail its health checks."""
        if self.backend in ("replica", "openai", "anthropic"):
            for url in self.endpoints:
                parts = urlsplit(url)
                if parts.scheme not in ("http", "https") or not parts.hostname:
                    raise ValueError(f"model {self.name!r}: endpoint {url!r} is not an http:// "
                                     f"or https:// URL with a host")
        return self

    @field_validator("discover")
    @classmethod
    def _check_discover(cls, discover: str | None) -> str | None:
        if discover is not None:
            from gateway.fleet.discovery import parse_discover

            parse_discover(discover)  # raises ValueError on a malformed target
        return discover

    @model_validator(mode="after")
    def _has_endpoints(self) -> ModelSettings:
        if self.embedded:
            if self.backend != "replica" or self.discover is not None:
                raise ValueError(f"model {self.name!r}: an embedded model is backend \"replica\" "
                                 f"without `discover`")
            return self
        if not self.endpoints and self.discover is None:
            raise ValueError(f"model {self.name!r}: set `endpoints`, `discover` or `embedded`")
        return self

    @property
    def upstream_name(self) -> str:
        return self.upstream_model or self.name


class LimitDefaults(BaseModel):
    """Limits handed to the meter (None = unlimited): per minute, in flight, and USD budgets
    (gateway/metering/settings.py::Limits checks them; the admin API's limits replace these).
    Unknown keys are errors: a misspelt `requests_per_minit` was ignored, leaving no limit."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)
    daily_budget_usd: float | None = Field(default=None, gt=0)
    max_concurrent_requests: int | None = Field(default=None, gt=0)
    budgets: tuple[Budget, ...] = ()  # day, month or custom windows, with alert_at thresholds
    webhook_url: str | None = None  # where the budgets' alerts are POSTed
    webhook_secret: str | None = None  # their HMAC-SHA256 signing key (x-aigw-signature)

    @model_validator(mode="after")
    def _check_as_metering_does(self) -> LimitDefaults:
        """What metering refuses (two budgets of one window, a webhook without its secret)
        is a settings error at start-up, in one line, not a traceback later."""
        from gateway.metering.settings import Limits

        Limits(**self.model_dump())
        return self


class _ConfigFileSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = _config_path.get()
        if path is None:
            return {}
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            data = tomllib.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the config file must hold a mapping")
        return data


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AIGW_", env_nested_delimiter="__", frozen=True,
                                      extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    models: tuple[ModelSettings, ...] = ()
    auth_enabled: bool = True
    redis_url: str | None = None
    data_dir: Path = Path(".aigw")
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0)
    # Slow clients: a request's headers must all arrive within this from its first byte (else
    # 408 and the connection closes), and its body within client_body_timeout_s (else 408 in
    # the route's envelope). Idle keep-alive connections close after keepalive_timeout_s.
    client_header_timeout_s: float = Field(10.0, gt=0)
    client_body_timeout_s: float = Field(60.0, gt=0)
    keepalive_timeout_s: float = Field(75.0, gt=0)
    # The prompt-segment token cache of the prefix router and token counts (per tokenizer; keyed
    # by the request's cache salt), bounded in bytes of segment text and token ids.
    prompt_segment_cache_max_bytes: int = Field(32 * 1024 * 1024, ge=0)
    # /metrics: series labelled with a project (tokens, cost, requests per project) are served
    # only to a caller with `Authorization: Bearer <metrics_token>` or an admin-scoped key, unless
    # metrics_public is true (every series to anyone: one tenant, or /metrics filtered upstream).
    # Without the credential, those series are summed over projects.
    metrics_token: str | None = Field(default=None, repr=False)
    metrics_public: bool = False
    # distinct projects with their own /metrics label value (per process; JWT `project` claims
    # of a trusted issuer are unbounded): later ones are summed under project="_other"
    metrics_max_projects: int = Field(1000, ge=0)
    default_max_tokens: int = Field(1024, gt=0)  # admission reserve when the client sets none
    limits: LimitDefaults = LimitDefaults()  # each project without its own entry below
    key_limits: LimitDefaults = LimitDefaults()  # each key alone, without its own entry below
    project_limits: dict[str, LimitDefaults] = {}  # project name -> its limits
    key_limits_by_id: dict[str, LimitDefaults] = {}  # key id -> its limits
    # Priority classes (OpenAI's service_tier; our replicas schedule by them): the class of a
    # request that asks for none or "auto", per project (project name -> class), else the default
    default_service_tier: Literal["priority", "default", "flex"] = "default"
    project_service_tiers: dict[str, Literal["priority", "default", "flex"]] = {}
    # Usage writes waiting on the store (queued, in flight, held through a Redis outage), in
    # bytes: past it new requests get 503 `metering_backlogged` until they drain (none dropped).
    metering_backlog_max_bytes: int = Field(64 * 1024 * 1024, gt=0)
    # Prompt-cache isolation (auth.cache_salt): per project, per key, or shared by all.
    cache_salt_scope: Literal["project", "key", "shared"] = "project"
    # The cache-miss explainer's store (gateway/request/cache_explainer.py): each session's
    # previous turn (its prompt's parts and token ids) and its last turns, per project, in bytes
    # (0: off)
    cache_explainer_max_bytes: int = Field(16 * 1024 * 1024, ge=0)
    # KV retention on our replicas (gateway/request/retention.py): the longest a client may ask
    # for (cache_control ttl, prompt_cache_retention), what a repeating session (prompt_cache_key
    # or x-session-id seen before) gets unasked (0: none), and how many sessions are remembered
    max_cache_retention_s: float = Field(3600.0, ge=0)
    session_cache_retention_s: float = Field(300.0, ge=0)
    cache_retention_max_sessions: int = Field(65_536, ge=0)
    # Retries before the first token: at most `num_retries` per request, and in all at most
    # `retry_budget_ratio` retries per request plus `num_retries_reserve` (a retry budget).
    num_retries: int = Field(2, ge=0)
    retry_budget_ratio: float = Field(0.2, ge=0)
    num_retries_reserve: int = Field(10, ge=0)
    connect_timeout_s: float = Field(5.0, gt=0)
    first_token_timeout_s: float = Field(60.0, gt=0)  # request sent -> first event (streamed)
    response_timeout_s: float = Field(600.0, gt=0)  # request sent -> a non-streamed whole answer
    # a non-streamed upstream answer is read whole: past this many bytes it is a 502 (billed as
    # admitted), not an unbounded buffer
    max_upstream_answer_bytes: int = Field(64 * 1024 * 1024, gt=0)
    idle_timeout_s: float = Field(60.0, gt=0)  # between two events of a stream
    # Endpoint health
    health_interval_s: float = Field(5.0, gt=0)
    health_timeout_s: float = Field(2.0, gt=0)
    # /health answers 503 "unready" once a model has had no endpoint that can serve for this long
    # (before that, and with some endpoints down, 200 "degraded"); GET /health/live stays 200
    unready_after_s: float = Field(30.0, gt=0)
    num_failures_to_eject: int = Field(3, gt=0)  # consecutive failures that open the breaker
    ejection_s: float = Field(10.0, gt=0)  # open -> half-open after this long
    drain_timeout_s: float = Field(30.0, ge=0)  # SIGTERM: finish in-flight within this
    # "auto": "prefix" for replica models with >= 2 endpoints, else "least_outstanding"
    router: Literal["least_outstanding", "prefix", "auto"] = "auto"
    # The credential sent to every `replica` endpoint (`Authorization: Bearer`, on generate, KV
    # events, /v1/models, health and metrics calls); the replicas read the same AIGW_REPLICA_SECRET
    # (or AIGW_REPLICA_SECRET_FILE). A model's own `api_key` wins. Embedded replicas: generated.
    replica_secret: str | None = Field(default=None, repr=False)
    replica_secret_file: Path | None = None  # a file holding it (a mounted Kubernetes Secret)
    # Request logs (gateway/request_logs/): opted-in projects' sampled bodies, redacted, bounded
    request_logs: RequestLogSettings = RequestLogSettings()
    # Guardrails on requests and answers, per model and/or project (gateway/guardrails/)
    guardrails: tuple[GuardrailSettings, ...] = ()
    # /v1/files and /v1/batches: bounds, the batch price discount, pacing (gateway/batch/)
    batch: BatchSettings = BatchSettings()
    # Stored Responses API answers (`store`, `previous_response_id`; gateway/responses_store/):
    # kept this long, in Redis when redis_url is set, else in <data_dir>/responses.sqlite3. A
    # response whose body (its conversation and output) is over max_response_bytes is answered
    # but not stored; past max_project_bytes (a project) or max_bytes (all), the soonest-expiring
    # responses are evicted. max_response_bytes <= max_project_bytes <= max_bytes.
    responses_store_ttl_s: float = Field(30 * 24 * 3600.0, gt=0)
    responses_store_max_response_bytes: int = Field(16 * 1024 * 1024, gt=0)
    responses_store_max_project_bytes: int = Field(256 * 1024 * 1024, gt=0)
    responses_store_max_bytes: int = Field(1024 * 1024 * 1024, gt=0)

    @model_validator(mode="after")
    def _check_responses_store(self) -> GatewaySettings:
        if not (self.responses_store_max_response_bytes <= self.responses_store_max_project_bytes
                <= self.responses_store_max_bytes):
            raise ValueError("responses_store_max_response_bytes <= responses_store_max_project_"
                             "bytes <= responses_store_max_bytes must hold")
        return self

    @model_validator(mode="after")
    def _unique_model_names(self) -> GatewaySettings:
        names = [model.name for model in self.models]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:  # (a second entry would silently shadow the first)
            raise ValueError(f"models: the name {duplicates[0]!r} is configured more than once")
        return self

    @model_validator(mode="after")
    def _one_embedded_model(self) -> GatewaySettings:
        if sum(model.embedded for model in self.models) > 1:
            raise ValueError("models: at most one model may be `embedded`")
        return self

    @model_validator(mode="after")
    def _check_fallbacks(self) -> GatewaySettings:
        from gateway.request.fallback import fallback_chains

        fallback_chains(self.models)  # raises ValueError: an unknown target or a loop
        return self

    @model_validator(mode="after")
    def _check_guardrails(self) -> GatewaySettings:
        """Guard names are unique, and the models a guard names (where it applies, a model
        guard's classifier) are configured ones (with no `models`, embedded replicas: unknown
        until they start)."""
        names = [guard.name for guard in self.guardrails]
        if len(set(names)) != len(names):
            raise ValueError("guardrails: names must be unique")
        known = {model.name for model in self.models}
        for guard in self.guardrails if known else ():
            named = [*guard.models, *([guard.options["model"]] if guard.type == "model" else [])]
            unknown = [name for name in named if name not in known]
            if unknown:
                raise ValueError(f"guardrail {guard.name!r}: no model {unknown[0]!r} is configured")
        return self

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings],
                                   init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _ConfigFileSource(settings_cls)

    @field_validator("redis_url")
    @classmethod
    def _known_redis_scheme(cls, value: str | None) -> str | None:
        from infra.redis_client import check_redis_url

        return check_redis_url(value) if value else value  # unset or empty: no Redis

    def read_replica_secret(self) -> str | None:
        """`replica_secret`, else the content of `replica_secret_file` (one trailing newline
        dropped), else None. OSError for an unreadable file, ValueError for an empty one."""
        if self.replica_secret:
            return self.replica_secret
        if self.replica_secret_file is None:
            return None
        value = self.replica_secret_file.read_text(encoding="utf-8").removesuffix("\n")
        if not value.removesuffix("\r"):
            raise ValueError(f"replica_secret_file {str(self.replica_secret_file)!r} is empty")
        return value.removesuffix("\r")

    def find_model(self, name: str) -> ModelSettings | None:
        for model in self.models:
            if model.name == name:
                return model
        return None


def load_settings(config_path: str | Path | None = None, **overrides: Any) -> GatewaySettings:
    """Settings from `overrides` > env > the config file (`config_path`, else $AIGW_CONFIG)."""
    import os

    path = config_path or os.environ.get("AIGW_CONFIG")
    token = _config_path.set(Path(path) if path else None)
    try:
        return GatewaySettings(**overrides)
    finally:
        _config_path.reset(token)
