"""Adapter files in Redis (store.redis_blobs) against a real redis-server: chunking, the manifest
written last, damaged copies refused before they reach a blob folder, and deletes that keep what a
record references."""

import asyncio
import json
import os
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import redis
import redis.asyncio as aioredis

from store import UNAVAILABLE_ERRORS, AdapterRecord, RedisStore, StoreError, Tenant
from store.blobs import (ADAPTER_FILES, BlobStore, collect_garbage, digest_files,
                         ensure_intact_copy, fetch_blob)
from store.redis import RedisKeys
from store.redis_blobs import RedisBlobs
from tests.helpers import small_volume, use_up_inodes
from tests.redis_server import PersistentRedisServer, redis_server, redis_url  # noqa: F401

pytestmark = pytest.mark.anyio

CHUNK_BYTES = 7  # the 8-byte config takes 2 chunks, the 20-byte weights 3
CONFIG, WEIGHTS = b'{"r": 8}', bytes(range(20))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis.asyncio needs asyncio


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[RedisStore]:
    opened = await RedisStore.open(redis_url)
    yield opened
    await opened.close()


@pytest.fixture
async def shared(redis_url: str) -> AsyncIterator[RedisBlobs]:
    blobs = RedisBlobs(aioredis.from_url(redis_url), RedisKeys("sb:"), chunk_bytes=CHUNK_BYTES)
    yield blobs
    await blobs.close()


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def adapter_folder(folder: Path, config: bytes = CONFIG, weights: bytes = WEIGHTS) -> Path:
    folder.mkdir(parents=True)
    for name, data in zip(ADAPTER_FILES, (config, weights)):
        (folder / name).write_bytes(data)
    return folder


def blob_keys(client: redis.Redis, digest: str) -> list[str]:
    return sorted(k.decode() for k in client.scan_iter(match=f"sb:blob:{digest}*"))


def read_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


async def test_files_are_chunked_under_their_digest_with_the_manifest(shared, client, tmp_path):
    src = adapter_folder(tmp_path / "src")
    digest = digest_files(src)
    await shared.put_files(digest, src)
    assert blob_keys(client, digest) == [f"sb:blob:{digest}"] + [
        f"sb:blob:{digest}:{n}" for n in range(5)]
    assert json.loads(client.get(f"sb:blob:{digest}")) == {"files": [
        {"name": "adapter_config.json", "size": 8, "num_chunks": 2},
        {"name": "adapter_model.safetensors", "size": 20, "num_chunks": 3}]}
    chunks = [client.get(f"sb:blob:{digest}:{n}") for n in range(5)]
    assert chunks == [CONFIG[:7], CONFIG[7:], WEIGHTS[:7], WEIGHTS[7:14], WEIGHTS[14:]]
    assert all(client.ttl(k) == -1 for k in blob_keys(client, digest))  # committed: kept
    assert list(client.scan_iter(match="sb:blob-staged:*")) == []

    (tmp_path / "copy").mkdir()
    assert await shared.fetch_into(digest, tmp_path / "copy")
    assert read_files(tmp_path / "copy") == read_files(src)


async def test_writing_the_same_files_twice_changes_nothing(shared, client, tmp_path):
    src = adapter_folder(tmp_path / "src")
    digest = digest_files(src)
    await shared.put_files(digest, src)
    before = {k: client.get(k) for k in blob_keys(client, digest)}
    await shared.put_files(digest, src)
    assert {k: client.get(k) for k in blob_keys(client, digest)} == before
    assert list(client.scan_iter(match="sb:blob-staged:*")) == []


async def test_a_blob_without_its_manifest_is_absent(shared, client, tmp_path):
    src = adapter_folder(tmp_path / "src")
    digest = digest_files(src)
    await shared.put_files(digest, src)
    client.delete(f"sb:blob:{digest}")  # every chunk, no manifest: as a write cut short
    (tmp_path / "copy").mkdir()
    assert not await shared.fetch_into(digest, tmp_path / "copy")
    assert list((tmp_path / "copy").iterdir()) == []
    local = BlobStore(tmp_path / "blobs")
    assert await fetch_blob(local, shared, digest) is None
    assert list(local.root.iterdir()) == []


