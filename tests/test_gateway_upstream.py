"""UpstreamEngineClient: a front gateway serving models of real upstreams on loopback ports.

The upstream is a second Switchboard gateway over the demo engine and the scripted engines of
tests/test_gateway_routing.py; a tiny ASGI app stands for upstreams that never answer or stop
midway, and a closed port for one that is down. The front also serves the demo engine itself, as
the local first tier of routes that escalate to an upstream. The same upstream is also served
through its chat API, and a tiny ASGI app stands for a hosted chat-only API (OpenAI's stream
shape), recording what it was asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.demo import demo_config
from gateway.config import UpstreamSource, load_serve_config
from gateway.engine_client import (AdapterRejected, EngineFailure, SamplingOptions,
                                   UpstreamUnavailable)
from gateway.upstream import (CONTENT_ID, NAME_ID, ROLE_ID, RenderedChat,
                              UpstreamEngineClient, _PromptRatio, open_upstreams)
from routing.pricing import Price
from routing.routes import parse_routes
from tests.conftest import ADMIN_KEY, DEMO_MODEL, GatewayServer, run_server, serve_gateway
from tests.helpers import no_open_file_left
from tests.processes import free_port
from tests.test_cli import SWITCHBOARD, _wait_for_health
from tests.test_gateway_routing import PRICES, ScriptedTier, eventually

# The front's timeout for every upstream. NOTE: not less: under load a call served by the upstream
# once took over 1 s, which the hanging-upstream test counts on it beating.
TIMEOUT_S = 3.0
KEY_ENV, WRONG_KEY_ENV = "SB_TEST_UPSTREAM_KEY", "SB_TEST_WRONG_KEY"
WRONG_KEY = "sb-this-key-does-not-exist"
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
MIXED_PRICES = {"local": Price(1.0, 2.0), "demo": Price(10.0, 30.0), "demo-chat": Price(5.0, 15.0)}
PREFIX_TOKENS = 2  # what the mixed routes judge a stream on


@dataclass
class Upstream:
    server: GatewayServer
    key: str  # the front gateway's key there
    scripted: dict[str, ScriptedTier]


@pytest.fixture(scope="module")
def upstream(demo_engine, tmp_path_factory) -> Iterator[Upstream]:
    scripted = {name: ScriptedTier(name) for name in ("small", "large")}
    with serve_gateway({DEMO_MODEL: demo_engine, **scripted},
                       tmp_path_factory.mktemp("upstream")) as server:
        yield Upstream(server, server.new_tenant("front"), scripted)


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _silent(scope: Scope, receive: Receive, send: Send) -> None:
    """Takes the request, then never answers: the caller has to give up."""
    await _wait_for_disconnect(receive)


async def _stalled(scope: Scope, receive: Receive, send: Send) -> None:
    """Starts a streamed answer, then stops sending."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    first = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
    await send({"type": "http.response.body", "more_body": True,
                "body": f"data: {json.dumps(first)}\n\n".encode()})
    await _wait_for_disconnect(receive)


# What failing upstreams say: their internals, and a request that names their own address.
INTERNAL_ERROR = "internal error at 10.1.2.3:8000 /srv/vllm/worker.py line 88; org org-SECRETORG"
RATE_LIMITED = "Rate limit reached for org-SECRETORG on tokens per min"
REFUSED_HERE = "this server ({host}) takes prompts of at most 3 tokens"


def _failing(status: int, message: str) -> ASGIApp:
    """Answers every request with `status` and OpenAI's error body saying `message` (in which
    "{host}" is the address the request was sent to)."""

    async def answer(scope: Scope, receive: Receive, send: Send) -> None:
        host = dict(scope["headers"])[b"host"].decode()
        body = {"error": {"message": message.format(host=host), "type": "server_error"}}
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})

    return answer


def _logprob(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


# What OpenAI streams for the answer "ok" with logprobs and usage.
HOSTED_EVENTS = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "", "refusal": None},
                  "logprobs": None, "finish_reason": None}], "usage": None},
    {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None, "logprobs": {
        "content": [
            {**_logprob("o", -0.1), "top_logprobs": [_logprob("o", -0.1), _logprob("k", -2.5)]},
            {**_logprob("k", -0.2), "top_logprobs": [_logprob("k", -0.2), _logprob("o", -1.75)]}],
        "refusal": None}}], "usage": None},
    {"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}],
     "usage": None},
    {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13,
                              "prompt_tokens_details": {"cached_tokens": 4}}},
]


class HostedChat:
    """A hosted chat-only API: records each request (path, JSON body) and answers HOSTED_EVENTS."""

    def __init__(self):
        self.requests: list[tuple[str, dict]] = []
        self.events = HOSTED_EVENTS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        self.requests.append((scope["path"], json.loads(body)))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"".join(
            f"data: {json.dumps(e)}\n\n".encode() for e in self.events) + b"data: [DONE]\n\n"})


@pytest.fixture(scope="module")
def hosted() -> HostedChat:
    return HostedChat()


@pytest.fixture(scope="module")
def stalling(hosted) -> Iterator[str]:
    app = Starlette(routes=[Mount("/silent/v1", app=_silent), Mount("/stalled/v1", app=_stalled),
                            Mount("/hosted/v1", app=hosted),
                            Mount("/broken/v1", app=_failing(500, INTERNAL_ERROR)),
                            Mount("/busy/v1", app=_failing(429, RATE_LIMITED)),
                            Mount("/picky/v1", app=_failing(400, REFUSED_HERE))])
    with run_server(app) as url:
        yield url


