"""The OpenAI API through the official `openai` client against a real server and engine."""

import logging
import re
import time

import httpx
import openai
import pytest

from engine.demo import build_byte_tokenizer, demo_config
from engine.llm import LLM
from engine.request import SamplingParams
from tests.conftest import ADMIN_KEY, DEMO_MODEL, gateway_server, logged_status
from gateway.text_codec import TextCodec
from tests.helpers import byte_tokenizer_with_token, save_successor_model

PROMPT = "The quick brown fox"
CHAT_PROMPT = "<|system|>\nBe brief.\n<|user|>\nhello\n<|assistant|>\n"  # the demo's template
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def key(server) -> str:
    return server.new_tenant("api-tests")


@pytest.fixture(scope="module")
def client(server, key) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def offline(demo_model_dir):
    """The offline engine API over the same model: the reference for greedy outputs."""
    return LLM(str(demo_model_dir), show_progress=False, num_kv_blocks=128)


def offline_greedy(offline, prompt, max_tokens, **params):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return offline.generate([prompt], params, use_tqdm=False)[0]


def ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [DEMO_MODEL]
    assert models[0].object == "model" and models[0].owned_by == "switchboard"


def test_a_model_is_retrieved_by_id_and_an_unknown_one_is_a_404(client):
    model = client.models.retrieve(DEMO_MODEL)
    assert (model.id, model.object, model.owned_by) == (DEMO_MODEL, "model", "switchboard")
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("no/such:model")
    assert (raised.value.body["code"], raised.value.body["param"]) == ("model_not_found", "model")


def test_greedy_completion_equals_offline_engine(client, offline):
    expected = offline_greedy(offline, PROMPT, 12, ignore_eos=True, logprobs=1)
    completion = client.completions.create(
        model=DEMO_MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    choice = completion.choices[0]
    assert ids(choice.logprobs.tokens) == expected.output_token_ids
    assert choice.text == expected.text
    assert choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in expected.logprobs],
                                                           abs=1e-4)
    assert all(len(top) <= 1 for top in choice.logprobs.top_logprobs)
    num_prompt = len(expected.prompt_token_ids)
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens,
            completion.usage.total_tokens) == (num_prompt, 12, num_prompt + 12)


def test_greedy_chat_equals_offline_engine_on_the_templated_prompt(client, offline, demo_engine):
    prompt_ids = demo_engine.tokenize(CHAT_PROMPT, add_special_tokens=False)
    expected = offline_greedy(offline, prompt_ids, 10, ignore_eos=True)
    chat = client.chat.completions.create(
        model=DEMO_MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0,
        logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert ids([t.token for t in choice.logprobs.content]) == expected.output_token_ids
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert chat.usage.prompt_tokens == len(prompt_ids) == len(CHAT_PROMPT)
    assert chat.usage.completion_tokens == 10 and choice.finish_reason == "length"


def test_a_developer_message_is_the_system_prompt_to_a_template_that_does_not_know_the_role(
        client, demo_engine):
    """OpenAI's newer name for the system role: a template written before it (Qwen2's) dropped
    such a message silently, or (Llama 2's) refused the chat."""
    kwargs = dict(model=DEMO_MODEL, max_completion_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})
    as_system = client.chat.completions.create(messages=MESSAGES, **kwargs)
    as_developer = client.chat.completions.create(
        messages=[{"role": "developer", "content": "Be brief."}, MESSAGES[1]], **kwargs)
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens == len(CHAT_PROMPT)
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content
    # A template that knows the role (as gpt-oss's) gets it as it is.
    codec = TextCodec(build_byte_tokenizer())
    codec._tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'developer' %}"
                                      "[dev]{% endif %}{{ m['content'] }}{% endfor %}")
    assert codec.render_chat([{"role": "developer", "content": "x"}]) == "[dev]x"


