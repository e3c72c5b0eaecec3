"""Scale-out with real processes: two gateways and two engine workers sharing one redis-server.

Adapters are placed as routing.placement says and answer exactly as the single-process engine;
a worker killed under load costs each request either its whole answer or a clean error, and the
pool recovers when a worker rejoins.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import redis

from gateway.config import load_serve_config
from gateway.engine_client import AdapterRef, SamplingOptions
from routing.placement import home_of
from store.blobs import digest_files
from store.workers import WorkerRecord
from tests.conftest import DEMO_MODEL
from tests.processes import SwitchboardProcess, is_healthy, start_switchboard, wait_until
from tests.redis_server import PersistentRedisServer

ADMIN_KEY = "sb-admin-scaleout-key"
NUM_ADAPTERS = 10
PROMPT = "Spread these adapters"
NUM_TOKENS = 6
LONG = 160  # tokens per request while a worker is killed: long enough to be cut


class Cluster:
    """redis-server, two gateways and two workers, all on loopback."""

    def __init__(self, root: Path, model_dir: Path):
        self.root, self.model_dir = root, model_dir
        (root / "redis").mkdir()
        self.redis_server = PersistentRedisServer(root / "redis")
        self.redis_url = self.redis_server.url
        self.redis = redis.Redis.from_url(self.redis_url)
        self.workers: list[SwitchboardProcess] = []
        self.gateways: list[SwitchboardProcess] = []

    def start_worker(self, index: int, port: int | None = None) -> SwitchboardProcess:
        worker = start_switchboard(
            ["worker", "--redis", self.redis_url, "--model", f"{DEMO_MODEL}={self.model_dir}",
             "--data-dir", str(self.root / f"worker{index}"), "--kv-cache-memory", "16MiB",
             "--max-loras", str(NUM_ADAPTERS), "--max-cpu-loras", "16", "--max-lora-rank", "16",
             # NOTE: records lapse 3 beats (1.5 s) after they are written: on a busy machine
             # heartbeats of 0.3 s were seen 0.55 s apart, close to lapsing a live worker.
             "--heartbeat", "0.5", "--log-level", "warning"],
            self.root / f"worker{index}.log", port)
        return worker

    def start_gateway(self, index: int) -> SwitchboardProcess:
        # NOTE: a data folder each: a gateway fetches the adapter files it lacks from Redis.
        return start_switchboard(
            ["serve", "--redis", self.redis_url, "--admin-key", ADMIN_KEY,
             "--data-dir", str(self.root / f"gateway{index}"), "--log-level", "warning"],
            self.root / f"gateway{index}.log")

    def records(self) -> list[WorkerRecord]:
        raws = [self.redis.get(f"sb:worker:{i.decode()}") for i in self.redis.smembers("sb:workers")]
        return [msgspec.json.decode(raw, type=WorkerRecord) for raw in raws if raw is not None]

    def wait_for_workers(self, count: int) -> None:
        for gateway in self.gateways:
            wait_until(gateway, lambda: len(self.records()) == count
                       and DEMO_MODEL in httpx.get(gateway.url + "/health").json()["models"])

    def log_tails(self) -> dict[str, str]:
        """The end of each process's log, for failure messages."""
        return {str(p.log.name): p.output()[-1500:] for p in self.gateways + self.workers}

    def close(self) -> None:
        for process in self.gateways + self.workers:
            process.stop()
        self.redis.close()
        self.redis_server.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, demo_model_dir):
    cluster = Cluster(tmp_path_factory.mktemp("scaleout"), demo_model_dir)
    try:
        cluster.workers = [cluster.start_worker(i) for i in range(2)]
        cluster.gateways = [cluster.start_gateway(i) for i in range(2)]
        for process in cluster.workers + cluster.gateways:
            wait_until(process, lambda: is_healthy(process))
        cluster.wait_for_workers(2)
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def tenant_key(cluster) -> str:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    gateway = cluster.gateways[0].url
    assert httpx.post(gateway + "/admin/tenants", json={"name": "fleet"},
                      headers=admin).status_code == 201
    return httpx.post(gateway + "/admin/tenants/fleet/keys", headers=admin).json()["key"]


def _peft_adapter(model_dir: Path, folder: Path, seed: int) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=4 + seed % 5, lora_alpha=8,
                                            target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: a no-op adapter
                param.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


def _completion(gateway: SwitchboardProcess, key: str, model: str, **fields) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0,
            "ignore_eos": True, **fields}
    return httpx.post(gateway.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})


