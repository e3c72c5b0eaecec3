"""Stop conditions and sampling failures on the real engine: min_tokens holds back stop strings and
keeps stop tokens and EOS from being sampled, a stop token's text is left out (as vLLM), a tiny
temperature is greedy, and a request whose sampling fails fails alone.

Expected outputs come from a greedy run of the same prompt with no stop condition: the demo
model's byte-level tokenizer makes each ASCII token exactly one character.
"""

import json
from dataclasses import dataclass, field

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import InvalidParameter, SamplingParams
from tests.helpers import (byte_tokenizer_with_token, make_hf_model, random_prompts, save_hf_model,
                           save_successor_model)

PROMPT = "World"
NUM_TOKENS = 16
SPACE = ord(" ")
EOS = 257  # the demo tokenizer's </s>


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    deltas: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.deltas)


def run(engine: LLMEngine, requests: dict[str, tuple]) -> dict[str, Result]:
    """Add every (prompt, params) at once and step until all finish; each request's outputs."""
    results = {}
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
        results[request_id] = Result()
    while engine.has_unfinished_requests():
        for output in engine.step():
            result = results[output.request_id]
            assert result.finish_reason is None, "an output after the request finished"
            result.tokens += output.new_token_ids
            result.deltas.append(output.new_text)
            result.finish_reason, result.stop_reason = output.finish_reason, output.stop_reason
            result.error = output.error
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    return results


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True, **kwargs})


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    # NOTE: one intra-op thread, as the shared demo engine: the tiny model gains nothing from more.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLMEngine(EngineConfig(model=str(demo_model_dir), num_kv_blocks=64), show_progress=False)
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def reference(engine) -> tuple[list[int], str]:
    """The greedy tokens of PROMPT with no stop condition, and their text (one char per token)."""
    result = run(engine, {"reference": (PROMPT, greedy())})["reference"]
    assert len(result.tokens) == NUM_TOKENS and all(t < 128 for t in result.tokens)
    text = bytes(result.tokens).decode("ascii")
    assert result.text == text
    return result.tokens, text


def first_stop(text: str, stop: str, min_tokens: int) -> int:
    """Where vLLM finds a stop string: its first occurrence that ends in token min_tokens or later."""
    index = text.find(stop, max(0, min_tokens - len(stop)))
    assert index != -1
    return index


@pytest.mark.parametrize("stops,min_tokens", [
    ((" ",), 0),
    ((" ",), 8),  # the bug report's case: spaces before token 8 stopped it after 4 tokens
    (("& ",), 5),  # "& " ends at token 4 and again at token 6
    (("& ",), 6),  # the second "& " starts before token 6 and ends in it
    (("& ", "never-generated"), 5),  # a longer stop string widens the held-back window
])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_wait_for_min_tokens(engine, reference, stops, min_tokens, include):
    tokens, text = reference
    stop = stops[0]
    assert all(s not in text for s in stops[1:])
    index = first_stop(text, stop, min_tokens)
    num_tokens = index + len(stop)
    if min_tokens:  # the test is about a stop string that appears before min_tokens
        assert text.find(stop) + len(stop) < min_tokens
    params = greedy(stop=stops, min_tokens=min_tokens, include_stop_str_in_output=include)
    result = run(engine, {"r": (PROMPT, params)})["r"]
    assert result.tokens == tokens[:num_tokens]
    assert result.text == text[:num_tokens if include else index]
    assert (result.finish_reason, result.stop_reason) == ("stop", stop)


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_left_out(engine, reference, include):
    tokens, text = reference
    num_tokens = tokens.index(SPACE) + 1
    assert num_tokens == 4  # the text starts "&&& "
    params = greedy(stop_token_ids=[SPACE], include_stop_str_in_output=include)
    result = run(engine, {"r": (PROMPT, params)})["r"]
    assert result.tokens == tokens[:num_tokens]
    assert result.text == text[:num_tokens if include else num_tokens - 1]
    assert (result.finish_reason, result.stop_reason) == ("stop", SPACE)


@pytest.mark.parametrize("include, text", [(False, "a"), (True, "a\u00e9")])
def test_a_left_out_stop_token_takes_the_bytes_it_would_finish_with_it(tmp_path, include, text):
    """As vLLM: no stray U+FFFD for the lead byte of an "\u00e9" whose last byte stops the output."""
    written = [ord("Q"), *"a\u00e9b".encode()]  # the model answers "Q" with "a", 0xC3, 0xA9, "b"
    folder = save_successor_model(dict(zip(written, written[1:])), tmp_path)
    engine = LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=16), show_progress=False)
    params = greedy(stop_token_ids=[0xA9], include_stop_str_in_output=include)
    result = run(engine, {"r": ([ord("Q")], params)})["r"]
    assert result.tokens == [ord("a"), 0xC3, 0xA9]
    assert (result.text, result.finish_reason, result.stop_reason) == (text, "stop", 0xA9)
    # Cut by length instead, the lone lead byte shows as U+FFFD, as transformers' decode does.
    cut = run(engine, {"cut": ([ord("Q")], greedy(max_tokens=2))})["cut"]
    assert cut.text == "a\ufffd"


