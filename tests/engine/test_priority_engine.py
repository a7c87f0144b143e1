"""Priority classes on the real model (SmolLM2-135M): a priority request added behind a flood of
flex requests that hold every seat gets its first token at the next step, its greedy output is what
it is alone, and every block is free afterwards."""

from __future__ import annotations

from typing import Any

from contracts.sampling_params import SamplingParams
from tests.engine.conftest import EngineFactory
from tests.engine.fakes import assert_idle_and_clean, drive_to_first_tokens, generate

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_a_priority_request_is_not_held_back_by_a_flex_flood(make_engine: EngineFactory,
                                                            tokenizer: Any) -> None:
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=128, enable_prefix_caching=False)
    urgent_prompt = tokenizer.encode_chat([{"role": "user", "content": "Name a colour."}])
    alone = generate(engine, {"alone": urgent_prompt}, GREEDY)["alone"]
    flood = {f"flex-{i}": tokenizer.encode_chat([{"role": "user", "content": f"Count to {i + 3}."}])
             for i in range(12)}
    for request_id, prompt in flood.items():
        engine.add_request(request_id, prompt, GREEDY, priority=1)
    def on_step(index: int) -> None:
        if index == 3:  # every seat taken by flex requests, eight more waiting
            assert len(engine.scheduler.running) == 4 and len(engine.scheduler.waiting) == 8
            engine.add_request("urgent", urgent_prompt, GREEDY, priority=-1)

    first_token_step, results = drive_to_first_tokens(engine, on_step)
    assert first_token_step["urgent"] == 3  # the step right after it arrived
    assert results["urgent"].token_ids == alone.token_ids
    assert all(len(results[r].token_ids) == 12 for r in flood)
    assert engine.scheduler.num_preemptions_total >= 1  # a flex request gave up its seat
    assert_idle_and_clean(engine)
