"""Cascade routes through the real gateway over scripted engines whose confidence is known.

Each engine answers with its letter ("s", "m", "l") and gives every token the probability its
script assigns to the prompt's first word, so every routing decision below is exact. The trained
models of tests/fixtures/arithmetic check the same routes on real answers.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import logging
import math
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from urllib.parse import urlsplit

import httpx
import msgspec
import pytest

from gateway.app import create_app
from gateway.engine_client import (AdapterInfo, AdapterRef, AdapterRejected, EngineFailure,
                                   EngineStats, EngineUnavailable, GenerationChunk,
                                   SamplingOptions, TokenLogprob)
from gateway.serving import _number
from routing.learned import Example, train_router
from routing.pricing import Price
from routing.routes import parse_routes
from tests.conftest import DEMO_MODEL, GatewayServer, serve_gateway
from tests.helpers import IdleEngineParts, make_hf_model, save_hf_model

PRICES = {"small": Price(1.0, 2.0), "medium": Price(3.0, 6.0), "large": Price(10.0, 20.0)}
# The probability each model gives every token of its answer, by the prompt's first word.
SCRIPTS = {
    "small": {"easy": 0.9, "hard": 0.2, "harder": 0.1, "odd": 0.4},
    "medium": {"easy": 0.95, "hard": 0.7, "harder": 0.3, "odd": 0.3},
    "large": {"easy": 0.99, "hard": 0.9, "harder": 0.8, "odd": 0.9},
}
_names = itertools.count()


class ScriptedTier(IdleEngineParts):
    """An engine that answers with its own letter, as sure as its script says."""

    max_model_len = 256
    supports_adapters = False
    max_adapter_rank = 0

    def __init__(self, name: str):
        self.name = name
        self.letter = name[0]
        self.fail = False
        self.down = False  # no engine up, as a model none of whose workers is up
        self.stall_after: int | None = None  # tokens after which answers wait to be aborted
        self.fail_after: int | None = None  # tokens after which answers fail (the engine died)
        self.failed = threading.Event()  # set once an answer failed there
        self.stalled = threading.Event()  # set once an answer waits there
        self.start_after: threading.Event | None = None  # answers wait for it to start
        self.token_delay_s = 0.0  # how long each token takes to make
        self.started: list[str] = []  # request ids, in order
        self.running: set[str] = set()
        self.closed_early: list[str] = []  # requests aborted before their last token

    def stats(self) -> EngineStats:
        return msgspec.structs.replace(super().stats(), num_running=len(self.running))

    tokenizer_key = "bytes"

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def render_chat(self, messages: list[dict[str, str]]) -> str | None:
        return None

    async def check_adapter(self, folder: str) -> AdapterInfo:
        raise AdapterRejected("no adapters here")

    async def ensure_available(self, adapter: AdapterRef | None = None) -> None:
        if self.down:
            raise EngineUnavailable(f"no engine serving {self.name!r} is up")

    async def generate(self, prompt_token_ids: list[int], options: SamplingOptions, *,
                       request_id: str, tenant: str | None = None,
                       adapter: AdapterRef | None = None) -> AsyncIterator[GenerationChunk]:
        self.started.append(request_id)
        await self.ensure_available()
        if self.fail:
            raise EngineFailure(f"{self.name} is down")
        words = bytes(prompt_token_ids).decode().split()
        word = next(w for w in words if w in SCRIPTS[self.name])  # chats: the user's first word
        logprob = math.log(SCRIPTS[self.name][word])
        finished = False
        self.running.add(request_id)
        try:
            while self.start_after is not None and not self.start_after.is_set():
                await asyncio.sleep(0.005)
            for i in range(options.max_tokens):
                if i == self.stall_after:
                    self.stalled.set()
                    await asyncio.Event().wait()  # until the gateway aborts the request
                if i == self.fail_after:
                    self.failed.set()
                    raise EngineFailure(f"{self.name} died midway")
                await asyncio.sleep(self.token_delay_s)
                finished = i == options.max_tokens - 1
                logprobs = [] if options.logprobs is None else [
                    TokenLogprob(ord(self.letter), logprob, [(ord(self.letter), logprob)])]
                yield GenerationChunk(token_ids=[ord(self.letter)], text=self.letter,
                                      logprobs=logprobs, finished=finished,
                                      finish_reason="length" if finished else None,
                                      num_prompt_tokens=len(prompt_token_ids),
                                      num_output_tokens=i + 1, num_cached_tokens=0)
        finally:
            self.running.discard(request_id)
            if not finished:
                self.closed_early.append(request_id)


class SpacedTier(ScriptedTier):
    """A scripted engine whose tokenizer reads text differently: with a space token first."""

    tokenizer_key = "a space, then bytes"

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(" ")] + super().tokenize(text)


class CrampedTier(ScriptedTier):
    """A scripted engine with a context of 24 tokens."""

    max_model_len = 24


@pytest.fixture(scope="module")
def engines() -> dict[str, ScriptedTier]:
    return {**{name: ScriptedTier(name) for name in SCRIPTS}, "spaced": SpacedTier("large"),
            "cramped": CrampedTier("large")}


@pytest.fixture(scope="module")
def router_dir(tmp_path_factory):
    """A learned router that has seen "easy ..." prompts succeed and "hard ..." ones fail."""
    examples = [Example(f"{word} {i}", word == "easy") for i in range(60)
                for word in ("easy", "hard")]
    router, _ = train_router(examples, target_strong_share=0.5, epochs=30)
    folder = tmp_path_factory.mktemp("router")
    router.save(folder)
    return folder


@pytest.fixture(scope="module")
def routed(engines, router_dir, tmp_path_factory):
    routes = parse_routes({
        "learned": {"kind": "learned", "tiers": ["small", "large"], "router": str(router_dir)},
        "tuned": {"kind": "learned", "tiers": ["small", "large"], "router": str(router_dir),
                  "target_strong_share": 0.25, "recalibrate_window": 40},
        "learned-mixed": {"kind": "learned", "tiers": ["small", "spaced"],
                          "router": str(router_dir)},
        "auto": {"tiers": ["small", "large"], "measure": "min_prob", "threshold": 0.5,
                 "prefix_tokens": 2},
        "three": {"tiers": ["small", "medium", "large"], "measure": "mean_logprob",
                  "thresholds": [math.log(0.5), math.log(0.5)]},
        "three-prefixed": {"tiers": ["small", "medium", "large"], "measure": "min_prob",
                           "threshold": 0.5, "prefix_tokens": 2},
        "to-cramped": {"tiers": ["small", "cramped"], "measure": "min_prob", "threshold": 0.5},
        "from-cramped": {"tiers": ["cramped", "large"], "measure": "min_prob", "threshold": 0.95},
        "learned-cramped": {"kind": "learned", "tiers": ["cramped", "large"],
                            "router": str(router_dir)},
    }, engines)
    with serve_gateway(engines, tmp_path_factory.mktemp("routed"), prices=PRICES, routes=routes,
                       default_route="auto") as server:
        yield server


@pytest.fixture(scope="module")
def chatml_engine(demo_engine, tmp_path_factory) -> Iterator:
    """A real engine whose tokenizer is the demo model's plus the special token "<|im_start|>"
    (id 258), as ChatML finetunes add: the demo model reads that text as its 12 bytes."""
    from engine.config import EngineConfig
    from engine.demo import build_byte_tokenizer
    from gateway.local_engine import LocalEngineClient

    folder = tmp_path_factory.mktemp("chatml")
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.save_pretrained(folder)
    save_hf_model(make_hf_model(vocab_size=259, bos_token_id=256, eos_token_id=257), folder)
    engine = LocalEngineClient.load(EngineConfig(model=str(folder), num_kv_blocks=64),
                                    show_progress=False)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def chatml_routed(demo_engine, chatml_engine, tmp_path_factory) -> Iterator[GatewayServer]:
    """Route "casc" from the demo model to the ChatML one, escalating every call (no answer is
    sure of all its tokens)."""
    engines = {DEMO_MODEL: demo_engine, "chatml": chatml_engine}
    routes = parse_routes({"casc": {"tiers": [DEMO_MODEL, "chatml"], "measure": "min_prob",
                                    "threshold": 1.0}}, engines)
    with serve_gateway(engines, tmp_path_factory.mktemp("chatml-routed"), routes=routes) as server:
        yield server


@pytest.fixture(autouse=True)
def healthy(engines):
    for engine in engines.values():
        engine.fail, engine.down, engine.stall_after, engine.start_after = False, False, None, None
        engine.fail_after, engine.token_delay_s = None, 0.0
        engine.failed.clear()
        engine.stalled.clear()


def new_tenant(server: GatewayServer, **policy) -> tuple[str, str]:
    name = f"r{next(_names)}"
    return name, server.new_tenant(name, **policy)


def complete(server, key, prompt: str, model: str = "auto", **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "prompt": prompt, "max_tokens": 4, **body})


def spend(server, tenant: str) -> dict:
    return server.settled_usage(tenant)


def cost(model: str, tokens_in: int, tokens_out: int) -> float:
    return PRICES[model].cost(tokens_in, tokens_out)


def eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Whether `condition` holds within `timeout_s` (polled)."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_confident_small_model_answers(routed):
    name, key = new_tenant(routed)
    response = complete(routed, key, "easy one")  # 8 prompt tokens
    assert response.status_code == 200, response.text
    body, headers = response.json(), response.headers
    assert body["choices"][0]["text"] == "ssss" and body["model"] == "small"
    assert headers["x-switchboard-model"] == "small"
    assert headers["x-switchboard-route"] == "auto"
    assert (float(headers["x-switchboard-score"]), float(headers["x-switchboard-threshold"])) == \
        pytest.approx((0.9, 0.5))
    assert headers["x-switchboard-escalated"] == "false"
    expected = cost("small", 8, 4)
    assert float(headers["x-switchboard-cost-usd"]) == pytest.approx(expected)
    assert body["usage"]["cost_usd"] == pytest.approx(expected)
    # Every digit, the same text as the usage's number: eight decimals cut a cheap model's cost.
    assert headers["x-switchboard-cost-usd"] == repr(body["usage"]["cost_usd"])
    assert "logprobs" not in body["choices"][0] or body["choices"][0]["logprobs"] is None
    usage = spend(routed, name)
    assert (usage["tokens_in"], usage["tokens_out"]) == (8, 4)
    assert usage["spend_usd"] == pytest.approx(expected)


def test_an_unsure_small_model_escalates_and_both_calls_are_billed(routed, engines):
    name, key = new_tenant(routed)
    response = complete(routed, key, "hard one")
    body, headers = response.json(), response.headers
    assert body["choices"][0]["text"] == "llll" and body["model"] == "large"
    assert headers["x-switchboard-escalated"] == "true"
    assert float(headers["x-switchboard-score"]) == pytest.approx(0.2)
    expected = cost("small", 8, 4) + cost("large", 8, 4)  # the small answer ran in full first
    assert float(headers["x-switchboard-cost-usd"]) == pytest.approx(expected)
    usage = spend(routed, name)
    assert (usage["tokens_in"], usage["tokens_out"]) == (16, 8)
    assert usage["spend_usd"] == pytest.approx(expected)


def test_a_call_that_only_scores_its_prompt_is_answered_by_the_first_tier(routed, engines):
    # Echo with max_tokens 0 returns the prompt scored: the one token the engine samples is never
    # seen, so it is not judged (it once escalated "hard one" and billed both tiers for it).
    name, key = new_tenant(routed)
    response = complete(routed, key, "hard one", echo=True, max_tokens=0)
    assert response.status_code == 200, response.text
    body, headers = response.json(), response.headers
    assert body["choices"][0]["text"] == "hard one" and body["model"] == "small"
    assert headers["x-switchboard-escalated"] == "false"
    # No tier was judged: no score or threshold (they were once sent empty).
    assert "x-switchboard-score" not in headers and "x-switchboard-threshold" not in headers
    usage = spend(routed, name)
    assert usage["tokens_in"] == 8 and usage["spend_usd"] == pytest.approx(
        cost("small", 8, usage["tokens_out"]))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_call_that_only_scores_its_prompt_goes_to_the_next_tier_if_the_first_fails(
        routed, engines, stream):
    """As any call does: it got the first tier's error (a 500), the next tier never asked."""
    name, key = new_tenant(routed)
    engines["small"].fail = True
    response = complete(routed, key, "hard one", echo=True, max_tokens=0, stream=stream)
    assert response.status_code == 200, response.text
    assert answer_text(response) == "hard one"
    assert response.headers["x-switchboard-model"] == "large"
    assert response.headers["x-switchboard-escalated"] == "true"  # another tier ran
    usage = spend(routed, name)
    assert usage["tokens_in"] == 8 and usage["spend_usd"] == pytest.approx(
        cost("large", 8, usage["tokens_out"]))  # the failed tier used nothing


