"""One configured guardrail, as the gateway config lists it (`[[guardrails]]`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Stage = Literal["request", "response"]


class GuardrailSettings(BaseModel):
    """`type`: "regex", "pii", "model" or an `aigw.guardrails` entry point; `stages`: which side
    it checks; `models` / `projects`: where it applies (empty: everywhere); `options`: the guard's
    own settings (see each guard's module)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    type: str = Field(min_length=1)
    stages: tuple[Stage, ...] = ("request", "response")
    models: tuple[str, ...] = ()
    projects: tuple[str, ...] = ()
    options: dict[str, Any] = {}

    @model_validator(mode="after")
    def _check_options(self) -> GuardrailSettings:
        """The guard's type exists and takes these options (its constructor checks them), so a
        bad guard is a one-line configuration error at start."""
        from gateway.guardrails import GuardContext, get_guardrail_class

        get_guardrail_class(self.type)(self.name, self.options, GuardContext(_no_model))
        return self

    def applies_to(self, model: str, project: str | None) -> bool:
        return ((not self.models or model in self.models)
                and (not self.projects or project in self.projects))


async def _no_model(*_: object) -> str:
    raise RuntimeError("a guard may not call a model while its options are checked")
