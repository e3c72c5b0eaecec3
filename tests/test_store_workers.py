"""The worker registry on a real redis-server: heartbeats lapse, clean exits leave at once, the
internal key is one for everybody, tokenizer files round-trip by digest."""

from __future__ import annotations

import asyncio

from store.workers import WorkerRecord, WorkerRegistry, files_digest
from tests.redis_server import redis_server, redis_url  # noqa: F401


def record(worker_id: str, **fields) -> WorkerRecord:
    values = dict(url=f"http://127.0.0.1:9/{worker_id}", model="m", max_model_len=64,
                  max_loras=2, tokenizer=None, num_running=1,
                  num_waiting=2, adapters_device=["a"], adapters_host=["a", "b"], stats=b"{}",
                  beat_at=1.0)
    return WorkerRecord(id=worker_id, **{**values, **fields})


def test_records_lapse_without_heartbeats_and_leave_at_once_on_remove(redis_url):  # noqa: F811
    async def scenario() -> None:
        registry = WorkerRegistry.open(redis_url)
        try:
            await registry.heartbeat(record("short"), ttl_s=0.2)
            await registry.heartbeat(record("long"), ttl_s=30)
            await registry.heartbeat(record("leaving"), ttl_s=30)
            assert [r.id for r in await registry.workers()] == ["leaving", "long", "short"]
            assert (await registry.workers())[1] == record("long")
            assert (await registry.workers())[1].load == 3
            await registry.remove("leaving")
            await asyncio.sleep(0.3)
            assert [r.id for r in await registry.workers()] == ["long"]
            await registry.heartbeat(record("short"), ttl_s=30)  # a lapsed worker may rejoin
            assert [r.id for r in await registry.workers()] == ["long", "short"]
        finally:
            await registry.close()

    asyncio.run(scenario())


def test_one_internal_key_and_tokenizers_by_digest(redis_url):  # noqa: F811
    async def scenario() -> None:
        first, second = WorkerRegistry.open(redis_url), WorkerRegistry.open(redis_url)
        try:
            key = await first.internal_key()
            assert len(key) > 30 and await second.internal_key() == key
            files = {"tokenizer.json": b'{"x": 1}', "config.json": b"\x00\xff binary"}
            digest = await first.put_tokenizer(files)
            assert digest == files_digest(files) == await second.put_tokenizer(dict(files))
            assert await second.get_tokenizer(digest) == files
            assert await second.get_tokenizer("0" * 64) is None
            assert files_digest({"a": b"bc"}) != files_digest({"ab": b"c"})
        finally:
            await first.close()
            await second.close()

    asyncio.run(scenario())