async def test_a_write_cut_short_leaves_nothing(shared, client, tmp_path):
    src = adapter_folder(tmp_path / "src")
    digest = digest_files(src)
    (src / ADAPTER_FILES[1]).unlink()  # the second file cannot be read: the write stops there
    with pytest.raises(FileNotFoundError):
        await shared.put_files(digest, src)
    assert blob_keys(client, digest) == []
    assert list(client.scan_iter(match="sb:blob-staged:*")) == []  # the first file's 2 chunks
    (tmp_path / "copy").mkdir()
    assert not await shared.fetch_into(digest, tmp_path / "copy")


async def test_a_write_redis_has_no_room_for_gives_its_memory_back(store, client, redis_url,
                                                                  tmp_path):
    """A write that takes Redis past its maxmemory deletes the chunks it staged: kept until they
    expire, they would have Redis refuse every write (every tenant's rate limits) for an hour."""
    acme = await store.create_tenant(Tenant(name="acme", rpm=10))
    assert (await store.check_and_consume_rate(acme)).allowed  # its bucket and script in place
    src = adapter_folder(tmp_path / "src", weights=os.urandom(1 << 20))
    # NOTE: chunks under Redis's 32 KiB "big argument" are copied out of the request after its
    # maxmemory check, so the last chunk Redis takes leaves it past its maxmemory.
    shared = RedisBlobs(aioredis.from_url(redis_url), RedisKeys("sb:"), chunk_bytes=16 << 10)
    client.config_set("maxmemory", client.info("memory")["used_memory"] + (256 << 10))
    try:
        with pytest.raises(redis.OutOfMemoryError):
            await shared.put_files(digest_files(src), src)
        assert list(client.scan_iter(match="sb:blob*")) == []
        assert (await store.check_and_consume_rate(acme)).allowed
    finally:
        client.config_set("maxmemory", 0)
        await shared.close()


async def test_a_chunk_redis_refuses_leaves_it_no_fuller(store, client, tmp_path):
    """Redis keeps the buffer it read a refused 4 MiB chunk into, counted against its maxmemory,
    until it trims it; the write that failed closes its connection, so the calls that follow
    have the room back at once."""
    acme = await store.create_tenant(Tenant(name="acme", rpm=10))
    assert (await store.check_and_consume_rate(acme)).allowed  # its bucket and script in place
    src = adapter_folder(tmp_path / "src", weights=bytes(4 << 20))  # one chunk of the store's
    client.config_set("maxmemory", client.info("memory")["used_memory"] + (3 << 20))
    try:
        with pytest.raises(redis.OutOfMemoryError):
            await store.shared_blobs.put_files(digest_files(src), src)
        assert (await store.check_and_consume_rate(acme)).allowed
        assert list(client.scan_iter(match="sb:blob*")) == []
    finally:
        client.config_set("maxmemory", 0)


async def test_a_write_cancelled_midway_deletes_what_it_staged(shared, redis_url, tmp_path):
    """Cancelled (its client left, a shutdown's deadline), even again while it cleans up, a write
    deletes its chunks; the hour they are staged for is only for a writer that crashed."""
    src = adapter_folder(tmp_path / "src", weights=bytes(20 << 10))  # 2926 chunks of 7 bytes
    writing = asyncio.create_task(shared.put_files(digest_files(src), src))
    reader = aioredis.from_url(redis_url)
    try:
        while not (staged := await reader.keys("sb:blob-staged:*")):
            await asyncio.sleep(0.001)
        assert 0 < await reader.pttl(staged[0]) <= 3600 * 1000
        while not writing.done():
            # NOTE: again and again: Python 3.11's asyncio.wait_for, with which redis-py sends a
            # command, drops a cancel that comes as the sending ends.
            writing.cancel()
            await asyncio.sleep(0.001)
        assert writing.cancelled()
        deadline = time.monotonic() + 5  # a cancel during the cleanup leaves it running
        while (left := await reader.keys("sb:blob*")) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert left == []
    finally:
        await reader.aclose()