def test_a_stream_is_judged_on_its_prefix_before_any_byte_is_sent(routed, engines):
    """The tier escalated past is held (to answer if the next fails before its first token) and
    its answer read on meanwhile: every token its engine made until it was aborted is billed (only
    the two judged were, while the engine made more)."""
    name, key = new_tenant(routed)
    engines["small"].stall_after = 4  # its answer is cut there, once held
    engines["large"].start_after = engines["small"].stalled
    with httpx.stream("POST", routed.url + "/v1/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "auto", "prompt": "hard one", "max_tokens": 6, "stream": True,
                            "stream_options": {"include_usage": True}}) as response:
        headers = response.headers
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    assert headers["x-switchboard-model"] == "large" and headers["x-switchboard-escalated"] == "true"
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "llllll"
    assert engines["small"].closed_early[-1] == engines["small"].started[-1]  # cut after 4 tokens
    expected = cost("small", 8, 4) + cost("large", 8, 6)
    assert events[-1]["usage"]["cost_usd"] == pytest.approx(expected)
    assert spend(routed, name)["spend_usd"] == pytest.approx(expected)

    engines["small"].stall_after = engines["large"].start_after = None
    kept = complete(routed, key, "easy one", stream=True, max_tokens=6)
    assert kept.headers["x-switchboard-model"] == "small"
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in kept.text.splitlines()
             if line.startswith("data: {")]
    assert "".join(texts) == "ssssss"  # the judged prefix is replayed, then the rest follows


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_mid_cascade_is_billed_every_token_generated(routed, engines, stream):
    name, key = new_tenant(routed)
    engines["medium"].stall_after = 2  # "harder": small escalates, then medium is judged
    large_before = len(engines["large"].started)
    metrics = routed.app.state.gateway.metrics

    def tier_calls() -> list[float]:
        return [metrics.route_attempts.value(route="three", model=m) for m in ("small", "medium")]

    tier_calls_before = tier_calls()
    url = urlsplit(routed.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    connection.request("POST", "/v1/completions", headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        body=json.dumps({"model": "three", "prompt": "harder x", "max_tokens": 4,
                         "stream": stream}))
    assert engines["medium"].stalled.wait(10)
    connection.close()  # while medium's answer is being judged
    assert eventually(lambda: spend(routed, name)["requests"] == 1)
    # small's whole answer, and medium's prompt and the 2 tokens it made before it was aborted
    expected = cost("small", 8, 4) + cost("medium", 8, 2)
    usage = spend(routed, name)
    assert (usage["tokens_in"], usage["tokens_out"]) == (16, 6)
    assert usage["spend_usd"] == pytest.approx(expected)
    # Both tiers ran: counted as the route's tier calls, though no tier answered.
    assert tier_calls() == [n + 1 for n in tier_calls_before]
    for model, tokens_in, tokens_out in [("small", 8, 4), ("medium", 8, 2)]:  # each under its name
        assert (metrics.prompt_tokens.value(tenant=name, model=model),
                metrics.generation_tokens.value(tenant=name, model=model)) == (tokens_in, tokens_out)
        assert metrics.spend.value(tenant=name, model=model) == \
            pytest.approx(cost(model, tokens_in, tokens_out))
    assert engines["medium"].closed_early[-1] == engines["medium"].started[-1]
    assert len(engines["large"].started) == large_before
    assert eventually(lambda: all(e.stats().num_running == 0 for e in engines.values()))


@pytest.mark.parametrize("stream", [False, True])
def test_a_routed_call_s_latencies_are_timed_as_its_tokens_came_not_as_judging_handed_them_on(
        routed, engines, stream):
    """A tier judged on its first tokens hands them on at once when it answers: timed then, the
    answering model's time per output token read 0 and its time to first token the whole wait."""
    _, key = new_tenant(routed)
    engines["small"].token_delay_s = 0.05
    latency = routed.app.state.gateway.metrics.time_per_output_token
    before = latency.count(model="small"), latency.sum(model="small")
    response = complete(routed, key, "easy one", max_tokens=6, stream=stream)  # small answers
    assert (response.status_code, answer_text(response)) == (200, "ssssss")
    assert response.headers["x-switchboard-model"] == "small"
    # Five gaps of at least the delay each (prefix_tokens 2: streamed, two judged tokens came
    # before the answer began, then four as they came).
    assert latency.count(model="small") - before[0] == 5
    assert latency.sum(model="small") - before[1] >= 5 * 0.05


def test_three_tiers_escalate_step_by_step(routed):
    _, key = new_tenant(routed)
    cases = {"easy x": ("small", "false", 1), "hard x": ("medium", "true", 2),
             "harder x": ("large", "true", 2)}
    for prompt, (model, escalated, judged) in cases.items():
        headers = complete(routed, key, prompt, model="three").headers
        assert (headers["x-switchboard-model"], headers["x-switchboard-escalated"]) == \
            (model, escalated), prompt
        assert len(headers["x-switchboard-score"].split(",")) == judged


def test_a_failing_tier_falls_back_to_the_next_and_the_last_fails_cleanly(routed, engines):
    _, key = new_tenant(routed)
    engines["small"].fail = True
    response = complete(routed, key, "easy one")
    assert response.status_code == 200 and response.json()["model"] == "large"
    assert response.headers["x-switchboard-score"] == "none"
    engines["large"].fail = True
    failed = complete(routed, key, "easy one")
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_failure"


def answer_text(response: httpx.Response) -> str:
    """The text of a completion, whole or streamed (up to an error event)."""
    if response.headers["content-type"].startswith("application/json"):
        return response.json()["choices"][0]["text"]
    return "".join(json.loads(line[6:])["choices"][0]["text"] for line in response.text.splitlines()
                   if line.startswith("data: {") and json.loads(line[6:]).get("choices"))


@pytest.mark.parametrize("stream", [False, True])
def test_a_route_leaves_out_a_tier_whose_engine_is_unavailable_before_running_any(
        routed, engines, stream):
    """A tier no engine could take the call on now (no worker of its model up) is left out, as
    one that cannot serve the call: the call runs on the others and is billed once (a cascade
    ran its first tier, then answered a 503 that clients retry, billed again each time)."""
    name, key = new_tenant(routed)
    engines["large"].down = True
    started = {model: len(engine.started) for model, engine in engines.items()}
    # (route, prompt): the model that answers, whether escalated, how many tiers were judged
    cases = {("auto", "hard one"): ("small", "false", 0), ("three", "harder x"): ("medium", "true", 1),
             ("learned", "hard 1000"): ("small", "false", 0)}  # the router's pick is large
    for (route, prompt), (model, escalated, num_judged) in cases.items():
        response = complete(routed, key, prompt, model=route, stream=stream)
        assert response.status_code == 200, response.text
        headers = response.headers
        assert (headers["x-switchboard-model"], headers["x-switchboard-escalated"]) == \
            (model, escalated), route
        scores = headers.get("x-switchboard-score")  # left out where no tier was judged
        assert (0 if scores is None else len(scores.split(","))) == num_judged
        assert answer_text(response) == model[0] * 4
    assert len(engines["large"].started) == started["large"]
    usage = spend(routed, name)
    expected = cost("small", 8, 4) + cost("small", 8, 4) + cost("medium", 8, 4) + cost("small", 9, 4)
    assert (usage["requests"], usage["tokens_in"], usage["tokens_out"]) == (3, 33, 16)
    assert usage["spend_usd"] == pytest.approx(expected)
    # No tier that can hold the call is up (cramped's context cannot): a 503 before it runs.
    refused = complete(routed, key, "easy one", model="from-cramped", max_tokens=20, stream=stream)
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "engine_unavailable")
    assert refused.headers["retry-after"] == "2"
    assert {model: len(engine.started) for model, engine in engines.items()} == {
        **started, "small": started["small"] + 3, "medium": started["medium"] + 1}
    assert spend(routed, name)["requests"] == 3


