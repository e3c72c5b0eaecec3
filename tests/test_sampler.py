"""Sampling: greedy, seeds, top-k, top-p, penalties, logit biases and logprobs on hand-made logits."""

import pytest
import torch

from engine.request import Request, SamplingParams
from engine.sampler import Sampler


def make(params: SamplingParams, prompt=(1,), seeded: Sampler | None = None) -> Request:
    request = Request("r", list(prompt), params)
    if seeded is not None and params.seed is not None:
        request.generator = seeded.make_request_generator(params.seed)
    return request


def test_greedy_takes_the_argmax():
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    out = sampler.sample(logits, [make(SamplingParams(temperature=0)), make(SamplingParams(temperature=0))])
    assert [t.token_id for t in out] == [1, 0]


def test_seeded_requests_are_reproducible_regardless_of_batch():
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))

    def draw(batch_neighbours: int) -> list[int]:
        request = make(SamplingParams(temperature=1.0, seed=42), seeded=sampler)
        others = [make(SamplingParams(temperature=1.0)) for _ in range(batch_neighbours)]
        tokens = []
        for _ in range(20):
            rows = torch.cat([logits] * (1 + batch_neighbours))
            tokens.append(sampler.sample(rows, others + [request])[-1].token_id)
        return tokens

    assert draw(0) == draw(3)
    assert len(set(draw(0))) > 1


def test_seeds_differing_only_in_their_high_bits_sample_differently():
    # torch's CPU generator reads a seed's low 32 bits only: these pairs once sampled alike.
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.zeros(1, 1000)

    def draw(seed: int) -> list[int]:
        request = make(SamplingParams(temperature=1.0, seed=seed), seeded=sampler)
        return [sampler.sample(logits, [request])[0].token_id for _ in range(8)]

    for low, high in [(0, 2**32), (-1, 2**63 - 1), (7, 7 + 2**40)]:
        assert draw(low) != draw(high), (low, high)
    assert draw(2**63 - 1) == draw(2**63 - 1)


def test_top_k_one_is_greedy_and_top_k_limits_support():
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.tensor([[1.0, 2.0, 3.0, 2.9, -1.0]])
    for _ in range(30):
        assert sampler.sample(logits, [make(SamplingParams(top_k=1))])[0].token_id == 2
        assert sampler.sample(logits, [make(SamplingParams(top_k=2))])[0].token_id in (2, 3)


def test_top_p_keeps_the_smallest_set_covering_p():
    sampler = Sampler(0, torch.device("cpu"))
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    seen = {sampler.sample(probs.log(), [make(SamplingParams(top_p=0.7))])[0].token_id
            for _ in range(200)}
    assert seen == {0, 1}


@pytest.mark.parametrize("top_p", [1e-46, 5e-324])  # positive, but 0 in float32
def test_a_top_p_too_small_for_float32_keeps_the_most_likely_token(top_p):
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0]])
    sampled = sampler.sample(logits, [make(SamplingParams(top_p=top_p))])[0]
    assert (sampled.token_id, sampled.error) == (1, None)


def test_repetition_penalty_discourages_seen_tokens():
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    plain = make(SamplingParams(temperature=0), prompt=[0])
    penalized = make(SamplingParams(temperature=0, repetition_penalty=1.5), prompt=[0])
    assert [t.token_id for t in sampler.sample(logits.repeat(2, 1), [plain, penalized])] == [0, 1]


def with_output(params: SamplingParams, output: list[int], prompt=(2,)) -> Request:
    request = make(params, prompt=prompt)
    request.output_token_ids = list(output)
    return request


def test_presence_and_frequency_penalties_follow_openai_on_output_tokens():
    """logit[j] -= frequency * count[j] + presence * (count[j] > 0), counting generated tokens only."""
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.tensor([[3.0, 2.6, 2.0, 1.0]])
    output = [0, 0, 1]  # token 0 twice, token 1 once; token 2 is only in the prompt
    frequency = with_output(SamplingParams(temperature=0, frequency_penalty=0.5), output, prompt=(2, 2))
    presence = with_output(SamplingParams(temperature=0, presence_penalty=0.7), output, prompt=(2, 2))
    both = with_output(SamplingParams(temperature=0, presence_penalty=0.7, frequency_penalty=0.5), output)
    adjusted = Sampler._adjust(logits.repeat(3, 1), [frequency, presence, both])
    torch.testing.assert_close(adjusted, torch.tensor([[2.0, 2.1, 2.0, 1.0], [2.3, 1.9, 2.0, 1.0],
                                                       [1.3, 1.4, 2.0, 1.0]]))
    tokens = [t.token_id for t in sampler.sample(logits.repeat(3, 1), [frequency, presence, both])]
    assert tokens == [1, 0, 2]
    # A negative penalty encourages repeats; nothing generated yet means nothing to penalise.
    fresh = make(SamplingParams(temperature=0, presence_penalty=2.0), prompt=[0])
    repeat = with_output(SamplingParams(temperature=0, presence_penalty=-2.0), [2])
    assert [t.token_id for t in sampler.sample(logits.repeat(2, 1), [fresh, repeat])] == [0, 2]


