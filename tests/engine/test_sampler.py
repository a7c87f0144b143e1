"""Sampler behaviour on hand-made logits (CPU, no model)."""

from __future__ import annotations

import math

import pytest
import torch

from contracts.sampling_params import SamplingParams
from engine.sampler import Sampler, SamplingRow, top_k_top_p_probs

VOCAB = 64
EOS = 3


def make_row(
    params: SamplingParams,
    output_token_ids: tuple[int, ...] = (),
    eos_token_ids: tuple[int, ...] = (EOS,),
) -> SamplingRow:
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    return SamplingRow(
        params=params,
        generator=generator,
        output_token_ids=list(output_token_ids),
        num_output_tokens=len(output_token_ids),
        eos_token_ids=eos_token_ids,
    )


def random_logits(num_rows: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((num_rows, VOCAB), generator=generator) * scale


def sample_one(logits_row: torch.Tensor, params: SamplingParams, num_steps: int) -> list[int]:
    """The tokens one seeded row gets over `num_steps` calls when it is alone in the batch."""
    sampler = Sampler(seed=1)
    row = make_row(params)
    return [sampler(logits_row[None], [row]).token_ids[0] for _ in range(num_steps)]


def test_greedy_rows_take_the_argmax():
    logits = random_logits(5)
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(5)]
    out = Sampler(seed=0)(logits, rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 5


def test_sampler_leaves_the_callers_logits_untouched():
    logits = random_logits(3)
    before = logits.clone()
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, presence_penalty=1.0, min_tokens=2)
    rows = [make_row(params, output_token_ids=(1, 2, 2)) for _ in range(3)]
    Sampler(seed=0)(logits, rows)
    assert torch.equal(logits, before)


def test_same_seed_gives_same_tokens_across_calls():
    logits = random_logits(1, scale=1.0)
    params = SamplingParams(temperature=1.0, seed=1234)
    first = sample_one(logits[0], params, num_steps=20)
    second = sample_one(logits[0], params, num_steps=20)
    assert first == second
    assert len(set(first)) > 1  # it really samples, it is not greedy