@contextlib.contextmanager
def _closed_port() -> Iterator[int]:
    """A loopback port that refuses connections, kept so until the block ends: bound, so that no
    other server (or test) can take it meanwhile, and never listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.fixture(scope="module")
def front(upstream, stalling, demo_engine, tmp_path_factory) -> Iterator[tuple[GatewayServer, str]]:
    """The gateway under test and a tenant key for it."""
    with _closed_port() as closed_port:
        yield from _front(upstream, stalling, demo_engine, tmp_path_factory, closed_port)


def _front(upstream, stalling, demo_engine, tmp_path_factory,
           closed_port: int) -> Iterator[tuple[GatewayServer, str]]:
    url = upstream.server.url + "/v1"
    sources = {
        # A context larger than the upstream's, so that the upstream's own check refuses.
        "demo": UpstreamSource(url, DEMO_MODEL, KEY_ENV, TIMEOUT_S, max_model_len=1 << 16),
        "demo-chat": UpstreamSource(url, DEMO_MODEL, KEY_ENV, TIMEOUT_S, max_model_len=1 << 16,
                                    api="chat"),
        # Its context as it is, as an operator declares it.
        "demo-exact": UpstreamSource(url, DEMO_MODEL, KEY_ENV, TIMEOUT_S,
                                     max_model_len=demo_engine.max_model_len),
        "demo-chat-exact": UpstreamSource(url, DEMO_MODEL, KEY_ENV, TIMEOUT_S, api="chat",
                                          max_model_len=demo_engine.max_model_len),
        "hosted": UpstreamSource(stalling + "/hosted/v1", "chat-model", None, TIMEOUT_S,
                                 api="chat"),
        "small": UpstreamSource(url, "small", KEY_ENV, TIMEOUT_S),
        "large": UpstreamSource(url, "large", KEY_ENV, TIMEOUT_S),
        "locked": UpstreamSource(url, "small", WRONG_KEY_ENV, TIMEOUT_S),
        "silent": UpstreamSource(stalling + "/silent/v1", "any", None, TIMEOUT_S),
        "stalled": UpstreamSource(stalling + "/stalled/v1", "any", None, TIMEOUT_S),
        "down": UpstreamSource(f"http://127.0.0.1:{closed_port}/v1", "any", None, TIMEOUT_S),
        **{name: UpstreamSource(f"{stalling}/{name}/v1", "any", None, TIMEOUT_S)
           for name in ("broken", "busy", "picky")},
    }
    engines = open_upstreams(sources, {KEY_ENV: upstream.key, WRONG_KEY_ENV: WRONG_KEY})
    served = {"local": demo_engine, **engines}
    # The local demo model first, then the same model through the upstream (a byte tokenizer
    # with no <s> and no chat template): no token of this random model has probability 1 or 0.
    mixed = {"tiers": ["local", "demo"], "measure": "min_prob", "prefix_tokens": PREFIX_TOKENS}
    routes = parse_routes({
        "auto": {"tiers": ["small", "large"], "measure": "min_prob", "threshold": 0.5,
                 "prefix_tokens": 2},
        "fallback": {"tiers": ["silent", "large"], "threshold": 0.5},
        "escalating": {**mixed, "threshold": 1.0},
        "keeping": {**mixed, "threshold": 0.0},
        "escalating-chat": {**mixed, "tiers": ["local", "demo-chat"], "threshold": 1.0},
        "chat-first": {**mixed, "tiers": ["demo-chat", "local"], "threshold": 0.0},
        "hosted-first": {**mixed, "tiers": ["hosted", "local"], "threshold": 0.0},
    }, served)
    try:
        with serve_gateway(served, tmp_path_factory.mktemp("front"), prices=PRICES | MIXED_PRICES,
                           routes=routes, default_route="auto") as server:
            yield server, server.new_tenant("client")
    finally:
        for engine in engines.values():
            engine.close()


def post(url: str, key: str, path: str = "/v1/completions", **body) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30, headers={"Authorization": f"Bearer {key}"})


def events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: {")]


def chat(url: str, key: str, **body) -> httpx.Response:
    return post(url, key, "/v1/chat/completions", **body)


def assert_same_logprobs(got: list[dict], expected: list[dict]) -> None:
    """Chat logprobs alike: the same tokens and alternatives, and logprobs up to float rounding
    (the engine may read a prompt it has seen from its prefix cache, in other batch shapes)."""

    def split(content: list[dict]) -> tuple[list, list[float]]:
        tokens = [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in content]
        values = [v for e in content
                  for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))]
        return tokens, values

    (got_tokens, got_values), (tokens, values) = split(got), split(expected)
    assert got_tokens == tokens and got_values == pytest.approx(values, abs=1e-4)


def test_an_upload_for_an_upstream_model_is_refused_saying_it_runs_no_adapters(front):
    """An upstream runs models of its own: the refusal says to upload the adapter for a model
    this server runs, not to restart anything with --max-loras (which would not help)."""
    server, key = front

    def upload_for(base_model: str) -> httpx.Response:
        return httpx.post(server.url + "/v1/adapters", data={"name": "mine", "base_model": base_model},
                          files={"adapter_config.json": ("adapter_config.json", b"{}"),
                                 "adapter_model.safetensors": ("adapter_model.safetensors", b"")},
                          headers={"Authorization": f"Bearer {key}"}, timeout=30)

    refused = upload_for("small")
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("adapters_not_served", "base_model")
    assert error["message"] == (
        "'small' is served by an upstream API, which runs none of this gateway's adapters: upload "
        "the adapter for a base model this server runs itself; the base models you may upload "
        "adapters for are local")
    # Nor are upstream models named as those to upload for (they were, the advice refused).
    refused = upload_for("typo")
    assert refused.status_code == 400 and refused.json()["error"]["message"] == (
        "unknown base model 'typo'; the base models you may upload adapters for are local")


def test_greedy_answers_and_usage_equal_the_upstream_s(front, upstream):
    server, key = front
    engine = server.app.state.gateway.engines["demo"]
    generated_before = engine.stats().num_generation_tokens  # the module's server's, so far
    body = {"prompt": "Hello there", "logprobs": 2, **GREEDY}
    direct = post(upstream.server.url, upstream.key, model=DEMO_MODEL, **body).json()
    proxied = post(server.url, key, model="demo", **body).json()
    assert proxied["choices"][0] == direct["choices"][0]  # text, logprobs, finish reason
    assert proxied["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"] != len("Hello there")
    assert proxied["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"] == 8

    streamed = events(post(server.url, key, model="demo", stream=True,
                           stream_options={"include_usage": True}, **body))
    assert "".join(e["choices"][0]["text"] for e in streamed if e["choices"]) == \
        direct["choices"][0]["text"]
    assert streamed[-1]["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert streamed[-1]["usage"]["completion_tokens"] == 8

    # A chat reaches the upstream as the gateway's plain transcript.
    chat = post(server.url, key, "/v1/chat/completions", model="demo",
                messages=[{"role": "user", "content": "hi"}], **GREEDY).json()
    transcript = post(upstream.server.url, upstream.key, model=DEMO_MODEL,
                      prompt="user: hi\nassistant:", **GREEDY).json()
    assert chat["choices"][0]["message"]["content"] == transcript["choices"][0]["text"]
    # NOTE: polled: a request leaves the count once its stream is closed, which may be just after
    # the client has read the last bytes.
    assert eventually(lambda: engine.stats().num_running == 0)
    assert engine.stats().num_generation_tokens - generated_before == 3 * 8


@pytest.mark.parametrize("stream", [False, True])
def test_each_choice_of_an_upstream_call_pays_its_prompt(front, upstream, stream):
    """The gateway asks the upstream once per choice, and the upstream bills each its prompt:
    the call was billed (and held) the prompt once, and the operator paid the rest."""
    server, key = front
    name = f"choices-{stream}"
    tenant_key = server.new_tenant(name)
    body = {"prompt": "Hello there", **GREEDY}
    direct = post(upstream.server.url, upstream.key, model=DEMO_MODEL, **body).json()
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    answer = post(server.url, tenant_key, model="demo", n=3, **body)
    usage = events(answer)[-1]["usage"] if stream else answer.json()["usage"]
    assert usage["prompt_tokens"] == 3 * direct["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == 3 * 8
    billed = server.settled_usage(name)
    assert (billed["tokens_in"], billed["tokens_out"]) == (usage["prompt_tokens"], 3 * 8)
    assert billed["spend_usd"] == pytest.approx(usage["cost_usd"])


def test_leaving_a_stream_early_stops_the_upstream_request(front, upstream):
    server, key = front

    def tokens_out() -> int:
        return upstream.server.admin("GET", "/admin/tenants/front").json()["usage"]["tokens_out"]

    before = tokens_out()
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "demo", "prompt": "hi", "max_tokens": 1000,
                            "ignore_eos": True, "stream": True}) as response:
        next(line for line in response.iter_lines() if line.startswith("data: {"))
    deadline = time.monotonic() + 10
    while tokens_out() == before and time.monotonic() < deadline:  # billed once it stopped
        time.sleep(0.05)
    assert 0 < tokens_out() - before < 1000


def test_a_route_over_upstream_tiers_judges_their_logprobs(front, upstream):
    server, key = front
    kept = post(server.url, key, model="auto", prompt="easy one", max_tokens=4)
    assert kept.json()["choices"][0]["text"] == "ssss"
    assert float(kept.headers["x-switchboard-score"]) == pytest.approx(0.9)
    escalated = post(server.url, key, model="auto", prompt="hard one", max_tokens=4)
    assert escalated.json()["choices"][0]["text"] == "llll"
    assert escalated.headers["x-switchboard-escalated"] == "true"
    assert float(escalated.headers["x-switchboard-score"]) == pytest.approx(0.2)
    expected = PRICES["small"].cost(8, 4) + PRICES["large"].cost(8, 4)  # the upstream's usage
    assert escalated.json()["usage"]["cost_usd"] == pytest.approx(expected)

    # The small tier is held while the large one starts, its answer read on: its upstream makes 4
    # tokens, then waits to be aborted; it is billed those the gateway read of them by the time the
    # large tier's first token came (the last ones may still be on their way), and its prompt
    # as its bytes (here as many as its tokens), as its usage never came.
    small, large = upstream.scripted["small"], upstream.scripted["large"]
    small.stall_after, large.start_after = 4, small.stalled
    try:
        streamed = events(post(server.url, key, model="auto", prompt="hard one", max_tokens=6,
                               stream=True, stream_options={"include_usage": True}))
    finally:
        small.stall_after = large.start_after = None
        small.stalled.clear()
    assert "".join(e["choices"][0]["text"] for e in streamed if e["choices"]) == "llllll"
    cost = streamed[-1]["usage"]["cost_usd"]
    small_output = round((cost - PRICES["small"].cost(8, 0) - PRICES["large"].cost(8, 6))
                         / PRICES["small"].cost(0, 1))
    assert 2 <= small_output <= 4  # its judged prefix, at least
    assert cost == pytest.approx(PRICES["small"].cost(8, small_output) + PRICES["large"].cost(8, 6))
    assert eventually(lambda: server.app.state.gateway.engines["small"].stats().num_running == 0)


FAILED = ("the upstream serving '{}' failed on this request (the gateway's operator can see why "
          "in its log); try again later")
UNAVAILABLE = "the upstream serving '{}' is unavailable or did not answer in time; try again later"


def assert_upstream_error(response: httpx.Response, model: str, is_unavailable: bool) -> None:
    """The tenant learns which model failed and whether to retry, nothing of the upstream."""
    status, code, message = (503, "upstream_unavailable", UNAVAILABLE) if is_unavailable \
        else (502, "upstream_failure", FAILED)
    assert response.status_code == status
    assert response.json()["error"] == {"message": message.format(model), "type": "server_error",
                                        "param": None, "code": code}
    assert response.headers.get("retry-after") == ("2" if is_unavailable else None)


def warnings(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records
                     if r.name == "gateway.upstream" and r.levelno == logging.WARNING)


def test_failing_upstreams_tell_tenants_which_model_failed_and_the_log_what_to_fix(
        front, upstream, caplog):
    server, key = front
    with caplog.at_level(logging.WARNING, logger="gateway.upstream"):
        locked = post(server.url, key, model="locked", prompt="easy one")
        broken = post(server.url, key, model="broken", prompt="hi")
        busy = post(server.url, key, model="busy", prompt="hi")
        started = time.monotonic()
        down = post(server.url, key, model="down", prompt="hi")
        assert time.monotonic() - started < TIMEOUT_S
    for response, model, is_unavailable in [(locked, "locked", False), (broken, "broken", False),
                                            (busy, "busy", True), (down, "down", True)]:
        assert_upstream_error(response, model, is_unavailable)
    logged = warnings(caplog)
    assert f"'locked' ({upstream.server.url}) refused the gateway's credentials (401: " in logged
    assert f"check the key in ${WRONG_KEY_ENV}" in logged
    assert "'broken' (http://127.0.0.1:" in logged and f"answered 500: {INTERNAL_ERROR}" in logged
    assert f"answered 429: {RATE_LIMITED}" in logged
    assert "'down' (http://127.0.0.1:" in logged and "failed: ConnectError" in logged
    assert WRONG_KEY not in logged and upstream.key not in logged


def test_an_upstream_a_gateway_out_of_open_files_cannot_reach_is_logged_as_that(upstream, caplog):
    engine = UpstreamEngineClient("small", UpstreamSource(upstream.server.url + "/v1", "small"),
                                  upstream.key)

    async def call() -> None:
        # NOTE: the limit lowered inside the event loop, which needs files of its own to start.
        with no_open_file_left(), pytest.raises(UpstreamUnavailable):
            async for _ in engine.generate([104, 105], SamplingOptions(max_tokens=2),
                                           request_id="no-file-left"):
                pass

    try:
        with caplog.at_level(logging.WARNING, logger="gateway.upstream"):
            asyncio.run(call())
    finally:
        engine.close()
    # Else the log read as the upstream refusing connections, sending its operator there.
    assert "this gateway is out of open files: raise its open-files limit" in warnings(caplog)


def test_an_upstream_s_refusal_of_the_request_reaches_the_tenant_without_its_address(front):
    server, key = front
    too_long = post(server.url, key, model="demo", prompt="hi", max_tokens=1 << 15)
    assert too_long.status_code == 400  # the upstream's own context check, in its words
    message = too_long.json()["error"]["message"]
    assert message.startswith("the upstream serving 'demo' refused the request: ")
    assert "maximum context length" in message and "127.0.0.1" not in message
    picky = post(server.url, key, model="picky", prompt="hi")
    assert picky.status_code == 400 and picky.json()["error"]["message"] == \
        "the upstream serving 'picky' refused the request: " + REFUSED_HERE.format(host="<upstream>")
    as_ids = post(server.url, key, model="demo", prompt=[300, 1])
    assert as_ids.status_code == 400 and "UTF-8 bytes" in as_ids.json()["error"]["message"]


def test_hanging_upstreams_time_out_and_a_route_falls_back_while_others_are_served(front, caplog):
    server, key = front

    def timed(**body) -> tuple[httpx.Response, float]:
        started = time.monotonic()
        return post(server.url, key, **body), time.monotonic() - started

    with ThreadPoolExecutor(4) as pool:
        silent = pool.submit(timed, model="silent", prompt="hi")
        stalled = pool.submit(timed, model="stalled", prompt="hi")
        stalled_stream = pool.submit(timed, model="stalled", prompt="hi", stream=True)
        fallback = pool.submit(timed, model="fallback", prompt="easy one", max_tokens=4)
        served, took = timed(model="small", prompt="easy one", max_tokens=4)
        assert served.status_code == 200 and took < TIMEOUT_S and not silent.done()
        for (response, took), model in ((silent.result(), "silent"), (stalled.result(), "stalled")):
            assert TIMEOUT_S <= took < TIMEOUT_S + 3
            assert_upstream_error(response, model, is_unavailable=True)
            assert f"'{model}' (http://127.0.0.1:" in warnings(caplog)
        assert f"timed out: ReadTimeout after {TIMEOUT_S:g} s" in warnings(caplog)
        response, _ = stalled_stream.result()
        texts = events(response)
        assert texts[0]["choices"][0]["text"] == "x"
        # The stream ends with the error
        assert texts[-1]["error"] == {"message": UNAVAILABLE.format("stalled"), "type": "server_error",
                                      "param": None, "code": "upstream_unavailable"}
        response, took = fallback.result()
    assert response.status_code == 200 and response.json()["model"] == "large"
    assert response.headers["x-switchboard-score"] == "none" and took >= TIMEOUT_S


def test_the_client_maps_ids_and_closes_for_good(upstream):
    engine = UpstreamEngineClient("small", UpstreamSource(upstream.server.url + "/v1", "small"))
    ids = engine.tokenize("naïve")
    assert bytes(ids).decode() == "naïve" and engine.token_text(ids[0]) == "n"
    assert engine.supports_adapters is False and engine.render_chat([]) is None
    with pytest.raises(AdapterRejected):
        asyncio.run(engine.check_adapter("/any"))
    engine.close()
    engine.close()

    async def first_chunk():
        return await anext(engine.generate(ids, SamplingOptions(), request_id="r"))

    with pytest.raises(EngineFailure, match="closed"):
        asyncio.run(first_chunk())


def test_serve_builds_upstreams_from_the_config_file_and_closes_them(upstream, tmp_path):
    config = tmp_path / "switchboard.toml"
    config.write_text(f'[models.remote]\nupstream = "{upstream.server.url}/v1"\n'
                      f'upstream_model = "large"\napi_key_env = "{KEY_ENV}"\ntimeout_s = 5\n'
                      'price_input = 10\nprice_output = 20\ntier = 1\n'
                      f'[models.remote-chat]\nupstream = "{upstream.server.url}/v1"\n'
                      f'upstream_model = "large"\nupstream_api = "chat"\n'
                      f'api_key_env = "{KEY_ENV}"\n')
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, KEY_ENV: upstream.key, "SWITCHBOARD_ADMIN_KEY": ADMIN_KEY,
           "SWITCHBOARD_HOME": str(tmp_path / "home")}
    process = subprocess.Popen(SWITCHBOARD + ["serve", "--config", str(config), "--port", str(port)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_health(url, process)
        server = GatewayServer(url, ADMIN_KEY, None)
        key = server.new_tenant("cli")
        assert [m["id"] for m in httpx.get(url + "/v1/models", headers={
            "Authorization": f"Bearer {key}"}).json()["data"]] == ["remote", "remote-chat"]
        answer = post(url, key, model="remote", prompt="easy one", max_tokens=3).json()
        assert answer["choices"][0]["text"] == "lll"
        assert answer["usage"]["cost_usd"] == pytest.approx(PRICES["large"].cost(8, 3))
        answer = chat(url, key, model="remote-chat", max_tokens=3,
                      messages=[{"role": "user", "content": "easy one"}]).json()
        assert answer["choices"][0]["message"]["content"] == "lll"
    finally:
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0 and "Traceback" not in stderr, stderr
    assert upstream.key not in stderr


def answered_by(response: httpx.Response) -> tuple[str, str]:
    """The tier that answered a route's call, and whether the route escalated to it."""
    return response.headers["x-switchboard-model"], response.headers["x-switchboard-escalated"]


