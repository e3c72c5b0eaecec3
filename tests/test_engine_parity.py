"""The engine against transformers on random Llama, Mistral and Qwen2 models (float32, CPU).

Requests arrive at different steps with prompts of very different lengths; greedy tokens must be
identical and every step's distribution must match transformers' logits within 1e-4.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import SamplingParams
from tests.helpers import TEST_DEVICE, hf_greedy, make_hf_model, random_prompts, save_hf_model

NUM_NEW_TOKENS = 12
PROMPT_LENGTHS = [3, 61, 17, 140, 1, 33]
ARRIVAL_STEPS = [0, 0, 2, 3, 5, 9]
TOP_LOGPROBS = 20


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def family(request, tmp_path_factory):
    overrides = {}
    if request.param == "llama":
        overrides["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0,
                                        "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}
    model = make_hf_model(request.param, **overrides)
    folder = save_hf_model(model, tmp_path_factory.mktemp(request.param))
    prompts = random_prompts(PROMPT_LENGTHS, model.config.vocab_size, seed=1)
    references = [hf_greedy(model, p, NUM_NEW_TOKENS) for p in prompts]
    return folder, prompts, references


def run_engine(folder, prompts, prompt_for_step=ARRIVAL_STEPS, **config):
    engine = LLMEngine(EngineConfig(model=str(folder), device=TEST_DEVICE, **config), show_progress=False)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=TOP_LOGPROBS)
    tokens = {i: [] for i in range(len(prompts))}
    logprobs = {i: [] for i in range(len(prompts))}
    step = 0
    while step <= max(prompt_for_step) or engine.has_unfinished_requests():
        for i, arrival in enumerate(prompt_for_step):
            if arrival == step:
                engine.add_request(str(i), prompts[i], params)
        for output in engine.step():
            tokens[int(output.request_id)] += output.new_token_ids
            logprobs[int(output.request_id)] += output.new_logprobs
        step += 1
    return engine, tokens, logprobs


def assert_matches_transformers(references, tokens, logprobs):
    for i, (ref_tokens, ref_logits) in enumerate(references):
        assert tokens[i] == ref_tokens, f"request {i}: greedy tokens differ"
        ref_logprobs = torch.log_softmax(ref_logits, dim=-1)
        for step, entry in enumerate(logprobs[i]):
            ids = [t for t, _ in entry.top]
            ours = torch.tensor([lp for _, lp in entry.top])
            torch.testing.assert_close(ours, ref_logprobs[step, ids], atol=1e-4, rtol=0)
            assert ids == torch.topk(ref_logprobs[step], TOP_LOGPROBS).indices.tolist()
            assert entry.token_id == ref_tokens[step]
            assert abs(entry.logprob - ref_logprobs[step, entry.token_id].item()) < 1e-4


def test_staggered_arrivals_match_transformers(family):
    folder, prompts, references = family
    engine, tokens, logprobs = run_engine(folder, prompts)
    assert_matches_transformers(references, tokens, logprobs)
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_chunked_prefill_matches_transformers(family):
    folder, prompts, references = family
    engine, tokens, logprobs = run_engine(folder, prompts, max_num_batched_tokens=16)
    assert_matches_transformers(references, tokens, logprobs)


def test_preemption_keeps_outputs_unchanged(family):
    folder, prompts, references = family
    # 20 blocks of 8 tokens cannot hold all six requests at once.
    engine, tokens, logprobs = run_engine(folder, prompts, num_kv_blocks=24, block_size=8,
                                          max_num_batched_tokens=64,
                                          prompt_for_step=[0] * len(prompts))
    assert engine.metrics().num_preemptions > 0
    assert_matches_transformers(references, tokens, logprobs)


@pytest.mark.parametrize("config", [dict(max_num_seqs=2), dict(num_kv_blocks=28, block_size=8)])
def test_urgent_requests_preempt_less_urgent_ones_and_outputs_stay_unchanged(family, config):
    """Two long requests of priority 10 fill the batch (or the KV cache); two of priority 0 that
    arrive later start at once, and every request still says exactly what transformers says."""
    folder, prompts, references = family
    engine = LLMEngine(EngineConfig(model=str(folder), device=TEST_DEVICE, **config), show_progress=False)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=TOP_LOGPROBS)
    arrivals = {1: (0, 10), 3: (0, 10), 2: (2, 0), 5: (3, 0)}  # prompt -> (step, priority)
    tokens = {i: [] for i in arrivals}
    logprobs = {i: [] for i in arrivals}
    first_output_step = {}
    step = 0
    while step <= 3 or engine.has_unfinished_requests():
        for i, (arrival, priority) in arrivals.items():
            if arrival == step:
                engine.add_request(str(i), prompts[i], params, priority=priority)
        for output in engine.step():
            tokens[int(output.request_id)] += output.new_token_ids
            logprobs[int(output.request_id)] += output.new_logprobs
            first_output_step.setdefault(int(output.request_id), step)
        step += 1
    assert (first_output_step[2], first_output_step[5]) == (2, 3)
    assert engine.metrics().num_preemptions > 0
    assert_matches_transformers([references[i] for i in arrivals], list(tokens.values()),
                                list(logprobs.values()))
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_prefix_cache_hits_keep_outputs_unchanged(family):
    folder, prompts, references = family
    repeated = prompts + prompts
    arrivals = [0] * len(prompts) + [20] * len(prompts)
    engine, tokens, logprobs = run_engine(folder, repeated, prompt_for_step=arrivals, block_size=4)
    metrics = engine.metrics()
    assert metrics.prefix_cache_hit_tokens > 0
    assert metrics.prefix_cache_hit_rate == pytest.approx(
        metrics.prefix_cache_hit_tokens / metrics.prefix_cache_queried_tokens)
    assert_matches_transformers(references + references, tokens, logprobs)


def test_copies_of_a_prompt_arriving_together_compute_it_once(family):
    # As the n choices of one call do: the first computes the prompt, the others wait one step
    # (or follow its chunks) and read its blocks from the prefix cache.
    folder, prompts, references = family
    copies = [prompts[3]] * 4  # 140 tokens
    for budget in (2048, 48):
        engine, tokens, logprobs = run_engine(folder, copies, prompt_for_step=[0] * 4, block_size=8,
                                              max_num_batched_tokens=budget)
        assert_matches_transformers([references[3]] * 4, tokens, logprobs)
        computed = engine.scheduler.stats.num_prompt_tokens_computed
        assert computed == 140 + 3 * (140 - 136), (budget, computed)  # the 17 full blocks: once


def test_raw_logits_of_a_mixed_batch_match_transformers(family):
    """One forward pass over a decode token and two prefill chunks, logits compared directly."""
    folder, prompts, references = family
    engine = LLMEngine(EngineConfig(model=str(folder), device=TEST_DEVICE, max_num_batched_tokens=100,
                                    block_size=4), show_progress=False)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("a", prompts[0], params)
    engine.step()  # "a" is now decoding
    engine.add_request("b", prompts[2], params)
    engine.add_request("c", prompts[3], params)  # 140 tokens: only part of it fits the budget
    output = engine.scheduler.schedule()
    assert [s.num_tokens for s in output.scheduled] == [1, 17, 82]
    with torch.inference_mode():
        batch = engine.runner.prepare_batch(engine.runner.batch_order(output))
        logits = engine.model.forward(batch, engine.runner.k_caches, engine.runner.v_caches)
    assert logits.shape[0] == 2  # "c" is mid-prefill: no logits wanted for it
    logits = logits.cpu()  # the references were computed on the CPU
    torch.testing.assert_close(logits[0], references[0][1][1], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1], references[2][1][0], atol=1e-4, rtol=0)



QWEN2_WINDOW_SETTINGS = {
    # use_sliding_window alone windows no layer here: only layers from max_window_layers (28) on.
    "no layer windowed": dict(use_sliding_window=True, sliding_window=16),
    "window switched off": dict(use_sliding_window=False, sliding_window=16, max_window_layers=0),
    "every layer windowed": dict(use_sliding_window=True, sliding_window=16, max_window_layers=0),
}


@pytest.mark.parametrize("setting", QWEN2_WINDOW_SETTINGS)
@pytest.mark.parametrize("chunk_budget", [None, 16])
def test_qwen2_sliding_window_settings_match_transformers(tmp_path, setting, chunk_budget):
    """Prompts of up to 140 tokens against a 16-token window, prefilled whole and in 16-token chunks."""
    model = make_hf_model("qwen2", **QWEN2_WINDOW_SETTINGS[setting])
    folder = save_hf_model(model, tmp_path)
    prompts = random_prompts(PROMPT_LENGTHS, model.config.vocab_size, seed=1)
    references = [hf_greedy(model, p, NUM_NEW_TOKENS) for p in prompts]
    config = {} if chunk_budget is None else dict(max_num_batched_tokens=chunk_budget)
    engine, tokens, logprobs = run_engine(folder, prompts, **config)
    hf_windows = {layer.self_attn.sliding_window for layer in model.model.layers}
    assert hf_windows == {engine.spec.sliding_window}
    assert_matches_transformers(references, tokens, logprobs)


def hf_prompt_logprobs(folder, prompt: list[int]) -> torch.Tensor:
    """transformers' log-distribution at each prompt position but the last: [len - 1, vocab]."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("case", ["chunked prefill next to prefix-cache hits", "preemption"])
