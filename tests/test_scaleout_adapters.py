"""Two gateways, each with its own adapter folder, sharing one redis-server: an adapter uploaded
through one answers through the other (its files fetched from Redis, once, and checked); deletes
remove the Redis copy; a damaged or half-written copy is refused and never reaches a folder, and
uploading the adapter again repairs it. Gateways and workers drop the files of deleted adapters
when they start, and every so often while they run.

The gateways are real apps on real sockets over the session's demo engine (see conftest).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
import redis

from gateway.worker import Worker, create_worker_app
from store.blobs import ADAPTER_FILES, OWNER_FILE, BlobStore, digest_files
from store.workers import WorkerRegistry
from tests.conftest import DEMO_MODEL, GatewayServer, gateway_server, run_server
from tests.helpers import TINY_DIMS, damage_adapter_files, fill_volume, save_peft_adapter, small_volume
from tests.processes import free_port
from tests.redis_server import redis_server  # noqa: F401
from tests.test_gateway_routing import eventually

PROMPT = "Shared adapters"
NUM_TOKENS = 6
_seeds = iter(range(1, 1000))


@pytest.fixture(scope="module")
def gateways(demo_engine, redis_server, tmp_path_factory) -> Iterator[list[GatewayServer]]:
    """Gateways A and B: one Redis store, two data folders (so two adapter folders)."""
    with ExitStack() as stack:
        yield [stack.enter_context(gateway_server(demo_engine, tmp_path_factory.mktemp(name),
                                                  redis_server))
               for name in ("gateway-a", "gateway-b")]


@pytest.fixture
def client(redis_server) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_server) as connected:
        yield connected


@pytest.fixture
def tenant_key(gateways) -> str:
    return gateways[0].new_tenant(f"t{next(_seeds)}")


@pytest.fixture
def adapter(tmp_path) -> Path:
    return demo_adapter(tmp_path / "adapter")


def demo_adapter(folder: Path, rank: int = 4) -> Path:
    """A PEFT adapter of `rank` for the demo model, with files no other test uploads."""
    from engine.demo import demo_config

    demo_dims = {name: getattr(demo_config(), name) for name in TINY_DIMS}
    save_peft_adapter(folder, seed=next(_seeds), model_overrides=demo_dims, r=rank,
                      lora_alpha=2 * rank)
    return folder


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def upload(gateway: GatewayServer, key: str, name: str, folder: Path) -> str:
    """Upload through `gateway`; the adapter's digest."""
    files = {n: (n, (folder / n).read_bytes()) for n in ADAPTER_FILES}
    reply = httpx.post(gateway.url + "/v1/adapters", files=files, headers=auth(key), timeout=60,
                       data={"name": name, "base_model": DEMO_MODEL})
    assert reply.status_code == 201, reply.text
    return reply.json()["digest"]


