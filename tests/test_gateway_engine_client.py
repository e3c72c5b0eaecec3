"""The gateway over a scripted EngineClient: chat fallback, engine refusals and failures.

No torch here: the scripted engine is what a remote worker would be, the protocol and nothing more.
"""

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest

from gateway.engine_client import (AdapterInfo, AdapterRef, AdapterRejected, EngineFailure,
                                   GenerationChunk, RequestRejected, SamplingOptions, TokenLogprob)
from gateway.worker_api import GenerateBody, StreamLine
from tests.conftest import serve_gateway
from tests.helpers import IdleEngineParts

MODEL = "scripted"


class ScriptedEngine(IdleEngineParts):
    """Emits "A", "B", ... one token per chunk; fails or refuses when told to."""

    max_model_len = 64

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.options: list[SamplingOptions] = []
        self.fail_after: int | None = None
        self.refuse: str | None = None
        self.refuse_prompts_with: int | None = None  # refuse, a moment late, prompts with this id
        # Set, tokenizing waits for it (a long prompt's seconds, the GIL released).
        self.tokenized: threading.Event | None = None
        self.tokenizing = threading.Event()  # set while a prompt is tokenized

    tokenizer_key = "1, then bytes"

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.tokenizing.set()
        try:
            if self.tokenized is not None:
                self.tokenized.wait(60)
            return ([1] if add_special_tokens else []) + list(text.encode())
        finally:
            self.tokenizing.clear()

    def render_chat(self, messages: list[dict[str, str]]) -> str | None:
        return None  # no chat template: the gateway's plain transcript is used

    supports_adapters = False
    max_adapter_rank = 0

    async def check_adapter(self, folder: str) -> AdapterInfo:
        raise AdapterRejected("the scripted engine serves no adapters")

    async def generate(self, prompt_token_ids: list[int], options: SamplingOptions, *,
                       request_id: str, tenant: str | None = None,
                       adapter: AdapterRef | None = None) -> AsyncIterator[GenerationChunk]:
        self.prompts.append(prompt_token_ids)
        self.options.append(options)
        if self.refuse is not None:
            raise RequestRejected(self.refuse)
        if self.refuse_prompts_with in prompt_token_ids:
            # NOTE: after a wait, as a worker's refusal comes: the call's other requests (ready
            # tasks, which run before a timer's) have produced their first chunks by then.
            await asyncio.sleep(0.05)
            raise RequestRejected("the prompt holds a token the model does not have", "prompt")
        for i in range(options.max_tokens):
            if i == self.fail_after:
                raise EngineFailure("the device fell over")
            last = i == options.max_tokens - 1
            yield GenerationChunk(token_ids=[65 + i], text=chr(65 + i), logprobs=[],
                                  finished=last, finish_reason="length" if last else None,
                                  num_prompt_tokens=len(prompt_token_ids),
                                  num_output_tokens=i + 1, num_cached_tokens=0)


@pytest.fixture(scope="module")
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture(scope="module")
def scripted(engine, tmp_path_factory):
    with serve_gateway({MODEL: engine}, tmp_path_factory.mktemp("scripted")) as server:
        yield server, server.new_tenant("scripted")


@pytest.fixture(autouse=True)
def reset(engine):
    engine.fail_after, engine.refuse, engine.tokenized = None, None, None
    engine.refuse_prompts_with = None