def mixed_cost(local: tuple[int, int], demo: tuple[int, int] | None = None,
               upstream: str = "demo") -> float:
    """What a mixed route's call costs: each tier's (prompt, output) tokens at its own price."""
    return MIXED_PRICES["local"].cost(*local) + (MIXED_PRICES[upstream].cost(*demo) if demo else 0)


def assert_billed_a_held_local_tier(cost: float, num_local: int, demo: tuple[int, int],
                                    upstream: str = "demo") -> None:
    """That a streamed call escalated from the local tier to `upstream` cost `cost`: the local
    tier is judged on its prefix, then held (its answer read on) until the upstream's first token,
    and billed every token its engine made by then (how many, the race between them decides)."""
    local_output = round((cost - mixed_cost((num_local, 0), demo, upstream))
                         / MIXED_PRICES["local"].cost(0, 1))
    assert PREFIX_TOKENS <= local_output <= GREEDY["max_tokens"]
    assert cost == pytest.approx(mixed_cost((num_local, local_output), demo, upstream))


def test_a_route_escalates_from_a_local_model_to_an_upstream(front, upstream, demo_engine):
    server, key = front
    body = {"prompt": "Hello there", "logprobs": 2, **GREEDY}
    direct = post(upstream.server.url, upstream.key, model=DEMO_MODEL, **body).json()
    num_local = len(demo_engine.tokenize("Hello there"))  # with <s>; here the upstream's too
    escalated = post(server.url, key, model="escalating", **body)
    assert escalated.status_code == 200, escalated.text
    assert answered_by(escalated) == ("demo", "true")
    answer = escalated.json()
    assert answer["model"] == "demo"
    assert answer["choices"][0] == direct["choices"][0]  # logprobs named by the upstream's tokens
    assert answer["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert answer["usage"]["cost_usd"] == pytest.approx(
        mixed_cost((num_local, 8), (direct["usage"]["prompt_tokens"], 8)))

    streamed = post(server.url, key, model="escalating", stream=True,
                    stream_options={"include_usage": True}, **body)
    assert answered_by(streamed) == ("demo", "true")
    chunks = events(streamed)
    assert "".join(e["choices"][0]["text"] for e in chunks if e["choices"]) == \
        direct["choices"][0]["text"]
    assert_billed_a_held_local_tier(chunks[-1]["usage"]["cost_usd"], num_local,
                                    (direct["usage"]["prompt_tokens"], 8))