def test_streamed_completion_matches_the_whole_one(client):
    kwargs = dict(model=DEMO_MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_streamed_chat_sends_role_first_content_then_usage_and_done(server, key, client):
    kwargs = dict(model=DEMO_MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage == whole.usage
    raw = httpx.post(server.url + "/v1/chat/completions", json={**kwargs, "stream": True,
                     **kwargs["extra_body"]}, headers={"Authorization": f"Bearer {key}"})
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [line for line in raw.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert '"usage":null' in events[0]  # no usage chunk unless include_usage


def test_the_largest_seed_works_for_every_choice(client):
    """Choice j is seeded seed + j, which wraps around within 64 bits."""
    kwargs = dict(model=DEMO_MODEL, prompt=PROMPT, max_tokens=4, n=2, temperature=1.0,
                  extra_body={"ignore_eos": True})
    last = client.completions.create(seed=2**63 - 1, **kwargs)
    first = client.completions.create(seed=-2**63, **kwargs)
    assert last.choices[1].text == first.choices[0].text  # 2**63 - 1 + 1 wrapped to -2**63


@pytest.mark.parametrize("extra, param", [
    ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"tool_choice": "required"}, "tool_choice"),
    # vLLM's extras that render the messages otherwise, and those that constrain sampling.
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"chat_template": "{{ messages[0].content }}"}, "chat_template"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ({"guided_choice": ["yes", "no"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs"),
])
def test_chat_fields_this_server_cannot_honour_are_refused(client, extra, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=DEMO_MODEL, messages=MESSAGES, max_tokens=1,
                                       extra_body=extra)
    assert (raised.value.body["param"], raised.value.body["code"]) == (param, "unsupported_parameter")
    fine = client.chat.completions.create(model=DEMO_MODEL, messages=MESSAGES, max_tokens=1,
                                          extra_body={"function_call": "none", "modalities": ["text"],
                                                      "tool_choice": "none", "min_p": 0,
                                                      "add_generation_prompt": True,
                                                      "continue_final_message": False,
                                                      "guided_json": None})
    assert fine.choices[0].finish_reason in ("stop", "length")


TOOL_CALL = {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.mark.parametrize("turns, param", [
    ([{"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
      {"role": "tool", "tool_call_id": "call_1", "content": "18C"}], "messages[2].tool_calls"),
    ([{"role": "tool", "tool_call_id": "call_1", "content": "18C"}], "messages[2].tool_call_id"),
    ([{"role": "tool", "content": "18C"}], "messages[2].role"),
    ([{"role": "assistant", "content": None, "function_call": TOOL_CALL["function"]}],
     "messages[2].function_call"),
    ([{"role": "function", "name": "get_weather", "content": "18C"}], "messages[2].role"),
])
def test_tool_calls_and_their_results_in_messages_are_refused(client, turns, param):
    """Tool and function calls are never made here: a chat that holds them is refused, as the
    `tools` that would make them are, never answered as if they were not there."""
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=DEMO_MODEL, messages=MESSAGES + turns, max_tokens=1)
    error = raised.value.body
    assert (error["param"], error["code"]) == (param, "unsupported_parameter")
    assert "calls no tools or functions" in error["message"]


def test_messages_as_openai_clients_send_them_back_are_answered(client):
    """An assistant turn as the SDK returns it (its unused fields null, no tool calls) is fine."""
    reply = {"role": "assistant", "content": "hi", "tool_calls": None, "function_call": None,
             "refusal": None, "audio": None}
    chat = client.chat.completions.create(
        model=DEMO_MODEL, max_tokens=1,
        messages=[*MESSAGES, reply, {"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": "again", "tool_calls": []}])
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_n_choices_with_seeds_are_reproducible(client):
    kwargs = dict(model=DEMO_MODEL, prompt=PROMPT, max_tokens=6, n=3, seed=7, temperature=1.0,
                  extra_body={"ignore_eos": True})
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 18
    assert first.usage.prompt_tokens == len(PROMPT) + 1  # counted once per prompt (byte + BOS)


def test_streamed_n_choices_carry_their_index(client):
    chunks = list(client.chat.completions.create(
        model=DEMO_MODEL, messages=MESSAGES, max_tokens=4, n=2, stream=True, temperature=0,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index: c.choices[0].finish_reason
                for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 8


def test_stop_string_ends_the_completion_without_it(client, offline):
    full = offline_greedy(offline, PROMPT, 12, ignore_eos=True).text
    stop = next(c for c in full[:-1] if c != "\ufffd")  # complete before the last token
    completion = client.completions.create(model=DEMO_MODEL, prompt=PROMPT, max_tokens=12,
                                           temperature=0, stop=[stop],
                                           extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full[:full.index(stop)]


def test_a_stop_string_before_a_partial_character_in_a_token_ends_the_text(tmp_path):
    """A token of "c" and the lead byte of a 2-byte character, generated last (max_tokens): the
    stop string "bc" that it completes is left out, streamed or not, and the call stops."""
    from engine.config import EngineConfig
    from gateway.local_engine import LocalEngineClient

    mixed_token, eos = 258, 257
    written = [ord("Q"), ord("a"), ord("b"), mixed_token, eos]
    folder = save_successor_model(dict(zip(written, written[1:])), tmp_path / "model",
                                  byte_tokenizer_with_token(b"c\xc3"))
    engine = LocalEngineClient.load(EngineConfig(model=str(folder), num_kv_blocks=16), show_progress=False)
    try:
        with gateway_server(engine, tmp_path / "gateway") as mixed:
            client = openai.OpenAI(base_url=mixed.url + "/v1", api_key=mixed.new_tenant("mixed"),
                                   max_retries=0)
            kwargs = dict(model=DEMO_MODEL, prompt=[ord("Q")], max_tokens=3, temperature=0, stop=["bc"])
            whole = client.completions.create(**kwargs).choices[0]
            chunks = list(client.completions.create(stream=True, **kwargs))
    finally:
        engine.close()
    assert (whole.text, whole.finish_reason) == ("a", "stop")
    assert "".join(c.choices[0].text for c in chunks) == "a"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_token_id_prompts_and_prompt_lists(client, offline, demo_engine):
    prompt_ids = demo_engine.tokenize("abc")
    expected = offline_greedy(offline, prompt_ids, 5, ignore_eos=True).text
    batch = client.completions.create(model=DEMO_MODEL, prompt=[prompt_ids, prompt_ids],
                                      max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in batch.choices] == [expected, expected]
    assert batch.usage.prompt_tokens == 2 * len(prompt_ids)
    strings = client.completions.create(model=DEMO_MODEL, prompt=["abc", "xyz"], max_tokens=5,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert strings.choices[0].text == expected and len(strings.choices) == 2


def test_one_call_starts_at_most_2048_choices(client):
    """OpenAI's cap of 2048 prompts, and the same on prompts x n: each choice is an engine request."""
    most = client.completions.create(model=DEMO_MODEL, prompt=[[5]] * 16, n=128, max_tokens=1)
    assert len(most.choices) == 2048 and most.usage.completion_tokens == 2048
    for prompt, n, param in [([[5]] * 2049, 1, "prompt"), (["x"] * 2049, 1, "prompt"),
                             ([[5]] * 17, 128, "n"), ([[5]] * 2048, 2, "n")]:
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=DEMO_MODEL, prompt=prompt, n=n, max_tokens=1)
        assert raised.value.body["param"] == param and "2048" in raised.value.body["message"]


def test_unknown_fields_are_ignored(client):
    completion = client.completions.create(model=DEMO_MODEL, prompt="x", max_tokens=2,
                                           extra_body={"ignore_eos": True, "no_such_field": 1})
    assert completion.usage.completion_tokens == 2


def test_bad_key_is_an_authentication_error(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sb-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as raised:
        bad.models.list()
    assert raised.value.status_code == 401
    assert raised.value.body["type"] == "authentication_error"


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert raised.value.body == {
        "message": raised.value.body["message"], "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}


def test_a_long_unknown_model_name_is_cut_in_the_message(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="m" * 100_000, prompt="x", max_tokens=1)
    message = raised.value.body["message"]
    assert "'" + "m" * 100 + "'... (100000 characters)" in message and len(message) < 400


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"),
    (dict(logprobs=21), "logprobs"),
    (dict(max_tokens=5000), "max_tokens"),  # prompt + output beyond the 2048-token context
    (dict(extra_body={"min_tokens": 9}), "min_tokens"),  # the engine's own check: min_tokens > max_tokens
    (dict(extra_body={"repetition_penalty": 1e-300}), "repetition_penalty"),  # logits would overflow
    (dict(seed=2**64), "seed"),  # not a 64-bit integer
    (dict(max_tokens=2**63), "max_tokens"),
    (dict(best_of=0), "best_of"),
    (dict(best_of=1, n=2), "best_of"),  # OpenAI's rule: best_of >= n
    (dict(stream_options={"include_usage": True}), "stream_options"),  # only with stream: true
])
def test_invalid_values_are_bad_requests_naming_the_field(client, kwargs, param):
    kwargs = {"max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=DEMO_MODEL, prompt="x", **kwargs)
    body = raised.value.body
    assert raised.value.status_code == 400
    assert (body["type"], body["param"]) == ("invalid_request_error", param)
    assert body["message"]


@pytest.mark.parametrize("extra, param", [
    ({"suffix": "and then"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    # vLLM's extras that constrain sampling: ignored, they gave a vLLM client unconstrained text.
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"guided_regex": "[0-9]+"}, "guided_regex"),
    ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"bad_words": ["x"]}, "bad_words"),
    ({"logits_processors": ["module.Processor"]}, "logits_processors"),
    ({"min_p": 0.1}, "min_p"),
    ({"use_beam_search": True}, "use_beam_search"),
])
def test_known_but_unsupported_fields_are_refused(client, extra, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=DEMO_MODEL, prompt="x", max_tokens=1, extra_body=extra)
    assert (raised.value.body["param"], raised.value.body["code"]) == (param, "unsupported_parameter")


def test_penalties_and_logit_bias_reach_the_engine(client, offline):
    """Each answer equals the offline engine's with the same options, and differs from plain greedy."""
    plain = offline_greedy(offline, PROMPT, 16, ignore_eos=True).output_token_ids
    assert len(set(plain)) < len(plain)  # greedy repeats itself here, so the penalties have work
    banned = {token: -100.0 for token in plain[:2]}
    for fields in [dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
                   dict(logit_bias=banned, presence_penalty=-0.5)]:
        expected = offline_greedy(offline, PROMPT, 16, ignore_eos=True, **fields).output_token_ids
        body = {**fields, "logit_bias": {str(t): b for t, b in fields.get("logit_bias", {}).items()}}
        completion = client.completions.create(
            model=DEMO_MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **body})
        got = ids(completion.choices[0].logprobs.tokens)
        assert got == expected != plain, fields
        assert not set(got) & set(banned) if "logit_bias" in fields else True
    chat = client.chat.completions.create(model=DEMO_MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logit_bias={str(plain[0]): 100}, logprobs=True,
                                          extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert ids([t.token for t in chat.choices[0].logprobs.content]) == [plain[0]] * 4


def test_echo_puts_the_prompt_and_its_logprobs_first(client, offline):
    expected = offline_greedy(offline, PROMPT, 3, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    prompt_ids = expected.prompt_token_ids
    completion = client.completions.create(
        model=DEMO_MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    choice = completion.choices[0]
    assert choice.text == PROMPT + expected.text
    logprobs = choice.logprobs
    assert ids(logprobs.tokens) == prompt_ids + expected.output_token_ids
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    reference = expected.prompt_logprobs + expected.logprobs  # prompt tokens 1.., then the output
    assert logprobs.token_logprobs[1:] == pytest.approx([lp.logprob for lp in reference], abs=1e-4)
    # Each top holds the token's own too, after the best ones, as OpenAI's do.
    chosen = prompt_ids[1:] + expected.output_token_ids
    best = [[t for t, _ in lp.top] for lp in reference]
    assert [ids(top) for top in logprobs.top_logprobs[1:]] == [
        top + ([token] if token not in top else []) for top, token in zip(best, chosen)]
    assert logprobs.text_offset[0] == 0 and len(logprobs.text_offset) == len(logprobs.tokens)
    assert completion.usage.prompt_tokens == len(prompt_ids)

    # max_tokens 0: the prompt alone, scored (how evaluation harnesses score a text).
    scored = client.completions.create(model=DEMO_MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                       logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    assert scored.choices[0].text == PROMPT
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(prompt_ids), 1)
    assert ids(scored.choices[0].logprobs.tokens) == prompt_ids
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        [lp.logprob for lp in expected.prompt_logprobs], abs=1e-4)

    # Streamed: the first event starts with the prompt; together they say what the whole reply does.
    events = list(client.completions.create(
        model=DEMO_MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True, stream=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}))
    assert events[0].choices[0].text.startswith(PROMPT)
    assert "".join(e.choices[0].text for e in events) == choice.text
    assert [t for e in events for t in e.choices[0].logprobs.tokens] == logprobs.tokens
    assert [o for e in events for o in e.choices[0].logprobs.text_offset] == logprobs.text_offset
    streamed_zero = list(client.completions.create(model=DEMO_MODEL, prompt=PROMPT, max_tokens=0,
                                                   echo=True, stream=True))
    assert "".join(e.choices[0].text for e in streamed_zero) == PROMPT
    # Its 0 tokens end it with `length`, even when the token sampled and left out was an EOS.
    eos = {"logit_bias": {str(demo_config().eos_token_id): 100}}
    assert streamed_zero[-1].choices[0].finish_reason == "length"
    for stream in (False, True):
        reply = client.completions.create(model=DEMO_MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                          stream=stream, **eos)
        last = list(reply)[-1] if stream else reply
        assert last.choices[0].finish_reason == "length"

    # n > 1 and several prompts: one choice of each prompt scores it, and every choice echoes it.
    short = offline_greedy(offline, prompt_ids[:4], 3, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    for stream in (False, True):
        reply = client.completions.create(
            model=DEMO_MODEL, prompt=[prompt_ids, prompt_ids[:4]], max_tokens=3, temperature=0,
            logprobs=2, echo=True, n=2, stream=stream,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        tokens, token_logprobs = {}, {}
        for part in reply if stream else [reply]:
            for c in part.choices:
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
                token_logprobs.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
        assert sorted(tokens) == [0, 1, 2, 3], stream
        for index, reference in [(0, expected), (1, expected), (2, short), (3, short)]:
            assert ids(tokens[index]) == reference.prompt_token_ids + reference.output_token_ids
            assert token_logprobs[index][0] is None
            scored_tokens = reference.prompt_logprobs + reference.logprobs
            assert token_logprobs[index][1:] == pytest.approx([lp.logprob for lp in scored_tokens], abs=1e-4)

    # Without logprobs, and for a prompt sent as token ids (its text is its tokens' text).
    plain = client.completions.create(model=DEMO_MODEL, prompt=[prompt_ids, prompt_ids[:3]], max_tokens=2,
                                      temperature=0, echo=True, n=2, extra_body={"ignore_eos": True})
    first, second = offline_greedy(offline, prompt_ids, 2, ignore_eos=True), \
        offline_greedy(offline, prompt_ids[:3], 2, ignore_eos=True)
    decode = offline.engine.tokenizer.decode
    assert [c.text for c in sorted(plain.choices, key=lambda c: c.index)] == \
        [decode(prompt_ids) + first.text] * 2 + [decode(prompt_ids[:3]) + second.text] * 2
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=DEMO_MODEL, prompt=PROMPT, max_tokens=0)
    assert raised.value.body["param"] == "max_tokens" and "echo" in raised.value.body["message"]


@pytest.mark.parametrize("extra, param, words", [
    ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty", "frequency_penalty"),
    ({"logit_bias": {"65": 101}}, "logit_bias", "logit_bias"),
    ({"logit_bias": {"sixty-five": 1}}, "logit_bias", "must be token ids"),
    ({"logit_bias": {"-3": 1}}, "logit_bias", "must be token ids"),
    ({"logit_bias": {"1" * 4301: 1}}, "logit_bias", "must be token ids"),  # beyond what int() reads
    # Refused by the engine, which names the field too.
    ({"logit_bias": {"1000000": 1}}, "logit_bias", "logit_bias has token ids outside the vocabulary"),
    ({"stop_token_ids": [1000000]}, "stop_token_ids", "stop_token_ids has token ids outside the vocabulary"),
    ({"min_tokens": 2}, "min_tokens", "min_tokens must be in [0, max_tokens]"),
    ({"min_tokens": 1, "stop_token_ids": list(range(258))}, "min_tokens", "no token could be generated"),
    ({"stop": ["end", ""]}, "stop", "stop strings must be non-empty"),
])
def test_bad_penalties_and_biases_are_bad_requests(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=DEMO_MODEL, prompt="x", max_tokens=1, extra_body=extra)
    assert raised.value.body["param"] == param
    assert words in raised.value.body["message"]


def test_min_tokens_above_max_completion_tokens_names_the_field_the_chat_sent(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=DEMO_MODEL, messages=MESSAGES, max_completion_tokens=1,
                                       extra_body={"min_tokens": 2})
    assert raised.value.body["param"] == "min_tokens"
    assert "min_tokens must be in [0, max_completion_tokens] = [0, 1], got 2" in \
        raised.value.body["message"]


@pytest.mark.parametrize("extra, param, limit", [
    ({"stop": ["x"] * 33}, "stop", "length <= 32"),
    ({"stop": "y" * 1001}, "stop", "length <= 1000"),
    ({"stop": ["x", "y" * 1001]}, "stop[1]", "length <= 1000"),
    ({"stop_token_ids": [5] * 1025}, "stop_token_ids", "length <= 1024"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "length <= 1024"),
])
def test_stop_conditions_and_biases_are_bounded(client, extra, param, limit):
    """The engine checks them for every token of every choice, in the step all tenants share."""
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=DEMO_MODEL, prompt="x", max_tokens=1, extra_body=extra)
    assert raised.value.body["param"] == param and limit in raised.value.body["message"]


def test_the_most_stop_conditions_allowed_are_honoured(client, offline):
    greedy = offline_greedy(offline, PROMPT, 12, ignore_eos=True)
    full = greedy.text
    stop = next(c for c in full[:-1] if c != "\ufffd")  # complete before the last token
    never = [f"{i:02}{'z' * 998}" for i in range(31)]  # 1000 characters each
    unused = next(t for t in range(demo_config().vocab_size) if t not in greedy.output_token_ids)
    completion = client.completions.create(
        model=DEMO_MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[*never, stop],
        extra_body={"ignore_eos": True, "stop_token_ids": [unused] * 1024,
                    "logit_bias": {str(t): 0 for t in range(demo_config().vocab_size)}})
    choice = completion.choices[0]
    assert (choice.text, choice.finish_reason) == (full[:full.index(stop)], "stop")


def test_a_prompt_longer_than_the_context_is_refused_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=DEMO_MODEL, prompt="x" * 2100, max_tokens=1)
    assert "shorten the prompt" in raised.value.body["message"]
    assert raised.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=DEMO_MODEL, max_tokens=1,
                                       messages=[{"role": "user", "content": "x" * 2100}])
    assert "shorten the prompt" in raised.value.body["message"]
    assert raised.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=DEMO_MODEL, prompt=[5, 99999], max_tokens=1)
    assert "outside the vocabulary" in raised.value.body["message"]
    assert raised.value.body["param"] == "prompt"


def test_a_prompt_too_long_for_the_context_is_refused_before_anything_is_held(server, demo_engine):
    """As the engine words it, even for a tenant whose tpm could never hold the prompt: the
    context is what to fix. The prompts after it are never tokenized (see
    test_gateway_generation.py), and the call is not admitted."""
    name = "context-tests"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.new_tenant(name, tpm=1000),
                           max_retries=0)
    too_long = "x" * 30_000
    expected = (r"the prompt has 300\d\d tokens but this model accepts at most "
                f"{demo_engine.max_model_len - 1}; shorten the prompt")
    calls = [(lambda: client.completions.create(model=DEMO_MODEL, prompt=too_long, max_tokens=1),
              "prompt"),
             (lambda: client.completions.create(model=DEMO_MODEL, prompt=["hi", too_long] * 50,
                                                max_tokens=1), "prompt"),
             (lambda: client.chat.completions.create(
                 model=DEMO_MODEL, messages=[{"role": "user", "content": too_long}]), "messages")]
    for create, param in calls:
        with pytest.raises(openai.BadRequestError) as raised:
            create()
        body = raised.value.body
        assert body["param"] == param and re.fullmatch(expected, body["message"]), body
    usage = server.admin("GET", f"/admin/tenants/{name}").json()["usage"]
    assert (usage["reserved_tokens"], usage["tokens_in"], usage["requests"]) == (0, 0, 0)


def test_a_list_of_prompts_is_bounded_in_characters_before_any_is_tokenized(client):
    prompts = ["x" * 30_000] * 150  # each short enough to be tokenized, were it alone
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=DEMO_MODEL, prompt=prompts, max_tokens=1)
    body = raised.value.body
    assert body["param"] == "prompt"
    assert "the 150 prompts hold 4500000 characters in all" in body["message"]
    assert "at most 4194304" in body["message"]


def test_a_body_past_the_limit_is_a_413_before_it_is_read_whole(server, key, monkeypatch):
    from gateway import serving

    monkeypatch.setattr(serving, "MAX_BODY_BYTES", 1000)  # NOTE: the server runs in this process
    url, headers = server.url + "/v1/completions", {"Authorization": f"Bearer {key}"}
    body = {"model": DEMO_MODEL, "prompt": "x" * 900, "max_tokens": 1}
    assert httpx.post(url, headers=headers, json=body).status_code == 200
    declared = httpx.post(url, headers=headers, json={**body, "prompt": "x" * 1000})

    def chunked():  # no Content-Length: counted as it arrives
        yield b'{"model": "' + DEMO_MODEL.encode() + b'", "prompt": "'
        for _ in range(100):
            yield b"x" * 100
        yield b'"}'

    streamed = httpx.post(url, headers={**headers, "Content-Type": "application/json"},
                          content=chunked())
    for refused in (declared, streamed):
        assert refused.status_code == 413
        assert refused.json()["error"]["code"] == "body_too_large"
        assert "(1000 bytes)" in refused.json()["error"]["message"]


@pytest.mark.parametrize("field, items, element", [
    ("prompt", 8_000_000, b"[0]"),  # one-token prompts
    ("tools", 4_000_000, b"{}"),
    ("messages", 1_100_000, b'{"role": "user", "content": "a"}')])
def test_a_body_of_millions_of_arrays_or_objects_is_refused_before_it_is_decoded(
        server, key, field, items, element):
    """Decoding makes an object of each, in the event loop every tenant shares: 8 million
    one-token prompts took seconds of it (and gigabytes) before their number was checked."""
    path = "/v1/completions" if field == "prompt" else "/v1/chat/completions"
    body = (b'{"model": "' + DEMO_MODEL.encode() + b'", "max_tokens": 1, '
            b'"messages": [{"role": "user", "content": "hi"}], "'
            + field.encode() + b'": [' + b",".join([element] * items) + b"]}")
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    started = time.process_time()  # NOTE: CPU time, of the server too (it runs in this process)
    refused = httpx.post(server.url + path, headers=headers, content=body, timeout=120)
    cpu_seconds = time.process_time() - started
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", field)
    assert f"characters (arrays, objects, and those characters in strings), {items + 1} of them " \
           f"in '{field}'; a body holds at most 1048576" in error["message"]
    assert cpu_seconds < 1.5  # decoding the prompts alone took over 3 s


def test_a_chat_holds_at_most_2048_messages(client):
    messages = [{"role": "user", "content": "hi"}] * 2048
    for chat, refusal in [(messages, "shorten the prompt"),  # read: too long for the demo model
                          ([*messages, messages[0]], "length <= 2048")]:
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=DEMO_MODEL, messages=chat, max_tokens=1)
        assert raised.value.body["param"] == "messages"
        assert refusal in raised.value.body["message"]


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"model": "%s", "prompt": "hi", "x": %s}'),  # a field it ignores
    ("/v1/completions", b'{"model": "%s", "prompt": "hi", "user": %s}'),
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user"}], "metadata": %s}')])
def test_json_nested_past_the_depth_limit_is_a_400(server, key, path, body):
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    refused = httpx.post(server.url + path, headers=headers,
                         content=body % (DEMO_MODEL.encode(), _nested(100_000)))
    assert refused.status_code == 400, refused.text  # was a 500 (a RecursionError)
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"] == ("the request body nests arrays and objects too deeply to be read; "
                                "no field of this API nests more than a few levels")


