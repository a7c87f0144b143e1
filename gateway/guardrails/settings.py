"""One configured guardrail, as the gateway config lists it (`[[guardrails]]`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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

    def applies_to(self, model: str, project: str | None) -> bool:
        return ((not self.models or model in self.models)
                and (not self.projects or project in self.projects))
