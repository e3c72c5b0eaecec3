"""The worker registry on a real redis-server: heartbeats lapse, clean exits leave at once, the
internal key is one for everybody, tokenizer files round-trip by digest."""

from __future__ import annotations

import asyncio
import functools
import random

from store.workers import ModelSeen, Periodic, WorkerRecord, WorkerRegistry, files_digest
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
            await registry.heartbeat(record("long"), ttl_s=30)
            await registry.heartbeat(record("leaving"), ttl_s=30)
            # NOTE: written last, with a TTL that outlasts one listing on a busy machine.
            await registry.heartbeat(record("short"), ttl_s=1.5)
            assert [r.id for r in await registry.workers()] == ["leaving", "long", "short"]
            assert (await registry.workers())[1] == record("long")
            assert (await registry.workers())[1].load == 3
            await registry.remove("leaving")
            await asyncio.sleep(1.6)
            assert [r.id for r in await registry.workers()] == ["long"]
            await registry.heartbeat(record("short"), ttl_s=30)  # a lapsed worker may rejoin
            assert [r.id for r in await registry.workers()] == ["long", "short"]
        finally:
            await registry.close()

    asyncio.run(scenario())


def test_a_model_seen_keeps_the_latest_heartbeat_of_a_worker_of_it_with_adapter_slots(
        redis_url):  # noqa: F811
    async def scenario() -> None:
        registry = WorkerRegistry.open(redis_url)
        try:
            await registry.heartbeat(record("plain", max_loras=0, beat_at=1.0), ttl_s=30)
            assert await registry.models_seen() == {
                "m": ModelSeen(beat_at=1.0, max_model_len=64, tokenizer=None)}
            await registry.heartbeat(record("lora", max_loras=2, beat_at=2.0), ttl_s=30)
            await registry.heartbeat(record("plain", max_loras=0, beat_at=3.0,
                                            max_model_len=32), ttl_s=30)
            assert await registry.models_seen() == {
                "m": ModelSeen(beat_at=3.0, max_model_len=32, tokenizer=None, adapters_beat_at=2.0)}
        finally:
            await registry.close()

    asyncio.run(scenario())


def test_a_model_seen_keeps_the_latest_heartbeat_of_each_rank_limit_of_its_workers(
        redis_url):  # noqa: F811
    """So that gateways know a worker with a higher --max-lora-rank is restarting (an upload it
    serves is taken meanwhile); workers without adapter slots, or that do not say their limit
    (an older version), leave no rank."""
    async def scenario() -> None:
        registry = WorkerRegistry.open(redis_url)
        try:
            for worker_id, rank, beat_at in [("narrow", 4, 1.0), ("wide", 16, 2.0),
                                             ("narrow", 4, 3.0), ("plain", 0, 4.0)]:
                await registry.heartbeat(record(worker_id, model="ranked", max_lora_rank=rank,
                                                max_loras=2 if rank else 0, beat_at=beat_at),
                                         ttl_s=30)
            await registry.heartbeat(record("older", model="ranked", beat_at=5.0), ttl_s=30)
            seen = (await registry.models_seen())["ranked"]
            assert seen.rank_beats == {4: 3.0, 16: 2.0}
            assert seen.adapters_beat_at == 5.0 and seen.beat_at == 5.0
            assert [seen.widest_rank_since(h) for h in (2.0, 2.5, 3.5)] == [16, 4, 0]
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
            # The tokenizer every gateway reads a model's prompts with, one for all of them.
            assert await second.reading_tokenizers() == {}
            await first.set_reading_tokenizer("m", digest)
            assert await second.reading_tokenizers() == {"m": digest}
        finally:
            await first.close()
            await second.close()

    asyncio.run(scenario())


def test_periodic_work_stops_though_a_cancellation_of_it_is_lost():
    """On Python 3.11 a cancellation landing while redis-py waits on its socket can be lost
    (asyncio.wait_for): the heartbeat loop went on, and a worker that had left the pool put its
    record back. Here the work loses every cancellation itself."""
    async def scenario() -> tuple[int, int]:
        runs, started = 0, asyncio.Event()

        async def work() -> None:
            nonlocal runs
            runs += 1
            started.set()
            try:
                await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                asyncio.current_task().uncancel()  # lost

        periodic = Periodic(work, 0.01, "working")
        await started.wait()
        await asyncio.wait_for(periodic.stop(), 5)
        runs_at_stop = runs
        await asyncio.sleep(0.1)
        return runs_at_stop, runs

    assert asyncio.run(scenario()) == (1, 1)


def test_a_heartbeat_loop_stopped_at_any_moment_writes_no_record_after(redis_url):  # noqa: F811
    async def scenario() -> list[str]:
        registry = WorkerRegistry.open(redis_url)
        try:
            for i in range(30):
                beating = Periodic(functools.partial(registry.heartbeat, record(f"w{i}"), 30), 0,
                                   "heartbeating")
                await asyncio.sleep(random.Random(i).uniform(0, 0.005))
                await asyncio.wait_for(beating.stop(), 5)
                await registry.remove(f"w{i}")
            await asyncio.sleep(0.05)
            return [r.id for r in await registry.workers()]
        finally:
            await registry.close()

    assert asyncio.run(scenario()) == []
