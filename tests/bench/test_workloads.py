"""Workload generators: deterministic for a seed, and shaped as their docstrings promise."""

from __future__ import annotations

from typing import Any

import pytest

from bench.workloads import (
    TokenSource,
    agent_sessions,
    hit_ratio_prompts,
    shared_prefix_prompts,
    unique_prompts,
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from engine.loader import default_model_path, load_tokenizer

    return load_tokenizer(default_model_path())


def test_same_seed_gives_same_prompts_and_other_seed_differs(tokenizer: Any) -> None:
    def prompts(seed: int) -> list[list[int]]:
        return unique_prompts(TokenSource(tokenizer, seed), num_prompts=3, prompt_tokens=40)

    assert prompts(1) == prompts(1)
    assert prompts(1) != prompts(2)


def test_shared_prefix_groups_share_exactly_the_system_prompt(tokenizer: Any) -> None:
    prompts = shared_prefix_prompts(TokenSource(tokenizer, 0), num_groups=2, prompts_per_group=3,
                                    system_tokens=50, question_tokens=10)
    assert [len(p) for p in prompts] == [60] * 6
    assert prompts[0][:50] == prompts[2][:50] != prompts[3][:50]
    assert prompts[0][50:] != prompts[1][50:]


def test_hit_ratio_prefix_is_whole_blocks_and_shared_by_every_prompt(tokenizer: Any) -> None:
    primers, prompts = hit_ratio_prompts(TokenSource(tokenizer, 0), num_prompts=4,
                                         prompt_tokens=640, hit_ratio=0.3, block_size=16)
    assert len(primers) == 1 and len(primers[0]) == 192
    assert all(len(p) == 640 and p[:192] == primers[0] for p in prompts)


def test_agent_turn_prompt_extends_the_previous_prompt_with_the_answer(tokenizer: Any) -> None:
    sessions = agent_sessions(tokenizer, num_sessions=2, num_turns=2, system_tokens=300,
                              message_tokens=(20, 30), answer_tokens=(4, 6), seed=0)
    assert sessions[0].segments is sessions[1].segments  # one system prompt for all
    session = sessions[0].fresh()
    first = session.next_request(None)
    assert first is not None and 4 <= first.max_tokens <= 6
    assert first.prompt_token_ids[:len(session.segments.system_ids)] == session.segments.system_ids
    answer = list(range(1000, 1000 + first.max_tokens))
    second = session.next_request(answer)
    assert second is not None
    prefix = first.prompt_token_ids + answer + session.segments.end_of_turn_ids
    assert second.prompt_token_ids[:len(prefix)] == prefix
    assert session.next_request([7] * second.max_tokens) is None