@pytest.mark.parametrize("stream", [False, True])
def test_a_cascade_whose_last_tier_fails_before_answering_answers_from_a_tier_it_passed_over(
        routed, engines, stream):
    """The tier surest of its answer among those escalated past answers, billed once (the call
    once failed after billing them); each tier ran counts once."""
    name, key = new_tenant(routed)
    metrics = routed.app.state.gateway.metrics
    engines["large"].fail = True  # up, as far as the gateway knows, until the call reaches it

    def tier_calls() -> dict[tuple[str, str], float]:
        return {(route, model): metrics.route_attempts.value(route=route, model=model)
                for route in ("auto", "three") for model in ("small", "medium", "large")}

    def logs(*probs: float) -> str:
        """A header of mean_logprob values (those of "three")."""
        return ",".join(repr(math.log(p)) for p in probs)

    before = tier_calls()
    auto = complete(routed, key, "hard one", stream=stream)
    # Both small (0.1) and medium (0.3) are escalated past: medium, the surer, answers.
    three = complete(routed, key, "harder x", model="three", stream=stream)
    for response, model, score, threshold in [(auto, "small", "0.2", "0.5"),
                                              (three, "medium", logs(0.1, 0.3), logs(0.5, 0.5))]:
        assert response.status_code == 200, response.text
        assert answer_text(response) == model[0] * 4
        headers = response.headers
        assert (headers["x-switchboard-model"], headers["x-switchboard-escalated"],
                headers["x-switchboard-score"], headers["x-switchboard-threshold"]) == \
            (model, "true", score, threshold)
    usage = spend(routed, name)
    assert (usage["requests"], usage["tokens_in"], usage["tokens_out"]) == (2, 24, 12)
    assert usage["spend_usd"] == pytest.approx(2 * cost("small", 8, 4) + cost("medium", 8, 4))
    counted = {("auto", "small"): 1, ("auto", "large"): 1, ("three", "small"): 1,
               ("three", "medium"): 1, ("three", "large"): 1}
    assert eventually(lambda: tier_calls() == {k: v + counted.get(k, 0) for k, v in before.items()})
    assert eventually(lambda: all(e.stats().num_running == 0 for e in engines.values()))