DAMAGES = {
    # case: (damage(client, digest), the error's message, chunks left once the copy is dropped)
    "changed chunk": (lambda c, d: c.set(f"sb:blob:{d}:3", b"\xff" * CHUNK_BYTES),
                      "hash to [0-9a-f]{64}, not to {digest}: they were changed", 0),
    "missing chunk": (lambda c, d: c.delete(f"sb:blob:{d}:4"),
                      "chunk 4 of blob {digest} is missing", 0),
    "manifest with a path": (lambda c, d: c.set(f"sb:blob:{d}", json.dumps({"files": [
        {"name": "../adapter_config.json", "size": 8, "num_chunks": 2},
        {"name": "adapter_model.safetensors", "size": 20, "num_chunks": 3}]})),
        "lists other files", 0),
    "unreadable manifest": (lambda c, d: c.set(f"sb:blob:{d}", b"{"),
                            "manifest of blob {digest} in Redis is unreadable", 5),
}


@pytest.mark.parametrize("case", list(DAMAGES))
async def test_a_damaged_copy_never_reaches_the_blob_folder_and_is_dropped(shared, client,
                                                                           tmp_path, case):
    damage, message, num_left = DAMAGES[case]
    src = adapter_folder(tmp_path / "src")
    digest = digest_files(src)
    await shared.put_files(digest, src)
    damage(client, digest)
    local = BlobStore(tmp_path / "blobs")
    with pytest.raises(StoreError, match=message.replace("{digest}", digest)):
        await fetch_blob(local, shared, digest)
    assert list(local.root.iterdir()) == []  # nothing stored, nothing written past the folder
    assert blob_keys(client, digest) == [f"sb:blob:{digest}:{n}" for n in range(num_left)]

    await shared.put_files(digest, src)  # the next upload of the files keeps them anew
    assert read_files(await fetch_blob(local, shared, digest)) == read_files(src)


async def test_fetch_blob_stores_a_verified_copy(shared, tmp_path):
    src = adapter_folder(tmp_path / "src")
    digest = digest_files(src)
    await shared.put_files(digest, src)
    local = BlobStore(tmp_path / "blobs")
    folder = await fetch_blob(local, shared, digest)
    assert folder == local.path(digest) and read_files(folder) == read_files(src)
    assert local.digests() == [digest]  # and no staging folder left


async def test_a_damaged_local_copy_is_replaced_by_the_stores_and_kept_without_a_good_one(
        shared, client, tmp_path):
    src = adapter_folder(tmp_path / "src")
    digest = digest_files(src)
    await shared.put_files(digest, src)
    local = BlobStore(tmp_path / "blobs")
    assert not await ensure_intact_copy(local, shared, digest)  # none here: nothing fetched
    local.put(src)
    weights = local.path(digest) / "adapter_model.safetensors"
    assert await ensure_intact_copy(local, shared, digest)
    weights.write_bytes(WEIGHTS[::-1])  # changed on disk since: same size, another digest
    assert await ensure_intact_copy(local, shared, digest)
    assert read_files(local.path(digest)) == read_files(src) and local.digests() == [digest]

    weights.write_bytes(WEIGHTS[::-1])
    assert not await ensure_intact_copy(local, None, digest)  # the folder's is the only copy
    client.delete(f"sb:blob:{digest}")  # the store's copy is gone too
    assert not await ensure_intact_copy(local, shared, digest)
    assert weights.read_bytes() == WEIGHTS[::-1]  # kept, for an upload of the files to replace


