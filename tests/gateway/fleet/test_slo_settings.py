"""A model's latency targets and reserved shares (models[].ttft_p90_ms, tpot_p90_ms,
reserved_shares) become the embedded replicas' flags; bad values are one-line settings errors;
an `embedded` model gets the started replicas' endpoints."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine.engine_args import add_engine_arguments, engine_config_from_args
from gateway.fleet.embedded import embedded_model, fill_embedded
from gateway.settings import GatewaySettings, ModelSettings


def test_targets_and_shares_become_replica_flags_the_replica_parses() -> None:
    import argparse

    model = ModelSettings(name="chat", embedded=True, ttft_p90_ms=250, tpot_p90_ms=40.5,
                          reserved_shares={"team-b": 0.2, "team-a": 0.3}, flex_max_wait_ms=9000)
    args = model.replica_args()
    assert args == ["--ttft-p90-ms", "250", "--tpot-p90-ms", "40.5",
                    "--reserved-share", "team-a=0.3", "--reserved-share", "team-b=0.2",
                    "--flex-max-wait-ms", "9000"]
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    scheduler = engine_config_from_args(parser.parse_args(args)).scheduler
    assert (scheduler.ttft_p90_ms, scheduler.tpot_p90_ms) == (250.0, 40.5)
    assert dict(scheduler.reserved_shares) == {"team-a": 0.3, "team-b": 0.2}
    assert scheduler.flex_max_wait_ms == 9000.0
    assert scheduler.policy == "slo"  # the default once a target is set
    assert ModelSettings(name="x", endpoints=("http://a",)).replica_args() == []


@pytest.mark.parametrize("fields", [
    {"ttft_p90_ms": 0}, {"tpot_p90_ms": -5}, {"ttft_p90_ms": float("nan")},
    {"reserved_shares": {"a": 1.0}}, {"reserved_shares": {"a": 0.5, "b": 0.5}},
    {"reserved_shares": {"": 0.1}}, {"reserved_shares": {"a=b": 0.1}},
    {"flex_max_wait_ms": 0}, {"flex_max_wait_ms": float("nan")},
])
def test_bad_targets_and_shares_are_refused_at_start(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ModelSettings(name="x", endpoints=("http://a",), **fields)  # type: ignore[arg-type]


def test_an_embedded_model_is_a_replica_model_and_there_is_one_at_most() -> None:
    with pytest.raises(ValidationError, match="embedded"):
        ModelSettings(name="x", embedded=True, backend="openai")
    with pytest.raises(ValidationError, match="`endpoints`, `discover` or `embedded`"):
        ModelSettings(name="x")
    with pytest.raises(ValidationError, match="at most one model"):
        GatewaySettings(models=[{"name": "a", "embedded": True}, {"name": "b", "embedded": True}])


def test_the_embedded_model_gets_the_started_replicas_endpoints() -> None:
    configured = (ModelSettings(name="chat", embedded=True, ttft_p90_ms=300),
                  ModelSettings(name="hosted", backend="openai", endpoints=("http://h",)))
    served = (ModelSettings(name="SmolLM2", endpoints=("http://r1", "http://r2"),
                            context_length=8192),
              ModelSettings(name="minilm", endpoints=("http://e1",)))
    assert embedded_model(configured) is configured[0]
    filled = fill_embedded(configured, served)
    chat = filled[0]
    assert (chat.name, chat.endpoints, chat.upstream_model, chat.context_length,
            chat.ttft_p90_ms) == ("chat", ("http://r1", "http://r2"), "SmolLM2", 8192, 300)
    assert [m.name for m in filled] == ["chat", "hosted", "minilm"]
    GatewaySettings(models=filled)  # what every worker is built from