def test_a_route_keeps_its_local_answer(front, demo_engine):
    server, key = front
    num_local = len(demo_engine.tokenize("Hello there"))
    local = post(server.url, key, model="local", prompt="Hello there", **GREEDY).json()
    kept = post(server.url, key, model="keeping", prompt="Hello there", **GREEDY)
    assert answered_by(kept) == ("local", "false")
    assert kept.json()["choices"][0]["text"] == local["choices"][0]["text"]
    assert kept.json()["usage"]["prompt_tokens"] == num_local
    assert kept.json()["usage"]["cost_usd"] == pytest.approx(mixed_cost((num_local, 8)))

    streamed = post(server.url, key, model="keeping", prompt="Hello there", stream=True,
                    **GREEDY)
    assert answered_by(streamed) == ("local", "false")
    assert "".join(e["choices"][0]["text"] for e in events(streamed)) == \
        local["choices"][0]["text"]


def test_a_chat_reaches_each_tier_as_that_model_reads_it(front, upstream, demo_engine):
    server, key = front
    messages = [{"role": "user", "content": "hi"}]
    # The local model reads its chat template, the upstream the gateway's plain transcript.
    num_local = len(demo_engine.tokenize(demo_engine.render_chat(messages),
                                         add_special_tokens=False))
    local = post(server.url, key, "/v1/chat/completions", model="local", messages=messages,
                 **GREEDY).json()
    transcript = post(upstream.server.url, upstream.key, model=DEMO_MODEL,
                      prompt="user: hi\nassistant:", **GREEDY).json()
    assert local["choices"][0]["message"]["content"] != transcript["choices"][0]["text"]

    kept = post(server.url, key, "/v1/chat/completions", model="keeping", messages=messages,
                **GREEDY).json()
    assert kept["choices"][0]["message"]["content"] == local["choices"][0]["message"]["content"]
    assert kept["usage"]["prompt_tokens"] == num_local
    escalated = post(server.url, key, "/v1/chat/completions", model="escalating",
                     messages=messages, **GREEDY).json()
    assert escalated["choices"][0]["message"]["content"] == transcript["choices"][0]["text"]
    num_upstream = transcript["usage"]["prompt_tokens"]
    assert escalated["usage"]["prompt_tokens"] == num_upstream != num_local
    assert escalated["usage"]["cost_usd"] == pytest.approx(
        mixed_cost((num_local, 8), (num_upstream, 8)))


def test_token_ids_reach_only_routes_whose_tiers_share_a_tokenizer(front):
    server, key = front
    mixed = post(server.url, key, model="escalating", prompt=list(b"Hello"), max_tokens=2)
    assert mixed.status_code == 400
    error = mixed.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "prompt")
    assert "send the prompt as text" in error["message"] and "local, demo" in error["message"]
    shared = post(server.url, key, model="auto", prompt=list(b"easy one"), max_tokens=4)
    assert shared.status_code == 200 and shared.json()["choices"][0]["text"] == "ssss"
    # An upstream reads ids as UTF-8 bytes: others are the prompt's fault (param was null).
    not_bytes = post(server.url, key, model="demo", prompt=[1000, 2000], max_tokens=2)
    error = not_bytes.json()["error"]
    assert (not_bytes.status_code, error["param"]) == (400, "prompt"), error
    assert "send the prompt as text" in error["message"]


def test_token_ids_in_sampling_options_reach_only_routes_whose_tiers_share_a_tokenizer(front):
    server, key = front
    for options in ({"logit_bias": {"115": 5}}, {"stop_token_ids": [115]}):
        mixed = post(server.url, key, model="escalating", prompt="Hello", max_tokens=2, **options)
        assert mixed.status_code == 400
        error = mixed.json()["error"]
        assert error["param"] == next(iter(options)) and "different tokenizers" in error["message"]
    # One upstream serves both tiers of 'auto' (scripted models, which answer alike whatever the bias).
    shared = post(server.url, key, model="auto", prompt="easy one", max_tokens=4, logit_bias={"115": 5})
    assert shared.status_code == 200 and shared.json()["choices"][0]["text"] == "ssss"


def test_penalties_and_logit_bias_reach_the_upstream_as_they_are(front, upstream, hosted):
    server, key = front
    options = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "logit_bias": {"7": -100, "9": 3}}
    body = {"prompt": "Hello there", "logprobs": 0, **GREEDY, **options}
    direct = post(upstream.server.url, upstream.key, model=DEMO_MODEL, **body).json()
    plain = post(upstream.server.url, upstream.key, model=DEMO_MODEL, prompt="Hello there", **GREEDY).json()
    proxied = post(server.url, key, model="demo", **body).json()
    assert proxied["choices"][0]["text"] == direct["choices"][0]["text"] != plain["choices"][0]["text"]
    post(server.url, key, model="hosted", prompt="hi", max_tokens=2, **options)
    sent = hosted.requests[-1][1]
    assert {name: sent[name] for name in options} == options


