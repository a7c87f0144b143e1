"""The routing simulator and router factory: small, fast runs that keep `aigw bench routing`
honest."""

from __future__ import annotations

import argparse
import random

import pytest

from bench import routing_bench
from bench.routing_sim import SimConfig, shared_prefix_workload, simulate, zero_reuse_workload
from gateway.routing import LeastOutstandingRouter, create_router
from gateway.routing.prefix_router import PrefixRouter
from gateway.settings import GatewaySettings, ModelSettings


def shared(rate: float) -> list[object]:
    return shared_prefix_workload(random.Random(1), num_groups=8, prompts_per_group=8,
                                  rate_per_s=rate, system_tokens=512, question_tokens=32,
                                  output_tokens=16)


def test_prefix_routing_keeps_groups_together_where_round_robin_thrashes() -> None:
    config = SimConfig(num_replicas=4, num_cache_blocks=100)
    ours = simulate(config, "prefix", shared(20.0))  # type: ignore[arg-type]
    round_robin = simulate(config, "round-robin", shared(20.0))  # type: ignore[arg-type]
    oracle = simulate(config, "oracle", shared(20.0))  # type: ignore[arg-type]
    assert len(ours.requests) == 64
    assert ours.token_hit_ratio > 2 * round_robin.token_hit_ratio
    assert ours.token_hit_ratio >= 0.8 * oracle.token_hit_ratio


def test_zero_reuse_traffic_never_hits_and_stays_balanced() -> None:
    result = simulate(SimConfig(num_replicas=4), "prefix",
                      zero_reuse_workload(random.Random(2), num_requests=80, rate_per_s=20.0))
    assert result.token_hit_ratio == 0.0 and result.imbalance < 1.3


def test_the_bench_reports_every_policy_and_its_targets(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    routing_bench.add_arguments(parser)
    args = parser.parse_args(["--replicas", "4", "--cache-blocks", "200", "--rates", "1",
                              "--workloads", "shared-prefix"])
    rows = routing_bench.run_sim(args, 2e-4, 1e-3)
    assert ({r["policy"] for r in rows}
            == {"round-robin", "least-load", "session-hash", "prefix", "oracle"})
    assert any("of the oracle's" in line for line in routing_bench.targets(rows))


def test_auto_picks_the_prefix_router_for_two_or_more_replica_endpoints() -> None:
    two = GatewaySettings(auth_enabled=False, models=[
        ModelSettings(name="m", endpoints=("http://127.0.0.1:1", "http://127.0.0.1:2"))])
    one = GatewaySettings(auth_enabled=False,
                          models=[ModelSettings(name="m", endpoints=("http://a:1",))])
    assert isinstance(create_router("auto", two), PrefixRouter)
    assert isinstance(create_router("auto", one), LeastOutstandingRouter)
    assert isinstance(create_router("prefix"), PrefixRouter)