def test_logit_bias_moves_greedy_and_sampled_choices():
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.tensor([[5.0, 1.0, 0.0, -2.0]])
    assert sampler.sample(logits, [make(SamplingParams(temperature=0, logit_bias={2: 5.5}))])[0].token_id == 2
    banned = make(SamplingParams(temperature=0, logit_bias={0: -100}))
    assert sampler.sample(logits, [banned])[0].token_id == 1
    forced = make(SamplingParams(temperature=1.0, logit_bias={3: 100}))
    assert {sampler.sample(logits, [forced])[0].token_id for _ in range(50)} == {3}
    # The other rows of the batch keep their logits, and the caller's tensor is not changed.
    plain = make(SamplingParams(temperature=0))
    assert [t.token_id for t in sampler.sample(logits.repeat(2, 1), [banned, plain])] == [1, 0]
    assert logits.tolist() == [[5.0, 1.0, 0.0, -2.0]]


def test_logprobs_report_the_raw_distribution():
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    out = sampler.sample(logits, [make(SamplingParams(temperature=0.5, top_k=1, logprobs=2))])[0]
    expected = torch.log_softmax(logits[0], -1)
    assert out.logprobs.token_id == 2
    assert out.logprobs.logprob == pytest.approx(expected[2].item())
    assert [t for t, _ in out.logprobs.top] == [2, 1]
    assert out.logprobs.top[1][1] == pytest.approx(expected[1].item())


def test_logprobs_past_the_vocabulary_size_list_every_token():
    """A request asking for 20 on a model of 3 tokens once failed every request of its batch."""
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    out = sampler.sample(logits, [make(SamplingParams(temperature=0, logprobs=20)),
                                  make(SamplingParams(temperature=0, logprobs=1))])
    assert [[t for t, _ in o.logprobs.top] for o in out] == [[2, 1, 0], [0]]
    prompt = Sampler.prompt_logprobs(logits, [0, 1], 20)
    assert [[t for t, _ in p.top] for p in prompt] == [[2, 1, 0], [0, 1, 2]]


def test_a_temperature_below_1e_5_is_greedy():
    assert SamplingParams(temperature=1e-40).is_greedy and SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.tensor([[1.0, 3.0, 2.9, -1.0]])
    for temperature in (1e-40, 1e-5):  # 1e-5 samples, but (3.0 - 2.9) / 1e-5 leaves no doubt
        out = sampler.sample(logits, [make(SamplingParams(temperature=temperature))])[0]
        assert (out.token_id, out.error) == (1, None)


def test_repetition_penalty_bounds_keep_logits_finite():
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.tensor([[300.0, 299.0, -300.0, 1.0]])  # prompt tokens 0 and 2 are penalised
    requests = [make(SamplingParams(temperature=1e-5, repetition_penalty=penalty), prompt=[0, 2])
                for penalty in (0.01, 100)]
    assert torch.isfinite(Sampler._adjust(logits.repeat(2, 1), requests)).all()
    out = sampler.sample(logits.repeat(2, 1), requests)
    assert [(t.token_id, t.error) for t in out] == [(0, None), (1, None)]


def test_a_row_that_cannot_be_sampled_fails_alone():
    sampler = Sampler(0, torch.device("cpu"))
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[nan, 1.0, 2.0], [0.0, 5.0, 1.0], [4.0, 0.0, 1.0], [1.0, nan, 0.0],
                           [0.0, 1.0, inf], [-inf, -inf, -inf], [-inf, 0.0, 1.0]])
    requests = [make(SamplingParams(temperature=1.0)), make(SamplingParams(temperature=1.0, top_k=1)),
                make(SamplingParams(temperature=0)), make(SamplingParams(temperature=0, logprobs=1)),
                make(SamplingParams(temperature=0)), make(SamplingParams(temperature=0)),
                make(SamplingParams(temperature=0))]
    out = sampler.sample(logits, requests)
    # Greedy rows too: argmax of a NaN row would answer token 0 with a NaN logprob.
    for failed in (out[0], out[3], out[4], out[5]):
        assert failed.error == "sampling failed: the model's logits are not finite (NaN or inf)"
    assert [(t.token_id, t.error) for t in (out[1], out[2], out[6])] == [(1, None), (0, None), (2, None)]


def test_logit_bias_applies_before_the_repetition_penalty():
    """As vLLM and transformers: the penalty scales the biased logit, (-1 + 5) / 2 = 2 < 2.5,
    not -1 * 2 + 5 = 3."""
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.tensor([[2.5, -1.0, -3.0]])
    request = make(SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={1: 5.0}), prompt=[1])
    torch.testing.assert_close(Sampler._adjust(logits, [request]), torch.tensor([[2.5, 2.0, -3.0]]))
    assert sampler.sample(logits, [request])[0].token_id == 0


@pytest.mark.parametrize("field,value,message", [
    ("max_tokens", 0, "max_tokens"), ("temperature", -1, "temperature"), ("top_p", 0, "top_p"),
    ("top_k", -2, "top_k"), ("logprobs", 21, "logprobs"), ("min_tokens", 99, "min_tokens"),
    ("repetition_penalty", 0, "repetition_penalty"), ("repetition_penalty", 1e-300, "repetition_penalty"),
    ("repetition_penalty", 101, "repetition_penalty"), ("stop", [""], "stop"),
    ("presence_penalty", 2.5, "presence_penalty"), ("frequency_penalty", -3, "frequency_penalty"),
    ("logit_bias", {5: 101}, "logit_bias values"), ("logit_bias", {-1: 1}, "logit_bias token ids"),
])
def test_invalid_params_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})