def test_echo_through_an_upstream_puts_the_prompt_first_but_has_no_prompt_logprobs(front, upstream):
    server, key = front
    direct = post(upstream.server.url, upstream.key, model=DEMO_MODEL, prompt="Hello there", **GREEDY).json()
    echoed = post(server.url, key, model="demo", prompt="Hello there", echo=True, **GREEDY).json()
    assert echoed["choices"][0]["text"] == "Hello there" + direct["choices"][0]["text"]
    refused = post(server.url, key, model="demo", prompt="Hello there", echo=True, logprobs=1, **GREEDY)
    assert refused.status_code == 400 and "echo with logprobs" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "echo"
    # A route echoes the prompt as the model that answers read it.
    kept = post(server.url, key, model="keeping", prompt="Hello there", echo=True, logprobs=0, **GREEDY).json()
    local = post(server.url, key, model="local", prompt="Hello there", echo=True, logprobs=0, **GREEDY).json()
    assert kept["choices"][0]["text"] == local["choices"][0]["text"]
    kept_logprobs, local_logprobs = kept["choices"][0]["logprobs"], local["choices"][0]["logprobs"]
    assert kept_logprobs["tokens"] == local_logprobs["tokens"]
    assert kept_logprobs["token_logprobs"][0] is None
    assert kept_logprobs["token_logprobs"][1:] == pytest.approx(local_logprobs["token_logprobs"][1:], abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_a_route_leaves_out_a_tier_that_refuses_the_call_s_options(front, upstream, hosted, stream):
    """An upstream cannot score an echoed prompt: a cascade that would escalate into it answers
    with its local tier (it once ran and billed that tier, then answered 400), and a call that no
    tier of a route serves is refused before anything runs."""
    server, key = front
    name = f"echo-{stream}"
    tenant_key = server.new_tenant(name)
    body = {"prompt": "Hello there", "echo": True, "logprobs": 0, **GREEDY}
    local = post(server.url, key, model="local", **body).json()
    kept = post(server.url, tenant_key, model="escalating", stream=stream, **body)
    assert kept.status_code == 200, kept.text
    assert answered_by(kept) == ("local", "false")
    text = "".join(e["choices"][0]["text"] for e in events(kept)) if stream else \
        kept.json()["choices"][0]["text"]
    assert text == local["choices"][0]["text"]
    num_local = local["usage"]["prompt_tokens"]
    usage = server.settled_usage(name)
    assert (usage["tokens_in"], usage["tokens_out"]) == (num_local, 8)
    assert usage["spend_usd"] == pytest.approx(mixed_cost((num_local, 8)))
    # An upstream first tier is left out, not escalated past: it is never asked.
    num_hosted_requests = len(hosted.requests)
    skipped = post(server.url, key, model="hosted-first", stream=stream, **body)
    assert answered_by(skipped) == ("local", "false")
    assert "x-switchboard-score" not in skipped.headers and len(hosted.requests) == num_hosted_requests

    started = {model: len(engine.started) for model, engine in upstream.scripted.items()}
    refused = post(server.url, tenant_key, model="auto", stream=stream, **body)  # upstreams only
    error = refused.json()["error"]
    assert (refused.status_code, error["param"]) == (400, "echo"), error
    assert "echo with logprobs" in error["message"]
    assert {model: len(engine.started) for model, engine in upstream.scripted.items()} == started
    assert server.settled_usage(name) == usage


@pytest.mark.parametrize("stream", [False, True])
def test_token_ids_in_logprobs_are_refused_for_an_upstream_and_a_route_leaves_it_out(front, stream):
    """An upstream's logprobs name tokens by text: the ids were this gateway's own, which the
    model (and logit_bias, which reaches it) reads as other tokens."""
    server, key = front
    as_ids = {"logprobs": 1, "return_tokens_as_token_ids": True, "stream": stream, **GREEDY}
    refused = post(server.url, key, model="demo", prompt="Hello there", **as_ids)
    error = refused.json()["error"]
    assert (refused.status_code, error["param"]) == (400, "return_tokens_as_token_ids"), error
    assert "'demo' is served by an upstream API" in error["message"]
    refused = chat(server.url, key, model="demo-chat", messages=SHORT_CHAT, max_tokens=4,
                   logprobs=True, return_tokens_as_token_ids=True, stream=stream)
    assert (refused.status_code, refused.json()["error"]["param"]) == \
        (400, "return_tokens_as_token_ids")
    # Without logprobs the option changes nothing, and the upstream answers.
    kept = post(server.url, key, model="demo", prompt="Hello there", max_tokens=4,
                return_tokens_as_token_ids=True)
    assert kept.status_code == 200, kept.text
    # A route that would escalate into the upstream answers with its local tier.
    routed = post(server.url, key, model="escalating", prompt="Hello there", **as_ids)
    assert answered_by(routed) == ("local", "false")
    local = post(server.url, key, model="local", prompt="Hello there", **as_ids)
    if stream:
        tokens = [[t for e in events(answer) for t in e["choices"][0]["logprobs"]["tokens"]]
                  for answer in (routed, local)]
    else:
        tokens = [answer.json()["choices"][0]["logprobs"]["tokens"] for answer in (routed, local)]
    assert tokens[0] == tokens[1] and all(t.startswith("token_id:") for t in tokens[0])


def test_each_tier_checks_its_own_context(front, demo_engine):
    server, key = front
    max_tokens = demo_engine.max_model_len  # too many for the local model, not for 'demo''s
    alone = post(server.url, key, model="local", prompt="hi", max_tokens=max_tokens)
    assert alone.status_code == 400 and alone.json()["error"]["param"] == "max_tokens"
    # The route escalates past the local tier; the upstream's own check then refuses it.
    routed = post(server.url, key, model="keeping", prompt="hi", max_tokens=max_tokens)
    assert routed.status_code == 400
    assert routed.json()["error"]["message"].startswith("the upstream serving 'demo'")


CHAT = [{"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "naïve?", "name": "ann"},
        {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Why?"}]


def test_a_chat_upstream_answers_a_chat_as_the_upstream_does(front, upstream):
    server, key = front
    body = {"messages": CHAT, "logprobs": True, "top_logprobs": 2, **GREEDY}
    direct = chat(upstream.server.url, upstream.key, model=DEMO_MODEL, **body).json()
    proxied = chat(server.url, key, model="demo-chat", **body).json()
    choice, expected = proxied["choices"][0], direct["choices"][0]
    assert (choice["message"], choice["finish_reason"]) == (expected["message"], "length")
    assert_same_logprobs(choice["logprobs"]["content"], expected["logprobs"]["content"])
    assert [len(e["top_logprobs"]) for e in choice["logprobs"]["content"]] == [2] * 8
    assert proxied["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert proxied["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"] == 8

    streamed = events(chat(server.url, key, model="demo-chat", stream=True,
                           stream_options={"include_usage": True}, **body))
    deltas = [e["choices"][0] for e in streamed if e["choices"]]
    assert "".join(d["delta"].get("content", "") for d in deltas) == \
        direct["choices"][0]["message"]["content"]
    assert_same_logprobs([lp for d in deltas if d["logprobs"] for lp in d["logprobs"]["content"]],
                         expected["logprobs"]["content"])
    assert deltas[-1]["finish_reason"] == "length"
    assert (streamed[-1]["usage"]["prompt_tokens"], streamed[-1]["usage"]["completion_tokens"]) == \
        (direct["usage"]["prompt_tokens"], 8)
    assert eventually(lambda: server.app.state.gateway.engines["demo-chat"].stats().num_running == 0)


def test_a_chat_upstream_answers_a_plain_prompt_as_one_user_message(front, upstream):
    server, key = front
    messages = [{"role": "user", "content": "Hello there"}]
    direct = chat(upstream.server.url, upstream.key, model=DEMO_MODEL, messages=messages,
                  logprobs=True, top_logprobs=2, **GREEDY).json()
    proxied = post(server.url, key, model="demo-chat", prompt="Hello there", logprobs=2,
                   **GREEDY).json()
    assert proxied["choices"][0]["text"] == direct["choices"][0]["message"]["content"]
    logprobs = proxied["choices"][0]["logprobs"]
    assert_same_logprobs([{"token": token, "logprob": logprob, "top_logprobs": [
        {"token": t, "logprob": v} for t, v in top.items()]} for token, logprob, top in zip(
            logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"])],
        direct["choices"][0]["logprobs"]["content"])
    assert proxied["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert proxied["usage"]["completion_tokens"] == 8
    as_ids = post(server.url, key, model="demo-chat", prompt=list(b"Hello there"), **GREEDY).json()
    assert as_ids["choices"][0]["text"] == proxied["choices"][0]["text"]


def test_chat_upstream_logprobs_name_the_upstream_s_tokens_and_alternatives(front, upstream):
    server, key = front
    body = {"messages": CHAT, "logprobs": True, "top_logprobs": 3, **GREEDY}
    direct = chat(upstream.server.url, upstream.key, model=DEMO_MODEL, **body).json()
    proxied = chat(server.url, key, model="demo-chat", **body).json()

    def texts(entries: list[dict]) -> list[str]:
        return [e["token"] for e in entries]

    expected = direct["choices"][0]["logprobs"]["content"]
    content = proxied["choices"][0]["logprobs"]["content"]
    assert texts(content) == texts(expected)
    assert [e["logprob"] for e in content] == pytest.approx([e["logprob"] for e in expected],
                                                            abs=1e-4)
    for entry, want in zip(content, expected):
        assert len(entry["top_logprobs"]) == 3
        assert texts(entry["top_logprobs"]) == texts(want["top_logprobs"])
    without = chat(server.url, key, model="demo-chat", messages=CHAT, logprobs=True, **GREEDY)
    assert [e["top_logprobs"] for e in without.json()["choices"][0]["logprobs"]["content"]] == \
        [[]] * 8


def test_a_route_escalates_from_a_local_model_to_a_chat_upstream(front, upstream, demo_engine):
    server, key = front
    messages = [{"role": "user", "content": "hi"}]
    direct = chat(upstream.server.url, upstream.key, model=DEMO_MODEL, messages=messages,
                  **GREEDY).json()
    num_upstream = direct["usage"]["prompt_tokens"]
    num_local = len(demo_engine.tokenize(demo_engine.render_chat(messages),
                                         add_special_tokens=False))
    escalated = chat(server.url, key, model="escalating-chat", messages=messages, **GREEDY)
    assert escalated.status_code == 200, escalated.text
    assert answered_by(escalated) == ("demo-chat", "true")
    answer = escalated.json()
    assert answer["choices"][0]["message"] == direct["choices"][0]["message"]
    assert answer["usage"]["prompt_tokens"] == num_upstream  # the same template as the local one
    cost = mixed_cost((num_local, 8), (num_upstream, 8), "demo-chat")
    assert answer["usage"]["cost_usd"] == pytest.approx(cost)
    assert float(escalated.headers["x-switchboard-cost-usd"]) == pytest.approx(cost)

    streamed = chat(server.url, key, model="escalating-chat", messages=messages, stream=True,
                    stream_options={"include_usage": True}, **GREEDY)
    assert answered_by(streamed) == ("demo-chat", "true")
    chunks = events(streamed)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in chunks if e["choices"]) \
        == direct["choices"][0]["message"]["content"]
    assert_billed_a_held_local_tier(chunks[-1]["usage"]["cost_usd"], num_local, (num_upstream, 8),
                                    "demo-chat")

    as_user = chat(upstream.server.url, upstream.key, model=DEMO_MODEL,
                   messages=[{"role": "user", "content": "Hello there"}], **GREEDY).json()
    plain = post(server.url, key, model="escalating-chat", prompt="Hello there", **GREEDY)
    assert answered_by(plain) == ("demo-chat", "true")
    assert plain.json()["choices"][0]["text"] == as_user["choices"][0]["message"]["content"]
    assert plain.json()["usage"]["cost_usd"] == pytest.approx(mixed_cost(
        (len(demo_engine.tokenize("Hello there")), 8), (as_user["usage"]["prompt_tokens"], 8),
        "demo-chat"))


def test_a_chat_upstream_s_special_tokens_add_no_bytes_as_the_upstream_says(front, upstream):
    """Its `bytes` are null for a token that adds no text (the EOS), so the bytes join back into
    the reply, through the gateway as at the upstream."""
    server, key = front
    eos = str(demo_config().eos_token_id)
    body = {"messages": CHAT, "logprobs": True, "top_logprobs": 1, "max_tokens": 3,
            "ignore_eos": True, "logit_bias": {eos: 100}}
    direct = chat(upstream.server.url, upstream.key, model=DEMO_MODEL, **body).json()
    proxied = chat(server.url, key, model="demo-chat", **body).json()
    for answer in (direct, proxied):
        content = answer["choices"][0]["logprobs"]["content"]
        assert [(e["token"], e["bytes"]) for e in content] == [("</s>", None)] * 3
        assert answer["choices"][0]["message"]["content"] == ""
    tops = [[[(t["token"], t["bytes"]) for t in e["top_logprobs"]]
             for e in answer["choices"][0]["logprobs"]["content"]] for answer in (direct, proxied)]
    assert tops[0] == tops[1]


def test_a_chat_upstream_s_alternatives_keep_the_bytes_it_says(front, hosted):
    """An alternative the reply did not take may be a special token too (null bytes), or text
    that reads as one."""
    server, _ = front
    key = server.new_tenant("alternatives")
    special, text = {"token": "</s>", "logprob": -3.0, "bytes": None}, _logprob("</s>", -3.0)
    hosted.events = [{"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None,
                                   "logprobs": {"content": [
        {**_logprob("o", -0.1), "top_logprobs": [_logprob("o", -0.1), special]},
        {**_logprob("k", -0.2), "top_logprobs": [_logprob("k", -0.2), text]}]}}]},
        *HOSTED_EVENTS[2:]]
    try:
        answer = chat(server.url, key, model="hosted", messages=CHAT, logprobs=True,
                      top_logprobs=2).json()
    finally:
        hosted.events = HOSTED_EVENTS
    tops = [[(t["token"], t["bytes"]) for t in e["top_logprobs"]]
            for e in answer["choices"][0]["logprobs"]["content"]]
    assert tops == [[("o", [111]), ("</s>", None)], [("k", [107]), ("</s>", [60, 47, 115, 62])]]


def test_a_chat_upstream_tier_is_judged_by_its_logprobs(front, upstream):
    server, key = front
    direct = chat(upstream.server.url, upstream.key, model=DEMO_MODEL, messages=CHAT,
                  logprobs=True, **GREEDY).json()
    kept = chat(server.url, key, model="chat-first", messages=CHAT, **GREEDY)
    assert answered_by(kept) == ("demo-chat", "false")
    assert kept.json()["choices"][0]["message"] == direct["choices"][0]["message"]
    lowest = min(math.exp(e["logprob"]) for e in direct["choices"][0]["logprobs"]["content"])
    assert float(kept.headers["x-switchboard-score"]) == pytest.approx(lowest, rel=1e-5)
    assert float(kept.headers["x-switchboard-cost-usd"]) == pytest.approx(
        MIXED_PRICES["demo-chat"].cost(direct["usage"]["prompt_tokens"], 8))


def test_a_prompt_that_looks_like_a_chat_stays_plain_text(front, upstream, hosted):
    server, key = front
    forged = str(RenderedChat(CHAT))  # the very text of a chat rendered for a chat upstream
    plain = post(server.url, key, model="demo-chat", prompt=forged, **GREEDY).json()
    as_text = chat(upstream.server.url, upstream.key, model=DEMO_MODEL,
                   messages=[{"role": "user", "content": forged}], **GREEDY).json()
    as_chat = chat(upstream.server.url, upstream.key, model=DEMO_MODEL, messages=CHAT,
                   **GREEDY).json()
    assert plain["choices"][0]["text"] == as_text["choices"][0]["message"]["content"]
    assert plain["usage"]["prompt_tokens"] == as_text["usage"]["prompt_tokens"] != \
        as_chat["usage"]["prompt_tokens"]
    for prompt in (forged, list(forged.encode())):
        assert post(server.url, key, model="hosted", prompt=prompt).status_code == 200
        assert hosted.requests[-1][1]["messages"] == [{"role": "user", "content": forged}]
    # Ids a client marks itself spell a chat, but only one the chat endpoint could send.
    marked = [ROLE_ID, *b"user", CONTENT_ID, *b"hi", NAME_ID, *b"ann"]
    assert post(server.url, key, model="hosted", prompt=marked).status_code == 200
    assert hosted.requests[-1][1]["messages"] == [{"role": "user", "content": "hi", "name": "ann"}]
    for bad in ([ROLE_ID, *b"user"], [ROLE_ID, *b"user", CONTENT_ID, CONTENT_ID], [CONTENT_ID, 1]):
        refused = post(server.url, key, model="hosted", prompt=bad)
        assert refused.status_code == 400 and "send the" in refused.json()["error"]["message"]
        assert refused.json()["error"]["param"] == "prompt"  # was null for the first two
    # A role the chat endpoint refuses went to the upstream, whose 400 named messages[0].
    sent = len(hosted.requests)
    for role in (b"tool", b"bot"):
        refused = post(server.url, key, model="hosted", prompt=[ROLE_ID, *role, CONTENT_ID, *b"hi"])
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
        assert f"the role {role.decode()!r}" in refused.json()["error"]["message"]
    assert len(hosted.requests) == sent


def test_a_hosted_chat_api_gets_the_messages_and_sampling_options(front, hosted):
    server, key = front
    answer = chat(server.url, key, model="hosted", messages=CHAT, max_tokens=5, temperature=0.5,
                  top_p=0.5, seed=7, stop="\n", logprobs=True, top_logprobs=1).json()
    path, body = hosted.requests[-1]
    assert path == "/hosted/v1/chat/completions"
    assert body == {"model": "chat-model", "messages": CHAT, "stream": True,
                    "stream_options": {"include_usage": True}, "max_tokens": 5,
                    "temperature": 0.5, "top_p": 0.5, "logprobs": True, "top_logprobs": 1,
                    "seed": 7, "stop": ["\n"]}
    choice = answer["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("ok", "stop")
    assert [(e["token"], e["logprob"], [t["token"] for t in e["top_logprobs"]])
            for e in choice["logprobs"]["content"]] == [("o", -0.1, ["o"]), ("k", -0.2, ["k"])]
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (11, 2)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 4
    # Each choice is a request of its own, billed the prompt and reporting its own cache hit.
    usage = chat(server.url, key, model="hosted", messages=CHAT, max_tokens=5, n=2).json()["usage"]
    assert (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]) == (22, 8)

    plain = post(server.url, key, model="hosted", prompt="hi", max_tokens=3, ignore_eos=True,
                 logprobs=1).json()
    body = hosted.requests[-1][1]
    assert (body["messages"], body["max_tokens"], body["ignore_eos"], body["top_logprobs"]) == \
        ([{"role": "user", "content": "hi"}], 3, True, 1)
    assert plain["choices"][0]["logprobs"]["top_logprobs"] == [{"o": -0.1, "k": -2.5},
                                                               {"k": -0.2, "o": -1.75}]


def test_a_chat_without_max_tokens_fills_what_the_upstream_s_context_leaves(front, hosted):
    """The upstream counts more prompt tokens than the gateway does (its BOS, its chat template):
    the rest of the context as the gateway counts it would be refused there as too long."""
    server, key = front
    ends_at_once = {"logit_bias": {str(demo_config().eos_token_id): 100}}
    for model in ("demo-exact", "demo-chat-exact"):
        answer = chat(server.url, key, model=model, messages=CHAT, **ends_at_once)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] == "stop"
    assert chat(server.url, key, model="hosted", messages=CHAT).status_code == 200
    assert "max_tokens" not in hosted.requests[-1][1]  # the hosted API's default: the rest
    chat(server.url, key, model="hosted", messages=CHAT, max_tokens=5)
    assert hosted.requests[-1][1]["max_tokens"] == 5
    # More bytes than its context (8192) holds tokens, fewer tokens: the upstream judges that.
    long_chat = [{"role": "user", "content": "many words " * 1000}]
    assert chat(server.url, key, model="hosted", messages=long_chat).status_code == 200
    assert hosted.requests[-1][1]["messages"] == long_chat


def test_a_client_s_max_tokens_reaches_the_upstream_as_it_is(front, hosted):
    """Only a max_tokens the gateway filled in is adjusted for the upstream's own counting: the
    client's own holds the answer (and the budget held for it) to what the client asked."""
    server, key = front
    long_chat = [{"role": "user", "content": "many words " * 1000}]  # more bytes than 8192
    assert chat(server.url, key, model="hosted", messages=long_chat, max_tokens=5).status_code == 200
    assert hosted.requests[-1][1]["max_tokens"] == 5


def test_an_answer_left_early_bills_its_prompt_at_the_upstream_s_tokens_per_byte(stalling, hosted):
    """The upstream counts the prompt only at the end: until then each chunk carries an estimate,
    what a cascade's judged tier or a client that leaves is billed. It is learnt from the
    upstream's own counts, not the prompt's bytes (several times its tokens)."""
    engine = UpstreamEngineClient("hosted", UpstreamSource(stalling + "/hosted/v1", "chat-model",
                                                           None, TIMEOUT_S, api="chat"))

    async def prompt_counts(ids: list[int]) -> list[int]:
        stream = engine.generate(ids, SamplingOptions(max_tokens=4), request_id="r")
        return [chunk.num_prompt_tokens async for chunk in stream]

    short, long = engine.tokenize("a short prompt"), engine.tokenize("a rather longer prompt " * 5)
    try:
        first, *_, last = asyncio.run(prompt_counts(short))
        assert (first, last) == (math.ceil(len(short) / 4), 11)  # 11: HOSTED_EVENTS' usage
        first, *_, last = asyncio.run(prompt_counts(long))
        assert (first, last) == (round(len(long) * 11 / len(short)), 11)
    finally:
        engine.close()
    # Learnt from a prompt of 2 bytes (5.5 tokens a byte), a long one is billed no more than it
    # held: its bytes and the 9 tokens a message the upstream added to the short one.
    engine = UpstreamEngineClient("hosted", UpstreamSource(stalling + "/hosted/v1", "chat-model",
                                                           None, TIMEOUT_S, api="chat"))
    try:
        asyncio.run(prompt_counts(engine.tokenize("ab")))
        first, *_, last = asyncio.run(prompt_counts(long))
        assert (first, last) == (len(long) + 9, 11) and first == engine.max_prompt_tokens(long)
    finally:
        engine.close()


def test_an_upstream_s_prompt_tokens_are_learnt_per_byte_and_per_message():
    """What a template adds to each message is no part of its text's tokens per byte: learnt from
    short chats, those would bill a long one several times its tokens."""
    ratio = _PromptRatio()
    for num_bytes, num_messages in [(40, 1), (100, 3), (400, 2), (2000, 5)]:
        ratio.learn(num_bytes, num_messages, round(0.25 * num_bytes + 30 * num_messages))
    assert ratio.estimate(10_000, 4) == 2500 + 120
    by_text_alone = _PromptRatio()  # every prompt of one size: tokens per byte alone
    by_text_alone.learn(100, 1, 50)
    assert by_text_alone.estimate(1000, 1) == 500


def test_an_upstream_answer_without_logprobs_is_billed_by_the_upstream_s_token_count(front, hosted):
    """Without logprobs a piece of text counts as one token until the usage says how many it held."""
    server, _ = front
    key = server.new_tenant("pieces")
    pieces = [{"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
              for text in ("Hello the", "re, world")]
    hosted.events = [*pieces, {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
                     {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 10,
                                               "total_tokens": 19}}]
    try:
        answer = chat(server.url, key, model="hosted", messages=CHAT, max_tokens=10).json()
        streamed = events(post(server.url, key, "/v1/chat/completions", model="hosted", messages=CHAT,
                               max_tokens=10, stream=True, stream_options={"include_usage": True}))
    finally:
        hosted.events = HOSTED_EVENTS
    assert answer["choices"][0]["message"]["content"] == "Hello there, world"
    assert (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]) == (9, 10)
    assert streamed[-1]["usage"]["completion_tokens"] == 10
    usage = server.settled_usage("pieces")
    assert (usage["tokens_in"], usage["tokens_out"]) == (18, 20)


SHORT_CHAT = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]


def test_an_upstream_call_holds_what_the_upstream_adds_to_its_prompt(upstream):
    """A prompt's bytes cover its text's tokens, not what the upstream adds: its BOS, and the
    chat API's template around each message (the demo's: some 20 tokens for one message, 30 for
    four). A call holds a safe amount per message until answers show it, then the most per
    message any answer showed."""
    url = upstream.server.url + "/v1"
    chat_api = UpstreamEngineClient("chat", UpstreamSource(url, DEMO_MODEL, api="chat"),
                                    upstream.key)
    completions_api = UpstreamEngineClient("legacy", UpstreamSource(url, DEMO_MODEL), upstream.key)

    async def prompt_tokens(engine: UpstreamEngineClient, ids: list[int]) -> int:
        stream = engine.generate(ids, SamplingOptions(max_tokens=1), request_id="r")
        return [chunk async for chunk in stream][-1].num_prompt_tokens

    four = chat_api.tokenize(chat_api.render_chat(SHORT_CHAT))
    one = chat_api.tokenize(chat_api.render_chat(SHORT_CHAT[1:2]))
    text = completions_api.tokenize("hello")
    try:
        held = [chat_api.max_prompt_tokens(four), chat_api.max_prompt_tokens(one),
                completions_api.max_prompt_tokens(text)]
        used_four = asyncio.run(prompt_tokens(chat_api, four))
        # Learnt from four messages: too little for one, whose answer it learns from in turn.
        assert chat_api.max_prompt_tokens(one) == len(one) + math.ceil((used_four - len(four)) / 4)
        used = [used_four, asyncio.run(prompt_tokens(chat_api, one)),
                asyncio.run(prompt_tokens(completions_api, text))]
        assert all(h >= u > n for h, u, n in zip(held, used, map(len, (four, one, text))))
        assert chat_api.max_prompt_tokens(one) == used[1]
        assert chat_api.max_prompt_tokens(four) == len(four) + 4 * (used[1] - len(one))
        assert completions_api.max_prompt_tokens(text) == used[2] == len(text) + 1  # its BOS
    finally:
        chat_api.close()
        completions_api.close()


def test_one_answer_billed_far_above_its_text_raises_later_holds_only_for_a_while(stalling,
                                                                                  hosted):
    """A hosted API that once adds a hidden system prompt of ~900 tokens: the calls after it hold
    that much more, but only until the upstream's later answers have shown it was one call's
    (the hold learns from its last 64 answers); before, every later call held it for good."""
    engine = UpstreamEngineClient("hosted", UpstreamSource(stalling + "/hosted/v1", "chat-model",
                                                           api="chat"))
    ids = engine.tokenize(engine.render_chat(SHORT_CHAT[1:2]))

    def answer_once() -> None:
        stream = engine.generate(ids, SamplingOptions(max_tokens=2), request_id="r")
        asyncio.run(asyncio.wait_for(_drain(stream), 10))

    try:
        answer_once()  # HOSTED_EVENTS: the upstream bills 11 prompt tokens
        usual = engine.max_prompt_tokens(ids)
        hosted.events = [*HOSTED_EVENTS[:-1], {"choices": [], "usage": {
            "prompt_tokens": 898, "completion_tokens": 2, "total_tokens": 900}}]
        answer_once()
        assert engine.max_prompt_tokens(ids) >= 898
        hosted.events = HOSTED_EVENTS
        for _ in range(63):
            answer_once()
        assert engine.max_prompt_tokens(ids) >= 898  # still among the last 64 answers
        answer_once()
        assert engine.max_prompt_tokens(ids) == usual
    finally:
        hosted.events = HOSTED_EVENTS
        engine.close()


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_calls_in_flight_to_a_chat_upstream_stay_within_the_tenant_s_budget(upstream, tmp_path):
    """Calls held the bytes of their messages alone (40 tokens for calls the upstream bills 70), so
    that calls in flight together went far past the monthly budget their holds fitted in."""
    engine = UpstreamEngineClient("demo-chat", UpstreamSource(
        upstream.server.url + "/v1", DEMO_MODEL, api="chat"), upstream.key)
    try:
        with serve_gateway({"demo-chat": engine}, tmp_path) as server:
            # Before any answer showed the template, then after. NOTE: a tenant each: the first
            # round's calls may use up most of the budget (those that come after its first answer
            # hold less), leaving the second none to run in.
            for tenant in ("tight", "tight-again"):
                key = server.new_tenant(tenant, monthly_token_budget=300)
                with ThreadPoolExecutor(8) as pool:
                    answers = list(pool.map(lambda _: chat(
                        server.url, key, model="demo-chat", messages=SHORT_CHAT, max_tokens=4,
                        ignore_eos=True), range(8)))
                usage = server.admin("GET", f"/admin/tenants/{tenant}").json()["usage"]
                assert usage["tokens_in"] + usage["tokens_out"] <= 300, usage
                assert {a.status_code for a in answers} <= {200, 429}
                assert any(a.status_code == 200 for a in answers)
    finally:
        engine.close()


def test_tokens_an_upstream_bills_beyond_the_hold_are_paid_into_tpm(stalling, hosted, demo_engine,
                                                                 tmp_path):
    """A call pays its hold into tpm, and settles at what it used: the tokens the upstream bills
    beyond the hold (a hidden system prompt of the hosted API's) are paid too, not left free."""
    engine = UpstreamEngineClient("hosted", UpstreamSource(stalling + "/hosted/v1", "chat-model",
                                                           api="chat"))
    hosted.events = [*HOSTED_EVENTS[:-1], {"choices": [], "usage": {
        "prompt_tokens": 898, "completion_tokens": 2, "total_tokens": 900}}]
    try:
        with serve_gateway({"hosted": engine, "local": demo_engine}, tmp_path) as server:
            key = server.new_tenant("metered", tpm=1000)
            answer = chat(server.url, key, model="hosted", messages=SHORT_CHAT[1:2], max_tokens=2)
            assert answer.json()["usage"]["total_tokens"] == 900, answer.text
            # 100 tokens left (and some 17 a second refilled): not the 400 this call holds
            refused = post(server.url, key, model="local", prompt="x" * 399, max_tokens=1)
    finally:
        hosted.events = HOSTED_EVENTS
        engine.close()
    assert refused.status_code == 429, refused.text
    assert "(tpm)" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 10


def test_a_judged_tier_that_sends_no_logprobs_is_escalated_not_taken_as_sure(front, hosted):
    server, _ = front
    name = "unjudged"
    key = server.new_tenant(name)
    hosted.events = [{"choices": [{"index": 0, "delta": {"content": "sure"}, "finish_reason": None}]},
                     {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                      "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}]
    try:
        answers = [post(server.url, key, model="hosted-first", prompt="Hello there", stream=stream,
                        **GREEDY) for stream in (False, True)]
    finally:
        hosted.events = HOSTED_EVENTS
    for answer in answers:  # a threshold of 0 keeps any answer that can be judged
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-switchboard-model"] == "local"
        assert (answer.headers["x-switchboard-escalated"], answer.headers["x-switchboard-score"]) == \
            ("true", "none")
    usage = server.settled_usage(name)
    assert usage["tokens_out"] >= 2  # the hosted answers are billed too


def test_a_chat_client_marks_its_chats_so_no_text_passes_for_one(upstream):
    url = upstream.server.url + "/v1"
    engine = UpstreamEngineClient("chat", UpstreamSource(url, DEMO_MODEL, api="chat"))
    legacy = UpstreamEngineClient("legacy", UpstreamSource(url, DEMO_MODEL))
    try:
        messages = [{"role": "user", "content": "hé", "name": "a"}]
        rendered = engine.render_chat(messages)
        assert legacy.render_chat(messages) is None  # the completions API: the transcript
        # The context check counts a chat as its fields' bytes and one mark per field.
        assert engine.tokenize(rendered) == [ROLE_ID, *b"user", CONTENT_ID, *"hé".encode(),
                                             NAME_ID, *b"a"]
        assert engine.tokenize(str(rendered)) == list(str(rendered).encode())  # as a text
    finally:
        engine.close()
        legacy.close()


def test_model_tables_name_the_api_of_their_upstream(tmp_path):
    config = tmp_path / "models.toml"
    config.write_text('[models.gpt]\nupstream = "https://api.openai.com/v1"\n'
                      'upstream_api = "chat"\n[models.legacy]\nupstream = "http://h/v1"\n')
    upstreams = load_serve_config({}, config, {}).upstreams()
    assert (upstreams["gpt"].api, upstreams["legacy"].api) == ("chat", "completions")
    for table, words in (('upstream = "https://h/v1"\nupstream_api = "responses"\n',
                          'upstream_api must be "completions" .* or "chat" .*, got \'responses\''),
                         ('upstream = "https://h/v1"\nupstream_api = 1\n', "got 1"),
                         ('path = "/m"\nupstream_api = "chat"\n', "unknown keys .*: upstream_api")):
        config.write_text("[models.x]\n" + table)
        with pytest.raises(ValueError, match=words):
            load_serve_config({}, config, {})