def completion(gateway: GatewayServer, key: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    return httpx.post(gateway.url + "/v1/completions", json=body, headers=auth(key), timeout=60)


def greedy_ids(gateway: GatewayServer, key: str, model: str) -> list[int]:
    reply = completion(gateway, key, model)
    assert reply.status_code == 200, reply.text
    return [int(t.removeprefix("token_id:"))
            for t in reply.json()["choices"][0]["logprobs"]["tokens"]]


def local_blobs(gateway: GatewayServer):
    return gateway.app.state.gateway.blobs


def leftovers(gateway: GatewayServer) -> list[str]:
    """Staging folders in the gateway's adapter folder (a fetch must leave none)."""
    return [p.name for p in local_blobs(gateway).root.iterdir()
            if p.name.startswith(".") and p.name != OWNER_FILE]


def blob_keys(client: redis.Redis, digest: str) -> list[str]:
    return sorted(k.decode() for k in client.scan_iter(match=f"sb:blob:{digest}*"))


def test_an_adapter_uploaded_through_one_gateway_answers_through_the_other(
        gateways, tenant_key, adapter, client):
    a, b = gateways
    digest = upload(a, tenant_key, "tuned", adapter)
    assert local_blobs(a).path(digest) is not None and local_blobs(b).path(digest) is None
    assert blob_keys(client, digest) == [f"sb:blob:{digest}", f"sb:blob:{digest}:0",
                                         f"sb:blob:{digest}:1"]  # one chunk per (small) file

    # B first, so the engine reads the adapter from the files B fetched.
    through_b = greedy_ids(b, tenant_key, "tuned")
    folder = local_blobs(b).path(digest)
    assert folder is not None and leftovers(b) == []
    for name in ADAPTER_FILES:
        assert (folder / name).read_bytes() == (adapter / name).read_bytes()
    assert greedy_ids(a, tenant_key, "tuned") == through_b
    assert greedy_ids(b, tenant_key, "tuned") == through_b  # now from B's own folder
    assert greedy_ids(b, tenant_key, DEMO_MODEL) != through_b  # the adapter is applied


@contextmanager
def redis_commands(url: str) -> Iterator[list[str]]:
    """The commands Redis runs while the block runs, as MONITOR reports them."""
    seen: list[str] = []
    # Sent once the block ends: MONITOR reports commands in the order Redis ran them, so every
    # command of the block comes before it, however far behind the reader is.
    end = f"end-of-block-{next(_seeds)}"

    def record(monitor) -> None:
        for command in monitor.listen():
            if end in command["command"]:
                return
            seen.append(command["command"])

    with redis.Redis.from_url(url) as client, client.monitor() as monitor:
        thread = threading.Thread(target=record, args=(monitor,), daemon=True)
        thread.start()
        try:
            yield seen
        finally:
            client.echo(end)
            thread.join(timeout=30)
            assert not thread.is_alive(), "MONITOR did not report the end of the block"


def test_concurrent_requests_fetch_a_missing_blob_once(gateways, tenant_key, adapter,
                                                       redis_server):
    a, b = gateways
    digest = upload(a, tenant_key, "popular", adapter)

    async def burst() -> list[httpx.Response]:
        body = {"model": "popular", "prompt": PROMPT, "max_tokens": 2}
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(
                http.post(b.url + "/v1/completions", json=body, headers=auth(tenant_key))
                for _ in range(8)))

    with redis_commands(redis_server) as commands:
        replies = asyncio.run(burst())
    assert [r.status_code for r in replies] == [200] * 8, replies[0].text
    reads = [c for c in commands if c.startswith(f"GET sb:blob:{digest}")]
    assert sorted(reads) == [f"GET sb:blob:{digest}", f"GET sb:blob:{digest}:0",
                             f"GET sb:blob:{digest}:1"]


def test_deleting_an_adapter_removes_its_redis_copy(gateways, adapter, client):
    a, b = gateways
    name = f"t{next(_seeds)}"
    key = a.new_tenant(name)
    digest = upload(a, key, "first", adapter)
    assert upload(b, key, "second", adapter) == digest  # the same files, twice
    greedy_ids(b, key, "first")

    deleted = httpx.delete(a.url + "/v1/adapters/first", headers=auth(key))
    assert deleted.status_code == 200, deleted.text
    assert len(blob_keys(client, digest)) == 3  # "second" still references the files
    assert local_blobs(a).path(digest) is not None

    assert b.admin("DELETE", f"/admin/tenants/{name}/adapters/second").status_code == 200
    assert blob_keys(client, digest) == []
    assert local_blobs(b).path(digest) is None  # the deleting gateway's own copy goes too
    reply = completion(a, key, "second")
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("when", ["before its manifest is read", "after its manifest is read",
                                  "and uploaded again, after its manifest is read"])