def test_a_client_that_leaves_while_sending_its_body_is_a_499_not_a_failure(server, key, caplog):
    caplog.set_level(logging.INFO, logger="gateway.access")
    server.leave_while_sending("/v1/completions", {"Authorization": f"Bearer {key}",
                                                   "Content-Type": "application/json"},
                               b'{"model": "%s", "prompt": "' % DEMO_MODEL.encode(), 1000)
    assert logged_status(caplog, "POST", "/v1/completions") == 499  # was a 500
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []  # and its traceback


def test_prompts_refused_beside_others_leave_the_engine_serving(client):
    # The first prompt is refused while the second's request is still on its way to the engine:
    # that one is given up, which once killed the engine's thread after a few such calls.
    for _ in range(40):
        with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
            client.completions.create(model=DEMO_MODEL, prompt=[[99999], [5, 6, 7]], max_tokens=2)
    completion = client.completions.create(model=DEMO_MODEL, prompt="still here", max_tokens=2,
                                           timeout=30)
    assert completion.usage.completion_tokens == 2


def test_a_prompt_of_megabytes_is_refused_without_tokenizing_it(client):
    for create, field in [
            (lambda text: client.completions.create(model=DEMO_MODEL, prompt=text, max_tokens=1), "prompt"),
            (lambda text: client.chat.completions.create(
                model=DEMO_MODEL, messages=[{"role": "user", "content": text}], max_tokens=1), "messages")]:
        start = time.monotonic()
        with pytest.raises(openai.BadRequestError) as raised:
            create("word " * 800_000)  # ~10 s to tokenize
        assert time.monotonic() - start < 2.0
        assert raised.value.body["param"] == field
        assert "shorten the prompt" in raised.value.body["message"]