@pytest.mark.parametrize("config_eos, generation_eos, ends_on", [
    (EOS, None, {EOS}),
    # A tokenizer's EOS that config.json leaves out, or names another token for (as a chat
    # fine-tune's new end-of-turn token): the reply once ran on to max_tokens past it.
    (None, None, {EOS}),
    (ord("x"), None, {EOS, ord("x")}),
    (None, [ord("x"), ord("y")], {EOS, ord("x"), ord("y")}),  # as Llama 3 instruct lists them
])
def test_a_reply_ends_on_the_eos_tokens_of_the_config_the_generation_config_and_the_tokenizer(
        tmp_path, config_eos, generation_eos, ends_on):
    written = [ord("Q"), ord("w"), ord("x"), ord("y"), EOS, ord("z"), ord("z")]
    folder = save_successor_model(dict(zip(written, written[1:])), tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": config_eos}))
    (folder / "generation_config.json").unlink(missing_ok=True)
    if generation_eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    engine = LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=16), show_progress=False)
    assert engine.eos_token_ids == ends_on
    result = run(engine, {"r": ([ord("Q")], SamplingParams(temperature=0, max_tokens=6))})["r"]
    first = next(i for i, token in enumerate(written[1:]) if token in ends_on)
    assert result.tokens == written[1:first + 2]
    assert (result.finish_reason, result.stop_reason) == ("stop", None)
    ignored = run(engine, {"r": ([ord("Q")], greedy(max_tokens=6))})["r"]
    assert (ignored.tokens, ignored.finish_reason) == (written[1:], "length")


def test_eos_ids_the_model_cannot_generate_are_ignored_with_a_warning(tmp_path, caplog):
    """A generation_config.json naming an id past the vocabulary (a tokenizer's added token the
    embeddings were never resized for) once failed every request in the batch as soon as one with
    min_tokens banned it (an index past the logits)."""
    written = [ord("Q"), ord("w"), ord("x"), EOS, ord("z")]
    folder = save_successor_model(dict(zip(written, written[1:])), tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 400, -1]}))
    with caplog.at_level("WARNING", logger="engine.tokenizer"):
        engine = LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=16), show_progress=False)
    assert engine.eos_token_ids == {EOS}
    assert (f"names EOS token ids the model cannot generate (its vocabulary has "
            f"{engine.spec.vocab_size} tokens): -1, 400; they are ignored") in caplog.text
    results = run(engine, {"plain": ([ord("Q")], greedy(max_tokens=4)),
                           "min": ([ord("Q")], SamplingParams(temperature=0, max_tokens=4, min_tokens=2))})
    assert (results["plain"].tokens, results["plain"].error) == (written[1:], None)
    assert (results["min"].tokens, results["min"].finish_reason) == (written[1:4], "stop")


MIXED = 258  # byte_tokenizer_with_token's token: "c" then the lead byte of a 2-byte character


@pytest.fixture(scope="module")
def mixed_engine(tmp_path_factory) -> LLMEngine:
    """Answers "Q" with "a", "b", MIXED, then EOS."""
    written = [ord("Q"), ord("a"), ord("b"), MIXED, EOS]
    folder = save_successor_model(dict(zip(written, written[1:])), tmp_path_factory.mktemp("mixed"),
                                  byte_tokenizer_with_token(b"c\xc3"))
    return LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=16), show_progress=False)


@pytest.mark.parametrize("params, deltas, finish_reason, stop_reason", [
    # "c" comes with its token; the lead byte after it shows as U+FFFD once EOS, which has no
    # text, ends the output, as transformers decodes the output and as its logprobs' bytes join
    # (it was dropped, but shown with include_stop_str_in_output). A stop string of two
    # characters holds one back.
    (dict(), ["a", "b", "c", "\ufffd"], "stop", None),
    (dict(include_stop_str_in_output=True), ["a", "b", "c", "\ufffd"], "stop", None),
    (dict(max_tokens=3), ["a", "b", "c\ufffd"], "length", None),
    (dict(stop=["bc"]), ["", "a", ""], "stop", "bc"),
    (dict(stop=["bc"], max_tokens=3), ["", "a", ""], "stop", "bc"),
    (dict(stop=["c"], max_tokens=3), ["a", "b", ""], "stop", "c"),
    (dict(stop=["bc"], include_stop_str_in_output=True), ["", "a", "bc"], "stop", "bc"),
    # The U+FFFD that the lead byte shows as once the output ends is searched for stop strings too.
    (dict(stop=["c\ufffd"], max_tokens=3), ["", "a", "b"], "stop", "c\ufffd"),
])
def test_a_stop_string_can_end_before_a_partial_character_in_the_same_token(
        mixed_engine, params, deltas, finish_reason, stop_reason):
    result = run(mixed_engine, {"r": ([ord("Q")], SamplingParams(temperature=0, **params))})["r"]
    assert result.tokens == [ord("a"), ord("b"), MIXED, EOS][:len(deltas)]
    assert (result.deltas, result.finish_reason, result.stop_reason) == (deltas, finish_reason, stop_reason)