def test_an_adapter_deleted_elsewhere_while_a_gateway_fetches_it_is_not_found(
        gateways, tenant_key, adapter, client, monkeypatch, when):
    """Deleted through A while B fetches its files from Redis, the adapter is not found (the
    README's 404), as when it was deleted before the call: B once answered 503
    adapter_files_damaged or adapter_files_missing, telling the tenant to upload it again."""
    a, b = gateways
    digest = upload(a, tenant_key, "tuned", adapter)
    through_a = greedy_ids(a, tenant_key, "tuned")
    shared = b.app.state.gateway.require_store().shared_blobs
    step = "fetch_into" if when.startswith("before") else "_fetch_files"
    read = getattr(shared, step)

    async def deleted_first(*args):
        deleted = await asyncio.to_thread(httpx.delete, a.url + "/v1/adapters/tuned",
                                          headers=auth(tenant_key))
        assert deleted.status_code == 200, deleted.text
        if when.startswith("and uploaded again"):
            await asyncio.to_thread(upload, a, tenant_key, "tuned", adapter)
        monkeypatch.setattr(shared, step, read)  # only the first read races the delete
        return await read(*args)

    monkeypatch.setattr(shared, step, deleted_first)
    reply = completion(b, tenant_key, "tuned")
    assert getattr(shared, step) == read  # the race was run
    if when.startswith("and uploaded again"):
        assert reply.status_code == 200, reply.text
        assert greedy_ids(b, tenant_key, "tuned") == through_a
        assert len(blob_keys(client, digest)) == 3  # the copy uploaded again is kept
        return
    assert reply.status_code == 404, reply.text
    assert reply.json()["error"] == {
        "message": "the adapter 'tuned' was deleted while this call fetched its files; GET "
                   "/v1/models lists the models you can use",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    assert local_blobs(b).path(digest) is None and leftovers(b) == []
    assert blob_keys(client, digest) == []


def test_a_gateway_drops_copies_of_adapters_deleted_elsewhere_when_it_starts(
        gateways, adapter, demo_engine, redis_server, tmp_path):
    a, b = gateways
    key = a.new_tenant(f"t{next(_seeds)}")
    digest, kept = upload(a, key, "gone", adapter), upload(a, key, "kept", demo_adapter(tmp_path / "kept"))
    greedy_ids(b, key, "gone"), greedy_ids(b, key, "kept")  # B caches both
    assert httpx.delete(a.url + "/v1/adapters/gone", headers=auth(key)).status_code == 200
    assert local_blobs(b).path(digest) is not None  # B did not see the delete

    # B's folder again, under a gateway starting now (as B would after a restart).
    with gateway_server(demo_engine, local_blobs(b).root.parent, redis_server) as restarted:
        assert local_blobs(restarted).path(digest) is None
        assert local_blobs(restarted).path(kept) is not None  # still referenced: kept
        assert greedy_ids(restarted, key, "kept") == greedy_ids(a, key, "kept")


def worker_over(blobs: BlobStore, engine, redis_url: str) -> Worker:
    """A worker keeping its adapter files in `blobs`, registered in (and with its store at) `redis_url`."""
    return Worker(model=DEMO_MODEL, engine=engine, url="", blobs=blobs,
                  registry=WorkerRegistry.open(redis_url), tokenizer_files={}, store_url=redis_url)


def test_a_worker_drops_files_of_deleted_adapters_when_it_starts(gateways, demo_engine, redis_server,
                                                                   tmp_path):
    a, _ = gateways
    owner, other = f"t{next(_seeds)}", f"t{next(_seeds)}"
    owner_key, other_key = a.new_tenant(owner), a.new_tenant(other)
    folders = {n: demo_adapter(tmp_path / n) for n in ("kept", "shared", "gone", "never_uploaded")}
    kept = upload(a, other_key, "kept", folders["kept"])
    shared = upload(a, other_key, "theirs", folders["shared"])
    assert upload(a, owner_key, "mine", folders["shared"]) == shared  # one blob, two tenants' records
    upload(a, owner_key, "gone", folders["gone"])
    assert a.admin("DELETE", f"/admin/tenants/{owner}").status_code == 200

    # The worker's folder as gateways left it before the deletes, plus a put that crashed long ago.
    blobs = BlobStore(tmp_path / "worker-adapters")
    for folder in folders.values():
        blobs.put(folder)
    crashed = blobs.root / ".tmp-crashed"
    crashed.mkdir()
    os.utime(crashed, (time.time() - 7200, time.time() - 7200))
    assert len(blobs.digests()) == 4

    with run_server(create_worker_app(worker_over(blobs, demo_engine, redis_server))):
        assert sorted(p.name for p in blobs.root.iterdir()) == sorted([kept, shared, OWNER_FILE])


def test_running_gateways_and_workers_drop_copies_of_adapters_deleted_elsewhere(
        gateways, demo_engine, redis_server, tmp_path):
    """Not only when they start: every blob_sweep_s, so a long-lived process's disk does not fill
    with the files of adapters deleted through the others; files still referenced stay."""
    a, _ = gateways
    key = a.new_tenant(f"t{next(_seeds)}")
    gone, kept = (upload(a, key, name, demo_adapter(tmp_path / name)) for name in ("gone", "kept"))
    worker_blobs = BlobStore(tmp_path / "worker-adapters")
    for digest in (gone, kept):
        worker_blobs.put(local_blobs(a).path(digest))
    worker = worker_over(worker_blobs, demo_engine, redis_server)
    worker.blob_sweep_s = 0.1
    with gateway_server(demo_engine, tmp_path / "gateway-c", redis_server, blob_sweep_s=0.1) as c, \
            run_server(create_worker_app(worker)):
        greedy_ids(c, key, "gone"), greedy_ids(c, key, "kept")  # C caches both
        time.sleep(0.3)  # sweeps ran meanwhile, and kept what is referenced
        assert local_blobs(c).digests() == sorted([gone, kept]) == worker_blobs.digests()
        assert httpx.delete(a.url + "/v1/adapters/gone", headers=auth(key)).status_code == 200
        assert eventually(lambda: local_blobs(c).digests() == [kept] == worker_blobs.digests())
        assert greedy_ids(c, key, "kept")


def test_a_worker_that_cannot_reach_the_store_keeps_its_files(demo_engine, tmp_path, caplog):
    blobs = BlobStore(tmp_path / "worker-adapters")
    digest, _ = blobs.put(demo_adapter(tmp_path / "adapter"))
    worker = worker_over(blobs, demo_engine, f"redis://127.0.0.1:{free_port()}/0")  # nobody there

    async def start() -> None:
        try:
            await worker.drop_unneeded_blobs()
        finally:
            await worker.registry.close()

    with caplog.at_level(logging.WARNING, logger="gateway.worker"):
        asyncio.run(start())
    assert blobs.digests() == [digest]
    [kept] = [r.getMessage() for r in caplog.records if r.name == "gateway.worker"]
    assert kept.startswith(f"kept the adapter files in {blobs.root}: cannot ask "
                           "the store which adapters were deleted: ")


def test_deleting_a_tenant_removes_its_adapters_redis_copies(gateways, adapter, client):
    a, b = gateways
    name = f"t{next(_seeds)}"
    digest = upload(a, a.new_tenant(name), "tuned", adapter)
    assert b.admin("DELETE", f"/admin/tenants/{name}").status_code == 200
    assert blob_keys(client, digest) == []
    assert local_blobs(b).path(digest) is None


def test_a_gateway_whose_engine_fails_on_its_damaged_copy_fetches_the_stores_and_answers(
        gateways, tenant_key, adapter):
    """Its adapter folder is a cache of Redis's copies: when its engine fails on a copy damaged
    on disk, the copy is fetched again and the call sent once more, so even that call answers
    (it once failed with a 500, and every call after it until the adapter was uploaded again)."""
    a, b = gateways
    digest = upload(b, tenant_key, "tuned", adapter)
    cached = local_blobs(b).path(digest)
    damage_adapter_files(cached)

    assert greedy_ids(b, tenant_key, "tuned") == greedy_ids(a, tenant_key, "tuned")
    assert digest_files(cached) == digest


def test_a_gateway_with_no_room_left_to_fetch_an_adapter_says_so_until_room_is_made(
        gateways, demo_engine, redis_server, tenant_key, adapter, tmp_path, caplog):
    """It once answered a 500 with a traceback, which OpenAI's SDKs sent twice more."""
    a = gateways[0]
    with small_volume(tmp_path / "volume", "1m") as volume, \
            gateway_server(demo_engine, tmp_path / "c", redis_server,
                           adapter_dir=volume / "adapters") as c:
        upload(a, tenant_key, "tuned", adapter)
        filler = fill_volume(volume)
        with caplog.at_level(logging.WARNING, logger="gateway.errors"):
            reply = completion(c, tenant_key, "tuned")
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"] == {
            "message": "the server has no disk space left to copy the files of adapter 'tuned' from "
                       "the store: the volume of the adapter folder (--adapter-dir) is full; "
                       "retrying will not help until the operator frees space there",
            "type": "server_error", "param": None, "code": "disk_full"}
        assert reply.headers["x-should-retry"] == "false" and "retry-after" not in reply.headers
        assert f"(--adapter-dir), {volume / 'adapters'}, has no room left" in caplog.text
        assert leftovers(c) == []
        filler.unlink()
        assert greedy_ids(c, tenant_key, "tuned") == greedy_ids(a, tenant_key, "tuned")


