"""`aigw replica --model DIR` serves the tiny Llama 4 MoE checkpoint
(tests/engine/models/_llama4.py) over HTTP; through the openai SDK a token-id prompt several
attention chunks long completes with transformers' greedy tokens and logprobs (2e-3), and a chat
repeated hits the prompt cache (the replica and the chat check are test_qwen3_replica.py's, over
this checkpoint)."""

from __future__ import annotations

import openai
import pytest

from engine.loader import load_tokenizer
from tests.engine.models._greedy import hf_greedy
from tests.engine.models._llama4 import CHUNK_SIZE
from tests.engine.models._qwen3 import TinyCheckpoint
from tests.engine.models.test_qwen3_replica import (  # noqa: F401 (the replica fixture, a check)
    NUM_NEW_TOKENS,
    _assert_logprobs_close,
    client,
    test_chat_is_transformers_greedy_answer_and_a_repeat_hits_the_prompt_cache,
)

pytestmark = pytest.mark.slow  # a replica process: ~25 s to start on the 2-core CI machine

# no special tokens (ids 0..5)
PROMPT_IDS = [(7 * i + 11) % 300 + 6 for i in range(3 * CHUNK_SIZE + 5)]


@pytest.fixture(scope="module")
def checkpoint(llama4_checkpoints: dict[str, TinyCheckpoint]) -> TinyCheckpoint:
    return llama4_checkpoints["moe"]


def test_a_prompt_of_several_chunks_completes_with_transformers_tokens(
        client: openai.OpenAI, checkpoint: TinyCheckpoint) -> None:  # noqa: F811
    model = client.models.list().data[0].id
    tokens, logprobs = hf_greedy(checkpoint.model, PROMPT_IDS, NUM_NEW_TOKENS)
    completion = client.completions.create(model=model, prompt=PROMPT_IDS,
                                           max_tokens=NUM_NEW_TOKENS,
                                           temperature=0, logprobs=1,
                                           extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    assert choice.text == load_tokenizer(checkpoint.directory).decode(tokens)
    _assert_logprobs_close(choice.logprobs.token_logprobs, logprobs)
    assert completion.usage.prompt_tokens == len(PROMPT_IDS)
