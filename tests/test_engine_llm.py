"""LLM.generate: a call that fails leaves the engine as it found it."""

import re

import pytest

from adapters.config import AdapterConfig
from engine.config import EngineConfig
from engine.llm import LLM
from engine.request import InvalidParameter, SamplingParams
from tests.helpers import make_hf_model, save_hf_model

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = [4, 5, 6]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def expected_tokens(folder) -> list[int]:
    """PROMPT's greedy continuation from an LLM that never saw a failed call."""
    llm = LLM(str(folder), show_progress=False)
    return llm.generate([PROMPT], PARAMS, use_tqdm=False)[0].output_token_ids


def assert_engine_is_idle(llm: LLM) -> None:
    kv = llm.engine.kv_manager
    assert not llm.engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks


def test_a_rejected_prompt_takes_back_the_prompts_queued_before_it(folder, expected_tokens):
    llm = LLM(str(folder), show_progress=False, max_model_len=64)
    with pytest.raises(ValueError, match="the prompt has 100 tokens"):
        llm.generate([[1, 2, 3], list(range(100))], PARAMS, use_tqdm=False)
    assert_engine_is_idle(llm)
    assert llm.generate([PROMPT], PARAMS, use_tqdm=False)[0].output_token_ids == expected_tokens


def test_an_interrupted_generate_aborts_its_running_requests(folder, expected_tokens, monkeypatch):
    llm = LLM(str(folder), show_progress=False)
    real_step, num_steps = llm.engine.step, 0

    def step_then_interrupt():
        nonlocal num_steps
        num_steps += 1
        if num_steps == 2:  # the requests are decoding and hold KV blocks
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3], [7, 8]], PARAMS, use_tqdm=False)
    monkeypatch.undo()
    assert_engine_is_idle(llm)
    assert llm.generate([PROMPT], PARAMS, use_tqdm=False)[0].output_token_ids == expected_tokens


def test_a_text_prompt_with_a_token_past_the_models_embeddings_is_refused_alone(tmp_path):
    from engine.demo import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()  # ids 0-257
    tokenizer.add_tokens(["<|extra|>"])  # 258: added to the tokenizer, not to the model
    tokenizer.save_pretrained(tmp_path)
    save_hf_model(make_hf_model("llama", vocab_size=258), tmp_path)
    llm = LLM(str(tmp_path), show_progress=False)
    text_params = SamplingParams(max_tokens=4, temperature=0.0)
    expected = llm.generate(["hello"], text_params, use_tqdm=False)[0].output_token_ids
    # It failed the forward pass of its step (an IndexError from the embedding), "hello" with it.
    with pytest.raises(InvalidParameter, match=r"the prompt's text encodes to tokens the model has "
                       r"no embedding for .*\[0, 258\): \[258\]") as raised:
        llm.generate(["hello", "hi <|extra|>"], text_params, use_tqdm=False)
    assert raised.value.param == "prompt"
    assert_engine_is_idle(llm)
    assert llm.generate(["hello"], text_params, use_tqdm=False)[0].output_token_ids == expected


def test_one_prompt_alone_is_one_prompt_as_vllm_takes_it(demo_model_dir):
    llm = LLM(str(demo_model_dir), show_progress=False)
    # A list of token ids failed (TypeError); a text ran as one prompt per character.
    [listed] = llm.generate(["Hello"], PARAMS, use_tqdm=False)
    [text] = llm.generate("Hello", PARAMS, use_tqdm=False)
    [ids] = llm.generate(listed.prompt_token_ids, PARAMS, use_tqdm=False)
    assert text.prompt_token_ids == ids.prompt_token_ids == listed.prompt_token_ids
    assert text.output_token_ids == ids.output_token_ids == listed.output_token_ids