def _answer_tokens(gateway: SwitchboardProcess, key: str, model: str) -> list[int]:
    answer = _completion(gateway, key, model, logprobs=0, return_tokens_as_token_ids=True)
    assert answer.status_code == 200, answer.text
    return [int(t.removeprefix("token_id:"))
            for t in answer.json()["choices"][0]["logprobs"]["tokens"]]


def _local_greedy(engine, adapter: AdapterRef | None) -> list[int]:
    async def run() -> list[int]:
        tokens = []
        options = SamplingOptions(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
        async for chunk in engine.generate(engine.tokenize(PROMPT), options,
                                           request_id=f"local-{next(_ids)}", adapter=adapter):
            tokens += chunk.token_ids
        return tokens
    return asyncio.run(run())


_ids = itertools.count()


@pytest.fixture(scope="module")
def uploaded_adapters(cluster, tenant_key, tmp_path_factory) -> dict[str, Path]:
    """Ten adapters uploaded through both gateways, by name, spread over both workers' homes."""
    tmp_path = tmp_path_factory.mktemp("adapters")
    worker_ids = [r.id for r in cluster.records()]
    folders = {f"tenant-lora-{i}": _peft_adapter(cluster.model_dir, tmp_path / f"a{i}", i)
               for i in range(NUM_ADAPTERS)}
    seed = NUM_ADAPTERS
    while len({home_of(digest_files(f), worker_ids) for f in folders.values()}) < len(worker_ids):
        # Worker ids are random: with odds of 1 in 512 all ten homes fall on one worker, and the
        # test would not show adapters spread. Swap in another adapter until both have some.
        folders[f"tenant-lora-{NUM_ADAPTERS - 1}"] = _peft_adapter(cluster.model_dir, tmp_path / f"a{seed}",
                                                                   seed)
        seed += 1
    for i, (name, folder) in enumerate(folders.items()):
        gateway = cluster.gateways[i % 2]  # uploads through either gateway land in one registry
        files = {f: (f, (folder / f).read_bytes())
                 for f in ("adapter_config.json", "adapter_model.safetensors")}
        uploaded = httpx.post(gateway.url + "/v1/adapters", files=files, timeout=60,
                              data={"name": name, "base_model": DEMO_MODEL},
                              headers={"Authorization": f"Bearer {tenant_key}"})
        assert uploaded.status_code == 201, uploaded.text
    return folders


def test_adapters_are_placed_by_affinity_and_answer_as_one_engine(cluster, tenant_key,
                                                                   uploaded_adapters, demo_engine):
    worker_ids = [r.id for r in cluster.records()]
    folders = uploaded_adapters
    for name, folder in folders.items():
        expected = _local_greedy(demo_engine, AdapterRef(digest_files(folder), str(folder)))
        for gateway in cluster.gateways:  # each adapter twice, through both gateways
            assert _answer_tokens(gateway, tenant_key, name) == expected, name
    base = _completion(cluster.gateways[1], tenant_key, DEMO_MODEL)
    assert base.status_code == 200, base.text

    # Each adapter went to its home worker, and only there (the registry lags a heartbeat; each
    # worker has device slots for all ten, so no eviction blurs where they went).
    assert sorted(r.id for r in cluster.records()) == sorted(worker_ids)
    homes = {digest_files(f): home_of(digest_files(f), worker_ids) for f in folders.values()}
    assert set(homes.values()) == set(worker_ids)  # both workers got adapters
    wait_until(cluster.gateways[0], lambda: all(
        {d for d, home in homes.items() if home == r.id}
        == set(r.adapters_device) & set(homes) for r in cluster.records()), timeout_s=10)


def test_a_request_a_worker_refuses_is_a_400_naming_its_field(cluster, tenant_key):
    for fields, param in [({"stop_token_ids": [10**6]}, "stop_token_ids"),
                          ({"min_tokens": NUM_TOKENS + 1}, "min_tokens")]:
        reply = _completion(cluster.gateways[1], tenant_key, DEMO_MODEL, **fields)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param, reply.text


def test_a_gateway_prices_and_routes_over_the_models_its_workers_serve(cluster, tenant_key):
    # Both were refused at startup: the routes were checked before the workers were known, and
    # a [models.X] table had to name a path or an upstream.
    config = cluster.root / "priced.toml"
    config.write_text(f'[models.{DEMO_MODEL}]\nprice_input = 1e6\nprice_output = 2e6\n'
                      f'[routes.over-workers]\ntiers = ["{DEMO_MODEL}", "local"]\n'
                      'measure = "min_prob"\nthreshold = 0.0\n')
    gateway = start_switchboard(
        ["serve", "--redis", cluster.redis_url, "--admin-key", ADMIN_KEY, "--config", str(config),
         "--model", f"local={cluster.model_dir}", "--data-dir", str(cluster.root / "priced"),
         "--log-level", "warning"], cluster.root / "priced.log")
    try:
        wait_until(gateway, lambda: is_healthy(gateway))
        for model in (DEMO_MODEL, "over-workers"):
            reply = _completion(gateway, tenant_key, model)
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-switchboard-model"] == DEMO_MODEL
            usage = reply.json()["usage"]  # 1 USD a prompt token, 2 an output token
            assert float(reply.headers["x-switchboard-cost-usd"]) == \
                pytest.approx(usage["prompt_tokens"] + 2 * usage["completion_tokens"])
    finally:
        gateway.stop()
    config.write_text(f'[models.{DEMO_MODEL}]\nprice_input = 1\n')
    with pytest.raises(ValueError, match="only a gateway with engine workers"):
        load_serve_config({}, config, {})


def test_a_worker_killed_under_load_costs_clean_errors_at_most_and_the_pool_recovers(
        cluster, tenant_key):
    def call(i: int) -> tuple[str, str]:
        gateway = cluster.gateways[i % 2]
        body = {"model": DEMO_MODEL, "prompt": f"{PROMPT} {i}", "max_tokens": LONG,
                "ignore_eos": True, "stream": i % 3 == 0}
        headers = {"Authorization": f"Bearer {tenant_key}"}
        with httpx.stream("POST", gateway.url + "/v1/completions", json=body, headers=headers,
                          timeout=30) as response:
            raw = response.read().decode()
        if response.status_code != 200:
            assert response.json()["error"]["code"] == "engine_failure", raw
            return "error", raw
        if not body["stream"]:
            assert response.json()["usage"]["completion_tokens"] == LONG, raw
            return "answer", raw
        events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
        assert events[-1] == "[DONE]", raw  # a cut stream still ends cleanly
        last = json.loads(events[-2])
        if "error" in last:
            assert last["error"]["code"] == "engine_failure", raw
            return "error", raw
        assert last["choices"][0]["finish_reason"] == "length", raw
        return "answer", raw

    victim = cluster.workers[1]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(call, i) for i in range(24)]
        wait_until(victim, lambda: any(r.num_running for r in cluster.records()
                                        if r.url == victim.url), timeout_s=30)
        victim.kill()  # while it runs requests
        outcomes = [f.result(timeout=60) for f in futures]  # nobody hangs
    kinds = [kind for kind, _ in outcomes]
    assert len(kinds) == 24 and kinds.count("answer") > 0, kinds

    # The dead worker lapses from the registry; every request now succeeds on the survivor.
    cluster.wait_for_workers(1)
    failed = [raw for kind, raw in map(call, range(1, 7)) if kind != "answer"]
    assert not failed, (failed, cluster.log_tails())

    # It rejoins (same port) and takes requests again.
    cluster.workers[1] = cluster.start_worker(1, port=victim.port)
    wait_until(cluster.workers[1], lambda: is_healthy(cluster.workers[1]))
    cluster.wait_for_workers(2)
    time.sleep(1.0)  # the gateways re-read the registry every 0.5 s
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        failed = [raw for kind, raw in pool.map(call, range(16)) if kind != "answer"]
    assert not failed, (failed, cluster.log_tails())
    # Both took requests (their records show it a heartbeat later).
    wait_until(cluster.workers[1], lambda: all(json.loads(r.stats)["num_generation_tokens"] > 0
                                               for r in cluster.records()), timeout_s=5)


def test_after_a_redis_restart_workers_rejoin_and_adapters_still_answer(cluster, tenant_key,
                                                                         uploaded_adapters):
    before = _answer_tokens(cluster.gateways[0], tenant_key, "tenant-lora-3")
    cluster.redis_server.stop()
    time.sleep(1.6)  # the workers' records would lapse now, were Redis up
    cluster.redis_server.start()
    cluster.wait_for_workers(2)  # re-registered by their heartbeats, nobody restarted
    for gateway in cluster.gateways:
        assert _answer_tokens(gateway, tenant_key, "tenant-lora-3") == before
    assert all(p.popen.poll() is None for p in cluster.gateways + cluster.workers)