def test_a_held_tier_whose_engine_failed_since_is_the_least_sure_to_fall_back_on(routed, engines):
    """Small (0.4) is surer than medium (0.3), but its engine failed while it was held: medium is
    held instead, and answers when the last tier fails (small was kept, to replay three tokens and
    its failure)."""
    _, key = new_tenant(routed)
    engines["small"].fail_after = 3
    engines["medium"].start_after = engines["small"].failed
    engines["large"].fail = True
    response = complete(routed, key, "odd x", model="three-prefixed", stream=True, max_tokens=6)
    assert response.headers["x-switchboard-model"] == "medium"
    assert answer_text(response) == "mmmmmm" and "engine_failure" not in response.text


def test_a_whole_cascade_call_whose_last_tier_fails_midway_answers_from_a_tier_it_passed_over(
        routed, engines):
    """None of a whole answer has reached the client before its last token: the held tier
    answers, and the failed tier's tokens are billed too."""
    name, key = new_tenant(routed)
    engines["large"].fail_after = 2
    response = complete(routed, key, "hard one")
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "ssss"
    assert (response.headers["x-switchboard-model"], response.headers["x-switchboard-escalated"]) \
        == ("small", "true")
    usage = spend(routed, name)
    assert (usage["requests"], usage["tokens_in"], usage["tokens_out"]) == (1, 16, 6)
    assert usage["spend_usd"] == pytest.approx(cost("small", 8, 4) + cost("large", 8, 2))
    assert eventually(lambda: all(e.stats().num_running == 0 for e in engines.values()))

    # A stream has sent the last tier's first tokens: the call ends in an error there, as before.
    streamed = complete(routed, key, "hard one", stream=True)
    assert answer_text(streamed) == "ll" and "engine_failure" in streamed.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_learned_route_hands_a_call_its_pick_fails_to_the_other_tier(routed, engines, stream):
    name, key = new_tenant(routed)
    for down, prompt, answering in [("small", "easy 1000", "large"), ("large", "hard 1000", "small")]:
        engines[down].fail = True
        response = complete(routed, key, prompt, model="learned", stream=stream)
        assert response.status_code == 200, response.text
        assert response.headers["x-switchboard-model"] == answering
        engines[down].fail = False
    # Midway, the call fails (whole or streamed): it held one tier's tokens, not two tiers'.
    engines["large"].fail_after = 2
    small_calls = len(engines["small"].started)
    midway = complete(routed, key, "hard 1000", model="learned", stream=stream)
    assert "engine_failure" in midway.text and len(engines["small"].started) == small_calls
    engines["large"].fail_after = None
    engines["small"].fail = engines["large"].fail = True
    metrics = routed.app.state.gateway.metrics

    def counts() -> tuple[float, ...]:
        return (*(metrics.routed.value(route="learned", model=m, escalated=e)
                  for m in ("small", "large") for e in ("true", "false")),
                *(metrics.route_attempts.value(route="learned", model=m) for m in ("small", "large")))

    spend(routed, name)  # NOTE: once the calls above are billed, they are counted
    before = counts()
    failed = complete(routed, key, "easy 1000", model="learned", stream=stream)
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_failure"
    # No tier answered: both ran, and neither is counted as the one that answered (the last was).
    assert eventually(lambda: counts() == (*before[:4], before[4] + 1, before[5] + 1))


def test_a_route_too_large_for_its_tenant_s_limits_says_what_it_holds_and_what_to_change(routed):
    """A cascade holds each of its tiers' prompt and max_tokens: the refusal said "prompt plus
    max_tokens for every choice" of twice what the call asked for, and to lower n, which a route
    takes only as 1."""
    _, key = new_tenant(routed, tpm=40)
    # "hard a": 6 tokens on each tier; 26 fit 40, each tier's together (52) do not
    refused = complete(routed, key, "hard a", max_tokens=20)
    error = refused.json()["error"]
    assert (refused.status_code, error["code"], error["param"]) == \
        (400, "request_too_large", "max_tokens"), error
    assert error["message"] == (
        "this request may use 52 tokens (prompt plus max_tokens on each tier of route 'auto', "
        "which may run them all) but your limit is 40 tokens per minute; lower max_tokens or "
        "shorten the prompt, or call one model instead of route 'auto'")
    assert complete(routed, key, "hard a", model="small", max_tokens=20).status_code == 200
    # A learned route runs one tier: it holds that one's.
    refused = complete(routed, key, "hard a", model="learned", max_tokens=40).json()["error"]
    assert "may use 46 tokens (prompt plus max_tokens for every choice)" in refused["message"]
    assert refused["message"].endswith("; lower max_tokens or shorten the prompt, or call one "
                                       "model instead of route 'learned'")
    # A chat without max_tokens, cut to one token on each tier, sets nothing else to lower.
    refused = httpx.post(routed.url + "/v1/chat/completions", timeout=30,
                         headers={"Authorization": f"Bearer {key}"},
                         json={"model": "auto", "messages": [{"role": "user", "content": "hard " * 30}]})
    message = refused.json()["error"]["message"]
    assert "(prompt plus one output token on each tier of route 'auto'" in message
    assert message.endswith("; shorten the prompt, or call one model instead of route 'auto'"), message


