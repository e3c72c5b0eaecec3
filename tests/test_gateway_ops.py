"""/health, /openapi.json, errors outside the API routes, what a graceful shutdown does to the calls
still running at its deadline, and the gateway's torch-free import."""

import asyncio
import json
import logging
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from gateway.app import ROUTES
from gateway.errors import REDIS_FULL_MESSAGE, SQLITE_FULL_MESSAGE
from gateway.openapi import openapi_path
from store import StoreUnavailable, unavailable_cause
from store.sqlite import LOCK_TIMEOUT_S, SqliteStore
from routing.routes import parse_routes
from tests.conftest import DEMO_MODEL, gateway_server, logged_status, serve_gateway
from tests.helpers import fill_volume, small_volume
from tests.redis_server import start_redis_server, stop_redis_server
from tests.test_gateway_routing import ScriptedTier, eventually

_SHUTDOWN_TIMEOUT_S = 1.0


def test_health_needs_no_key(server):
    response = httpx.get(server.url + "/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "models": [DEMO_MODEL]}


def test_a_sqlite_store_locked_by_another_process_answers_503_to_retry(server, caplog):
    key = server.new_tenant("locked-out", rpm=100)
    completion = {"model": DEMO_MODEL, "prompt": "hi", "max_tokens": 1}
    other = sqlite3.connect(server.app.state.gateway.store.path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # an sqlite3 shell, a script's long write
        started = time.monotonic()
        refused = httpx.post(server.url + "/v1/completions", json=completion, timeout=60,
                             headers={"Authorization": f"Bearer {key}"})
        assert time.monotonic() - started < 2 * LOCK_TIMEOUT_S
        assert (refused.status_code, refused.headers["retry-after"]) == (503, "2"), refused.text
        assert refused.json()["error"]["code"] == "store_unavailable"
        with caplog.at_level(logging.INFO, logger="gateway.ops"):
            health = [httpx.get(server.url + "/health", timeout=60) for _ in range(2)]
        # It said only "retry shortly", and logged nothing.
        assert [h.status_code for h in health] == [503, 503]
        assert health[0].json()["error"] == (
            "the gateway cannot use its store (tenants, keys, limits): another process (a backup, "
            "a script, an sqlite3 shell) held the SQLite file's write lock for more than "
            f"{LOCK_TIMEOUT_S:g} s; it serves again by itself once that is mended")
    finally:
        other.execute("ROLLBACK")
        other.close()
    with caplog.at_level(logging.INFO, logger="gateway.ops"):
        assert httpx.get(server.url + "/health").status_code == 200
    # Logged as the outage began (with the file's path, which /health does not show) and ended.
    logged = [r.getMessage() for r in caplog.records if r.name == "gateway.ops"]
    assert logged == [f"/health: the store cannot take writes: {unavailable_cause(StoreUnavailable())} "
                      f"(StoreUnavailable: the SQLite store {server.app.state.gateway.store.path} "
                      f"stayed locked by another process for {LOCK_TIMEOUT_S:g} s)",
                      "/health: the store takes writes again"]
    answered = httpx.post(server.url + "/v1/completions", json=completion, timeout=60,
                          headers={"Authorization": f"Bearer {key}"})
    assert answered.status_code == 200, answered.text


def test_a_full_redis_store_answers_503_store_full_until_it_has_room(demo_engine, tmp_path):
    """Redis out of its maxmemory (noeviction, as README asks) refuses every write until its
    operator gives it room: calls say so, not "retry shortly", and so does /health."""
    process, url = start_redis_server()
    client = redis.Redis.from_url(url)
    completion = {"model": DEMO_MODEL, "prompt": "hi", "max_tokens": 1}
    try:
        with gateway_server(demo_engine, tmp_path, url) as server:
            key = server.new_tenant("crowded", rpm=100)  # so each call writes its rate bucket
            client.config_set("maxmemory", 1)
            refused = httpx.post(server.url + "/v1/completions", json=completion, timeout=60,
                                 headers={"Authorization": f"Bearer {key}"})
            assert refused.status_code == 503, refused.text
            assert refused.json() == {"error": {"message": REDIS_FULL_MESSAGE, "type": "server_error",
                                                "param": None, "code": "store_full"}}
            assert "retry-after" not in refused.headers
            assert refused.headers["x-should-retry"] == "false"
            health = httpx.get(server.url + "/health", timeout=60)
            assert (health.status_code, health.json()["error"]) == (503, REDIS_FULL_MESSAGE)

            client.config_set("maxmemory", 0)
            assert httpx.get(server.url + "/health").status_code == 200
            answered = httpx.post(server.url + "/v1/completions", json=completion, timeout=60,
                                  headers={"Authorization": f"Bearer {key}"})
            assert answered.status_code == 200, answered.text
    finally:
        client.close()
        stop_redis_server(process)


def _cap_sqlite_file(store: SqliteStore, max_pages: int) -> None:
    """Cap the store's file at `max_pages` pages (never below its size now) on both of its
    connections, as a full disk caps it: a write that needs a page more fails with SQLITE_FULL
    ("database or disk is full"), with no volume to fill (which needs root)."""
    for conn in (store._inline_conn, store._conn):
        conn.execute(f"PRAGMA max_page_count = {max_pages}")


def test_a_sqlite_store_with_no_room_left_answers_503_store_full_until_it_has_room(
        demo_engine, tmp_path, caplog):
    """SQLite refusing a write for want of room refuses the call with what to do, not retrying
    (only the operator makes room), and the calls go on by themselves once there is room."""
    with gateway_server(demo_engine, tmp_path) as server:
        store = server.app.state.gateway.store
        _cap_sqlite_file(store, 1)  # its size now: each new page of tenants passes it
        with caplog.at_level(logging.WARNING, logger="gateway.errors"):
            for i in range(100):  # a few pages of tenants at most
                refused = server.admin("POST", "/admin/tenants", json={"name": f"crowd-{i}"})
                if refused.status_code != 201:
                    break
        assert refused.status_code == 503, refused.text
        assert refused.json() == {"error": {"message": SQLITE_FULL_MESSAGE, "type": "server_error",
                                            "param": None, "code": "store_full"}}
        assert "retry-after" not in refused.headers
        assert refused.headers["x-should-retry"] == "false"
        # The log names the file, which the message does not show the client.
        assert (f"POST /admin/tenants: store_full: the SQLite store {store.path} cannot be written "
                f"(database or disk is full): free disk space on the volume of {tmp_path}") in caplog.text

        _cap_sqlite_file(store, 1 << 30)
        created = server.admin("POST", "/admin/tenants", json={"name": f"crowd-{i}"})
        assert created.status_code == 201, created.text


def test_a_sqlite_store_on_a_full_disk_answers_503_store_full_and_health_says_so(demo_engine,
                                                                                 tmp_path):
    """The SQLite file's disk full (a small volume, filled): calls that write and /health say that
    the store has no room left, and all answer again as soon as space is freed."""
    completion = {"model": DEMO_MODEL, "prompt": "hi", "max_tokens": 1}
    with small_volume(tmp_path / "volume", "4m") as volume, \
            gateway_server(demo_engine, volume / "data") as server:
        key = server.new_tenant("crowded", rpm=100)  # so each call writes its rate bucket
        filler = fill_volume(volume)
        refused = httpx.post(server.url + "/v1/completions", json=completion, timeout=60,
                             headers={"Authorization": f"Bearer {key}"})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "store_full"
        assert refused.headers["x-should-retry"] == "false"
        health = httpx.get(server.url + "/health", timeout=60)
        assert (health.status_code, health.json()["error"]) == (503, SQLITE_FULL_MESSAGE)

        filler.unlink()
        assert httpx.get(server.url + "/health").status_code == 200
        answered = httpx.post(server.url + "/v1/completions", json=completion, timeout=60,
                              headers={"Authorization": f"Bearer {key}"})
        assert answered.status_code == 200, answered.text


def test_openapi_lists_every_route_and_method(server):
    document = httpx.get(server.url + "/openapi.json").json()
    assert document["openapi"].startswith("3.")
    listed = {(method.upper(), path) for path, ops in document["paths"].items() for method in ops}
    routed = {(method, openapi_path(route.path)) for route in ROUTES for method in route.methods - {"HEAD"}}
    assert listed == routed
    assert len(routed) == 22
    assert document["paths"]["/v1/models/{model}"]["get"]["parameters"][0]["name"] == "model"
    operation_ids = [op["operationId"] for ops in document["paths"].values() for op in ops.values()]
    assert len(operation_ids) == len(set(operation_ids))
    upload = document["paths"]["/v1/adapters"]["post"]["requestBody"]["content"]
    assert {"name", "base_model", "file"} <= set(upload["multipart/form-data"]["schema"]["properties"])
    chat = document["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = document["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"model", "messages", "max_completion_tokens", "top_logprobs"} <= set(schema["properties"])
    assert document["paths"]["/admin/keys/{key_id}"]["delete"]["parameters"][0]["name"] == "key_id"
    assert "security" not in document["paths"]["/health"]["get"]
    created = {(method.upper(), path) for path, ops in document["paths"].items()
               for method, op in ops.items() if "201" in op["responses"]}
    assert created == {("POST", "/admin/tenants"), ("POST", "/admin/tenants/{tenant}/keys"),
                       ("POST", "/v1/adapters"), ("POST", "/admin/tenants/{tenant}/adapters")}
    summary = document["paths"]["/v1/models/{model}"]["get"]["summary"]  # once cut at a line's end
    assert summary.endswith("(another tenant's adapter included: its name is not even confirmed).")


def test_unknown_routes_and_methods_get_openai_shaped_errors(server):
    missing = httpx.get(server.url + "/v1/nothing")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "invalid_request_error"
    wrong_method = httpx.get(server.url + "/v1/completions")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["message"]


def test_a_405_allows_every_method_of_its_path(server):
    """Its Allow header lists every method the path answers (RFC 9110), where it once listed
    those of one endpoint only; the methods it lists work."""
    allowed = {
        "/admin/tenants": {"GET", "HEAD", "POST"},
        "/admin/tenants/acme": {"GET", "HEAD", "PATCH", "DELETE"},
        "/admin/tenants/acme/keys": {"POST"},
        "/admin/tenants/acme/adapters": {"GET", "HEAD", "POST"},
        "/admin/tenants/acme/adapters/bot": {"GET", "HEAD", "DELETE"},
        "/v1/adapters": {"GET", "HEAD", "POST"},
        "/v1/adapters/bot": {"GET", "HEAD", "DELETE"},
        "/v1/completions": {"POST"},
    }
    refused = {path: httpx.put(server.url + path) for path in allowed}
    assert {path: set(answer.headers["allow"].split(", ")) for path, answer in refused.items()} == allowed
    for answer in refused.values():
        assert answer.status_code == 405
        assert answer.json() == {"error": {"message": "Method Not Allowed",
                                           "type": "invalid_request_error", "param": None, "code": None}}
    server.new_tenant("acme")
    answered = [server.admin(method, "/admin/tenants/acme", **body) for method, body in
                (("HEAD", {}), ("GET", {}), ("PATCH", {"json": {"rpm": 5}}), ("DELETE", {}))]
    assert [answer.status_code for answer in answered] == [200, 200, 200, 200]
    assert answered[0].content == b"" and answered[1].json()["tenant"]["name"] == "acme"
    assert answered[2].json()["rpm"] == 5


def test_a_client_cannot_forge_access_log_lines(server, caplog):
    forged = "\n2026-01-01 00:00:00,000 INFO gateway.access: POST /admin/tenants 201 tenant=mallory"
    with caplog.at_level("INFO", logger="gateway.access"):
        httpx.get(server.url + "/v1/models/x" + forged.replace("\n", "%0A").replace(" ", "%20"))

        def access_lines() -> list[str]:
            # NOTE: the previous test's last line may land here too: lines are logged once the
            # response is sent, which may be after the client read it
            return [r.getMessage() for r in caplog.records
                    if r.name == "gateway.access" and "/v1/models/x" in r.getMessage()]

        assert eventually(access_lines)
    [line] = access_lines()
    assert "\n" not in line and "x\\n2026-01-01" in line  # escaped, still readable


def _stalling_tier() -> ScriptedTier:
    """An engine whose answers stop after their first token and wait until they are aborted: calls
    still running when a shutdown reaches its deadline."""
    tier = ScriptedTier("small")
    tier.stall_after = 1
    return tier


def test_a_call_the_shutdown_stops_is_logged_and_counted_as_the_503_its_client_gets(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gateway.access")
    tier = _stalling_tier()
    with ThreadPoolExecutor(1) as clients:
        with serve_gateway({"small": tier}, tmp_path,
                           shutdown_timeout_s=_SHUTDOWN_TIMEOUT_S) as server:
            key = server.new_tenant("acme")
            reply = clients.submit(httpx.post, server.url + "/v1/completions", timeout=30,
                                   json={"model": "small", "prompt": "easy", "max_tokens": 4},
                                   headers={"Authorization": f"Bearer {key}"})
            assert tier.stalled.wait(10)
        stopped = reply.result()  # the block's end shut the server down, the call still running
    assert (stopped.status_code, stopped.headers["retry-after"]) == (503, "2"), stopped.text
    assert stopped.json()["error"]["code"] == "server_shutdown"
    # Once both said 500, so every rolling restart raised alerts for server errors.
    assert logged_status(caplog, "POST", "/v1/completions") == 503
    requests = server.app.state.gateway.metrics.requests
    assert [requests.value(tenant="acme", model="small", status=status)
            for status in ("503", "500")] == [1, 0]


@pytest.mark.parametrize("model", ["small", "casc"])
def test_a_call_the_shutdown_stops_before_its_first_token_gives_its_request_back(tmp_path, model):
    """Its client is told to send it again: that call, here or on a gateway sharing the store, is
    not refused for the rpm the stopped one held (as a call a stopping worker refuses)."""
    waiting = ScriptedTier("small")
    waiting.start_after = threading.Event()  # never set: its answers wait before their first token
    engines = {"small": waiting, "large": ScriptedTier("large")}
    routes = parse_routes({"casc": {"tiers": ["small", "large"], "measure": "min_prob",
                                    "threshold": 0.5}}, engines)
    body = {"model": model, "prompt": "easy", "max_tokens": 4}
    with ThreadPoolExecutor(1) as clients:
        with serve_gateway(engines, tmp_path, shutdown_timeout_s=_SHUTDOWN_TIMEOUT_S,
                           routes=routes) as server:
            key = server.new_tenant("acme", rpm=1)
            headers = {"Authorization": f"Bearer {key}"}
            reply = clients.submit(httpx.post, server.url + "/v1/completions", timeout=30,
                                   json=body, headers=headers)
            assert eventually(lambda: waiting.started)
        stopped = reply.result()
    assert stopped.status_code == 503 and stopped.json()["error"]["code"] == "server_shutdown"
    waiting.start_after = None
    with serve_gateway(engines, tmp_path, routes=routes) as server:
        again = httpx.post(server.url + "/v1/completions", timeout=30, json=body, headers=headers)
        assert again.status_code == 200, again.text  # was a 429: rpm 1 was used up
        assert server.settled_usage("acme")["requests"] == 1


def test_a_stream_the_shutdown_stops_ends_with_a_server_shutdown_event_and_one_log_line(
        tmp_path, caplog):
    caplog.set_level(logging.INFO)
    tier = _stalling_tier()

    def stream(url: str, key: str) -> list[str]:
        with httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json={"model": "small", "prompt": "easy", "max_tokens": 4, "stream": True},
                          headers={"Authorization": f"Bearer {key}"}) as response:
            return [line.removeprefix("data: ") for line in response.iter_lines() if line]

    with ThreadPoolExecutor(1) as clients:
        with serve_gateway({"small": tier}, tmp_path,
                           shutdown_timeout_s=_SHUTDOWN_TIMEOUT_S) as server:
            events = clients.submit(stream, server.url, server.new_tenant("acme"))
            assert tier.stalled.wait(10)
        # Once cut mid-stream, with uvicorn's traceback of the CancelledError in the log.
        *chunks, error, done = events.result()
    assert [json.loads(chunk)["choices"][0]["text"] for chunk in chunks] == ["s"]
    assert (json.loads(error)["error"]["code"], done) == ("server_shutdown", "[DONE]")
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    assert [r.getMessage() for r in caplog.records if r.name == "gateway.sse"] == [
        "POST /v1/completions: the server's shutdown ended this stream before its answer did"]
    # Billed for the token it streamed, as when a client leaves.
    [access] = [r.getMessage() for r in caplog.records
                if r.name == "gateway.access" and "/v1/completions" in r.getMessage()]
    assert " 200 tenant=acme model=small prompt_tokens=4 completion_tokens=1 " in access


def test_a_stream_whose_billing_the_shutdown_deadline_passes_is_one_warning_and_still_billed(
        tmp_path, caplog, monkeypatch):
    """The client has its whole stream, and the store is slow to record it: a shutdown reaching
    its deadline then cancels the call as it waits for its billing. Once uvicorn's ERROR traceback
    ("Exception in ASGI application"); the billing itself goes on until the store closes. (A
    whole answer is sent once billed.)"""
    caplog.set_level(logging.INFO)
    released = threading.Event()
    with serve_gateway({"small": ScriptedTier("small")}, tmp_path,
                       shutdown_timeout_s=_SHUTDOWN_TIMEOUT_S) as server:
        store = server.app.state.gateway.store
        settle = store.settle

        async def slow_settle(*args, **kwargs):  # a store slow to answer, until released
            while not released.is_set():
                await asyncio.sleep(0.01)
            return await settle(*args, **kwargs)

        monkeypatch.setattr(store, "settle", slow_settle)
        key = server.new_tenant("acme")
        reply = httpx.post(server.url + "/v1/completions", timeout=30,
                           json={"model": "small", "prompt": "easy", "max_tokens": 4, "stream": True},
                           headers={"Authorization": f"Bearer {key}"})
        assert reply.status_code == 200 and "server_shutdown" not in reply.text, reply.text

        def release_once_warned() -> None:
            assert eventually(lambda: any(r.name == "gateway.middleware" for r in caplog.records),
                              timeout_s=30)
            released.set()

        releasing = threading.Thread(target=release_once_warned)
        releasing.start()
    releasing.join()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert [r.getMessage() for r in caplog.records if r.name == "gateway.middleware"] == [
        "POST /v1/completions: the server's shutdown deadline passed while this call's usage was "
        "recorded; it is recorded if the store answers before it closes"]

    async def usage():
        reopened = await SqliteStore.open(tmp_path / "switchboard.db")
        try:
            return await reopened.get_usage("acme")
        finally:
            await reopened.close()

    billed = asyncio.run(usage())
    assert (billed.requests, billed.tokens_out) == (1, 4)


def test_request_handling_never_imports_torch():
    code = ("import sys, gateway.app, gateway.cli; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
