"""Two real gateways sharing one Redis: limits hold across both, and both ride out a Redis restart.

The gateways are `switchboard serve` processes over the demo model with one store (a Redis that
persists to disk, as production's should) and a data folder each, as replicas on two machines
behind a load balancer: adapter files reach the second gateway through Redis.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gateway.errors import STORE_UNAVAILABLE_MESSAGE
from tests.conftest import ADMIN_KEY, DEMO_MODEL
from tests.helpers import TINY_DIMS, save_peft_adapter
from tests.processes import SwitchboardProcess, is_healthy, start_switchboard, wait_until
from tests.redis_server import PersistentRedisServer

PROMPT = "hi"
MAX_TOKENS = 1
COST = 1 + len(PROMPT) + MAX_TOKENS  # tokens of one call: BOS, one per byte, then the output
RPM = 4
_OUTAGE_REPLY_S = 3.0  # calls during the outage must fail fast, not hang


@dataclass
class Gateway:
    process: SwitchboardProcess

    @property
    def url(self) -> str:
        return self.process.url

    def request(self, method: str, path: str, key: str, **kwargs) -> httpx.Response:
        return httpx.request(method, self.url + path, headers=auth(key), timeout=30, **kwargs)


@dataclass
class Cluster:
    gateways: list[Gateway]
    redis: PersistentRedisServer

    def new_tenant(self, name: str, **limits) -> str:
        """Create a tenant with `limits` through the first gateway; a fresh API key for it."""
        created = self.gateways[0].request("POST", "/admin/tenants", ADMIN_KEY,
                                           json={"name": name, **limits})
        assert created.status_code == 201, created.text
        key = self.gateways[0].request("POST", f"/admin/tenants/{name}/keys", ADMIN_KEY)
        assert key.status_code == 201, key.text
        return key.json()["key"]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _start_gateway(demo_model_dir: Path, data_dir: Path, store_url: str, log: Path) -> Gateway:
    return Gateway(start_switchboard([
        "serve", "--model", f"{DEMO_MODEL}={demo_model_dir}", "--store", store_url,
        "--admin-key", ADMIN_KEY, "--data-dir", str(data_dir),
        "--adapter-dir", str(data_dir / "adapters"), "--kv-cache-memory", "16MiB",
        "--max-loras", "2", "--max-lora-rank", "8"], log))


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("scaleout")
    (root / "redis").mkdir()
    with ExitStack() as stack:
        redis = PersistentRedisServer(root / "redis")
        stack.callback(redis.stop)
        gateways: list[Gateway] = []
        for name in ("a", "b"):
            gateways.append(_start_gateway(demo_model_dir, root / f"gateway-{name}", redis.url,
                                           root / f"gateway-{name}.log"))
            stack.callback(gateways[-1].process.stop)
        for gateway in gateways:
            wait_until(gateway.process, lambda: is_healthy(gateway.process))
        yield Cluster(gateways, redis)


def completion(model: str = DEMO_MODEL, max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


def complete_all(gateways: list[Gateway], key: str, num_calls: int) -> list[httpx.Response]:
    """`num_calls` concurrent completions, sent to the gateways in turn."""
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(
                client.post(gateways[i % len(gateways)].url + "/v1/completions", headers=auth(key),
                            json=completion()) for i in range(num_calls)))

    return asyncio.run(run())


def test_rate_limit_holds_across_both_gateways(cluster):
    key = cluster.new_tenant("rpm", rpm=RPM)
    replies = complete_all(cluster.gateways, key, 3 * RPM)
    assert sorted(r.status_code for r in replies) == [200] * RPM + [429] * (2 * RPM)
    for refused in (r for r in replies if r.status_code == 429):
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(refused.headers["retry-after"]) >= 1


def test_token_budget_holds_across_both_gateways(cluster):
    key = cluster.new_tenant("budget", monthly_token_budget=2 * COST)
    replies = complete_all(cluster.gateways, key, 6)
    assert sorted(r.status_code for r in replies) == [200] * 2 + [429] * 4
    served = [r.json()["usage"]["total_tokens"] for r in replies if r.status_code == 200]
    assert served == [COST] * 2
    assert {r.json()["error"]["code"] for r in replies if r.status_code == 429} == \
        {"insufficient_quota"}
    usage = cluster.gateways[1].request("GET", "/admin/tenants/budget", ADMIN_KEY).json()["usage"]
    assert (usage["requests"], usage["tokens_in"] + usage["tokens_out"]) == (2, 2 * COST)


def _upload_adapter(gateway: Gateway, key: str, folder: Path) -> httpx.Response:
    from engine.demo import demo_config

    demo_dims = {name: getattr(demo_config(), name) for name in TINY_DIMS}
    save_peft_adapter(folder, model_overrides=demo_dims, r=4, lora_alpha=8)
    files = {name: (name, (folder / name).read_bytes())
             for name in ("adapter_config.json", "adapter_model.safetensors")}
    return gateway.request("POST", "/v1/adapters", key, files=files,
                           data={"name": "tuned", "base_model": DEMO_MODEL})


def _answer(gateway: Gateway, key: str, model: str) -> str:
    reply = gateway.request("POST", "/v1/completions", key, json=completion(model, max_tokens=8))
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_both_gateways_ride_out_a_redis_restart(cluster, tmp_path):
    key = cluster.new_tenant("durable")
    uploaded = _upload_adapter(cluster.gateways[0], key, tmp_path / "adapter")
    assert uploaded.status_code == 201, uploaded.text
    answer = _answer(cluster.gateways[1], key, "tuned")
    assert answer != _answer(cluster.gateways[1], key, DEMO_MODEL)  # the adapter is applied

    cluster.redis.stop()
    try:
        for gateway in cluster.gateways:
            for method, path, caller, body in (
                    ("POST", "/v1/completions", key, completion("tuned")),
                    ("GET", "/v1/models", key, None), ("GET", "/v1/adapters", key, None),
                    ("POST", "/admin/tenants", ADMIN_KEY, {"name": "new"})):
                started = time.monotonic()
                reply = gateway.request(method, path, caller, json=body)
                assert time.monotonic() - started < _OUTAGE_REPLY_S
                assert (reply.status_code, reply.headers["retry-after"]) == (503, "2"), reply.text
                assert reply.json() == {"error": {
                    "message": STORE_UNAVAILABLE_MESSAGE, "type": "server_error", "param": None,
                    "code": "store_unavailable"}}
            health = httpx.get(gateway.url + "/health")
            assert health.status_code == 503
            assert health.json() == {  # it said only "retry shortly", whatever the cause
                "status": "unavailable", "models": [DEMO_MODEL],
                "error": "the gateway cannot use its store (tenants, keys, limits): Redis cannot be "
                         "reached (down, restarting, or refusing connections); it serves again by "
                         "itself once that is mended"}
    finally:
        cluster.redis.start()

    for gateway in cluster.gateways:  # the same processes, with the tenant, key and adapter kept
        assert httpx.get(gateway.url + "/health").status_code == 200
        assert _answer(gateway, key, "tuned") == answer
        record = gateway.request("GET", "/v1/adapters/tuned", key)
        assert record.status_code == 200 and record.json() == uploaded.json()
        tenant = gateway.request("GET", "/admin/tenants/durable", ADMIN_KEY)
        assert tenant.status_code == 200 and tenant.json()["tenant"]["name"] == "durable"