def test_seeded_row_is_independent_of_batch_composition_and_order():
    logits = random_logits(4, seed=5)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=77)
    alone = sample_one(logits[2], params, num_steps=10)

    sampler = Sampler(seed=99)
    seeded = make_row(params)
    others = [
        make_row(SamplingParams(temperature=0.9)),
        make_row(SamplingParams(temperature=0.0)),
        make_row(SamplingParams(temperature=1.3, seed=5)),
    ]
    in_batch = []
    for step in range(10):
        batch = others[: step % 4]  # the batch changes size and the row moves around
        position = step % (len(batch) + 1)
        rows = batch[:position] + [seeded] + batch[position:]
        batch_logits = torch.stack([logits[(j + 1) % 4] for j in range(len(rows))])
        batch_logits[position] = logits[2]
        in_batch.append(sampler(batch_logits, rows).token_ids[position])
    assert in_batch == alone


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])
def test_top_k_one_equals_greedy_at_any_temperature(temperature):
    logits = random_logits(8, seed=2, scale=0.5)  # flat: sampling would stray without top_k
    rows = [make_row(SamplingParams(temperature=temperature, top_k=1)) for _ in range(8)]
    assert Sampler(seed=0)(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_equals_greedy():
    logits = random_logits(8, seed=3, scale=0.5)
    rows = [make_row(SamplingParams(temperature=1.5, top_p=1e-9)) for _ in range(8)]
    assert Sampler(seed=0)(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, 1e-38, 1e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy_not_an_out_of_vocabulary_id(temperature):
    # 5e-324 is valid JSON in [0, 2]: dividing the logits by it made them inf, the softmax NaN, and
    # inverse-CDF sampling returned id VOCAB, which the next step's embedding lookup crashed on
    # (killing the replica's engine loop for every request)
    logits = random_logits(4, seed=5, scale=30.0)
    rows = [make_row(SamplingParams(temperature=temperature)) for _ in range(2)]
    rows += [make_row(SamplingParams(temperature=1.0, seed=7)) for _ in range(2)]  # a mixed batch
    token_ids = Sampler(seed=0)(logits, rows).token_ids
    assert token_ids[:2] == logits[:2].argmax(dim=-1).tolist()
    assert all(0 <= t < VOCAB for t in token_ids)


def test_top_k_never_samples_outside_the_k_best():
    logits = random_logits(1, seed=4, scale=0.3).expand(500, VOCAB)
    rows = [make_row(SamplingParams(temperature=2.0, top_k=3)) for _ in range(500)]
    tokens = set(Sampler(seed=0)(logits, rows).token_ids)
    assert tokens == set(logits[0].topk(3).indices.tolist())


def test_top_p_keeps_the_nucleus_only():
    logits = torch.full((400, VOCAB), -10.0)
    logits[:, 7], logits[:, 8], logits[:, 9] = 2.0, 1.5, 1.0  # probs ~ 0.51, 0.31, 0.19
    rows = [make_row(SamplingParams(temperature=1.0, top_p=0.8)) for _ in range(400)]
    tokens = Sampler(seed=0)(logits, rows).token_ids
    assert set(tokens) == {7, 8}


def test_top_p_nucleus_matches_a_full_sort_for_small_and_large_nuclei():
    vocab_size = 3000  # beyond the 64- and 1024-token shortcuts
    generator = torch.Generator().manual_seed(9)
    scales = torch.tensor([8.0, 3.0, 1.0, 0.05])[:, None]  # peaked ... nearly flat
    logits = torch.randn((4, vocab_size), generator=generator) * scales
    params = [SamplingParams(temperature=1.0, top_p=p) for p in (0.9, 0.95, 0.5, 0.99)]
    probs = top_k_top_p_probs(logits, params)

    full = logits.softmax(dim=-1)
    for row, p in enumerate((0.9, 0.95, 0.5, 0.99)):
        sorted_probs, order = full[row].sort(descending=True)
        keep = (sorted_probs.cumsum(0) - sorted_probs) < p
        expected = torch.zeros(vocab_size).scatter_(0, order[keep], sorted_probs[keep])
        assert torch.allclose(probs[row], expected, atol=1e-7)
    nucleus_sizes = (probs > 0).sum(dim=-1).tolist()
    assert nucleus_sizes[0] < 64 < nucleus_sizes[1] and nucleus_sizes[3] > 1024


def test_presence_penalty_flips_the_argmax_away_from_a_generated_token():
    logits = torch.zeros((2, VOCAB))
    logits[:, 10], logits[:, 11] = 5.0, 4.5
    plain = make_row(SamplingParams(temperature=0.0), output_token_ids=(10,))
    penalised = make_row(SamplingParams(temperature=0.0, presence_penalty=1.0), (10,))
    assert Sampler(seed=0)(logits, [plain, penalised]).token_ids == [10, 11]


def test_frequency_penalty_grows_with_the_count():
    logits = torch.zeros((2, VOCAB))
    logits[:, 10], logits[:, 11] = 5.0, 4.0
    params = SamplingParams(temperature=0.0, frequency_penalty=0.6)
    once = make_row(params, output_token_ids=(10, 20))  # 5.0 - 0.6 > 4.0
    twice = make_row(params, output_token_ids=(10, 10))  # 5.0 - 1.2 < 4.0
    assert Sampler(seed=0)(logits, [once, twice]).token_ids == [10, 11]


def test_negative_presence_penalty_favours_generated_tokens():
    logits = torch.zeros((1, VOCAB))
    logits[0, 10], logits[0, 11] = 5.0, 4.5
    row = make_row(SamplingParams(temperature=0.0, presence_penalty=-1.0), (11,))
    assert Sampler(seed=0)(logits, [row]).token_ids == [11]


def test_min_tokens_blocks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros((3, VOCAB))
    logits[:, EOS], logits[:, 5], logits[:, 6] = 9.0, 8.0, 7.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(5,))
    early = make_row(params, output_token_ids=(1,))
    done = make_row(params, output_token_ids=(1, 2))
    ignored = make_row(SamplingParams(temperature=0.0), output_token_ids=(1,))
    assert Sampler(seed=0)(logits, [early, done, ignored]).token_ids == [6, EOS, EOS]


def test_min_tokens_blocks_eos_when_sampling():
    logits = torch.zeros((200, VOCAB))
    logits[:, EOS] = 20.0  # eos would win almost surely
    rows = [make_row(SamplingParams(temperature=1.0, min_tokens=1)) for _ in range(200)]
    assert EOS not in Sampler(seed=0)(logits, rows).token_ids


def test_logprobs_come_from_the_raw_logits():
    logits = random_logits(2, seed=6)
    params = SamplingParams(
        temperature=0.5, presence_penalty=2.0, logprobs=True, top_logprobs=5, seed=3
    )
    rows = [make_row(params, output_token_ids=(1, 2)), make_row(SamplingParams(temperature=0.0))]
    out = Sampler(seed=0)(logits, rows)
    expected = logits[0].log_softmax(dim=-1)
    logprob = out.logprobs[0]
    assert logprob is not None and out.logprobs[1] is None
    assert logprob.token_id == out.token_ids[0]
    assert logprob.logprob == pytest.approx(expected[out.token_ids[0]].item(), abs=1e-5)
    assert [t for t, _ in logprob.top] == expected.topk(5).indices.tolist()
    values = [v for _, v in logprob.top]
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(expected.topk(5).values.tolist(), abs=1e-5)
    assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5
    assert all(v <= 0.0 for v in values)


def test_logprobs_without_top_alternatives():
    logits = random_logits(1, seed=7)
    row = make_row(SamplingParams(temperature=0.0, logprobs=True))
    logprob = Sampler(seed=0)(logits, [row]).logprobs[0]
    assert logprob is not None and logprob.top == ()
    assert logprob.token_id == logits[0].argmax().item()
    assert logprob.logprob == pytest.approx(logits[0].log_softmax(-1).max().item(), abs=1e-5)


def test_samples_at_temperature_one_follow_the_softmax():
    num_samples, num_tokens = 4000, 6
    row_logits = torch.full((VOCAB,), -1e9)
    row_logits[:num_tokens] = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 0.2])
    rows = [make_row(SamplingParams(temperature=1.0)) for _ in range(num_samples)]
    tokens = Sampler(seed=0)(row_logits.expand(num_samples, VOCAB), rows).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).float()
    assert counts[num_tokens:].sum() == 0
    expected = row_logits[:num_tokens].softmax(-1) * num_samples
    chi_square = ((counts[:num_tokens] - expected) ** 2 / expected).sum().item()
    assert chi_square < 25.0  # 5 degrees of freedom: p < 2e-4 by chance