@pytest.fixture(scope="module")
def stray_byte_engine(tmp_path_factory) -> LLMEngine:
    """Answers "Q" with "a", a byte no character starts with (0x80: shown as U+FFFD), "b", EOS."""
    written = [ord("Q"), ord("a"), 0x80, ord("b"), EOS]
    folder = save_successor_model(dict(zip(written, written[1:])), tmp_path_factory.mktemp("stray"))
    return LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=16), show_progress=False)


@pytest.mark.parametrize("params, deltas, stop_reason", [
    # The U+FFFD streams with its token: no byte to come could make a character of it (it was
    # once held back until a character followed).
    (dict(), ["a", "\ufffd", "b", ""], None),
    # A stop string ending in it stops the output at once (it once ran a token further, billed).
    (dict(stop=["a\ufffd"]), ["", ""], "a\ufffd"),
    (dict(stop=["\ufffd"], include_stop_str_in_output=True), ["a", "\ufffd"], "\ufffd"),
])
def test_bytes_that_never_make_a_character_are_final_at_once(stray_byte_engine, params, deltas,
                                                              stop_reason):
    result = run(stray_byte_engine, {"r": ([ord("Q")], SamplingParams(temperature=0, **params))})["r"]
    assert result.tokens == [ord("a"), 0x80, ord("b"), EOS][:len(deltas)]
    assert (result.deltas, result.stop_reason) == (deltas, stop_reason)


@pytest.mark.parametrize("prompt_bytes", [b"\xe4", b"\xe4\xbd"])
@pytest.mark.parametrize("params, text, stop_reason", [
    (dict(), "\u4f60ok", None),
    (dict(stop=["\u4f60o"]), "", "\u4f60o"),
    (dict(stop=["k"]), "\u4f60o", "k"),
])
def test_a_character_a_token_id_prompt_ends_partway_into_is_the_outputs(
        tmp_path_factory, prompt_bytes, params, text, stop_reason):
    """The model finishes the prompt's "\u4f60" (0xE4 0xBD 0xA0): the output starts with it whole, as
    vLLM's. It was lost: its bytes read as the prompt's U+FFFD, read past, then as the output's."""
    written = [ord("Q"), *"\u4f60ok".encode(), EOS]
    folder = save_successor_model(dict(zip(written, written[1:])), tmp_path_factory.mktemp("split"))
    engine = LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=16), show_progress=False)
    prompt = [ord("Q"), *prompt_bytes]
    result = run(engine, {"r": (prompt, SamplingParams(temperature=0, **params))})["r"]
    assert (result.text, result.stop_reason) == (text, stop_reason)


@pytest.fixture(scope="module")
def hf_demo(demo_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_model_dir).eval()


@pytest.mark.parametrize("stop_token, min_tokens, bias", [
    (ord("&"), 2, {}),  # greedy starts "&&&": masked, it starts with other tokens, then "&"
    (None, 3, {EOS: 5.0}),  # EOS made the favourite: it may end the reply from token 4 on
])
def test_min_tokens_keeps_stop_tokens_from_being_sampled(engine, hf_demo, stop_token, min_tokens, bias):
    """As vLLM, and transformers' min_new_tokens: before min_tokens, EOS and stop_token_ids are
    masked, so the reply goes on with another token instead of carrying one it did not stop at."""
    params = greedy(min_tokens=min_tokens, logit_bias=bias, ignore_eos=stop_token is not None,
                    stop_token_ids=[stop_token] if stop_token is not None else [])
    result = run(engine, {"r": (PROMPT, params)})["r"]
    prompt = engine.tokenizer.encode(PROMPT)
    expected = hf_greedy_until(hf_demo, prompt, stop_token if stop_token is not None else EOS,
                                  min_tokens, {(t,): b for t, b in bias.items()})
    assert result.tokens == expected
    assert len(expected) > min_tokens and expected[-1] == (stop_token or EOS)
    assert (stop_token or EOS) not in expected[:-1]
    assert result.finish_reason == "stop"


