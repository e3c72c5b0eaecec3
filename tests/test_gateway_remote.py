"""The gateway over the worker registry, in-process: a model whose only worker cannot be reached
answers 503 `engine_unavailable` at once (no hang), and its adapter uploads 503 too. Over real
workers (in-process, on the demo engine): a gateway streams from them past any connection limit
of its own, counts each call against its worker from the moment it places it there, sends an
adapter's files to a worker once however many calls need them at once, serves each adapter on
the workers whose --max-lora-rank holds its rank, and sees a worker that shuts down leave the pool
at once, its calls ending for their clients to send them again. A restarted worker drops the
files of deleted adapters where the gateways' store is the registry's Redis, and only files no
call used for a day where a gateway keeps its adapter records in a store of its own."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest
import redis

from gateway.engine_client import (AdapterRef, DamagedAdapterCopy, EngineStats, EngineUnavailable,
                                   GatewayOutOfFiles, GenerationChunk, RequestRejected,
                                   SamplingOptions)
from gateway.remote import (DEFAULT_POLL_S, RemoteEngineClient, WorkerPool, _stream_lines,
                            _WorkerTotals)
from gateway.worker import Worker, create_worker_app, tokenizer_files
from gateway.worker_api import ADAPTERS_PATH, CHECK_ADAPTER_PATH, GENERATE_PATH, GenerateBody
from routing.placement import home_of
from store import RedisStore
from store.blobs import ADAPTER_FILES, UNUSED_BLOB_S, BlobStore, digest_files, ensure_intact_copy
from store.workers import ModelSeen, WorkerRecord, WorkerRegistry, files_digest
from tests.conftest import (DEMO_MODEL, NARROW_MAX_LORA_RANK, leave_while_sending, run_server,
                            send_partly, serve_gateway)
from tests.helpers import (damage_adapter_files, fill_volume, no_open_file_left, small_volume,
                           use_up_inodes)
from tests.redis_server import redis_server, redis_url  # noqa: F401
from tests.test_gateway_routing import eventually
from tests.test_scaleout_adapters import demo_adapter, upload

GHOST = "ghost"
_HEARTBEAT_S = 0.1
# A worker's record outlives its last heartbeat by 5 s: the worker's thread, stalled by a busy
# machine, does not drop out of the registry between a test's calls.
_LAPSE_BEATS = 50
_names = itertools.count()


def _record(worker_id: str, load: int = 0, beat_at: float = 0.0, **fields) -> WorkerRecord:
    """A worker of GHOST at an address where nothing listens (unless `fields` say otherwise)."""
    stats = EngineStats(num_running=load, num_waiting=0, kv_blocks_total=1, kv_blocks_used=0,
                        prefix_cache_hit_rate=0.0, num_prompt_tokens=0, num_generation_tokens=0,
                        num_preemptions=0)
    values = dict(id=worker_id, url="http://127.0.0.1:1", model=GHOST, max_model_len=64,
                  max_loras=1, tokenizer=None, num_running=load, num_waiting=0,
                  adapters_device=[], adapters_host=[], stats=msgspec.json.encode(stats),
                  beat_at=beat_at)
    return WorkerRecord(**{**values, **fields})


def _register_unreachable_worker(url: str, record: WorkerRecord | None = None) -> None:
    record = record or _record("gone")

    async def register() -> None:
        registry = WorkerRegistry.open(url)
        await registry.heartbeat(record, ttl_s=60)
        await registry.close()

    asyncio.run(register())


class _Registry:
    """What WorkerPool.refresh() reads; nothing here needs Redis. `records` are the workers up;
    as in Redis, their heartbeats leave their models seen."""

    def __init__(self) -> None:
        self.records: list[WorkerRecord] = []
        self.seen: dict[str, ModelSeen] = {}
        self.tokenizers: dict[str, dict[str, bytes]] = {}
        self.reading: dict[str, str] = {}  # model -> the tokenizer gateways read its prompts with

    def publish_tokenizer(self, files: dict[str, bytes]) -> str:
        """Publish tokenizer files as a worker does; their digest."""
        digest = files_digest(files)
        self.tokenizers[digest] = files
        return digest

    async def internal_key(self) -> str:
        return "k"

    async def get_tokenizer(self, digest: str) -> dict[str, bytes] | None:
        return self.tokenizers.get(digest)

    async def workers(self) -> list[WorkerRecord]:
        for r in self.records:
            before = self.seen.get(r.model)
            rank_beats = {} if before is None else dict(before.rank_beats)
            if r.supports_adapters and r.max_lora_rank is not None:
                rank_beats[r.max_lora_rank] = r.beat_at
            self.seen[r.model] = msgspec.structs.replace(ModelSeen.of(r), adapters_beat_at=(
                r.beat_at if r.supports_adapters else before and before.adapters_beat_at),
                rank_beats=rank_beats)
        return self.records

    async def models_seen(self) -> dict[str, ModelSeen]:
        return self.seen

    async def reading_tokenizers(self) -> dict[str, str]:
        return dict(self.reading)

    async def set_reading_tokenizer(self, model: str, digest: str) -> None:
        self.reading[model] = digest


class _Requests:
    """An ASGI app that records each HTTP request's (method, path) as it arrives, then hands it to
    `app`: what a worker was asked to do, seen from the worker's side."""

    def __init__(self, app) -> None:
        self.app = app
        self.seen: list[tuple[str, str]] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.seen.append((scope["method"], scope["path"]))
        await self.app(scope, receive, send)


@contextlib.contextmanager
def _serving_worker(engine, registry_url: str, folder: Path, worker_id: str,
                    shutdown_timeout_s: float = 5, drops_blobs: bool = False,
                    in_front: Callable | None = None, model: str = DEMO_MODEL,
                    heartbeat_s: float = _HEARTBEAT_S) -> Iterator[_Requests]:
    """A real worker of `model` over `engine`, registered in the Redis at `registry_url` and
    serving on a loopback port until the block ends, then shut down as `switchboard worker` is
    (its calls in flight get `shutdown_timeout_s`); yields the record of what it was asked.
    `drops_blobs`: it drops the adapter files no request will need, as `switchboard worker`
    does (else it keeps them all). `in_front`: wraps the worker's ASGI app."""
    registry = WorkerRegistry.open(registry_url)
    worker = Worker(model=model, engine=engine, url="", blobs=BlobStore(folder),
                    registry=registry, tokenizer_files={}, heartbeat_s=heartbeat_s,
                    lapse_beats=_LAPSE_BEATS, id=worker_id,
                    store_url=registry_url if drops_blobs else None)
    requests = _Requests(create_worker_app(worker))
    app = requests if in_front is None else in_front(requests)
    # NOTE: its URL set before it starts: a record without one, read by a gateway already
    # running, got the first calls, which failed (503) until the next read of the registry.
    with run_server(app, shutdown_timeout_s, on_shutdown=worker.begin_shutdown,
                    on_bound=lambda url: setattr(worker, "url", url)) as url:

        async def published() -> None:
            reader = WorkerRegistry.open(registry_url)
            try:
                while not any(r.id == worker_id and r.url == url for r in await reader.workers()):
                    await asyncio.sleep(_HEARTBEAT_S / 2)
            finally:
                await reader.close()

        asyncio.run(asyncio.wait_for(published(), 10))
        yield requests


async def _registered(registry_url: str) -> list[str]:
    """The ids of the workers registered in the Redis at `registry_url`."""
    registry = WorkerRegistry.open(registry_url)
    try:
        return sorted(r.id for r in await registry.workers())
    finally:
        await registry.close()


async def _address_and_key(registry_url: str, worker_id: str) -> tuple[str, str]:
    """Where worker `worker_id` serves, and the internal key gateways send it, as Redis has them."""
    registry = WorkerRegistry.open(registry_url)
    try:
        url = next(r.url for r in await registry.workers() if r.id == worker_id)
        return url, await registry.internal_key()
    finally:
        await registry.close()


@contextlib.asynccontextmanager
async def _gateway_pool(registry_url: str, folder: Path,
                        **options) -> AsyncIterator[WorkerPool]:
    """A gateway's pool over the workers registered in the Redis at `registry_url`, read once (it
    does not poll, so that each test decides when the gateway sees their heartbeats); `options`
    go to WorkerPool."""
    pool = WorkerPool(WorkerRegistry.open(registry_url), folder, lambda tokenizer_dir: None, {},
                      **options)
    await pool.refresh()
    try:
        yield pool
    finally:
        await pool.close()


async def _token_ids(client: RemoteEngineClient, request_id: str, max_tokens: int,
                     adapter: AdapterRef | None = None) -> list[int]:
    """The whole greedy answer to a fixed prompt, through `client`."""
    options = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = []
    async for chunk in client.generate([1, 2, 3], options, request_id=request_id, adapter=adapter):
        tokens += chunk.token_ids
    return tokens


async def _load_in_registry(pool: WorkerPool, worker_id: str) -> int | None:
    return next((r.load for r in await pool.registry.workers() if r.id == worker_id), None)


def _counted(pool: WorkerPool) -> dict[str, int]:
    """This gateway's calls counted against each worker's load now (workers with none left out)."""
    return {worker_id: n for worker_id, n in pool.inflight.items() if n}


@pytest.fixture(scope="module")
def second_engine(demo_engine, demo_model_dir) -> Iterator:
    """Another engine over the demo model (built, as demo_engine, with one intra-op thread), so
    that two workers each report a load of their own."""
    from engine.config import EngineConfig
    from gateway.local_engine import LocalEngineClient

    engine = LocalEngineClient.load(EngineConfig(model=str(demo_model_dir), num_kv_blocks=512),
                                    show_progress=False)
    yield engine
    engine.close()


def _completion(url: str, key: str, model: str, max_tokens: int) -> httpx.Response:
    """A greedy completion of a fixed prompt of token ids, its tokens named by their ids."""
    return httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      timeout=30, json={"model": model, "prompt": [1, 2, 3], "temperature": 0,
                                        "max_tokens": max_tokens, "ignore_eos": True,
                                        "logprobs": 0, "return_tokens_as_token_ids": True})


def _serves(url: str, key: str) -> bool:
    """Whether the gateway at `url` answers a call to DEMO_MODEL (it has seen a worker of it)."""
    return _completion(url, key, DEMO_MODEL, 1).status_code == 200


def _answer_ids(reply: httpx.Response) -> list[int]:
    assert reply.status_code == 200, reply.text
    return [int(t.removeprefix("token_id:"))
            for t in reply.json()["choices"][0]["logprobs"]["tokens"]]


def test_a_model_whose_workers_cannot_be_reached_answers_503(redis_url, tmp_path):  # noqa: F811
    _register_unreachable_worker(redis_url)
    with serve_gateway({}, tmp_path, store_url=redis_url, workers_url=redis_url,
                       load_tokenizer=lambda folder: None) as server:
        url = server.url
        key = server.new_tenant("acme", rpm=2)
        headers = {"Authorization": f"Bearer {key}"}
        models = httpx.get(url + "/v1/models", headers=headers).json()["data"]
        assert [m["id"] for m in models] == [GHOST]

        def upload() -> httpx.Response:
            return httpx.post(url + "/v1/adapters", headers=headers, timeout=10,
                              data={"name": "a", "base_model": GHOST},
                              files={"adapter_config.json": b"{}", "adapter_model.safetensors": b"x"})

        first = upload()  # the worker is not known to be down yet: the check tries it first
        assert first.status_code == 503 and first.json()["error"]["code"] == "engine_unavailable", \
            first.text
        reply = httpx.post(url + "/v1/completions", headers=headers, timeout=10,
                           json={"model": GHOST, "prompt": [1, 2, 3], "max_tokens": 2})
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "engine_unavailable"
        assert "switchboard worker --model ghost=PATH" in reply.json()["error"]["message"]
        again = upload()
        assert again.status_code == 503, again.text
        assert httpx.get(url + "/v1/adapters", headers=headers).json()["data"] == []
        # Known to be down, it costs no rate limit: 503s, never a 429 (rpm 2), none billed.
        for _ in range(3):
            reply = httpx.post(url + "/v1/completions", headers=headers, timeout=10,
                               json={"model": GHOST, "prompt": [1, 2, 3], "max_tokens": 2})
            assert reply.status_code == 503, reply.text
        usage = server.admin("GET", "/admin/tenants/acme").json()["usage"]
        assert usage["requests"] == 0
        # Not ready while no engine can take a request (it once answered 200 "ok").
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["unavailable_models"] == [GHOST]