def test_prompt_logprobs_match_transformers(family, case):
    """Every prompt token's logprob and top alternatives, whatever chunks the prompt was computed
    in, recomputed after a preemption, or cached for another request."""
    folder, prompts, references = family
    preempting = case == "preemption"
    config = dict(num_kv_blocks=24, block_size=8, max_num_batched_tokens=64) if preempting else \
        dict(block_size=8, max_num_batched_tokens=64)
    engine = LLMEngine(EngineConfig(model=str(folder), device=TEST_DEVICE, **config), show_progress=False)
    plain = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    asking = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    arrivals = {} if preempting else {0: [(f"plain-{i}", p, plain) for i, p in enumerate(prompts)]}
    arrivals.setdefault(0 if preempting else 20, []).extend((str(i), p, asking) for i, p in enumerate(prompts))
    outputs: dict[str, list] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params)
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
        step += 1
    if preempting:
        assert engine.metrics().num_preemptions > 0
    else:
        assert engine.metrics().prefix_cache_hit_tokens == 0  # the asking requests computed all
    for i, prompt in enumerate(prompts):
        first, *rest = outputs[str(i)]
        assert all(o.prompt_logprobs is None for o in rest)
        assert [t for o in outputs[str(i)] for t in o.new_token_ids] == references[i][0]
        expected = hf_prompt_logprobs(folder, prompt)
        got = first.prompt_logprobs
        assert [entry.token_id for entry in got] == prompt[1:]
        for position, entry in enumerate(got):
            assert abs(entry.logprob - expected[position, entry.token_id].item()) < 1e-4
            assert [t for t, _ in entry.top] == torch.topk(expected[position], 3).indices.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in entry.top]),
                                       torch.topk(expected[position], 3).values, atol=1e-4, rtol=0)


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties, written out for transformers: the reference."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