def hf_greedy_until(model, prompt: list[int], stop_token: int, min_tokens: int,
                    sequence_bias: dict) -> list[int]:
    """transformers' greedy reply, ended by `stop_token` from token `min_tokens` on."""
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=NUM_TOKENS, min_new_tokens=min_tokens, eos_token_id=stop_token,
                             pad_token_id=0, sequence_bias=sequence_bias or None,
                             return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist()


def test_a_tiny_temperature_is_greedy_and_spares_its_batch(engine, reference):
    sampled = {
        "seeded": ("Hello", greedy(temperature=1.0, seed=7)),
        "top_p": ("A long story:", greedy(temperature=0.8, top_p=0.9, seed=3)),
    }
    alone = run(engine, sampled)
    batch = run(engine, {**sampled, "tiny": (PROMPT, greedy(temperature=1e-40))})
    assert batch["tiny"].tokens == reference[0]
    assert batch["tiny"].finish_reason == "length"
    for request_id in sampled:
        assert batch[request_id].tokens == alone[request_id].tokens
        assert batch[request_id].finish_reason == "length"


@pytest.mark.parametrize("params, banned", [
    (greedy(min_tokens=2, stop_token_ids=range(EOS + 1)), "stop_token_ids"),
    (greedy(temperature=1.0, min_tokens=1, stop_token_ids=range(EOS), ignore_eos=False),
     "EOS and stop_token_ids"),
])
def test_a_ban_of_every_token_before_min_tokens_is_refused(engine, params, banned):
    message = (f"min_tokens {params.min_tokens} bans {banned} until that many tokens are generated, "
               "and they are all 258 tokens of the vocabulary")
    with pytest.raises(InvalidParameter, match=message) as raised:
        engine.add_request("banned", PROMPT, params)
    assert raised.value.param == "min_tokens" and not engine.has_unfinished_requests()
    # EOS left out of the ban (ignore_eos) is the one token these may start with.
    allowed = run(engine, {"eos": (PROMPT, greedy(min_tokens=2, stop_token_ids=range(EOS)))})["eos"]
    assert allowed.tokens[:2] == [EOS, EOS] and allowed.error is None


@pytest.mark.parametrize("penalty", [1e-300, 0.0099, 100.5])
def test_a_repetition_penalty_that_would_overflow_is_rejected(engine, penalty):
    with pytest.raises(ValueError, match=r"repetition_penalty must be in \[0.01, 100\]"):
        SamplingParams(repetition_penalty=penalty)
    assert not engine.has_unfinished_requests()


POISON = 7  # a token whose embedding is NaN: any prompt holding it gets NaN logits


@pytest.fixture(scope="module")
def poisoned_model(tmp_path_factory):
    """A tiny random Llama that produces NaN logits for prompts containing POISON, as a model whose
    activations overflow does, and finite ones for every other prompt."""
    model = make_hf_model("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[POISON] = float("nan")
    return save_hf_model(model, tmp_path_factory.mktemp("poisoned"))


def poisoned_engine(folder) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=64), show_progress=False)


def healthy_requests() -> dict[str, tuple]:
    """A greedy and a sampled request of different lengths that never see POISON."""
    prompts = random_prompts([9, 40], 384, seed=5)
    assert all(POISON not in p for p in prompts)
    ban = {POISON: -100}  # NOTE: so they never generate it and read the NaN embedding
    return {"greedy": (prompts[0], greedy(logit_bias=ban)),
            "seeded": (prompts[1], greedy(temperature=1.0, seed=11, logit_bias=ban))}


def assert_same_tokens(results: dict[str, Result], alone: dict[str, Result]) -> None:
    for request_id, result in alone.items():
        assert len(result.tokens) == NUM_TOKENS and result.finish_reason == "length"
        assert (results[request_id].tokens, results[request_id].finish_reason) == (result.tokens, "length")


def test_a_request_whose_sampling_fails_fails_alone(poisoned_model):
    engine = poisoned_engine(poisoned_model)
    alone = run(engine, healthy_requests())
    batch = run(engine, {"nan": ([3, POISON, 5], greedy(temperature=1.0)), **healthy_requests()})
    assert (batch["nan"].tokens, batch["nan"].text, batch["nan"].finish_reason) == ([], "", "error")
    assert batch["nan"].error.startswith("sampling failed: ")
    assert_same_tokens(batch, alone)


def test_a_failed_request_leaves_nothing_behind_in_the_kv_cache(poisoned_model):
    alone = run(poisoned_engine(poisoned_model), healthy_requests())
    engine = poisoned_engine(poisoned_model)
    # First on a fresh engine, so its NaN keys and values land in block 0 and stay there (cached).
    assert run(engine, {"nan": ([3, POISON, 5], greedy(temperature=1.0))})["nan"].finish_reason == "error"
    assert_same_tokens(run(engine, healthy_requests()), alone)