def test_a_worker_model_with_the_name_of_an_adapter_is_warned_of_once_and_lists_it_as_base_name(
        demo_engine, redis_url, tmp_path, caplog):  # noqa: F811
    """A model whose first worker registers after a tenant uploaded an adapter of its name takes
    the name: the gateway warns of the adapter once, however often it reads the registry."""
    with caplog.at_level(logging.WARNING, logger="gateway.shadowing"), serve_gateway(
            {DEMO_MODEL: demo_engine}, tmp_path, store_url=redis_url, workers_url=redis_url,
            load_tokenizer=lambda folder: None) as server:
        key = server.new_tenant("early")
        upload(server, key, GHOST, demo_adapter(tmp_path / "adapter"))
        _register_unreachable_worker(redis_url)
        assert eventually(lambda: any(r.name == "gateway.shadowing" for r in caplog.records))
        time.sleep(4 * DEFAULT_POLL_S)  # read again and again: no other warning
        cards = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    warnings = [r.getMessage() for r in caplog.records if r.name == "gateway.shadowing"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"adapter {GHOST!r} of tenant 'early' (base model {DEMO_MODEL!r}) "
                                  f"has the name of the served model {GHOST!r}")
    assert [c["id"] for c in cards.json()["data"]] == [DEMO_MODEL, GHOST, f"{DEMO_MODEL}:{GHOST}"]


def test_a_worker_model_with_the_name_of_a_route_leaves_the_route_as_it_is_with_a_warning(
        demo_engine, redis_url, tmp_path, caplog):  # noqa: F811
    """A route's name a worker's model takes (a worker registered before the gateway starts, or
    after) keeps meaning the route: the gateway starts (it once refused to), logs a warning that
    says what to change, and lists the name once, as the route (it once listed it twice)."""
    from routing.routes import parse_routes

    routes = parse_routes({"fast": {"tiers": [DEMO_MODEL, GHOST], "threshold": 0.0}}, None)
    _register_unreachable_worker(redis_url)
    _register_unreachable_worker(redis_url, _record("clashing", model="fast"))
    with caplog.at_level(logging.WARNING, logger="gateway.shadowing"), serve_gateway(
            {DEMO_MODEL: demo_engine}, tmp_path, store_url=redis_url, workers_url=redis_url,
            routes=routes, load_tokenizer=lambda folder: None) as server:
        key = server.new_tenant("acme")
        headers = {"Authorization": f"Bearer {key}"}
        cards = httpx.get(server.url + "/v1/models", headers=headers).json()["data"]
        card = httpx.get(server.url + "/v1/models/fast", headers=headers).json()
        reply = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                           json={"model": "fast", "prompt": [1, 2, 3], "max_tokens": 2})
    assert [c["id"] for c in cards] == [DEMO_MODEL, GHOST, "fast"]
    assert card["max_model_len"] == demo_engine.max_model_len  # the route's, from its tier
    # The route's answer (its tiers read prompts differently), not the unreachable worker's 503.
    assert reply.status_code == 400 and "route 'fast'" in reply.json()["error"]["message"], reply.text
    warnings = [r.getMessage() for r in caplog.records if r.name == "gateway.shadowing"]
    assert warnings == [
        "engine workers serve a model named 'fast', which is the name of the route 'fast': calls "
        "naming 'fast' run the route, never the model, and /v1/models leaves the model out; start "
        "the workers with another name for it (--model NAME=PATH), or rename the route"]


def test_a_burst_is_placed_by_this_gateways_live_counts_not_a_stale_heartbeat(tmp_path):
    from gateway.remote import WorkerPool
    from routing.placement import place

    registry = _Registry()
    pool = WorkerPool(registry, tmp_path, lambda folder: None, {})
    # Our 16 requests ran on "a" when it last heartbeat; "b" also runs 3 of another gateway's.
    pool.inflight = {"a": 16, "b": 0}
    registry.records = [_record("a", 16, 1.0), _record("b", 3, 1.0)]
    asyncio.run(pool.refresh())
    pool.inflight["a"] = 0  # they finished since; a burst of 8 arrives before the next heartbeat
    chosen = []
    for i in range(8):
        worker = place(pool.candidates(GHOST, set()), f"req-{i}").id
        pool.inflight[worker] += 1
        chosen.append(worker)
    assert chosen.count("a") == 5 and chosen.count("b") == 3  # even: 5 + 0 and 3 + 3
    asyncio.run(pool.http.aclose())


def test_the_counts_of_workers_gone_are_forgotten(tmp_path):
    """Each worker started takes a new id: a gateway kept counts of every worker it ever saw."""
    from gateway.remote import WorkerPool

    registry = _Registry()
    pool = WorkerPool(registry, tmp_path, lambda folder: None, {})
    registry.records = [_record("old", 0, 1.0), _record("gone", 0, 1.0)]
    asyncio.run(pool.refresh())
    with pool.placed_on("old"):
        pass
    with pool.placed_on("gone"):
        registry.records = [_record("new", 0, 2.0)]  # a rolling restart
        asyncio.run(pool.refresh())
        assert pool.inflight == {"gone": 1}  # a request still placed there is counted down
    asyncio.run(pool.refresh())
    assert (pool.inflight, pool._inflight_at_beat) == ({}, {"new": 0})
    asyncio.run(pool.http.aclose())


def _upload_for_ghost(redis_url: str, folder: Path) -> httpx.Response:
    """An upload for GHOST through a gateway over the workers in the Redis at `redis_url`."""
    with serve_gateway({}, folder, store_url=redis_url, workers_url=redis_url,
                       load_tokenizer=lambda folder: None) as server:
        key = server.new_tenant("acme")
        return httpx.post(server.url + "/v1/adapters", headers={"Authorization": f"Bearer {key}"},
                          data={"name": "a", "base_model": GHOST}, timeout=10,
                          files={"adapter_config.json": b"{}", "adapter_model.safetensors": b"x"})


def test_an_upload_for_a_model_whose_workers_run_no_adapter_slots_says_to_start_one_that_does(
        redis_url, tmp_path):  # noqa: F811
    _register_unreachable_worker(redis_url, _record("plain", max_loras=0))
    refused = _upload_for_ghost(redis_url, tmp_path)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"] == {
        "message": f"{GHOST!r} is served by engine workers all started without adapter slots "
                   "(--max-loras 0), so it runs no adapters: the operator must start a worker of "
                   "it with --max-loras above 0; you may upload adapters for no base model "
                   "served now",
        "type": "invalid_request_error", "param": "base_model", "code": "adapters_not_served"}


def test_an_upload_while_the_only_worker_with_adapter_slots_restarts_is_told_to_retry_shortly(
        redis_url, tmp_path):  # noqa: F811
    """Among workers without adapter slots: it once got the 400 saying none runs adapters."""
    _register_unreachable_worker(redis_url, _record("lora", max_loras=4, beat_at=time.time()))

    async def leave() -> None:  # as a worker that shuts down cleanly
        registry = WorkerRegistry.open(redis_url)
        await registry.remove("lora")
        await registry.close()

    asyncio.run(leave())
    _register_unreachable_worker(redis_url, _record("plain", max_loras=0, beat_at=time.time()))
    refused = _upload_for_ghost(redis_url, tmp_path)
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "2"  # as a call that no engine can take now
    assert refused.json()["error"] == {
        "message": f"cannot check the adapter now: no engine worker of {GHOST!r} with adapter slots "
                   "is up now (those up were started with --max-loras 0); retry shortly, or start "
                   "one with --max-loras above 0",
        "type": "server_error", "param": None, "code": "engine_unavailable"}


def test_adapter_requests_go_only_to_workers_that_serve_adapters_and_the_context_outlives_a_restart(
        tmp_path):
    registry = _Registry()
    pool = WorkerPool(registry, tmp_path, lambda folder: None, {})
    registry.records = [_record("lora", max_loras=4), _record("plain", max_loras=0)]
    asyncio.run(pool.refresh())
    assert {c.id for c in pool.candidates(GHOST, set())} == {"lora", "plain"}
    assert [c.id for c in pool.candidates(GHOST, set(), adapter_rank=0)] == ["lora"]
    client = RemoteEngineClient(GHOST, pool, None, None)
    assert client.max_model_len == 64
    registry.records = []  # every worker restarting at once
    asyncio.run(pool.refresh())
    assert client.max_model_len == 64  # it was 0: an answer without max_tokens got 1 token
    asyncio.run(pool.http.aclose())


def test_a_record_written_without_max_lora_rank_is_read_as_a_worker_serving_any_rank(
        redis_url, tmp_path):  # noqa: F811
    import redis

    older = msgspec.structs.asdict(_record("older"))
    del older["max_lora_rank"]  # as a worker of an older version writes its record
    with redis.Redis.from_url(redis_url) as client:
        client.set("sb:worker:older", msgspec.json.encode(older))
        client.sadd("sb:workers", "older")
    _register_unreachable_worker(redis_url, _record("narrow", max_lora_rank=NARROW_MAX_LORA_RANK))

    async def serving(rank: int) -> list[str]:
        async with _gateway_pool(redis_url, tmp_path) as pool:
            return sorted(c.id for c in pool.candidates(GHOST, set(), adapter_rank=rank))

    assert asyncio.run(serving(NARROW_MAX_LORA_RANK)) == ["narrow", "older"]
    assert asyncio.run(serving(NARROW_MAX_LORA_RANK + 1)) == ["older"]


def test_a_worker_address_that_answers_no_worker_json_is_passed_over(redis_url, tmp_path):  # noqa: F811
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse
    from starlette.routing import Route

    from tests.conftest import run_server

    async def bad_gateway(request):
        return HTMLResponse("<html><body>502 Bad Gateway</body></html>", status_code=502)

    proxy = Starlette(routes=[Route("/{path:path}", bad_gateway, methods=["GET", "POST", "PUT"])])
    with run_server(proxy) as proxy_url:
        _register_unreachable_worker(redis_url, _record("proxied", url=proxy_url))
        with serve_gateway({}, tmp_path, store_url=redis_url, workers_url=redis_url,
                           load_tokenizer=lambda folder: None) as server:
            key = server.new_tenant("acme")
            reply = httpx.post(server.url + "/v1/completions", timeout=10,
                               headers={"Authorization": f"Bearer {key}"},
                               json={"model": GHOST, "prompt": [1, 2, 3], "max_tokens": 2})
    assert reply.status_code == 503, reply.text  # was a 500 (JSON is malformed)
    assert reply.json()["error"]["code"] == "engine_unavailable"