@pytest.mark.parametrize("sampling, hf_options", [
    (dict(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
    (dict(logit_bias={7: 4.0, 11: -3.0, 99: 2.5}, presence_penalty=0.8, frequency_penalty=0.6),
     dict(sequence_bias={(7,): 4.0, (11,): -3.0, (99,): 2.5}, presence=0.8, frequency=0.6)),
    (dict(logit_bias={7: 4.0, 11: -3.0, 99: 2.5}, repetition_penalty=1.8),
     dict(sequence_bias={(7,): 4.0, (11,): -3.0, (99,): 2.5}, repetition_penalty=1.8)),
])
def test_penalties_and_logit_bias_match_transformers(tmp_path, sampling, hf_options):
    """Greedy tokens with penalties and biases, in one batch with plain requests, equal
    transformers' own processors (repetition_penalty, sequence_bias) and the OpenAI formula."""
    model = make_hf_model("llama", vocab_size=128)
    folder = save_hf_model(model, tmp_path)
    prompts = random_prompts([5, 23, 2], 128, seed=3)
    hf_options = dict(hf_options)
    presence, frequency = hf_options.pop("presence", 0.0), hf_options.pop("frequency", 0.0)
    engine = LLMEngine(EngineConfig(model=str(folder), device=TEST_DEVICE), show_progress=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"adjusted-{i}", prompt, SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0,
                                                                    ignore_eos=True, **sampling))
        engine.add_request(f"plain-{i}", prompt, SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0,
                                                                 ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    for i, prompt in enumerate(prompts):
        processors = LogitsProcessorList([OpenAIPenalties(len(prompt), presence, frequency)])
        expected, _ = hf_greedy(model, prompt, NUM_NEW_TOKENS, logits_processor=processors, **hf_options)
        assert tokens[f"adjusted-{i}"] == expected, i
        assert tokens[f"plain-{i}"] == hf_greedy(model, prompt, NUM_NEW_TOKENS)[0]
    assert any(tokens[f"adjusted-{i}"] != tokens[f"plain-{i}"] for i in range(len(prompts)))