def test_temperature_sharpens_the_distribution():
    row_logits = torch.tensor([1.0, 0.0] + [-1e9] * (VOCAB - 2))
    rows = [make_row(SamplingParams(temperature=0.25)) for _ in range(2000)]
    tokens = Sampler(seed=0)(row_logits.expand(2000, VOCAB), rows).token_ids
    share = tokens.count(0) / 2000  # softmax([4, 0])[0] ~ 0.982
    assert 0.96 < share < 0.995


def test_mixed_batch_gives_each_row_what_it_gets_alone():
    logits = random_logits(4, seed=8)
    all_params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=10, seed=11),
        SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=True, top_logprobs=2),
        SamplingParams(temperature=1.2, top_p=0.9, presence_penalty=1.5, seed=12),
    ]
    histories = [(), (4, 5), tuple(logits[2].topk(2).indices.tolist()), (1, 1, 9)]
    alone = [
        Sampler(seed=0)(logits[i][None], [make_row(p, histories[i])])
        for i, p in enumerate(all_params)
    ]
    rows = [make_row(p, h) for p, h in zip(all_params, histories, strict=True)]
    together = Sampler(seed=0)(logits, rows)
    assert together.token_ids == [out.token_ids[0] for out in alone]
    assert together.logprobs == [out.logprobs[0] for out in alone]


def test_empty_batch_returns_nothing():
    out = Sampler()(torch.zeros((0, VOCAB)), [])
    assert out.token_ids == [] and out.logprobs == []