async def test_a_damaged_local_copy_is_kept_while_its_folder_has_no_room_to_fetch_the_stores(
        shared, tmp_path, caplog):
    """A reader's call then fails as for a damaged copy (it once failed with the OSError, a 500)."""
    src = adapter_folder(tmp_path / "src")
    digest = digest_files(src)
    await shared.put_files(digest, src)
    with small_volume(tmp_path / "volume", "1m", inodes=64) as volume:
        local = BlobStore(volume / "blobs")
        local.put(src)
        weights = local.path(digest) / "adapter_model.safetensors"
        weights.write_bytes(WEIGHTS[::-1])
        fillers = use_up_inodes(volume, leave=0)
        assert not await ensure_intact_copy(local, shared, digest)
        assert "the folder has no room left to fetch the store's ([Errno 28]" in caplog.text
        shutil.rmtree(fillers)
        assert await ensure_intact_copy(local, shared, digest)
        assert read_files(local.path(digest)) == read_files(src) and local.digests() == [digest]


async def test_deletes_keep_what_a_record_references(store, shared, client, tmp_path):
    kept_src, dropped_src = adapter_folder(tmp_path / "a"), adapter_folder(tmp_path / "b", b"{}")
    kept, dropped = digest_files(kept_src), digest_files(dropped_src)
    for digest, src in ((kept, kept_src), (dropped, dropped_src)):
        await shared.put_files(digest, src)
    await store.create_tenant(Tenant(name="acme", created_at=time.time()))
    record = AdapterRecord(tenant="acme", name="sql", base_model="m", digest=kept, rank=8,
                           target_modules=("q_proj",), size_bytes=28)
    await store.put_adapter_record(record)

    assert not await shared.delete_unreferenced(kept)
    assert len(blob_keys(client, kept)) == 6
    assert await shared.delete_unreferenced(dropped)
    assert blob_keys(client, dropped) == []
    assert not await shared.delete_unreferenced(dropped)  # gone already

    # collect_garbage drops the shared copy even where this gateway's folder never held it.
    await store.delete_adapter("acme", "sql")
    local = BlobStore(tmp_path / "blobs")
    assert await collect_garbage(local, store, [kept]) == []
    assert blob_keys(client, kept) == []


async def test_the_store_keeps_whole_files_in_a_few_mib_chunks(store, client, tmp_path):
    weights = bytes(range(256)) * (40 << 10)  # 10 MiB: three chunks of at most 4 MiB
    src = adapter_folder(tmp_path / "src", weights=weights)
    digest = digest_files(src)
    await store.shared_blobs.put_files(digest, src)
    manifest = msgspec.json.decode(client.get(f"sb:blob:{digest}"))
    assert [f["num_chunks"] for f in manifest["files"]] == [1, 3]
    assert max(client.strlen(k) for k in blob_keys(client, digest)) == 4 << 20
    local = BlobStore(tmp_path / "blobs")
    folder = await fetch_blob(local, store.shared_blobs, digest)
    assert (folder / ADAPTER_FILES[1]).read_bytes() == weights


async def test_while_redis_is_down_calls_fail_fast_and_keep_nothing(tmp_path):
    (tmp_path / "redis").mkdir()
    server = PersistentRedisServer(tmp_path / "redis")
    store = await RedisStore.open(server.url)
    try:
        src = adapter_folder(tmp_path / "src")
        digest = digest_files(src)
        server.stop()
        started = time.monotonic()
        with pytest.raises(UNAVAILABLE_ERRORS):
            await store.shared_blobs.put_files(digest, src)
        local = BlobStore(tmp_path / "blobs")
        with pytest.raises(UNAVAILABLE_ERRORS):
            await fetch_blob(local, store.shared_blobs, digest)
        assert time.monotonic() - started < 3
        assert list(local.root.iterdir()) == []
        server.start()
        await store.shared_blobs.put_files(digest, src)  # reconnects by itself
        assert await fetch_blob(local, store.shared_blobs, digest) == local.path(digest)
    finally:
        await store.close()
        server.stop()