@pytest.mark.parametrize("damage", ["changed chunk", "missing chunk"])
def test_a_damaged_redis_copy_is_refused(gateways, tenant_key, adapter, client, damage):
    a, b = gateways
    digest = upload(a, tenant_key, "tuned", adapter)
    weights = f"sb:blob:{digest}:1"
    if damage == "changed chunk":
        client.setrange(weights, 100, b"\x00\x01\x02\x03")
    else:
        client.delete(weights)
    before = sorted(local_blobs(b).root.iterdir())

    reply = completion(b, tenant_key, "tuned")
    assert reply.status_code == 503, reply.text
    # Only uploading again mends it: OpenAI's SDKs are told not to send the call again.
    assert reply.headers["x-should-retry"] == "false" and "retry-after" not in reply.headers
    error = reply.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "adapter_files_damaged")
    assert error["message"].startswith("the files of adapter 'tuned' are damaged in the store "
                                       "and were not used (")
    assert error["message"].endswith("); upload the adapter again")
    assert sorted(local_blobs(b).root.iterdir()) == before  # nothing of it was kept
    assert blob_keys(client, digest) == []  # the damaged copy is dropped
    through_a = greedy_ids(a, tenant_key, "tuned")  # A's own copy is intact and still serves

    upload(a, tenant_key, "tuned", adapter)  # uploading again repairs it, as the error says
    assert greedy_ids(b, tenant_key, "tuned") == through_a


def test_a_copy_without_its_manifest_is_missing(gateways, tenant_key, adapter, client):
    a, b = gateways
    digest = upload(a, tenant_key, "tuned", adapter)
    client.delete(f"sb:blob:{digest}")  # the chunks stay, as after a write cut short

    reply = completion(b, tenant_key, "tuned")
    assert reply.status_code == 503, reply.text
    assert reply.headers["x-should-retry"] == "false" and "retry-after" not in reply.headers
    assert reply.json()["error"] == {
        "message": "the files of adapter 'tuned' are missing from this server's adapter folder "
                   "and the store; upload the adapter again",
        "type": "server_error", "param": None, "code": "adapter_files_missing"}
    assert local_blobs(b).path(digest) is None and leftovers(b) == []
    upload(a, tenant_key, "tuned", adapter)  # uploading again repairs it
    assert greedy_ids(b, tenant_key, "tuned")