def test_a_route_over_workers_not_started_yet_answers_503_not_a_failed_startup(
        redis_url, tmp_path):  # noqa: F811
    from routing.routes import parse_routes

    routes = parse_routes({"auto": {"tiers": [GHOST, "later"], "threshold": 0.5}}, None)
    # No worker serves either model yet: the gateway once exited at startup (a crash loop for
    # a gateway restarted while its workers restart).
    with serve_gateway({}, tmp_path, store_url=redis_url, workers_url=redis_url, routes=routes,
                       default_route="auto", load_tokenizer=lambda folder: None) as server:
        key = server.new_tenant("early")
        assert httpx.get(server.url + "/health").status_code == 503
        reply = httpx.post(server.url + "/v1/completions", timeout=10,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"model": "auto", "prompt": [1, 2, 3], "max_tokens": 2})
        headers = {"Authorization": f"Bearer {key}"}
        listed = httpx.get(server.url + "/v1/models", headers=headers)
        one = httpx.get(server.url + "/v1/models/auto", headers=headers)
    assert reply.status_code == 503, reply.text
    error = reply.json()["error"]
    assert error["code"] == "engine_unavailable" and "no engine worker serves" in error["message"]
    # Listed, with no context length until its models are served (this listing once failed).
    assert listed.status_code == 200 and one.status_code == 200, listed.text
    assert [(m["id"], m["max_model_len"]) for m in listed.json()["data"]] == [("auto", None)]
    assert one.json() == listed.json()["data"][0]


