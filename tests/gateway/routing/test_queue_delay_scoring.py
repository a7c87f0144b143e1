"""The router's load score uses the replica's predicted queueing delay for the request's class
(aigw_replica_predicted_queue_delay_ms): parsed per service_tier from /metrics, converted to KV
blocks with the replica's prefill cost (or the default), and never below the queue-length term."""

from __future__ import annotations

from gateway.backends.replica import parse_load
from gateway.fleet.breaker import CircuitBreaker
from gateway.fleet.endpoints import Endpoint, EndpointLoad
from gateway.request.canonical import CanonicalRequest
from gateway.routing.base import LeastOutstandingRouter
from gateway.routing.scoring import CandidateLoad, ScoringConfig, choose, score
from gateway.settings import ModelSettings

METRICS = """# HELP aigw_replica_predicted_queue_delay_ms x
# TYPE aigw_replica_predicted_queue_delay_ms gauge
aigw_replica_num_requests_waiting{model="m",replica="r"} 2.0
aigw_replica_predicted_queue_delay_ms{model="m",replica="r",service_tier="priority"} 15.0
aigw_replica_predicted_queue_delay_ms{model="m",replica="r",service_tier="default"} 480.5
aigw_replica_predicted_queue_delay_ms{model="m",replica="r",service_tier="flex"} 2400
aigw_replica_predicted_queue_delay_ms{model="m",replica="r",service_tier="bogus"} 7
aigw_replica_predicted_queue_delay_ms{model="m",replica="r",service_tier="default"} nan
aigw_replica_prefill_ms_per_token{model="m",replica="r"} 0.25
"""


def test_parse_load_keeps_the_delay_per_class_and_skips_junk() -> None:
    load = parse_load(METRICS)
    assert load is not None and load.num_requests_waiting == 2
    assert load.predicted_queue_delay_ms == {"priority": 15.0, "default": 480.5, "flex": 2400.0}
    assert load.queue_delay_ms("flex") == 2400.0
    assert load.queue_delay_ms(None) == 480.5  # a request with no class is "default"
    assert load.prefill_ms_per_token == 0.25
    assert parse_load("aigw_replica_num_requests_waiting 1\n") == EndpointLoad(
        num_requests_waiting=1)  # an older replica: no delay reported


def test_a_replica_predicting_a_long_queue_loses_its_prefix_advantage() -> None:
    config = ScoringConfig()
    num_blocks = 20
    holder = CandidateLoad("holder", num_matched_blocks=20, queue_delay_ms=1_000.0)
    empty = CandidateLoad("empty", num_matched_blocks=0, queue_delay_ms=0.0)
    # 1,000 ms at the default 4 ms a block is 250 blocks of queued work: more than the 30
    # (20 blocks x W = 1.5) that recomputing the prefix elsewhere costs
    best, scores = choose(config, num_blocks, 1, [holder, empty])
    assert (best, scores[0].active_blocks) == (1, 250.0)
    # without the estimate the holder wins, as before
    best, _ = choose(config, num_blocks, 1, [CandidateLoad("holder", 20), empty])
    assert best == 0
    # a short predicted queue keeps the prefix where it is
    best, _ = choose(config, num_blocks, 1, [
        CandidateLoad("holder", 20, queue_delay_ms=40.0), empty])
    assert best == 0


def test_the_replicas_own_prefill_cost_converts_its_delay() -> None:
    config = ScoringConfig()
    fast = CandidateLoad("gpu", 0, queue_delay_ms=100.0, ms_per_block=0.5)  # 200 blocks queued
    assert score(config, 10, fast).active_blocks == 200.0
    # the queue-length term stands when it is the larger of the two estimates
    waiting = CandidateLoad("busy", 0, num_requests_waiting=5, queue_delay_ms=4.0)
    assert score(config, 10, waiting).active_blocks == 5 * (10 + config.decode_blocks_per_request)


def _endpoint(name: str, delays: dict[str, float]) -> Endpoint:
    model = ModelSettings(name="m", endpoints=(f"http://{name}",))
    endpoint = Endpoint(f"http://{name}", model, CircuitBreaker(3, 10.0))
    endpoint.load = EndpointLoad(num_requests_waiting=0, predicted_queue_delay_ms=delays)
    return endpoint


def test_least_outstanding_breaks_ties_by_the_requests_class_delay() -> None:
    a = _endpoint("a:1", {"priority": 900.0, "flex": 10.0})
    b = _endpoint("b:1", {"priority": 50.0, "flex": 3_000.0})
    router = LeastOutstandingRouter()
    request = CanonicalRequest(request_id="r1", model="m")
    request.service_tier = "priority"
    assert router.pick(request, [a, b]).endpoint is b
    request.service_tier = "flex"
    assert router.pick(request, [a, b]).endpoint is a
    a.num_outstanding = 1  # this gateway's own in-flight count still comes first
    assert router.pick(request, [a, b]).endpoint is b
