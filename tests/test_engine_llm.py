"""LLM.generate: a call that fails leaves the engine as it found it."""

import pytest

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
