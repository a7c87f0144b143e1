"""The prefix router's estimate of a request's cached prompt tokens (what admission reserves
against a token limit is the rest): the longest run of the rendered prompt's blocks a candidate
holds in the index (or the session's last replica is credited with), never the last token."""

from __future__ import annotations

from gateway.request.canonical import CanonicalRequest
from gateway.routing.prompt_hashing import PromptHasher
from tests.gateway.routing.conftest import IndexUnderTest
from tests.gateway.routing.test_prefix_router import Rig, hasher, hashes_of, request

__all__ = ["hasher"]  # the module fixture, shared


def rendered(rig: Rig, req: CanonicalRequest) -> CanonicalRequest:
    req.rendered_prompt = rig.backend.render_prompt(req, rig.endpoints[0])
    return req


def estimate(rig: Rig, req: CanonicalRequest) -> int:
    return int(rig.ix.run(rig.router.expected_cached_tokens(req, rig.endpoints)))


def test_the_estimate_is_the_best_holders_run_in_tokens(index: IndexUnderTest,
                                                        hasher: PromptHasher) -> None:
    rig = Rig(index)
    req = rendered(rig, request("Agent system prompt with tools. "))
    hashes = hashes_of(rig, hasher, req)
    num_prompt = len(req.rendered_prompt[1])  # type: ignore[index]
    assert estimate(rig, req) == 0  # nothing held anywhere
    rig.hold(rig.endpoints[0], hashes[:3])
    rig.hold(rig.endpoints[1], hashes[:-1])
    assert estimate(rig, req) == (len(hashes) - 1) * 16
    rig.hold(rig.endpoints[1], hashes)
    expected = min(len(hashes) * 16, num_prompt - 1)  # a replica always computes the last token
    assert estimate(rig, req) == expected
    unrendered = request("Agent system prompt with tools. ")
    assert estimate(rig, unrendered) == 0  # no rendered prompt: nothing assumed (no token limit)


def test_a_sessions_previous_turn_just_routed_counts_as_held(index: IndexUnderTest,
                                                             hasher: PromptHasher) -> None:
    """(before its replica's events arrive: the router's tentative entries and session credit)"""
    rig = Rig(index)
    first = rendered(rig, request("Session prompt. ", "turn one", "r1"))
    first.prompt_cache_key = "agent-7"
    rig.choose(first)  # remembered: this session's blocks on the chosen replica
    second = rendered(rig, request("Session prompt. ", "turn one", "r2"))
    second.prompt_cache_key = "agent-7"
    assert estimate(rig, second) >= (len(hashes_of(rig, hasher, first)) - 1) * 16