def post(scripted, path: str, **body) -> httpx.Response:
    server, key = scripted
    return httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 4, **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_chat_without_a_template_uses_a_plain_transcript(scripted, engine):
    response = post(scripted, "/v1/chat/completions", messages=[
        {"role": "system", "content": "S"}, {"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}])
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "ABCD"
    assert engine.prompts[-1] == [1] + list(b"system: S\nuser: hi\nthere\nassistant:")


def test_the_gateway_answers_others_while_a_long_prompt_is_tokenized(scripted, engine):
    # NOTE: no clock, which a loaded machine outran: tokenizing goes on until the other calls are
    # answered (were it to hold the server up, they would time out).
    engine.tokenized = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool, httpx.Client(timeout=30) as client:
        slow = pool.submit(post, scripted, "/v1/completions", prompt="a long prompt")
        try:
            assert engine.tokenizing.wait(30)
            for _ in range(3):
                assert client.get(scripted[0].url + "/health").status_code == 200
                assert engine.tokenizing.is_set()
        finally:
            engine.tokenized.set()
        assert slow.result().status_code == 200


def test_a_refused_request_is_a_400_with_the_engine_reason(scripted, engine):
    engine.refuse = "the adapter is not loaded"
    for stream in (False, True):
        response = post(scripted, "/v1/completions", prompt="x", stream=stream)
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "the adapter is not loaded"


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_refused_for_one_prompt_bills_nothing_the_others_produced(scripted, engine, stream):
    """The client gets a 400 and none of the answers: it was billed the tokens of the prompts
    the engine ran before it refused the other, and counted a request against rpm."""
    server, key = scripted
    before = server.admin("GET", "/admin/tenants/scripted").json()["usage"]
    engine.refuse_prompts_with = ord("!")
    response = post(scripted, "/v1/completions", prompt=["fine", "bad!", "also fine"], stream=stream)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt"
    assert [len(p) for p in engine.prompts[-3:]] == [5, 5, 10]  # all three ran
    assert server.admin("GET", "/admin/tenants/scripted").json()["usage"] == before


def test_an_engine_failure_is_a_500_or_an_error_event(scripted, engine):
    engine.fail_after = 0
    before_first_token = post(scripted, "/v1/completions", prompt="x", stream=True)
    assert before_first_token.status_code == 500
    assert before_first_token.json()["error"]["code"] == "engine_failure"
    engine.fail_after = 2
    whole = post(scripted, "/v1/completions", prompt="x")
    assert whole.status_code == 500
    assert whole.json()["error"]["type"] == "server_error"
    streamed = post(scripted, "/v1/chat/completions", stream=True,
                    messages=[{"role": "user", "content": "x"}])
    assert streamed.status_code == 200
    events = [e.removeprefix("data: ") for e in streamed.text.split("\n\n") if e]
    assert '"code":"engine_failure"' in events[-2] and events[-1] == "[DONE]"
    assert '"content":"A"' in streamed.text and '"content":"B"' in streamed.text


def test_usage_counts_each_prompt_once_and_every_choice(scripted):
    response = post(scripted, "/v1/completions", prompt=["ab", "cde"], n=2, max_tokens=3)
    body = response.json()
    assert [c["text"] for c in body["choices"]] == ["ABC"] * 4
    assert body["usage"] == {"prompt_tokens": 3 + 4, "completion_tokens": 12,
                             "total_tokens": 19, "prompt_tokens_details": {"cached_tokens": 0},
                             "cost_usd": 0.0}


def test_sampling_fields_reach_the_engine_and_cross_to_a_worker_intact(scripted, engine):
    fields = dict(temperature=0.5, top_p=0.9, top_k=5, seed=3, min_tokens=1, repetition_penalty=1.2,
                  presence_penalty=-0.5, frequency_penalty=1.25, stop=["\n"], stop_token_ids=[2])
    response = post(scripted, "/v1/completions", prompt="x", logit_bias={"65": -100, "7": 2.5}, **fields)
    assert response.status_code == 200
    options = engine.options[-1]
    assert options == SamplingOptions(
        max_tokens=4, logprobs=None, logit_bias={65: -100.0, 7: 2.5},
        **{**fields, "stop": ("\n",), "stop_token_ids": (2,)})
    # A worker gets the options as JSON, whose keys are strings: the ids come back as ints.
    body = GenerateBody(model=MODEL, prompt_token_ids=[1], options=options, request_id="r")
    assert msgspec.json.decode(msgspec.json.encode(body), type=GenerateBody) == body
    # And its chunks come back with the prompt's logprobs (for echo) as they were.
    line = StreamLine(chunk=GenerationChunk(
        token_ids=[5], text="x", logprobs=[TokenLogprob(5, -0.5, [(5, -0.5)])], finished=True,
        finish_reason="length", num_prompt_tokens=3, num_output_tokens=1, num_cached_tokens=0,
        prompt_logprobs=[TokenLogprob(7, -1.5, [(2, -0.25)]), TokenLogprob(9, -3.0, [])]))
    assert msgspec.json.decode(msgspec.json.encode(line), type=StreamLine) == line


def test_a_worker_stream_keeps_alive_while_its_request_waits_and_closing_aborts_it(monkeypatch):
    """A worker answers at once and sends keepalives until the engine's first chunk (a request
    queued for minutes once looked like a dead worker); refusals and failures are lines."""
    import asyncio

    import gateway.worker
    from gateway.worker import _KeptAlive

    monkeypatch.setattr(gateway.worker, "KEEPALIVE_S", 0.05)
    chunk = GenerationChunk(token_ids=[65], text="A", logprobs=[], finished=True,
                            finish_reason="length", num_prompt_tokens=1, num_output_tokens=1,
                            num_cached_tokens=0)
    aborted = []
    answered: list[bytes] = []

    async def queued_then_answers():
        # NOTE: counted, not timed: a loop stalled past two keepalives sent only one in 0.3 s.
        while len(answered) < 3:
            await asyncio.sleep(0.01)
        yield chunk

    async def refused():
        raise RequestRejected("min_tokens must be in [0, max_tokens]", "min_tokens")
        yield chunk

    async def stuck():
        try:
            await asyncio.Event().wait()
            yield chunk
        finally:
            aborted.append(True)

    async def lines_of(stream, limit: int | None = None, lines: list[bytes] | None = None
                       ) -> list[bytes]:
        answer, lines = _KeptAlive(stream), [] if lines is None else lines
        try:
            async for line in answer.lines():
                lines.append(line)
                if len(lines) == limit:
                    break
        finally:
            await answer.close()
        return lines

    asyncio.run(lines_of(queued_then_answers(), lines=answered))
    assert set(answered[:-1]) == {b": keepalive\n\n"} and len(answered) >= 4
    assert msgspec.json.decode(answered[-1][6:], type=StreamLine) == StreamLine(chunk=chunk)
    [line] = asyncio.run(lines_of(refused()))
    rejected = msgspec.json.decode(line[6:], type=StreamLine).rejected
    assert (rejected.message, rejected.param) == ("min_tokens must be in [0, max_tokens]", "min_tokens")
    assert asyncio.run(lines_of(stuck(), limit=2)) == [b": keepalive\n\n"] * 2
    assert aborted == [True]  # the gateway went away: the engine request is aborted


def test_the_benchmarks_instant_engine_is_a_whole_engine_client(tmp_path):
    """benchmarks/bench_gateway.py measures the gateway over it: it must keep up with the protocol
    (it once lacked a method the gateway calls on every request, and every request failed)."""
    from benchmarks.instant_engine import INSTANT_MODEL, InstantEngine
    from gateway.engine_client import EngineClient

    missing = [name for name in dir(EngineClient) if not name.startswith("_")
               and not hasattr(InstantEngine, name)]
    assert missing == []
    with serve_gateway({INSTANT_MODEL: InstantEngine()}, tmp_path) as server:
        key = server.new_tenant("bench")
        health = httpx.get(server.url + "/health")
        reply = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": INSTANT_MODEL, "prompt": "hi", "max_tokens": 5})
    assert health.status_code == 200, health.text
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "Hello", reply.text