def test_a_route_answers_from_its_served_tiers_while_a_worker_model_is_not_served(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    """A route over a model of this gateway and one of engine workers that are not up (not
    started yet, or gone long enough that the pool stopped serving their model): the route
    leaves that tier out, as it does while the model's workers are all down. It once answered a
    503 that clients retry, for as long as no worker came back, though its other tier was up."""
    from routing.learned import Example, train_router
    from routing.routes import parse_routes

    router, _ = train_router([Example(f"{word} {i}", word == "easy") for i in range(20)
                              for word in ("easy", "hard")], target_strong_share=0.5, epochs=5)
    router.save(tmp_path / "router")
    # Whichever tier the router picks, one of these has GHOST there.
    learned = [{"kind": "learned", "tiers": tiers, "router": str(tmp_path / "router")}
               for tiers in ([DEMO_MODEL, GHOST], [GHOST, DEMO_MODEL])]
    routes = parse_routes({
        "first": {"tiers": [GHOST, DEMO_MODEL], "measure": "min_prob", "threshold": 1.0},
        "last": {"tiers": [DEMO_MODEL, GHOST], "measure": "min_prob", "threshold": 1.0},
        **{f"learned-{i}": route for i, route in enumerate(learned)},
        "nowhere": {"tiers": [GHOST, "later"], "threshold": 0.5}}, None)
    with serve_gateway({DEMO_MODEL: demo_engine}, tmp_path, store_url=redis_url,
                       workers_url=redis_url, routes=routes) as server:
        key = server.new_tenant("acme")
        direct = _answer_ids(_completion(server.url, key, DEMO_MODEL, 3))
        names = ["first", "last", *(f"learned-{i}" for i in range(len(learned)))]
        replies = [_completion(server.url, key, route, 3) for route in names]
        nowhere = _completion(server.url, key, "nowhere", 3)
        listed = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        usage = server.admin("GET", "/admin/tenants/acme").json()["usage"]
    assert [_answer_ids(r) for r in replies] == [direct] * len(names)
    assert [r.headers["x-switchboard-model"] for r in replies] == [DEMO_MODEL] * len(names)
    assert [r.headers["x-switchboard-escalated"] for r in replies[:2]] == ["false"] * 2
    assert (usage["requests"], usage["tokens_out"]) == (1 + len(names), 3 + 3 * len(names))
    assert nowhere.status_code == 503, nowhere.text  # no tier it names is served
    assert nowhere.json()["error"]["code"] == "engine_unavailable"
    lengths = {m["id"]: m["max_model_len"] for m in listed.json()["data"]}
    assert (lengths["first"], lengths["last"], lengths["nowhere"]) == \
        (demo_engine.max_model_len,) * 2 + (None,)


def test_a_cascade_into_a_model_whose_workers_are_down_answers_from_the_tier_it_ran(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    """A cascade whose last tier's only worker cannot be reached answers from its first tier,
    billed once: the call that finds the worker down, after its first tier ran (it once got a
    503 that clients retry, billing that tier again each time), and the calls after, which leave
    the tier out before running any."""
    from routing.routes import parse_routes

    routes = parse_routes({"escalating": {"tiers": [DEMO_MODEL, GHOST], "measure": "min_prob",
                                          "threshold": 1.0}}, None)
    _register_unreachable_worker(redis_url)
    with _serving_worker(demo_engine, redis_url, tmp_path / "worker", "up"), serve_gateway(
            {}, tmp_path / "gateway", store_url=redis_url, workers_url=redis_url, routes=routes,
            load_tokenizer=lambda folder: None) as server:
        key = server.new_tenant("acme")
        replies = [_completion(server.url, key, "escalating", 2) for _ in range(2)]
        usage = server.admin("GET", "/admin/tenants/acme").json()["usage"]
    assert [len(_answer_ids(r)) for r in replies] == [2, 2]
    assert [(r.headers["x-switchboard-model"], r.headers["x-switchboard-escalated"])
            for r in replies] == [(DEMO_MODEL, "true"), (DEMO_MODEL, "false")]
    assert (usage["requests"], usage["tokens_in"], usage["tokens_out"]) == (2, 6, 4)


def test_a_model_whose_workers_all_have_a_new_tokenizer_is_read_with_it(demo_model_dir, tmp_path):
    from engine.tokenizer import load_tokenizer

    registry, models = _Registry(), {}
    old, new = (registry.publish_tokenizer(tokenizer_files(demo_model_dir) | {
        "chat_template.jinja": template.encode()}) for template in [
            "{{ messages[0]['content'] }}", "NEW {{ messages[0]['content'] }}"])
    pool = WorkerPool(registry, tmp_path, load_tokenizer, models)
    registry.records = [_record("a", tokenizer=old), _record("b", tokenizer=old)]
    asyncio.run(pool.refresh())
    chat = [{"role": "user", "content": "hi"}]
    assert models[GHOST].render_chat(chat) == "hi"
    registry.records = [_record("a", tokenizer=old), _record("b", tokenizer=new)]
    asyncio.run(pool.refresh())  # halfway through an upgrade: still the old one
    assert models[GHOST].render_chat(chat) == "hi"
    # A gateway started now reads as the others do (it once took the last worker's, by id: b's).
    later_models: dict = {}
    later = WorkerPool(registry, tmp_path / "later", load_tokenizer, later_models)
    asyncio.run(later.refresh())
    assert later_models[GHOST].render_chat(chat) == "hi"
    registry.records = [_record("b", tokenizer=new), _record("c", tokenizer=new)]
    for each in (pool, later):
        asyncio.run(each.refresh())  # it once kept the old template for good
    assert models[GHOST].render_chat(chat) == later_models[GHOST].render_chat(chat) == "NEW hi"
    assert registry.reading == {GHOST: new}
    for each in (pool, later):
        asyncio.run(each.http.aclose())


def test_the_prefix_cache_hit_rate_over_workers_is_their_hits_over_their_lookups():
    """It weighted each worker's own rate by the prompt tokens it computed, which leave out the
    tokens its cache served: a worker whose cache served most of its prompts weighed least."""
    def stats(computed: int, queried: int, cached: int) -> EngineStats:
        return EngineStats(num_running=0, num_waiting=0, kv_blocks_total=8, kv_blocks_used=0,
                           prefix_cache_hit_rate=cached / queried, num_prompt_tokens=computed,
                           num_generation_tokens=0, num_preemptions=0,
                           prefix_cache_queried_tokens=queried, prefix_cache_hit_tokens=cached)

    # One prompt sent 10 times to a, 10 prompts once each to b (as measured on two engines).
    totals = _WorkerTotals()
    totals.take_up({"a": stats(262, 1990, 1728), "b": stats(1990, 1990, 0)}, 0.0)
    summed = totals.total()
    assert summed.prefix_cache_hit_rate == pytest.approx(1728 / 3980)  # 0.101 before
    assert (summed.prefix_cache_queried_tokens, summed.prefix_cache_hit_tokens) == (3980, 1728)


def test_a_model_s_engine_counters_never_go_down_as_its_workers_come_and_go(tmp_path):
    """Summed over the workers registered now, they fell as one left (a rolling restart), which
    Prometheus reads as a reset; its gauges are those of the workers registered now."""
    registry, models = _Registry(), {}
    pool = WorkerPool(registry, tmp_path, lambda folder: None, models)

    def worker(worker_id: str, prompt_tokens: int, hits: int, cached: int) -> WorkerRecord:
        stats = EngineStats(num_running=1, num_waiting=0, kv_blocks_total=8, kv_blocks_used=2,
                            prefix_cache_hit_rate=cached / max(1, prompt_tokens),
                            num_prompt_tokens=prompt_tokens, num_generation_tokens=0,
                            num_preemptions=0, adapter_hits=hits,
                            prefix_cache_queried_tokens=prompt_tokens, prefix_cache_hit_tokens=cached)
        return _record(worker_id, stats=msgspec.json.encode(stats))

    def totals() -> tuple:
        asyncio.run(pool.refresh())
        stats = models[GHOST].stats()
        return (stats.num_prompt_tokens, stats.adapter_hits, stats.num_running,
                round(stats.prefix_cache_hit_rate, 6))

    registry.records = [worker("a", 10, 3, 5), worker("b", 30, 5, 3)]
    assert totals() == (40, 8, 2, 0.2)  # the hit rate: hits over lookups, summed
    registry.records = [worker("a", 12, 3, 6)]  # b left
    assert totals() == (42, 8, 1, round(9 / 42, 6))
    registry.records = [worker("a", 12, 3, 6), worker("b", 35, 6, 4)]  # back under its id
    assert totals() == (47, 9, 2, round(10 / 47, 6))
    registry.records = [worker("c", 0, 0, 0)]  # both restarted, under a new id
    assert totals() == (47, 9, 1, round(10 / 47, 6))
    # What a worker counted after the last scrape is kept when it leaves before the next: the
    # counters took up the workers registered at each scrape only.
    registry.records = [worker("c", 20, 4, 0)]
    asyncio.run(pool.refresh())
    registry.records = [worker("c", 30, 7, 0), worker("d", 2, 0, 0)]
    asyncio.run(pool.refresh())
    registry.records = [worker("d", 2, 0, 0)]  # c left
    assert totals() == (79, 16, 1, round(10 / 79, 6))
    # Stats that do not read as EngineStats (a worker of another version) count as none.
    registry.records = [_record("d", stats=b'{"num_running": "busy"}')]
    assert totals() == (79, 16, 0, round(10 / 79, 6))
    asyncio.run(pool.http.aclose())
    # A long-running gateway keeps no entry for each worker ever started: long gone, their
    # counts are folded into one.
    kept = _WorkerTotals()
    kept.take_up({"a": msgspec.json.decode(worker("a", 10, 3, 5).stats, type=EngineStats)}, 0.0)
    kept.take_up({}, _WorkerTotals.FOLD_AFTER_S + 1)
    assert kept.total().num_prompt_tokens == 10
    assert kept._latest == {}


def test_refreshes_at_once_serve_a_new_model_once_and_stop_serving_it_once_it_is_gone(
        tmp_path, caplog):
    """Calls and health probes refresh the pool while a model has no worker up, as the poll
    does: two refreshes at once each started serving a model new to both (loading its tokenizer
    meanwhile), and the one left serving it was never stopped."""
    caplog.set_level(logging.INFO, logger="gateway.remote")
    registry, models = _Registry(), {}
    digest = registry.publish_tokenizer({"tokenizer.json": b"{}"})

    def slow_load(folder: Path) -> None:
        time.sleep(0.2)

    pool = WorkerPool(registry, tmp_path, slow_load, models)
    registry.records = [_record("a", tokenizer=digest)]

    async def scenario() -> None:
        await asyncio.gather(*(pool.refresh() for _ in range(4)))
        assert models[GHOST] is pool.clients[GHOST]
        registry.records, registry.seen = [], {}  # its worker left, its TTL passed
        await pool.refresh()
        await pool.http.aclose()

    asyncio.run(scenario())
    assert models == {} and pool.clients == {}
    assert caplog.text.count(f"serving {GHOST} on the workers") == 1
    assert "own engine" not in caplog.text


def test_a_damaged_copy_of_a_workers_tokenizer_is_fetched_again(demo_model_dir, tmp_path, caplog):
    """A gateway keeps the tokenizer files its workers published in its data folder: a copy cut
    short (a crash as it was written) once kept the gateway from starting until removed by hand."""
    from engine.tokenizer import load_tokenizer

    registry = _Registry()
    files = tokenizer_files(demo_model_dir)
    digest = registry.publish_tokenizer(files)
    registry.records = [_record("a", tokenizer=digest)]
    for damage in [lambda copy: copy.write_bytes(copy.read_bytes()[:100]), Path.unlink]:
        models = {}
        pool = WorkerPool(registry, tmp_path, load_tokenizer, models)
        asyncio.run(pool.refresh())  # it writes its copy, or reads the one a start before wrote
        asyncio.run(pool.http.aclose())
        assert models[GHOST].tokenize("hi") == [256, 104, 105]
        damage(tmp_path / digest / "tokenizer.json")
        models = {}
        pool = WorkerPool(registry, tmp_path, load_tokenizer, models)
        with caplog.at_level(logging.WARNING, logger="gateway.remote"):
            asyncio.run(pool.refresh())  # a restart
        asyncio.run(pool.http.aclose())
        assert models[GHOST].tokenize("hi") == [256, 104, 105]
        assert (tmp_path / digest / "tokenizer.json").read_bytes() == files["tokenizer.json"]
        assert f"the copy of tokenizer {digest} in {tmp_path / digest} is damaged" in caplog.text
        caplog.clear()


def test_a_route_reads_prompts_with_the_tokenizer_a_models_workers_rolled_out(
        demo_engine, demo_model_dir, tmp_path):
    """Workers of GHOST move from the demo model's tokenizer to one that adds no BOS: a route over
    the demo model and GHOST, which read alike before, reads each prompt with each tokenizer
    after, and no longer takes token ids (it once kept reading GHOST's prompts as the old
    tokenizer had, with the demo model's BOS)."""
    from engine.tokenizer import load_tokenizer
    from gateway.generation import Prompt, Tier
    from gateway.serving import Target

    registry, models = _Registry(), {}
    files = tokenizer_files(demo_model_dir)
    without_bos = json.loads(files["tokenizer.json"]) | {"post_processor": None}
    old = registry.publish_tokenizer(files)
    new = registry.publish_tokenizer(files | {"tokenizer.json": json.dumps(without_bos).encode()})
    pool = WorkerPool(registry, tmp_path, load_tokenizer, models)
    registry.records = [_record("a", tokenizer=old)]
    asyncio.run(pool.refresh())
    route = Target((Tier(DEMO_MODEL, demo_engine), Tier(GHOST, models[GHOST])))
    before = Prompt.of_text("hi")
    assert [before.tokens(tier.engine) for tier in route.tiers] == [[256, 104, 105]] * 2
    assert route.shares_tokenizer
    registry.records = [_record("a", tokenizer=new)]
    asyncio.run(pool.refresh())
    after = Prompt.of_text("hi")
    assert [after.tokens(tier.engine) for tier in route.tiers] == [[256, 104, 105], [104, 105]]
    assert not route.shares_tokenizer
    asyncio.run(pool.http.aclose())


def test_workers_of_a_model_the_gateway_serves_itself_are_said_to_get_nothing(demo_engine,
                                                                            tmp_path, caplog):
    """Workers register a model this gateway serves with its own engine: that engine keeps it.
    The log once said the gateway served it on the workers, and later that it no longer served
    it, though its own engine answered throughout."""
    registry, models, served = _Registry(), {DEMO_MODEL: demo_engine}, []

    async def on_serving(model: str) -> None:
        served.append(model)

    pool = WorkerPool(registry, tmp_path, lambda folder: None, models, on_serving=on_serving,
                      model_ttl_s=0.001)
    registry.records = [_record("a", model=DEMO_MODEL)]
    with caplog.at_level(logging.INFO, logger="gateway.remote"):
        asyncio.run(pool.refresh())
        registry.records = []
        time.sleep(0.01)
        asyncio.run(pool.refresh())  # its workers' model ages out of the registry
    asyncio.run(pool.http.aclose())
    assert models[DEMO_MODEL] is demo_engine and served == []
    said = [r.getMessage() for r in caplog.records if r.name == "gateway.remote"]
    assert said == [f"engine workers of {DEMO_MODEL} registered, but this gateway serves "
                    f"{DEMO_MODEL} with its own engine, so it sends them nothing"]


def test_a_gateway_streams_from_its_workers_past_any_connection_limit_of_its_own(
        demo_engine, redis_url, tmp_path, patient_connects):  # noqa: F811
    num_held = 100  # httpx's default limit on one client's connections
    options = SamplingOptions(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def scenario() -> tuple[list[int], list[str]]:
        async with _gateway_pool(redis_url, tmp_path / "tokenizers") as pool:
            client = pool.clients[DEMO_MODEL]
            started, release = asyncio.Semaphore(0), asyncio.Event()

            async def held(i: int) -> None:
                # A slow client: its first token read, the rest not yet; its stream stays open.
                stream = client.generate([1, 2, 3], options, request_id=f"held-{i}")
                try:
                    await anext(stream)
                    started.release()
                    await release.wait()
                finally:
                    await stream.aclose()

            holders = [asyncio.create_task(held(i)) for i in range(num_held)]
            try:
                # NOTE: bounded: a holder that failed never releases, and the test hung for good.
                async with asyncio.timeout(60):
                    for _ in range(num_held):
                        await started.acquire()
                # It once waited 12 s for a connection, took the worker for dead and failed.
                async with asyncio.timeout(30):
                    tokens = await _token_ids(client, "one-more", max_tokens=2)
            finally:
                release.set()
                await asyncio.gather(*holders)
            return tokens, [c.id for c in pool.candidates(DEMO_MODEL, set())]

    with _serving_worker(demo_engine, redis_url, tmp_path / "worker", "solo"):
        tokens, up = asyncio.run(scenario())
    assert len(tokens) == 2 and up == ["solo"]


def test_a_worker_refuses_json_nested_past_the_depth_limit_as_malformed(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    nested = b'{"model": "%s", "x": %s}' % (DEMO_MODEL.encode(), b"[" * 100_000 + b"]" * 100_000)
    with _serving_worker(demo_engine, redis_url, tmp_path / "worker", "nested") as worker:
        url, key = asyncio.run(_address_and_key(redis_url, "nested"))
        refused = httpx.post(url + GENERATE_PATH, content=nested,
                             headers={"Authorization": f"Bearer {key}"})
    assert refused.status_code == 400, refused.text  # was a 500 (a RecursionError)
    assert refused.json()["kind"] == "rejected" and "too deeply" in refused.json()["message"]
    assert worker.seen == [("POST", GENERATE_PATH)]


def test_a_worker_refuses_a_key_with_characters_outside_ascii_as_any_wrong_key(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    with _serving_worker(demo_engine, redis_url, tmp_path / "worker", "latin") as worker:
        url, _ = asyncio.run(_address_and_key(redis_url, "latin"))
        refused = [httpx.post(url + path, content=b"{}", headers={"Authorization": b"Bearer caf\xe9"})
                   for path in (GENERATE_PATH, CHECK_ADAPTER_PATH)]
    assert [r.status_code for r in refused] == [401, 401]  # were 500s (a TypeError)
    assert {r.json()["kind"] for r in refused} == {"unauthorized"}
    assert len(worker.seen) == 2


def test_a_worker_checks_an_adapter_against_the_rank_limit_a_gateway_asks_for_if_higher(
        narrow_engine, redis_url, tmp_path):  # noqa: F811
    """That of a worker of its model with a higher --max-lora-rank, restarting."""
    folder = demo_adapter(tmp_path / "adapter", rank=2 * NARROW_MAX_LORA_RANK)
    files = {n: (n, (folder / n).read_bytes()) for n in ADAPTER_FILES}
    with _serving_worker(narrow_engine, redis_url, tmp_path / "worker", "narrow"):
        url, key = asyncio.run(_address_and_key(redis_url, "narrow"))
        replies = [httpx.post(url + CHECK_ADAPTER_PATH, files=files, params=params, timeout=30,
                              headers={"Authorization": f"Bearer {key}"})
                   for params in ({}, {"max_lora_rank": 16}, {"max_lora_rank": 2},
                                  {"max_lora_rank": "-1"})]
    assert [r.status_code for r in replies] == [422, 200, 422, 400], [r.text for r in replies]
    assert f"retrain with r <= {NARROW_MAX_LORA_RANK}" in replies[0].json()["message"]
    assert replies[1].json()["rank"] == 2 * NARROW_MAX_LORA_RANK
    assert f"retrain with r <= {NARROW_MAX_LORA_RANK}" in replies[2].json()["message"]
    assert "max_lora_rank must be a whole number" in replies[3].json()["message"]


@pytest.mark.parametrize("method, path, content_type", [
    ("POST", GENERATE_PATH, "application/json"),
    ("PUT", ADAPTERS_PATH + "/" + "ab" * 32, "multipart/form-data; boundary=b"),
    ("POST", CHECK_ADAPTER_PATH, "multipart/form-data; boundary=b")])
def test_a_gateway_that_hangs_up_midway_through_a_body_costs_the_worker_one_line_of_log(
        demo_engine, redis_url, tmp_path, caplog, method, path, content_type):  # noqa: F811
    caplog.set_level(logging.INFO, logger="gateway.worker")
    started = (b'--b\r\nContent-Disposition: form-data; name="adapter_config.json"; '
               b'filename="c"\r\n\r\n{')
    with _serving_worker(demo_engine, redis_url, tmp_path / "worker", "left") as worker:
        url, key = asyncio.run(_address_and_key(redis_url, "left"))
        leave_while_sending(url, path, {"Authorization": f"Bearer {key}",
                                        "Content-Type": content_type}, started, 10_000, method)
        deadline = time.monotonic() + 10
        while not any("closed the connection" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the worker never saw the gateway leave"
            time.sleep(0.01)
        # Was a 500 and a traceback, as if the worker had failed; and it keeps serving.
        assert [r.getMessage() for r in caplog.records if r.exc_info] == []
        assert httpx.get(url + "/health").json()["status"] == "ok"
    assert worker.seen[0] == (method, path)
    assert not list((tmp_path / "worker").glob("*/*")), "no file of the cut upload is kept"


class _SlowToAnswer:
    """An ASGI app that holds each HTTP request `delay_s` before handing it to `app`, counting how
    many it holds at once: a worker whose answers' headers are slow to come."""

    def __init__(self, app, delay_s: float) -> None:
        self.app, self.delay_s = app, delay_s
        self.holding = self.most_held = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.holding += 1
            self.most_held = max(self.most_held, self.holding)
            await asyncio.sleep(self.delay_s)
            self.holding -= 1
        await self.app(scope, receive, send)


@pytest.fixture
def patient_connects(monkeypatch) -> None:
    """Streams to workers wait 30 s for their connections: the 32 a gateway opens at once to one
    worker (loopback: the kernel takes each at once) may wait over the usual 2 s for this test's
    event loop on a loaded 2-core machine, and one timed out took the worker for down. The bound
    on openings is what such tests check."""
    import gateway.remote

    monkeypatch.setattr(gateway.remote, "_STREAM_TIMEOUT",
                        httpx.Timeout(gateway.remote.STREAM_SILENCE_S, connect=30))


def test_a_gateway_opens_a_bounded_number_of_streams_at_once_however_many_calls_start(
        demo_engine, redis_url, tmp_path, patient_connects):  # noqa: F811
    """A call of 2048 prompts opened its 2048 streams at once: on the gateway's busy event loop
    their connects timed out, and it took every worker for down, for every caller."""
    slow = None

    def in_front(app) -> _SlowToAnswer:
        nonlocal slow
        slow = _SlowToAnswer(app, 0.2)
        return slow

    async def burst() -> tuple[list[list[int]], dict[str, float]]:
        async with _gateway_pool(redis_url, tmp_path / "tokenizers") as pool:
            client = pool.clients[DEMO_MODEL]
            answers = await asyncio.gather(*(_token_ids(client, f"r{i}", 1) for i in range(96)))
            return answers, dict(pool._down)

    with _serving_worker(demo_engine, redis_url, tmp_path / "worker", "solo", in_front=in_front):
        answers, down = asyncio.run(burst())
    assert all(len(a) == 1 for a in answers) and down == {}
    assert slow.most_held <= 32  # remote._MAX_OPENING: it once held all 96 at once


def test_a_worker_that_hangs_with_its_port_open_holds_up_no_stream_to_another(
        demo_engine, redis_url, tmp_path, patient_connects):  # noqa: F811
    """Streams opening to a hung worker (the kernel takes its connections, nothing answers) wait
    for their headers until they time out: they once held the gateway's every opening, so calls
    to live workers waited for them too (12 s, in a burst to a worker stopped by SIGSTOP)."""
    num_hung = 40  # more than the openings a gateway makes to one worker at once
    taken: list[socket.socket] = []  # connections to the hung worker, never answered

    def take_connections(listener: socket.socket) -> None:
        with contextlib.suppress(OSError):  # until the listener closes
            while True:
                taken.append(listener.accept()[0])

    async def scenario(hung_url: str) -> tuple[list[int], int]:
        registry = WorkerRegistry.open(redis_url)
        [solo] = await registry.workers()
        # Busier than the live worker, so the call below is placed on the live one.
        hung = msgspec.structs.replace(solo, id="hung", url=hung_url, num_running=1000)
        await registry.heartbeat(hung, ttl_s=60)
        await registry.close()
        async with _gateway_pool(redis_url, tmp_path / "tokenizers") as pool:
            body = msgspec.json.encode(GenerateBody(
                model=DEMO_MODEL, prompt_token_ids=[1, 2, 3], request_id="to-hung",
                options=SamplingOptions(max_tokens=2, temperature=0.0)))

            async def to_hung() -> None:
                lines = _stream_lines(pool, pool.workers["hung"], body, None)
                try:
                    await anext(lines)
                finally:
                    await lines.aclose()

            waiting = [asyncio.create_task(to_hung()) for _ in range(num_hung)]
            try:
                async with asyncio.timeout(30):
                    while len(taken) < 32:  # the openings a gateway once made to all workers at once
                        await asyncio.sleep(0.01)
                tokens = await _token_ids(pool.clients[DEMO_MODEL], "to-live", max_tokens=2)
                return tokens, sum(task.done() for task in waiting)
            finally:
                for task in waiting:
                    task.cancel()
                await asyncio.gather(*waiting, return_exceptions=True)

    with _serving_worker(demo_engine, redis_url, tmp_path / "worker", "solo"), \
            socket.create_server(("127.0.0.1", 0)) as listener:
        threading.Thread(target=take_connections, args=(listener,), daemon=True).start()
        try:
            tokens, num_done = asyncio.run(scenario(f"http://127.0.0.1:{listener.getsockname()[1]}"))
        finally:
            listener.shutdown(socket.SHUT_RDWR)
            for connection in taken:
                connection.close()
    assert len(tokens) == 2
    assert num_done == 0  # answered while every stream to the hung worker still waited


def test_a_burst_counts_each_call_against_its_worker_from_the_moment_it_is_placed(
        demo_engine, second_engine, redis_url, tmp_path):  # noqa: F811
    num_others, num_burst = 3, 8

    async def scenario() -> None:
        async with _gateway_pool(redis_url, tmp_path / "tokenizers") as pool, \
                httpx.AsyncClient(timeout=30) as other_gateway:
            busy = pool.workers["busy"]
            body = GenerateBody(model=DEMO_MODEL, prompt_token_ids=[1, 2, 3], request_id="",
                                options=SamplingOptions(max_tokens=1900, ignore_eos=True))

            async def run_elsewhere(i: int, release: asyncio.Event) -> None:
                # Another gateway's long request on "busy", as a worker sees it.
                async with other_gateway.stream(
                        "POST", busy.url + GENERATE_PATH,
                        headers={"Authorization": f"Bearer {pool.internal_key}"},
                        content=msgspec.json.encode(msgspec.structs.replace(
                            body, request_id=f"other-{i}"))) as response:
                    assert response.status_code == 200
                    await release.wait()

            release = asyncio.Event()
            others = [asyncio.create_task(run_elsewhere(i, release)) for i in range(num_others)]
            try:
                async with asyncio.timeout(10):
                    while (await _load_in_registry(pool, "busy")) != num_others:
                        await asyncio.sleep(_HEARTBEAT_S / 2)
                await pool.refresh()  # this gateway sees them; the burst comes before its next read
                client = pool.clients[DEMO_MODEL]
                await asyncio.gather(*(_token_ids(client, f"burst-{i}", max_tokens=2)
                                       for i in range(num_burst)))
            finally:
                release.set()
                await asyncio.gather(*others)
            assert _counted(pool) == {}

    with _serving_worker(second_engine, redis_url, tmp_path / "busy", "busy") as busy, \
            _serving_worker(demo_engine, redis_url, tmp_path / "idle", "idle") as idle:
        asyncio.run(scenario())
    generates = [[path for _, path in w.seen].count(GENERATE_PATH) for w in (busy, idle)]
    # Spread as evenly as the loads allow: "idle" first catches up with the others' 3, then the
    # two alternate (ties go by each request's hash). It once took all 8: each call counted only
    # from its first token, so the whole burst saw "idle" as it was at the last heartbeat.
    assert generates in ([num_others + 2, 6], [num_others + 3, 5]), generates


def test_a_call_stops_counting_against_its_worker_however_it_ends(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    options = SamplingOptions(max_tokens=50, temperature=0.0, ignore_eos=True)

    async def scenario() -> None:
        async with _gateway_pool(redis_url, tmp_path / "tokenizers") as pool:
            client = pool.clients[DEMO_MODEL]
            held = client.generate([1, 2, 3], options, request_id="held")
            await anext(held)
            assert _counted(pool) == {"solo": 1}
            # A worker that cannot be reached, less loaded: tried first, then passed over.
            await pool.registry.heartbeat(_record("gone", model=DEMO_MODEL), ttl_s=60)
            await pool.refresh()
            assert await _token_ids(client, "replaced", max_tokens=2) != []
            assert _counted(pool) == {"solo": 1}
            await held.aclose()  # its client went away mid-answer
            assert _counted(pool) == {}

            waiting = asyncio.create_task(_token_ids(client, "gone-early", max_tokens=2))
            await asyncio.sleep(0)  # placed, it waits for the worker's answer: it counts already
            assert _counted(pool) == {"solo": 1}
            waiting.cancel()  # its client went away before its first token
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            assert _counted(pool) == {}

            with pytest.raises(RequestRejected):
                await anext(client.generate([1, 2, 3], SamplingOptions(stop_token_ids=(10**6,)),
                                            request_id="refused"))
            assert _counted(pool) == {}

    with _serving_worker(demo_engine, redis_url, tmp_path / "worker", "solo"):
        asyncio.run(scenario())


def test_a_gateway_out_of_open_files_answers_503_and_does_not_pass_over_its_worker(
        demo_engine, redis_url, tmp_path, caplog):  # noqa: F811
    async def scenario() -> None:
        # NOTE: a fresh pool, so that no kept-alive connection to the worker spares it a socket.
        async with _gateway_pool(redis_url, tmp_path / "tokenizers") as pool:
            client = pool.clients[DEMO_MODEL]
            with no_open_file_left(), pytest.raises(GatewayOutOfFiles):
                await _token_ids(client, "no-file-left", max_tokens=2)
            # The worker is not passed over: it was taken for failed, so every call after got a
            # 503 saying no worker was up until its next heartbeat was read.
            assert [c.id for c in pool.candidates(DEMO_MODEL, set(), adapter_rank=None)] == ["solo"]
            assert _counted(pool) == {}
            assert await _token_ids(client, "files-again", max_tokens=2) != []

    with _serving_worker(demo_engine, redis_url, tmp_path / "worker", "solo"):
        asyncio.run(scenario())
    assert "this gateway is out of open files" in caplog.text
    assert "ulimit -n" in caplog.text


def test_calls_go_through_while_the_gateway_or_the_worker_has_not_taken_up_a_new_internal_key(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    """A Redis restarted without its data holds a new internal key, made by the first gateway or
    worker to ask; the others take it up at their next poll or heartbeat. Calls meanwhile go
    through: a worker reads the key again when it is sent one it does not know, and a gateway
    whose key a worker refuses reads it again and sends the call once more."""
    store = redis.Redis.from_url(redis_url)

    async def scenario(worker: _Requests) -> list[list[int]]:
        async with _gateway_pool(redis_url, tmp_path / "tokenizers") as pool:
            client = pool.clients[DEMO_MODEL]
            answers = [await _token_ids(client, "before", 2)]
            # A gateway made the new key: this worker still has the old one.
            store.set("sb:internal_key", "made-by-another-gateway")
            pool.internal_key = "made-by-another-gateway"
            answers.append(await _token_ids(client, "worker-behind", 2))
            # The worker made it: this gateway still has the old one.
            store.set("sb:internal_key", "made-by-a-worker")
            worker.app.state.worker.internal_key = "made-by-a-worker"
            answers.append(await _token_ids(client, "gateway-behind", 2))
            assert pool.internal_key == "made-by-a-worker"
            return answers

    # Heartbeats far apart: the worker takes up no key from them during the test.
    with _serving_worker(demo_engine, redis_url, tmp_path / "worker", "solo",
                         heartbeat_s=30) as worker:
        answers = asyncio.run(scenario(worker))
    assert len(answers[0]) == 2 and answers == [answers[0]] * 3
    assert worker.seen.count(("POST", GENERATE_PATH)) == 4  # the one refused was sent again
    store.close()


def test_a_gateway_reads_the_worker_registry_while_redis_is_out_of_its_maxmemory(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    """Redis out of its maxmemory refuses writes, not reads: a gateway's read of the registry
    goes on (it began with a write of the internal key, and, for a gateway keeping its adapter
    records elsewhere, of that mark; both failed it, so it kept a stale view of its workers)."""
    store = redis.Redis.from_url(redis_url)

    async def scenario() -> list[int]:
        async with _gateway_pool(redis_url, tmp_path / "tokenizers", records_elsewhere=True) as pool:
            store.config_set("maxmemory", 1)
            try:
                pool.workers = {}  # as if the worker had just joined
                await pool.refresh()
                assert list(pool.workers) == ["solo"]
                return await _token_ids(pool.clients[DEMO_MODEL], "full", 2)
            finally:
                store.config_set("maxmemory", 0)

    with _serving_worker(demo_engine, redis_url, tmp_path / "worker", "solo"):
        assert len(asyncio.run(scenario())) == 2
    store.close()


def test_concurrent_calls_for_an_adapter_a_worker_lacks_send_its_files_once(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    first, second = (demo_adapter(tmp_path / name) for name in ("first", "second"))
    first_ref, second_ref = (AdapterRef(digest_files(f), str(f)) for f in (first, second))

    async def scenario(worker: _Requests) -> tuple[list[list[int]], list[int]]:
        async with _gateway_pool(redis_url, tmp_path / "tokenizers") as pool:
            client = pool.clients[DEMO_MODEL]
            burst = await asyncio.gather(*(_token_ids(client, f"first-{i}", 2, first_ref)
                                           for i in range(8)))
            # All but one go away while the files are on their way: the last one is answered.
            calls = [asyncio.create_task(_token_ids(client, f"second-{i}", 2, second_ref))
                     for i in range(4)]
            async with asyncio.timeout(10):
                while ("PUT", f"{ADAPTERS_PATH}/{second_ref.digest}") not in worker.seen:
                    await asyncio.sleep(0.005)
            for call in calls[:-1]:
                call.cancel()
            return burst, await calls[-1]

    with _serving_worker(demo_engine, redis_url, tmp_path / "worker", "solo") as worker:
        burst, last = asyncio.run(scenario(worker))
    assert len(burst[0]) == 2 and burst == [burst[0]] * 8 and len(last) == 2
    # Each adapter's files went once (they once went for every call that found the worker
    # without them: 8 times for the 8 calls).
    assert [path for method, path in worker.seen if method == "PUT"] == [
        f"{ADAPTERS_PATH}/{first_ref.digest}", f"{ADAPTERS_PATH}/{second_ref.digest}"]


def test_calls_waiting_for_an_adapter_transfer_the_worker_refuses_fail_as_one_call_alone(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    folder, other = demo_adapter(tmp_path / "adapter"), demo_adapter(tmp_path / "other")
    # The worker refuses these files (as a damaged copy), and this pool has no other copy.
    mislabelled = AdapterRef(digest_files(other), str(folder))

    async def scenario() -> list[BaseException | list[int]]:
        async with _gateway_pool(redis_url, tmp_path / "tokenizers") as pool:
            client = pool.clients[DEMO_MODEL]
            async with asyncio.timeout(30):
                burst = await asyncio.gather(*(_token_ids(client, f"burst-{i}", 2, mislabelled)
                                               for i in range(4)), return_exceptions=True)
                # Nothing of the failed transfer is kept: a later call tries the worker again.
                later = await asyncio.gather(_token_ids(client, "later", 2, mislabelled),
                                             return_exceptions=True)
            return burst + later

    with _serving_worker(demo_engine, redis_url, tmp_path / "worker", "solo") as worker:
        outcomes = asyncio.run(scenario())
    assert [type(o) for o in outcomes] == [DamagedAdapterCopy] * 5, outcomes
    assert str(outcomes[0]).startswith(f"this gateway's copy of the files of adapter "
                                       f"{mislabelled.digest} is damaged")
    # Sent for the burst (again for a call that found the worker without the files only once
    # that transfer had failed), then for the later call.
    puts = [path for method, path in worker.seen if method == "PUT"]
    assert set(puts) == {f"{ADAPTERS_PATH}/{mislabelled.digest}"} and 2 <= len(puts) <= 5


def test_a_gateway_whose_copy_of_an_adapter_is_damaged_sends_the_stores_copy_instead(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    """Its adapter folder is a cache of Redis's copies: files that the worker refuses, as they
    do not hash to their digest, are fetched again from Redis for the call that found them
    damaged (it once got 503 engine_unavailable, on every call, and after restarts too)."""
    with _serving_worker(demo_engine, redis_url, tmp_path / "worker", "solo") as worker, \
            serve_gateway({}, tmp_path / "gateway", store_url=redis_url, workers_url=redis_url,
                          load_tokenizer=lambda folder: None) as gateway:
        key = gateway.new_tenant("acme")
        digest = upload(gateway, key, "tuned", demo_adapter(tmp_path / "adapter"))
        cached = gateway.app.state.gateway.blobs.path(digest)
        damage_adapter_files(cached)
        reply = httpx.post(gateway.url + "/v1/completions", timeout=60,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"model": "tuned", "prompt": [1, 2, 3], "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    assert digest_files(cached) == digest
    # The damaged files, refused; then Redis's.
    assert [path for method, path in worker.seen if method == "PUT"] == [
        f"{ADAPTERS_PATH}/{digest}"] * 2


class _HoldingFirstGenerate:
    """An ASGI app that holds the first generate request until `resume` is set, once it has come
    (`arrived`)."""

    def __init__(self, app) -> None:
        self.app = app
        self.arrived, self.resume = threading.Event(), threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == GENERATE_PATH and not self.arrived.is_set():
            self.arrived.set()
            await asyncio.to_thread(self.resume.wait, 30)
        await self.app(scope, receive, send)


def test_a_call_whose_adapter_is_deleted_before_a_worker_has_its_files_is_not_found(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    """The worker asks for the files of the call's adapter, deleted meanwhile: the call gets the
    404 a call sent after the delete gets (sending the files it no longer had raised out of the
    call: a 500 with a traceback)."""
    held = None

    def in_front(app) -> _HoldingFirstGenerate:
        nonlocal held
        held = _HoldingFirstGenerate(app)
        return held

    with _serving_worker(demo_engine, redis_url, tmp_path / "worker", "solo", in_front=in_front), \
            serve_gateway({}, tmp_path / "gateway", store_url=redis_url, workers_url=redis_url,
                          load_tokenizer=lambda folder: None) as gateway, \
            ThreadPoolExecutor(1) as pool:
        key = gateway.new_tenant("acme")
        upload(gateway, key, "tuned", demo_adapter(tmp_path / "adapter"))
        call = pool.submit(httpx.post, gateway.url + "/v1/completions", timeout=60,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"model": "tuned", "prompt": [1, 2, 3], "max_tokens": 2})
        assert held.arrived.wait(30)
        deleted = httpx.delete(gateway.url + "/v1/adapters/tuned",
                               headers={"Authorization": f"Bearer {key}"})
        held.resume.set()
        reply = call.result()
    assert deleted.status_code == 200, deleted.text
    assert reply.status_code == 404, reply.text
    assert reply.json()["error"]["message"].startswith("the adapter 'tuned' was deleted while this "
                                                       "call waited to run")


def test_workers_that_refuse_a_damaged_copy_at_once_each_get_the_stores(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    folder = demo_adapter(tmp_path / "adapter")
    blobs = BlobStore(tmp_path / "gateway-adapters")
    digest, _ = blobs.put(folder)
    damage_adapter_files(blobs.path(digest))
    adapter = AdapterRef(digest, str(blobs.path(digest)))

    async def scenario() -> None:
        store = await RedisStore.open(redis_url)
        try:
            await store.shared_blobs.put_files(digest, folder)
            async with _gateway_pool(redis_url, tmp_path / "tokenizers", ensure_intact_copy=(
                    functools.partial(ensure_intact_copy, blobs, store.shared_blobs))) as pool:
                await asyncio.gather(*(pool.send_adapter(worker, adapter)
                                       for worker in pool.workers.values()))
        finally:
            await store.close()

    with _serving_worker(demo_engine, redis_url, tmp_path / "one", "one") as one, \
            _serving_worker(demo_engine, redis_url, tmp_path / "two", "two") as two:
        asyncio.run(scenario())
    assert digest_files(blobs.path(digest)) == digest
    # Both sent the damaged files, and then the store's (fetched once, by either transfer: the
    # other found them intact then).
    for worker in (one, two):
        assert [path for method, path in worker.seen if method == "PUT"] == [
            f"{ADAPTERS_PATH}/{digest}"] * 2

def _out_of_space_error(worker_id: str, prefix: str = "") -> dict:
    return {"message": f"{prefix}the engine workers of {DEMO_MODEL!r} that could run this adapter "
                       f"({worker_id}) have no disk space left to take its files; retrying will not "
                       "help until their operator frees space there",
            "type": "server_error", "param": None, "code": "disk_full"}


def test_a_call_a_worker_has_no_disk_space_to_take_the_adapter_files_of_is_told_so(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    """The worker once answered the files with a 500 and a traceback, and the gateway told the
    caller that no worker of the model was up, to retry shortly: each retry sent the files again."""
    with small_volume(tmp_path / "volume", "1m") as volume, \
            _serving_worker(demo_engine, redis_url, volume / "blobs", "cramped") as worker, \
            serve_gateway({}, tmp_path / "gateway", store_url=redis_url, workers_url=redis_url,
                          load_tokenizer=lambda folder: None) as gateway:
        key = gateway.new_tenant("acme")
        digest = upload(gateway, key, "tuned", demo_adapter(tmp_path / "adapter"))
        filler = fill_volume(volume)
        refused = _completion(gateway.url, key, "tuned", 2)
        assert refused.status_code == 503, refused.text
        assert refused.json() == {"error": _out_of_space_error("cramped")}
        assert refused.headers["x-should-retry"] == "false" and "retry-after" not in refused.headers
        assert len(_answer_ids(_completion(gateway.url, key, DEMO_MODEL, 2))) == 2  # it is up
        filler.unlink()
        assert len(_answer_ids(_completion(gateway.url, key, "tuned", 2))) == 2
    assert [path for method, path in worker.seen if method == "PUT"] == [
        f"{ADAPTERS_PATH}/{digest}"] * 2  # once refused, once taken


def test_an_upload_no_worker_has_the_disk_space_to_check_is_refused_until_room_is_made(
        demo_engine, redis_url, tmp_path, monkeypatch):  # noqa: F811
    with small_volume(tmp_path / "tmp", "4m", inodes=64) as volume, \
            _serving_worker(demo_engine, redis_url, tmp_path / "blobs", "cramped"), \
            serve_gateway({}, tmp_path / "gateway", store_url=redis_url, workers_url=redis_url,
                          load_tokenizer=lambda folder: None) as gateway:
        key = gateway.new_tenant("acme", rpm=2)
        fillers = use_up_inodes(volume, leave=0)
        monkeypatch.setattr(tempfile, "tempdir", str(volume))  # as the worker's TMPDIR names it
        files = {n: (n, (demo_adapter(tmp_path / "adapter") / n).read_bytes()) for n in ADAPTER_FILES}
        refused = httpx.post(gateway.url + "/v1/adapters", files=files, timeout=60,
                             headers={"Authorization": f"Bearer {key}"},
                             data={"name": "tuned", "base_model": DEMO_MODEL})
        assert refused.status_code == 503, refused.text
        assert refused.json() == {"error": _out_of_space_error("cramped", "cannot check the adapter: ")}
        assert refused.headers["x-should-retry"] == "false"
        shutil.rmtree(fillers)
        listed = httpx.get(gateway.url + "/v1/adapters", headers={"Authorization": f"Bearer {key}"})
        assert listed.json()["data"] == []  # nothing of it was kept
        # Its request was given back: an rpm of 2 leaves room for an upload and a call.
        digest = upload(gateway, key, "tuned", tmp_path / "adapter")
        assert len(_answer_ids(_completion(gateway.url, key, "tuned", 2))) == 2
    assert digest in BlobStore(tmp_path / "blobs").digests()


def test_a_restarted_worker_keeps_the_files_of_adapters_a_gateway_records_in_a_store_of_its_own(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    """A gateway whose store is not the registry's Redis (SQLite here) keeps adapter records that
    workers cannot read: a worker keeps the files of its adapters when it starts (it took them
    all for deleted ones, there and every 10 minutes, and had them sent again), and drops only
    those no call used for a day, as the files of deleted adapters are."""
    folder = tmp_path / "worker"
    with contextlib.ExitStack() as first_running:
        first_running.enter_context(_serving_worker(demo_engine, redis_url, folder, "first",
                                                    drops_blobs=True))
        with serve_gateway({}, tmp_path / "gateway", workers_url=redis_url,
                           load_tokenizer=lambda folder: None) as gateway:
            key = gateway.new_tenant("acme")
            assert eventually(lambda: _serves(gateway.url, key))
            used, idle = (upload(gateway, key, name, demo_adapter(tmp_path / name))
                          for name in ("used", "idle"))
            expected = {name: _answer_ids(_completion(gateway.url, key, name, 2))
                        for name in ("used", "idle")}
            a_day_ago = time.time() - UNUSED_BLOB_S - 60
            for digest in (used, idle):
                os.utime(folder / digest, (a_day_ago, a_day_ago))
            assert _answer_ids(_completion(gateway.url, key, "used", 2)) == expected["used"]
            first_running.close()

            with _serving_worker(demo_engine, redis_url, folder, "second",
                                 drops_blobs=True) as second:
                assert BlobStore(folder).digests() == [used]
                assert eventually(lambda: _serves(gateway.url, key))
                for name, ids in expected.items():
                    assert _answer_ids(_completion(gateway.url, key, name, 2)) == ids
    # Only the files dropped as unused were sent again.
    assert [path for method, path in second.seen if method == "PUT"] == [f"{ADAPTERS_PATH}/{idle}"]


def test_a_restarted_worker_drops_the_files_of_deleted_adapters_whose_records_were_in_its_redis(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    """Where the gateways keep their store in the registry's Redis, workers read which adapters
    exist there: the files of a deleted one go, whenever it was last used."""
    folder = tmp_path / "worker"
    with serve_gateway({}, tmp_path / "gateway", store_url=redis_url, workers_url=redis_url,
                       load_tokenizer=lambda folder: None) as gateway:
        with _serving_worker(demo_engine, redis_url, folder, "first", drops_blobs=True):
            key = gateway.new_tenant("acme")
            assert eventually(lambda: _serves(gateway.url, key))
            kept, gone = (upload(gateway, key, name, demo_adapter(tmp_path / name))
                          for name in ("kept", "gone"))
            for name in ("kept", "gone"):
                assert len(_answer_ids(_completion(gateway.url, key, name, 2))) == 2
        deleted = httpx.delete(gateway.url + "/v1/adapters/gone", timeout=30,
                               headers={"Authorization": f"Bearer {key}"})
        assert deleted.status_code == 200, deleted.text
        with _serving_worker(demo_engine, redis_url, folder, "second", drops_blobs=True):
            assert BlobStore(folder).digests() == [kept]


def test_workers_with_different_max_lora_ranks_serve_each_adapter_on_one_its_rank_fits(
        demo_engine, narrow_engine, redis_url, tmp_path):  # noqa: F811
    """Once no worker up serves its rank, the adapter's calls get a 503 asking to retry, those
    naming it under a route too: the route's next tier, on its base model, once answered them
    (and billed them at its price), where the call asked for the adapter; and a route whose
    adapter tier comes later ran and billed the tiers before it, then answered the 503."""
    from routing.routes import parse_routes

    routes = parse_routes({
        "escalating": {"tiers": [DEMO_MODEL, "large"], "measure": "min_prob", "threshold": 1.0},
        "to-adapter": {"tiers": ["large", DEMO_MODEL], "measure": "min_prob", "threshold": 1.0},
    }, None)
    folder = demo_adapter(tmp_path / "adapter", rank=2 * NARROW_MAX_LORA_RANK)
    adapter = AdapterRef(digest_files(folder), str(folder))
    expected = asyncio.run(_token_ids(demo_engine, "local", 4, adapter))
    # An id by which rendezvous hashing alone sends both the upload's check and the adapter's calls
    # to the narrow worker: the check was refused there (400) though the wide worker serves the
    # adapter, and once checked on the wide one, every call failed there (500).
    narrow = next(f"narrow-{i}" for i in itertools.count()
                  if home_of("check", ["wide", f"narrow-{i}"])
                  == home_of(adapter.digest, ["wide", f"narrow-{i}"]) == f"narrow-{i}")
    with _serving_worker(narrow_engine, redis_url, tmp_path / "narrow", narrow) as narrow_seen, \
            _serving_worker(demo_engine, redis_url, tmp_path / "large", "large", model="large"), \
            contextlib.ExitStack() as wide_running:
        wide_seen = wide_running.enter_context(
            _serving_worker(demo_engine, redis_url, tmp_path / "wide", "wide"))
        with serve_gateway({}, tmp_path / "gateway", store_url=redis_url, workers_url=redis_url,
                           routes=routes, load_tokenizer=lambda folder: None) as server:
            key = server.new_tenant("mixed")
            uploaded = httpx.post(server.url + "/v1/adapters", timeout=30,
                                  headers={"Authorization": f"Bearer {key}"},
                                  data={"name": "tuned", "base_model": DEMO_MODEL},
                                  files={n: (n, (folder / n).read_bytes()) for n in ADAPTER_FILES})
            assert uploaded.status_code == 201, uploaded.text
            assert uploaded.json()["rank"] == 2 * NARROW_MAX_LORA_RANK
            for _ in range(3):
                assert _answer_ids(_completion(server.url, key, "tuned", 4)) == expected
            # All on the wide worker (the first call found it without the adapter's files).
            assert [p for _, p in narrow_seen.seen] == []
            assert [p for _, p in wide_seen.seen] == [
                CHECK_ADAPTER_PATH, GENERATE_PATH, f"{ADAPTERS_PATH}/{adapter.digest}",
                *[GENERATE_PATH] * 3]

            wide_running.close()  # the only worker that serves the adapter's rank leaves
            before = server.admin("GET", "/admin/tenants/mixed").json()["usage"]
            refusals = [_completion(server.url, key, model, 4)
                        for model in ("tuned", "escalating:tuned", "to-adapter:tuned")]
            after = server.admin("GET", "/admin/tenants/mixed").json()["usage"]
            assert len(_answer_ids(_completion(server.url, key, DEMO_MODEL, 4))) == 4
    assert after == before  # nothing billed
    for refused in refusals:
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "2"
        error = refused.json()["error"]
        assert error["code"] == "engine_unavailable"
        assert (f"no engine worker of {DEMO_MODEL!r} that is up serves adapters of rank "
                f"{2 * NARROW_MAX_LORA_RANK} (the highest rank they take is "
                f"{NARROW_MAX_LORA_RANK})") in error["message"]
    assert [p for _, p in narrow_seen.seen] == [GENERATE_PATH]  # the base model's call alone


def test_an_upload_above_the_rank_of_the_workers_up_is_taken_while_a_wider_one_restarts(
        demo_engine, narrow_engine, redis_url, tmp_path):  # noqa: F811
    """During a rolling restart of workers with different --max-lora-rank, an adapter the
    restarting worker serves is checked against its limit by a worker up, and taken: its calls
    wait (503) until a worker of that rank is back. It had been refused for good (400, "retrain
    with r <= 4"). One above every limit is still refused."""
    from tests.conftest import DEMO_MAX_LORA_RANK

    wide_rank = 2 * NARROW_MAX_LORA_RANK
    folder = demo_adapter(tmp_path / "adapter", rank=wide_rank)
    adapter = AdapterRef(digest_files(folder), str(folder))
    expected = asyncio.run(_token_ids(demo_engine, "local", 4, adapter))
    too_wide = demo_adapter(tmp_path / "too-wide", rank=2 * DEMO_MAX_LORA_RANK)

    def upload_reply(server, key: str, name: str, files: Path) -> httpx.Response:
        return httpx.post(server.url + "/v1/adapters", timeout=30,
                          headers={"Authorization": f"Bearer {key}"},
                          data={"name": name, "base_model": DEMO_MODEL},
                          files={n: (n, (files / n).read_bytes()) for n in ADAPTER_FILES})

    with _serving_worker(narrow_engine, redis_url, tmp_path / "narrow", "narrow") as narrow_seen:
        with _serving_worker(demo_engine, redis_url, tmp_path / "wide", "wide"):
            pass  # it sent heartbeats, then left (restarting)
        with serve_gateway({}, tmp_path / "gateway", store_url=redis_url, workers_url=redis_url,
                           load_tokenizer=lambda folder: None) as server:
            key = server.new_tenant("acme")
            uploaded = upload_reply(server, key, "tuned", folder)
            refused = upload_reply(server, key, "huge", too_wide)
            waiting = _completion(server.url, key, "tuned", 4)
            with _serving_worker(demo_engine, redis_url, tmp_path / "wide", "wide-again"):
                assert eventually(lambda: _completion(server.url, key, "tuned", 4).status_code
                                  == 200, timeout_s=30)
                answer = _completion(server.url, key, "tuned", 4)
    assert uploaded.status_code == 201, uploaded.text
    assert uploaded.json()["rank"] == wide_rank
    assert refused.status_code == 400, refused.text
    assert f"retrain with r <= {DEMO_MAX_LORA_RANK}" in refused.json()["error"]["message"]
    assert [p for _, p in narrow_seen.seen] == [CHECK_ADAPTER_PATH] * 2  # both checked there
    assert waiting.status_code == 503, waiting.text
    assert waiting.json()["error"]["code"] == "engine_unavailable"
    assert _answer_ids(answer) == expected


def test_gateways_agree_on_a_model_whose_workers_left_until_the_ttl_then_forget_it(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    import redis

    local, ttl_s = "local-demo", 600.0
    prompt = {"prompt": [1, 2, 3], "max_tokens": 2}
    folder = demo_adapter(tmp_path / "adapter")

    def gateway(name: str):
        return serve_gateway({local: demo_engine}, tmp_path / name, store_url=redis_url,
                             workers_url=redis_url, load_tokenizer=lambda folder: None,
                             worker_model_ttl_s=ttl_s)

    def answers(server, key: str) -> dict:
        """What a gateway says of the worker model and of its own: the same on every replica."""
        headers = {"Authorization": f"Bearer {key}"}
        allowed = server.admin("POST", "/admin/tenants", json={
            "name": f"policy-{next(_names)}", "allowed_models": [DEMO_MODEL, local]})
        listed = httpx.get(server.url + "/v1/models", headers=headers).json()["data"]
        calls = {m: httpx.post(server.url + "/v1/completions", headers=headers, timeout=30,
                               json={"model": m, **prompt}) for m in (DEMO_MODEL, "tuned", local)}
        return {"allowed_models": allowed.status_code,
                "listed": sorted((m["id"], m["max_model_len"]) for m in listed),
                "calls": {m: (r.status_code, r.json().get("error", {}).get("code"))
                          for m, r in calls.items()},
                "health": httpx.get(server.url + "/health").json()}

    length = demo_engine.max_model_len
    with contextlib.ExitStack() as stack:
        with _serving_worker(demo_engine, redis_url, tmp_path / "worker", "leaving"):
            early = stack.enter_context(gateway("early"))  # it saw the worker up
            key = early.new_tenant("caller")
            upload(early, key, "tuned", folder)
        late = stack.enter_context(gateway("late"))  # started once the worker had left
        # Within the TTL: served, but no worker can take its calls (the late gateway once did
        # not know the model at all: a 400 in allowed_models, a 404 for its calls, not listed).
        within = [answers(server, key) for server in (early, late)]
        assert within[0] == within[1], within
        assert within[0]["allowed_models"] == 201
        assert within[0]["listed"] == sorted([(DEMO_MODEL, length), (local, length),
                                              ("tuned", length)])
        assert within[0]["calls"] == {DEMO_MODEL: (503, "engine_unavailable"),
                                      "tuned": (503, "engine_unavailable"), local: (200, None)}
        assert within[0]["health"] == {"status": "ok", "models": [local, DEMO_MODEL],
                                       "unavailable_models": [DEMO_MODEL]}

        # Its last heartbeat longer ago than the TTL, as Redis would hold it by then.
        with redis.Redis.from_url(redis_url) as client:
            client.hset("sb:models", DEMO_MODEL, msgspec.json.encode(ModelSeen(
                beat_at=time.time() - ttl_s - 1, max_model_len=length, tokenizer=None)))
        for server in (early, late):
            assert eventually(lambda: DEMO_MODEL not in httpx.get(
                server.url + "/health").json()["models"]), "the worker model is still served"
        # Past it: served by neither (the early gateway once served it until restarted); their
        # own engine's model is unaffected.
        after = [answers(server, key) for server in (early, late)]
    assert after[0] == after[1], after
    assert after[0]["allowed_models"] == 400
    assert after[0]["listed"] == [(local, length)]
    assert after[0]["calls"] == {DEMO_MODEL: (404, "model_not_found"),
                                 "tuned": (404, "model_not_found"), local: (200, None)}
    assert after[0]["health"] == {"status": "ok", "models": [local]}
    # A gateway of workers alone serves nothing now, and says so (it once listed nothing).
    with serve_gateway({}, tmp_path / "bare", store_url=redis_url, workers_url=redis_url,
                       load_tokenizer=lambda folder: None, worker_model_ttl_s=ttl_s) as bare:
        tuned = httpx.post(bare.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": "tuned", **prompt}, timeout=30)
        policy = bare.admin("POST", "/admin/tenants", json={
            "name": f"policy-{next(_names)}", "allowed_models": [DEMO_MODEL]})
    assert tuned.status_code == 404, tuned.text
    assert tuned.json()["error"]["message"] == (
        f"'tuned' is an adapter for the base model {DEMO_MODEL!r}, which this server does not "
        "serve now (it serves no base model now): the operator can serve it again, or you can "
        "upload the adapter again for a base model it serves")
    assert policy.status_code == 400, policy.text
    assert policy.json()["error"]["message"].endswith(
        "which this server does not serve; it serves no base model or route now")


def test_a_redis_that_lost_its_data_leaves_worker_models_served_within_their_ttl(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    """A Redis restarted without persistence (or flushed) forgets every model until its workers'
    next heartbeats: a gateway that saw one within the TTL still serves it, as it does one whose
    workers all left (a 503 to retry while none is up). It once dropped them at once: calls got
    404s, which clients do not retry, and the log said no heartbeat had come for the TTL."""
    import redis

    prompt = {"model": DEMO_MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
    with serve_gateway({}, tmp_path / "gateway", workers_url=redis_url,
                       load_tokenizer=lambda folder: None, worker_model_ttl_s=600.0) as server:
        key = server.new_tenant("caller")
        headers = {"Authorization": f"Bearer {key}"}
        with _serving_worker(demo_engine, redis_url, tmp_path / "worker", "leaving"):
            assert eventually(lambda: DEMO_MODEL in httpx.get(server.url + "/health").json()["models"])
            served = httpx.post(server.url + "/v1/completions", headers=headers, json=prompt, timeout=30)
        with redis.Redis.from_url(redis_url) as client:
            client.flushall()
        time.sleep(4 * DEFAULT_POLL_S)  # the gateway reads the emptied registry
        after = [httpx.post(server.url + "/v1/completions", headers=headers, json=prompt, timeout=30)
                 for _ in range(2)]  # the first one reads it too, finding no worker up
        health = httpx.get(server.url + "/health").json()
    assert served.status_code == 200, served.text
    assert [(r.status_code, r.json()["error"]["code"]) for r in after] == [(503, "engine_unavailable")] * 2
    assert (health["models"], health["unavailable_models"]) == ([DEMO_MODEL], [DEMO_MODEL])


def test_a_call_whose_model_the_gateway_stops_serving_meanwhile_is_still_answered(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    """A worker leaves while answering a call, and the gateway stops serving the model (its TTL
    passed) before the answer ends: the call still gets it, as billed (its logprobs once looked
    the model up again by name: a 500 with a KeyError)."""
    from tests.helpers import HeldEngine

    engine = HeldEngine(demo_engine)
    with serve_gateway({}, tmp_path / "gateway", workers_url=redis_url,
                       load_tokenizer=lambda folder: None, worker_model_ttl_s=0.001) as server, \
            ThreadPoolExecutor(2) as pool:
        key = server.new_tenant("caller")

        def served() -> list[str]:
            return httpx.get(server.url + "/health").json()["models"]

        def answer_once_not_served() -> bool:
            not_served = eventually(lambda: DEMO_MODEL not in served())
            engine.resume.set()
            return not_served

        with _serving_worker(engine, redis_url, tmp_path / "worker", "leaving", shutdown_timeout_s=30):
            assert eventually(lambda: DEMO_MODEL in served())
            call = pool.submit(httpx.post, server.url + "/v1/completions", timeout=60,
                               headers={"Authorization": f"Bearer {key}"},
                               json={"model": DEMO_MODEL, "prompt": [1, 2, 3], "max_tokens": 2,
                                     "logprobs": 1})
            assert engine.arrived.wait(30)
            answering = pool.submit(answer_once_not_served)
        # Leaving the block shut the worker down: it left the registry at once, and answered
        # the call in flight once the gateway had stopped serving its model.
        reply = call.result()
        assert answering.result()
        usage = server.admin("GET", "/admin/tenants/caller").json()["usage"]
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"][0]["logprobs"]["tokens"]) == 2
    assert (usage["tokens_in"], usage["tokens_out"]) == (3, 2)


class _StallingEngine:
    """`engine`, whose answers stop after `stall_after` tokens (0: before their first chunk) and
    wait there until they are aborted: calls still running when a worker's shutdown reaches its
    deadline."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.stall_after = 1
        self.num_stalled = 0
        self.num_tokens = 0  # sent in all, before they stalled

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def generate(self, prompt_token_ids: list[int], options: SamplingOptions,
                       **kwargs) -> AsyncIterator[GenerationChunk]:
        num_tokens, stall_after = 0, self.stall_after
        async with contextlib.aclosing(self._engine.generate(prompt_token_ids, options,
                                                             **kwargs)) as answer:
            while num_tokens < stall_after:
                chunk = await anext(answer)
                num_tokens += len(chunk.token_ids)
                self.num_tokens += len(chunk.token_ids)
                yield chunk
        self.num_stalled += 1
        await asyncio.Event().wait()  # until the worker aborts the request


def test_a_request_a_workers_shutdown_stops_before_it_answers_is_refused_as_by_a_stopping_worker(
        demo_engine, redis_url, tmp_path, caplog):  # noqa: F811
    """A PUT of files still on their way at the deadline: gateways send a stopping worker's 503
    `unavailable` elsewhere (it once got uvicorn's plain-text 500, and a traceback in the log)."""
    caplog.set_level(logging.INFO)
    with contextlib.ExitStack() as stopping:
        requests = stopping.enter_context(_serving_worker(
            demo_engine, redis_url, tmp_path / "stopping", "stopping", shutdown_timeout_s=0.5))
        worker = requests.app.state.worker
        path = f"{ADAPTERS_PATH}/{'0' * 64}"
        connection = send_partly(worker.url, path, {
            "Authorization": f"Bearer {worker.internal_key}",
            "Content-Type": "multipart/form-data; boundary=b"}, b"--b\r\n", 100_000, "PUT")
        assert eventually(lambda: ("PUT", path) in requests.seen)
        stopping.close()
    with connection:
        connection.settimeout(10)
        answer = b"".join(iter(lambda: connection.recv(65536), b""))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), answer
    assert msgspec.json.decode(body)["kind"] == "unavailable"
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    # The deadline is the operator's setting: uvicorn's line about it is no alert.
    [cancelled] = [r for r in caplog.records if r.getMessage().startswith("Cancel 1 running task")]
    assert cancelled.levelname == "WARNING"


class _StallingCheck:
    """`engine`, whose adapter checks never end (until they are cancelled)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.num_checking = 0

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def check_adapter(self, folder: str, max_lora_rank: int | None = None):
        self.num_checking += 1
        await asyncio.Event().wait()


def test_an_adapter_check_a_workers_shutdown_stops_is_taken_for_no_worker_up_not_a_failure(
        demo_engine, redis_url, tmp_path):  # noqa: F811
    stalling = _StallingCheck(demo_engine)
    folder = demo_adapter(tmp_path / "adapter")

    async def scenario(stopping: contextlib.ExitStack) -> BaseException | None:
        async with _gateway_pool(redis_url, tmp_path / "tokenizers") as pool:
            check = asyncio.create_task(pool.clients[DEMO_MODEL].check_adapter(str(folder)))
            async with asyncio.timeout(30):
                while not stalling.num_checking:
                    await asyncio.sleep(0.01)
                await asyncio.to_thread(stopping.close)  # the check still running at the deadline
                return (await asyncio.gather(check, return_exceptions=True))[0]

    with contextlib.ExitStack() as stopping:
        stopping.enter_context(_serving_worker(stalling, redis_url, tmp_path / "stopping",
                                               "stopping", shutdown_timeout_s=0.5))
        outcome = asyncio.run(scenario(stopping))
    # An upload told to retry shortly (503), where it once got a 500 for a failed check.
    assert isinstance(outcome, EngineUnavailable), outcome


def test_a_worker_shutting_down_leaves_the_pool_at_once_and_its_calls_end_to_be_sent_again(
        demo_engine, redis_url, tmp_path, caplog):  # noqa: F811
    caplog.set_level(logging.INFO)
    drain_s = 2.0  # the stopping worker's --shutdown-timeout
    stalling = _StallingEngine(demo_engine)
    with serve_gateway({}, tmp_path / "gateway", store_url=redis_url, workers_url=redis_url,
                       load_tokenizer=lambda folder: None) as gateway, \
            ThreadPoolExecutor(3) as clients, contextlib.ExitStack() as stopping:
        headers = {"Authorization": f"Bearer {gateway.new_tenant('acme')}"}
        body = {"model": DEMO_MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}

        def complete() -> httpx.Response:
            return httpx.post(gateway.url + "/v1/completions", json=body, headers=headers,
                              timeout=30)

        def stream() -> list[str]:
            with httpx.stream("POST", gateway.url + "/v1/completions", timeout=30,
                              json={**body, "stream": True}, headers=headers) as response:
                return [line.removeprefix("data: ") for line in response.iter_lines() if line]

        stopping.enter_context(_serving_worker(stalling, redis_url, tmp_path / "stopping",
                                               "stopping", shutdown_timeout_s=drain_s))
        assert eventually(lambda: httpx.get(gateway.url + "/health").status_code == 200)
        whole, streamed = clients.submit(complete), clients.submit(stream)
        assert eventually(lambda: stalling.num_stalled == 2)  # each after its first token
        stalling.stall_after = 0
        queued = clients.submit(complete)
        assert eventually(lambda: stalling.num_stalled == 3)  # before its first token
        with _serving_worker(demo_engine, redis_url, tmp_path / "live", "live"):
            shutdown = threading.Thread(target=stopping.close)
            shutdown.start()
            # It leaves the registry as its shutdown begins (once, when its calls had ended).
            assert eventually(lambda: asyncio.run(_registered(redis_url)) == ["live"], drain_s)
            assert not any(call.done() for call in (whole, streamed, queued))
            whole, (*chunks, error, done), queued = whole.result(), streamed.result(), queued.result()
            shutdown.join()
        usage = gateway.admin("GET", "/admin/tenants/acme").json()["usage"]
    # At its deadline it ended them with a line the gateway understands: the calls it had
    # started are told to be sent again, as by a gateway that shuts down (they once got 500
    # engine_failure, "lost worker ... mid-answer", with no Retry-After)...
    assert (whole.status_code, whole.headers["retry-after"]) == (503, "2"), whole.text
    assert whole.json()["error"]["code"] == "server_shutdown"
    assert all("choices" in json.loads(chunk) for chunk in chunks)
    assert (json.loads(error)["error"]["code"], done) == ("server_shutdown", "[DONE]")
    # ...and the call it had not started is answered by the live worker, as if nothing happened.
    assert queued.status_code == 200, queued.text
    assert queued.json()["usage"]["completion_tokens"] == 4
    # Each billed for what it produced.
    assert (usage["requests"], usage["tokens_out"], usage["reserved_tokens"]) == (
        3, stalling.num_tokens + 4, 0)
    # The gateway never took it for a failed worker; one line for each stream it ended, and no
    # traceback (there was one for each).
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "placing its requests elsewhere" in m or "lost worker" in m] == []
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    assert messages.count(f"POST {GENERATE_PATH}: the server's shutdown ended this stream before "
                          "its answer did") == 3