@pytest.mark.parametrize("fields, param", [
    # Each passed the range checks, then failed the step that sampled it (the whole batch).
    ({"logprobs": True}, "logprobs"), ({"prompt_logprobs": True}, "prompt_logprobs"),
    ({"logprobs": 1.0}, "logprobs"), ({"top_k": 2.5}, "top_k"), ({"max_tokens": "8"}, "max_tokens"),
    ({"seed": 1.5}, "seed"), ({"min_tokens": True}, "min_tokens"),
    ({"temperature": "0.5"}, "temperature"), ({"stop": ["\n", 13]}, "stop"),
    ({"stop_token_ids": [2.7]}, "stop_token_ids"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {1: "a"}}, "logit_bias"), ({"temperature": float("inf")}, "temperature"),
    # A ValueError or TypeError naming no field: "²" is a digit to str.isdigit(), not to int().
    ({"logit_bias": {"²": 1.0}}, "logit_bias"), ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop": 5}, "stop")])
def test_sampling_params_of_the_wrong_type_are_refused_naming_the_field(fields, param):
    with pytest.raises(InvalidParameter, match=f"^{param} must be") as raised:
        SamplingParams(**fields)
    assert raised.value.param == param


@pytest.mark.parametrize("priority", ["1", None, 1.5, True])
def test_a_priority_that_is_not_an_integer_is_refused_and_nothing_is_kept(folder, priority):
    # The waiting queue is sorted by it: the sort failed with the request already registered, so
    # the engine never went idle (its thread spun) and the id stayed taken for good.
    llm = LLM(str(folder), show_progress=False)
    engine = llm.engine
    engine.add_request("queued", PROMPT, PARAMS)
    with pytest.raises(InvalidParameter, match="priority must be an integer") as refused:
        engine.add_request("odd", PROMPT, PARAMS, priority=priority)
    assert refused.value.param == "priority"
    assert engine.abort_request("queued") is not None and engine.abort_request("odd") is None
    assert_engine_is_idle(llm)
    engine.add_request("odd", PROMPT, PARAMS)  # its id is free


@pytest.mark.parametrize("fields, message", [
    # Each failed once the weights had loaded with a TypeError naming no field, or was kept
    # as given (a max_model_len of 100.5; prefix caching on for "false").
    ({"kv_cache_memory_bytes": 2e8}, "kv_cache_memory_bytes must be an integer or None, got 200000000.0"),
    ({"num_kv_blocks": 64.0}, "num_kv_blocks must be an integer or None"),
    ({"block_size": 16.0}, "block_size must be an integer, got 16.0"),
    ({"max_num_seqs": 2.5}, "max_num_seqs must be an integer"),
    ({"max_model_len": 100.5}, "max_model_len must be an integer or None"),
    ({"seed": 1.5}, "seed must be an integer"), ({"max_num_batched_tokens": True}, "must be an integer"),
    ({"enable_prefix_caching": "false"}, "enable_prefix_caching must be True or False"),
    ({"lora": {"max_lora_rank": 8}}, "lora must be an AdapterConfig or None, got dict"),
])
def test_engine_settings_of_the_wrong_type_are_refused_before_loading(folder, fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(model=str(folder), **fields)


@pytest.mark.parametrize("fields, message", [
    ({"max_lora_rank": 8.0}, "max_lora_rank must be an integer, got 8.0"),
    ({"num_load_threads": None}, "num_load_threads must be an integer, got None"),
])
def test_adapter_settings_of_the_wrong_type_are_refused(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        AdapterConfig(**fields)


def test_a_list_of_sampling_params_for_other_prompts_is_refused(folder):
    llm = LLM(str(folder), show_progress=False)
    # An empty list ran both prompts with the defaults.
    with pytest.raises(ValueError, match="2 prompts but 0 SamplingParams values"):
        llm.generate([PROMPT, PROMPT], [], use_tqdm=False)


def test_none_for_stop_stop_token_ids_and_logit_bias_means_none_as_in_vllm():
    # A TypeError or AttributeError naming no field.
    params = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None)
    assert (params.stop, params.stop_token_ids, params.logit_bias) == ((), (), {})
    assert SamplingParams(logit_bias={"5": 1}).logit_bias == {5: 1.0}  # JSON's keys


def test_a_request_that_fails_as_it_is_added_leaves_nothing_queued(demo_model_dir):
    llm = LLM(str(demo_model_dir), show_progress=False)
    expected = llm.generate([PROMPT], PARAMS, use_tqdm=False)[0].output_token_ids
    broken = SamplingParams(max_tokens=4, stop=["\n"])
    broken.stop = ("\n", 13)  # changed after its checks: its stop strings fail to be prepared
    with pytest.raises(TypeError):
        llm.generate([[1, 2, 3], PROMPT], [PARAMS, broken], use_tqdm=False)
    # It was queued with no output state: every call after failed (KeyError) until it finished.
    assert_engine_is_idle(llm)
    assert llm.generate([PROMPT], PARAMS, use_tqdm=False)[0].output_token_ids == expected


def test_max_tokens_none_generates_up_to_the_context(folder):
    llm = LLM(str(folder), show_progress=False, max_model_len=32)
    [output] = llm.generate([PROMPT], SamplingParams(max_tokens=None, temperature=0.0,
                                                      ignore_eos=True), use_tqdm=False)
    assert len(output.output_token_ids) == 32 - len(PROMPT) and output.finish_reason == "length"