def test_policies_limit_routes_and_pick_the_default(routed):
    _, only_small = new_tenant(routed, allowed_models=["small"])
    for model in ("auto", "three", "large"):
        refused = complete(routed, only_small, "easy one", model=model)
        assert refused.status_code == 403, model
        assert refused.json()["error"]["code"] == "model_not_allowed"
    assert complete(routed, only_small, "easy one", model="small").status_code == 200
    listed = httpx.get(routed.url + "/v1/models",
                       headers={"Authorization": f"Bearer {only_small}"}).json()["data"]
    assert [m["id"] for m in listed] == ["small"]

    three_name, three = new_tenant(routed, allowed_models=["three"], default_route="three")
    headers = complete(routed, three, "hard one").headers  # auto is this tenant's "three"
    assert (headers["x-switchboard-route"], headers["x-switchboard-model"]) == ("three", "medium")
    requests = routed.app.state.gateway.metrics.requests
    # Counted (once its answer is sent) under the route `auto` names for it, not as "auto".
    assert eventually(lambda: requests.value(tenant=three_name, model="three", status="200") == 1)
    listed = httpx.get(routed.url + "/v1/models",
                       headers={"Authorization": f"Bearer {three}"}).json()["data"]
    assert [m["id"] for m in listed] == ["auto", "three"]
    _, anyone = new_tenant(routed)  # the server's default route is named "auto": listed once
    listed = [m["id"] for m in httpx.get(routed.url + "/v1/models",
                                         headers={"Authorization": f"Bearer {anyone}"}).json()["data"]]
    assert listed.count("auto") == 1 and len(set(listed)) == len(listed)
    _, only_auto = new_tenant(routed, allowed_models=["auto"])
    listed = httpx.get(routed.url + "/v1/models",
                       headers={"Authorization": f"Bearer {only_auto}"}).json()["data"]
    assert [m["id"] for m in listed] == ["auto"]
    bad = routed.admin("POST", "/admin/tenants", json={"name": "x1", "default_route": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "default_route"
    many = complete(routed, three, "easy one", n=2)
    assert many.status_code == 400 and many.json()["error"]["param"] == "n"
    two = complete(routed, three, ["easy one", "easy two"])
    assert two.status_code == 400 and two.json()["error"]["param"] == "prompt"


def test_a_tenant_s_default_route_the_server_no_longer_declares_gives_way_to_the_server_s(
        engines, tmp_path, caplog):
    """Restarted without the route a tenant's `auto` meant, the server gives the tenant its own
    default route (the tenant's `auto` was a 404 and left out of /v1/models), and logs a warning
    saying what to change. A change of its allowed_models that leaves out the old route is refused
    saying how to clear it (it said to add the route to them, which is refused as not served)."""
    declared = {"auto": {"tiers": ["small", "large"], "measure": "min_prob", "threshold": 0.5},
                "three": {"tiers": ["small", "medium", "large"], "threshold": 0.5}}
    with serve_gateway(engines, tmp_path, routes=parse_routes(declared, engines),
                       default_route="auto") as before:
        name, key = new_tenant(before, default_route="three")
        assert complete(before, key, "hard one").headers["x-switchboard-route"] == "three"
    del declared["three"]
    with caplog.at_level(logging.WARNING, logger="gateway.shadowing"), serve_gateway(
            engines, tmp_path, routes=parse_routes(declared, engines),
            default_route="auto") as after:
        answer = complete(after, key, "hard one")
        listed = httpx.get(after.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        narrowed = after.admin("PATCH", f"/admin/tenants/{name}", json={"allowed_models": ["auto"]})
        cleared = after.admin("PATCH", f"/admin/tenants/{name}",
                              json={"allowed_models": ["auto"], "default_route": None})
    assert narrowed.status_code == 400 and "or to null (the server's default route)" in \
        narrowed.json()["error"]["message"], narrowed.text
    assert cleared.status_code == 200, cleared.text
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-switchboard-route"] == "auto"
    assert "auto" in [m["id"] for m in listed.json()["data"]]
    warnings = [r.getMessage() for r in caplog.records if r.name == "gateway.shadowing"]
    assert len(warnings) == 1 and "has the default route 'three', which this server does not " \
        "declare: its calls to 'auto' get the server's default route 'auto' instead" in warnings[0]


def test_a_route_named_auto_that_is_not_the_default_route_is_warned_of(engines, caplog):
    """`model: "auto"` means the default route: a route named so while default_route names
    another (or none) is reached only by tenants whose own default route it is. That once
    passed unremarked, the route unreachable for everyone else."""
    from gateway.app import check_routes

    declared = {"auto": {"tiers": ["small", "large"], "threshold": 0.5},
                "other": {"tiers": ["small", "large"], "threshold": 0.5}}
    routes = parse_routes(declared, engines)
    warned = []
    for default in ("auto", "other", None):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gateway.app"):
            check_routes(engines, routes, default)
        warned.append([r.getMessage() for r in caplog.records if r.name == "gateway.app"])
    assert warned[0] == []
    for words, messages in zip(("which is 'other'", "which is not set"), warned[1:]):
        assert len(messages) == 1 and "reached only by tenants whose default_route is 'auto'" in \
            messages[0] and words in messages[0] and 'set default_route = "auto"' in messages[0]


def test_a_tenant_s_default_route_is_one_its_allowed_models_hold(routed):
    """Else `auto` is a 403 for the tenant, and /v1/models lists no `auto`."""
    def refused(response: httpx.Response) -> bool:
        return response.status_code == 400 and response.json()["error"]["param"] == "default_route"

    assert refused(routed.admin("POST", "/admin/tenants", json={
        "name": "forbidden-default", "allowed_models": ["three"], "default_route": "learned"}))
    assert routed.admin("GET", "/admin/tenants/forbidden-default").status_code == 404
    name, key = new_tenant(routed, allowed_models=["three"], default_route="three")
    for change in ({"default_route": "learned"}, {"allowed_models": ["auto", "small"]},
                   {"allowed_models": ["learned"], "default_route": "three"}):
        assert refused(routed.admin("PATCH", f"/admin/tenants/{name}", json=change)), change
    tenant = routed.admin("GET", f"/admin/tenants/{name}").json()["tenant"]
    assert (tenant["allowed_models"], tenant["default_route"]) == (["three"], "three")
    assert complete(routed, key, "hard one").headers["x-switchboard-route"] == "three"
    for change in ({"allowed_models": None}, {"default_route": "learned"},
                   {"allowed_models": ["small"], "default_route": None}):
        assert routed.admin("PATCH", f"/admin/tenants/{name}", json=change).status_code == 200
    assert refused(routed.admin("PATCH", f"/admin/tenants/{name}",
                                json={"default_route": "learned"}))


def test_the_spend_budget_stops_a_tenant(routed):
    name, key = new_tenant(routed, monthly_spend_budget_usd=cost("large", 8, 4) * 1.5)
    assert complete(routed, key, "easy one", model="large").status_code == 200
    refused = complete(routed, key, "easy one", model="large")
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "insufficient_quota"
    assert spend(routed, name)["spend_usd"] == pytest.approx(cost("large", 8, 4))


def test_a_chat_without_max_tokens_is_shortened_to_what_the_spend_budget_leaves(routed):
    budget = cost("large", 40, 20)
    name, key = new_tenant(routed, monthly_spend_budget_usd=budget)
    chat = httpx.post(routed.url + "/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "large", "messages": [{"role": "user", "content": "easy one"}]})
    assert chat.status_code == 200, chat.text
    usage = chat.json()["usage"]
    assert chat.json()["choices"][0]["finish_reason"] == "length"
    # As many tokens as the budget pays for, where the rest of the context (hundreds) would not.
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    assert cost("large", prompt, completion) <= budget < cost("large", prompt, completion + 1)
    assert spend(routed, name)["spend_usd"] == pytest.approx(cost("large", prompt, completion))


def test_a_cascade_holds_what_all_its_tiers_may_use_so_no_budget_is_overspent(routed):
    """"hard" escalates: both tiers run and are billed (8 + 4 tokens each), so a call needs 24."""
    name, key = new_tenant(routed, monthly_token_budget=20)
    refused = complete(routed, key, "hard one")  # one tier's 12 fit 20; both tiers' 24 do not
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "request_too_large"
    assert spend(routed, name)["tokens_in"] == 0
    name, key = new_tenant(routed, monthly_token_budget=36)
    assert complete(routed, key, "hard one").headers["x-switchboard-escalated"] == "true"
    assert complete(routed, key, "hard one").status_code == 429  # 24 used, 12 left
    assert (spend(routed, name)["tokens_in"], spend(routed, name)["tokens_out"]) == (16, 8)
    both = cost("small", 8, 4) + cost("large", 8, 4)
    name, key = new_tenant(routed, monthly_spend_budget_usd=both * 0.99)
    refused = complete(routed, key, "hard one")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "request_too_large"
    assert spend(routed, name)["spend_usd"] == 0


def test_a_cascade_never_escalates_into_a_tier_whose_context_cannot_hold_the_call(routed, engines):
    # "hard one" is 8 tokens: with 20 more it fits small's context (256) but not cramped's (24).
    name, key = new_tenant(routed)
    before = len(engines["cramped"].started)
    kept = complete(routed, key, "hard one", model="to-cramped", max_tokens=20)
    assert kept.status_code == 200, kept.text  # once a 400, after billing small's answer
    assert (kept.json()["model"], kept.headers["x-switchboard-escalated"]) == ("small", "false")
    assert len(engines["cramped"].started) == before
    assert spend(routed, name)["tokens_out"] == 20
    # Where it fits, the same prompt escalates.
    escalated = complete(routed, key, "hard one", model="to-cramped", max_tokens=4)
    assert escalated.json()["model"] == "cramped"
    # The route takes what its roomiest tier's context holds, and says so.
    card = httpx.get(routed.url + "/v1/models/to-cramped", headers={"Authorization": f"Bearer {key}"})
    assert card.json()["max_model_len"] == 256
    refused = complete(routed, key, "hard one", model="to-cramped", max_tokens=300)
    assert refused.status_code == 400
    assert "maximum context length is 256 tokens" in refused.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_that_skips_a_first_tier_it_cannot_fit_is_not_an_escalation(routed, engines, stream):
    # "easy one" is 8 tokens: with 20 more it does not fit cramped's context (24).
    _, key = new_tenant(routed)
    metrics = routed.app.state.gateway.metrics

    def counted(*change: int) -> bool:
        """Whether the calls answered by large (not escalated, escalated) and cramped's attempts
        rose by `change` from `before` (a stream counts once it closes)."""
        return eventually(lambda: counts() == tuple(b + c for b, c in zip(before, change)))

    def counts() -> tuple[float, ...]:
        return (*(metrics.routed.value(route="from-cramped", model="large", escalated=escalated)
                  for escalated in ("false", "true")),
                metrics.route_attempts.value(route="from-cramped", model="cramped"))

    started, before = len(engines["cramped"].started), counts()
    skipped = complete(routed, key, "easy one", model="from-cramped", max_tokens=20, stream=stream)
    assert skipped.status_code == 200, skipped.text
    # It once said escalated, with no score, and was counted as an escalation.
    assert (skipped.headers["x-switchboard-model"], skipped.headers["x-switchboard-escalated"],
            skipped.headers.get("x-switchboard-score"),
            skipped.headers.get("x-switchboard-threshold")) == ("large", "false", None, None)
    assert len(engines["cramped"].started) == started
    assert counted(1, 0, 0)
    # Where the first tier runs and is passed over, the call is escalated.
    before = counts()
    escalated = complete(routed, key, "hard one", model="from-cramped", stream=stream)
    assert (escalated.headers["x-switchboard-model"], escalated.headers["x-switchboard-escalated"],
            escalated.headers["x-switchboard-score"]) == ("large", "true", "0.9")
    assert counted(0, 1, 1)


def test_a_call_without_max_tokens_skips_a_tier_that_cannot_fit_its_min_tokens(routed, engines):
    """Its answer fills the rest of the context, but no less than min_tokens: a tier whose context
    cannot hold that is left out, as for a max_tokens it cannot hold. It was run, refused by its
    engine (min_tokens above the max_tokens the call never sent) and counted as an escalation."""
    name, key = new_tenant(routed, monthly_token_budget=1000)
    started = len(engines["cramped"].started)

    def chat(model: str) -> httpx.Response:  # 21 prompt tokens: with 10 more, over cramped's 24
        return httpx.post(routed.url + "/v1/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": model, "min_tokens": 10,
                                "messages": [{"role": "user", "content": "easy"}]})

    skipped = chat("from-cramped")
    assert skipped.status_code == 200, skipped.text
    assert (skipped.headers["x-switchboard-model"], skipped.headers["x-switchboard-escalated"],
            skipped.headers.get("x-switchboard-score")) == ("large", "false", None)
    refused = chat("cramped")
    error = refused.json()["error"]
    assert (refused.status_code, error["param"]) == (400, "min_tokens"), error
    assert error["message"] == (
        "this model's maximum context length is 24 tokens, but you asked for at least 31 (21 in "
        "the prompt, min_tokens = 10 for the output); lower min_tokens or shorten the prompt")
    assert len(engines["cramped"].started) == started
    assert spend(routed, name)["reserved_tokens"] == 0


@pytest.mark.parametrize("max_tokens", [300, 2**31 - 1, 2**63 - 1])
def test_a_call_that_cannot_fit_the_context_is_a_400_before_any_budget_is_held(routed, max_tokens):
    name, key = new_tenant(routed, monthly_token_budget=1000)
    for model in ("small", "auto"):
        refused = complete(routed, key, "easy one", model=model, max_tokens=max_tokens)
        error = refused.json()["error"]
        assert (refused.status_code, error["type"], error["param"]) == \
            (400, "invalid_request_error", "max_tokens"), error
    usage = spend(routed, name)
    assert (usage["reserved_tokens"], usage["tokens_in"]) == (0, 0)


def test_a_prompt_no_tier_can_hold_is_refused_before_anything_is_held(routed, engines):
    name, key = new_tenant(routed, monthly_token_budget=1000)
    started = {model: len(engine.started) for model, engine in engines.items()}
    for model in ("small", "to-cramped", "learned-cramped"):
        refused = complete(routed, key, "hard " * 60, model=model)  # 300 tokens
        error = refused.json()["error"]
        assert (refused.status_code, error["param"]) == (400, "prompt"), error
        # The roomiest tier's refusal (256 tokens, for a learned route's second tier too)
        assert error["message"] == ("the prompt has 300 tokens but this model accepts at most "
                                    "255; shorten the prompt")
    assert {model: len(engine.started) for model, engine in engines.items()} == started
    usage = spend(routed, name)
    assert (usage["reserved_tokens"], usage["tokens_in"]) == (0, 0)


def test_a_learned_route_runs_a_prompt_its_pick_cannot_hold_on_its_other_tier(routed, engines):
    _, key = new_tenant(routed)
    before = len(engines["cramped"].started)
    fits = complete(routed, key, "easy 1000", model="learned-cramped")
    assert fits.json()["model"] == "cramped"  # its pick for easy prompts
    longer = complete(routed, key, "easy 1000 " + "1" * 20, model="learned-cramped")
    assert longer.status_code == 200, longer.text
    assert (longer.json()["model"], longer.headers["x-switchboard-escalated"]) == ("large", "true")
    assert len(engines["cramped"].started) == before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_learned_route_counts_each_tier_it_ran_once_and_reports_a_pick_only_where_it_ran(
        routed, engines, stream):
    """The route's tier calls count a pick that failed and the tier that answered once each (the
    pick was counted twice, the answering tier never), and its score and threshold headers are
    the router's only where its pick ran: a pick left out was never judged (as a cascade's)."""
    _, key = new_tenant(routed)
    metrics = routed.app.state.gateway.metrics

    def tier_calls(route: str) -> dict[str, float]:
        return {m: metrics.route_attempts.value(route=route, model=m)
                for m in ("small", "large", "cramped")}

    def call(route: str, prompt: str, counted: dict[str, int]) -> httpx.Response:
        """The call's response, once the tier calls it counted are `counted`."""
        before = tier_calls(route)
        response = complete(routed, key, prompt, model=route, stream=stream)
        assert response.status_code == 200, response.text
        expected = {m: before[m] + counted.get(m, 0) for m in before}
        assert eventually(lambda: tier_calls(route) == expected), (tier_calls(route), expected)
        return response

    def judged(response: httpx.Response) -> tuple[str, str]:
        return (response.headers.get("x-switchboard-score"),
                response.headers.get("x-switchboard-threshold"))

    picked = call("learned", "hard 1000", {"large": 1})
    score, threshold = map(float, judged(picked))
    assert score >= threshold and picked.headers["x-switchboard-model"] == "large"
    engines["large"].fail = True  # the pick runs and fails before its first token
    failed_over = call("learned", "hard 1000", {"large": 1, "small": 1})
    assert failed_over.headers["x-switchboard-model"] == "small"
    assert judged(failed_over) == judged(picked)  # what the router judged to pick large
    engines["large"].fail = False
    # The pick (cramped, for easy prompts) cannot hold this call: it never runs.
    left_out = call("learned-cramped", "easy 1000 " + "1" * 20, {"large": 1})
    assert (left_out.headers["x-switchboard-model"], judged(left_out)) == ("large", (None, None))


def test_routes_are_checked_at_startup(tmp_path):
    engines = {"small": ScriptedTier("small"), "large": ScriptedTier("large")}
    routes = parse_routes({"auto": {"tiers": ["small", "large"], "threshold": 0.5}}, engines)
    with pytest.raises(ValueError, match="default route 'nope' is not declared"):
        create_app(engines, data_dir=tmp_path, routes=routes, default_route="nope")
    with pytest.raises(ValueError, match="names models that are not served: large"):
        create_app({"small": engines["small"]}, data_dir=tmp_path, routes=routes)


def test_a_learned_route_runs_only_the_model_it_picks(routed, engines):
    name, key = new_tenant(routed)
    small_before, large_before = len(engines["small"].started), len(engines["large"].started)
    easy = complete(routed, key, "easy 1000", model="learned")
    hard = complete(routed, key, "hard 1000", model="learned")
    assert (easy.json()["model"], hard.json()["model"]) == ("small", "large")
    assert (easy.headers["x-switchboard-escalated"], hard.headers["x-switchboard-escalated"]) == \
        ("false", "true")
    assert float(easy.headers["x-switchboard-score"]) < \
        float(easy.headers["x-switchboard-threshold"]) <= float(hard.headers["x-switchboard-score"])
    # One engine call each, no cascade: billed once at the picked model's price.
    assert (len(engines["small"].started), len(engines["large"].started)) == \
        (small_before + 1, large_before + 1)
    assert spend(routed, name)["spend_usd"] == pytest.approx(cost("small", 9, 4) + cost("large", 9, 4))
    chat = httpx.post(routed.url + "/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "learned", "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hard 1000"}]})
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == "large"  # the user's words are routed, not the template


def test_a_learned_route_scores_prompts_off_the_event_loop(routed, monkeypatch):
    """Scoring reads every n-gram of the prompt: about a second for a long context's, during which
    every other call of the gateway once waited."""
    _, key = new_tenant(routed)
    router = routed.app.state.gateway.routes["learned"].router
    score, on_the_loop = router.score, []

    def recorded(text: str) -> float:
        try:
            asyncio.get_running_loop()
            on_the_loop.append(True)
        except RuntimeError:  # no event loop runs in this thread
            on_the_loop.append(False)
        return score(text)

    monkeypatch.setattr(router, "score", recorded)
    assert complete(routed, key, "hard 1000", model="learned").json()["model"] == "large"
    assert on_the_loop == [False]


def test_a_learned_route_runs_its_pick_on_that_model_s_own_tokens(routed):
    _, key = new_tenant(routed)
    easy = complete(routed, key, "easy 1000", model="learned-mixed")
    hard = complete(routed, key, "hard 1000", model="learned-mixed")
    assert (easy.json()["model"], hard.json()["model"]) == ("small", "spaced")
    assert hard.json()["choices"][0]["text"] == "llll"
    assert (easy.json()["usage"]["prompt_tokens"], hard.json()["usage"]["prompt_tokens"]) == \
        (9, 10)  # the spaced tokenizer's space first
    as_ids = complete(routed, key, list(b"easy 1000"), model="learned-mixed")
    assert as_ids.status_code == 400 and as_ids.json()["error"]["param"] == "prompt"
    assert "send the prompt as text" in as_ids.json()["error"]["message"]
    assert complete(routed, key, list(b"easy 1000"), model="learned").json()["model"] == "small"


def test_a_route_over_tokenizers_that_differ_on_a_special_token_reads_the_prompt_with_each(
        chatml_routed):
    """Tokenizers that read most texts alike, but not a special token one of them adds, are
    different tokenizers: the model the route escalates to reads the prompt as it does when
    called by name, and the route refuses token ids, which would mean different tokens to its
    models."""
    _, key = new_tenant(chatml_routed)
    direct = complete(chatml_routed, key, "<|im_start|>hi", model="chatml")
    routed = complete(chatml_routed, key, "<|im_start|>hi", model="casc")
    assert routed.status_code == 200, routed.text
    assert routed.headers["x-switchboard-model"] == "chatml"
    # <s>, <|im_start|>, h, i (the demo model's reading has 15: <s> and 14 bytes)
    assert direct.json()["usage"]["prompt_tokens"] == routed.json()["usage"]["prompt_tokens"] == 4
    as_ids = complete(chatml_routed, key, [256, 258, 104, 105], model="casc")
    assert as_ids.status_code == 400 and as_ids.json()["error"]["param"] == "prompt"
    assert complete(chatml_routed, key, [256, 258, 104, 105], model="chatml").status_code == 200


@pytest.fixture(scope="module")
def strict_routed(demo_engine, router_dir, tmp_path_factory) -> Iterator[GatewayServer]:
    """Routes from a real model whose chat template refuses a system message (as Mistral's first
    templates do) to the demo model, whose template takes it: cascade "casc" (escalating every
    call: no answer is sure of all its tokens) and learned "smart"."""
    from engine.config import EngineConfig
    from engine.demo import build_byte_tokenizer
    from gateway.local_engine import LocalEngineClient

    folder = tmp_path_factory.mktemp("strict")
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
        "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] ")
    tokenizer.save_pretrained(folder)
    save_hf_model(make_hf_model(vocab_size=258, bos_token_id=256, eos_token_id=257), folder)
    strict = LocalEngineClient.load(EngineConfig(model=str(folder), num_kv_blocks=64),
                                    show_progress=False)
    engines = {"strict": strict, DEMO_MODEL: demo_engine}
    routes = parse_routes({
        "casc": {"tiers": ["strict", DEMO_MODEL], "measure": "min_prob", "threshold": 1.0},
        "smart": {"kind": "learned", "tiers": ["strict", DEMO_MODEL], "router": str(router_dir)},
    }, engines)
    try:
        with serve_gateway(engines, tmp_path_factory.mktemp("strict-routed"),
                           routes=routes) as server:
            yield server
    finally:
        strict.close()


def test_a_route_leaves_out_a_tier_whose_chat_template_refuses_the_chat(strict_routed):
    """That model cannot serve the chat, as one whose context cannot hold it: called by name it
    is a 400 naming it; a route runs the chat on its other tiers, without escalating."""
    _, key = new_tenant(strict_routed)

    def chat(model: str, messages: list[dict]) -> httpx.Response:
        return httpx.post(strict_routed.url + "/v1/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": model, "messages": messages, "max_tokens": 3})

    with_system = [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "easy 1000"}]
    refused = chat("strict", with_system)
    error = refused.json()["error"]
    assert (refused.status_code, error["param"]) == (400, "messages"), refused.text
    assert error["message"].startswith("the chat template of 'strict' rejected the messages: Only user")
    for route in ("casc", "smart"):
        response = chat(route, with_system)
        assert response.status_code == 200, response.text
        assert response.headers["x-switchboard-model"] == DEMO_MODEL
        # (a learned route counts its strong tier answering as escalated)
        assert response.headers["x-switchboard-escalated"] == str(route == "smart").lower()
    # A chat the template takes runs on it: the cascade escalates from it.
    cascaded = chat("casc", with_system[1:])
    assert (cascaded.headers["x-switchboard-model"],
            cascaded.headers["x-switchboard-escalated"]) == (DEMO_MODEL, "true")


def test_a_tenant_share_recalibrates_the_threshold_on_its_own_traffic(routed):
    _, key = new_tenant(routed, strong_share=0.5)
    # Traffic that is 3/4 hard: the router's own threshold would send 3/4 to the large model.
    # (Shuffled, so that no trend in the numbers' scores biases the sliding window.)
    prompts = [f"{'easy' if i % 4 == 0 else 'hard'} {i}" for i in range(80)]
    random.Random(0).shuffle(prompts)
    models = [complete(routed, key, p, model="tuned", max_tokens=1).json()["model"]
              for p in prompts]
    late = models[40:]  # once the window is full, the threshold puts half above it
    assert late.count("large") == pytest.approx(len(late) * 0.5, abs=3)
    _, default_key = new_tenant(routed)  # no share of its own: the route's 0.25
    models = [complete(routed, default_key, p, model="tuned", max_tokens=1).json()["model"]
              for p in prompts]
    assert models[40:].count("large") == pytest.approx(40 * 0.25, abs=3)
    # A route that sets no window recalibrates too (it once ignored every share): 500 prompts.
    name, all_strong = new_tenant(routed, strong_share=1.0)
    models = [complete(routed, all_strong, p, model="learned", max_tokens=1).json()["model"]
              for p in prompts[:30]]
    assert models[20:] == ["large"] * 10
    # A tenant made anew under the name starts from the router's own threshold, not from the
    # deleted one's traffic.
    assert routed.admin("DELETE", f"/admin/tenants/{name}").status_code == 200
    anew = routed.new_tenant(name, strong_share=1.0)
    assert [complete(routed, anew, p, model="learned", max_tokens=1).json()["model"]
            for p in prompts[:10]] == models[:10] != ["large"] * 10


def test_routes_are_counted_per_route_and_tier(routed):
    name, key = new_tenant(routed)
    complete(routed, key, "easy one")
    complete(routed, key, "hard one")
    metrics = routed.app.state.gateway.metrics
    assert metrics.routed.value(route="auto", model="small", escalated="false") >= 1
    assert metrics.routed.value(route="auto", model="large", escalated="true") >= 1
    assert metrics.route_attempts.value(route="auto", model="small") >= 2
    # Tokens and spend count under the model that used them: the escalated call's small attempt
    # under small (it once went under the model that answered).
    assert metrics.spend.value(tenant=name, model="large") == pytest.approx(cost("large", 8, 4))
    assert metrics.spend.value(tenant=name, model="small") == pytest.approx(2 * cost("small", 8, 4))
    assert metrics.generation_tokens.value(tenant=name, model="small") == 8
    assert metrics.prompt_tokens.value(tenant=name, model="large") == 8
    text = routed.admin("GET", "/metrics").text
    assert 'switchboard_routed_requests_total{route="auto",model="large",escalated="true"}' in text


def test_a_tier_passed_over_and_dropped_at_once_has_its_answer_closed():
    """Dropped as soon as held (a later tier was surer), its read never began, so the `finally`
    that closes its answer (aborting the engine request) never ran: the request was left to
    garbage collection."""
    from gateway.cascade import Attempt, _PassedOver
    from gateway.generation import Tier

    class Answer:  # an engine's answer stream that is not a generator: GC never closes it
        closed = False

        def __aiter__(self):
            return self

        async def __anext__(self) -> GenerationChunk:
            await asyncio.Event().wait()  # the engine is still making it
            raise AssertionError("unreachable")  # pragma: no cover

        async def aclose(self) -> None:
            self.closed = True

    async def drop_at_once() -> Answer:
        answer = Answer()
        held = _PassedOver(Tier(DEMO_MODEL, None), answer, [], 0.1, 0)
        await held.drop([Attempt(DEMO_MODEL, 0.1, 0.5, 0, 0)])
        return answer

    assert asyncio.run(drop_at_once()).closed


def test_score_and_threshold_headers_keep_every_digit():
    # A learned route whose strong share rounds to no prompt sets its threshold one float step above
    # the top score: rounded to six digits, the headers showed a score equal to the threshold.
    score = 0.909717
    threshold = math.nextafter(score, math.inf)
    assert (float(_number(score)), float(_number(threshold))) == (score, threshold)
    assert _number(0.5) == "0.5" and _number(None) == "none"