def test_chat_errors_name_the_field(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=DEMO_MODEL, messages=MESSAGES, top_logprobs=2)
    assert raised.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=DEMO_MODEL, messages=[])
    assert raised.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=DEMO_MODEL, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert raised.value.body["param"] == "messages[0].content"
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=DEMO_MODEL, messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text"}]}])
    assert raised.value.body["param"] == "messages[0].content[1].text"
    assert "a text part with no 'text'" in raised.value.body["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=DEMO_MODEL, messages=[
            *MESSAGES, {"role": "wizard", "content": "hi"}])
    assert raised.value.body["param"] == "messages[2].role"
    assert "one of system, developer, user, assistant" in raised.value.body["message"]


def test_malformed_json_is_a_bad_request(server, key):
    response = httpx.post(server.url + "/v1/completions", content=b"{not json",
                          headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    # A string that is not UTF-8 is the client's mistake too (not a 500 its SDK would retry).
    for path, body, auth in [("/v1/completions", b'{"model": "x", "prompt": "\xff\xfe"}', key),
                             ("/admin/tenants", b'{"name": "\xff"}', ADMIN_KEY)]:
        response = httpx.post(server.url + path, content=body, headers={"Authorization": f"Bearer {auth}"})
        assert response.status_code == 400 and "UTF-8" in response.json()["error"]["message"], path


def test_cached_tokens_count_only_what_earlier_calls_left_in_the_cache(client):
    """A call's choices share the blocks its first computes: that saved the call nothing (n=2 on
    a fresh prompt once said 128 of 129 tokens were cached)."""
    prompt = "A prompt no call has sent before, long enough for several KV blocks. " * 3
    for n in (2, 4):
        fresh = client.completions.create(model=DEMO_MODEL, prompt=f"{n} {prompt}", max_tokens=1,
                                          n=n)
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=DEMO_MODEL, prompt=f"2 {prompt}", max_tokens=1, n=2)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_cached_tokens_leave_out_what_a_prompt_repeated_in_the_same_call_computed(client):
    """A prompt sent several times in one call's list is computed once, and its repeats read its
    blocks: that saved the call nothing (three copies of a fresh prompt once said two were cached)."""
    prompt = "Another prompt no call has sent before, long enough for several KV blocks. " * 3

    def cached(prompts: str | list[str]) -> int:
        completion = client.completions.create(model=DEMO_MODEL, prompt=prompts, max_tokens=1)
        return completion.usage.prompt_tokens_details.cached_tokens

    assert cached([prompt, prompt, prompt]) == 0
    once = cached(prompt)
    assert once > 0
    assert cached(["Other text first. " + prompt, prompt, prompt]) == 2 * once


def test_tenants_never_hit_each_others_cached_prompts(server):
    """`cached_tokens` (and a faster first token) would tell one tenant what another had sent."""
    secret = "The board meets on Friday to approve the merger with Acme. " * 2  # several KV blocks

    def cached(key: str) -> int:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        completion = client.completions.create(model=DEMO_MODEL, prompt=secret, max_tokens=1)
        client.close()
        return completion.usage.prompt_tokens_details.cached_tokens

    alice, bob = server.new_tenant("cache-alice"), server.new_tenant("cache-bob")
    assert cached(alice) == 0
    assert cached(bob) == 0
    assert cached(alice) > 0  # a tenant's own prompts are still cached
    # Nor does a tenant made anew under a deleted one's name: it "starts from nothing".
    assert server.admin("DELETE", "/admin/tenants/cache-alice").status_code == 200
    assert cached(server.new_tenant("cache-alice")) == 0
