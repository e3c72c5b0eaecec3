"""The worker registry in Redis: which engine workers are alive, what they serve, how loaded they
are, and which adapters they hold; plus what gateways need to talk to them.

Each worker (`switchboard worker`) writes its WorkerRecord under `<prefix>worker:<id>` with a TTL
a few heartbeats long and adds its id to the set `<prefix>workers`; a worker that stops
heartbeating disappears when its key expires, and readers drop its id from the set. Gateways read
the records to place requests (routing.placement).

With each heartbeat a worker also records its model in the hash `<prefix>models` (model ->
ModelSeen), which outlives its workers: every gateway reads the same one, so all agree on which
worker models they serve while none of their workers is up (gateway/remote.py).

Three more things live here because every gateway and worker reaches the same Redis:
- the internal key, a random secret created by whichever process comes first (SET NX), which
  gateways send to workers and workers require: whoever can read it could read Redis anyway;
- tokenizer files by digest, published by workers, so a gateway serves a model it has no folder
  of with the very tokenizer its workers use;
- `<prefix>adapter_records_elsewhere`, kept alive by gateways whose store is not this Redis:
  while it lives, workers cannot tell deleted adapters by the records here (gateway/worker.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import secrets
from collections.abc import Awaitable, Callable, Mapping

import msgspec
import redis.asyncio as aioredis

from store.redis import ReadTogether, connect

logger = logging.getLogger(__name__)

_INTERNAL_KEY_BYTES = 32


class WorkerRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker publishes with each heartbeat."""

    id: str
    url: str  # where gateways reach its internal API, e.g. http://10.0.0.7:9000
    model: str  # the served name of its one model
    max_model_len: int
    max_loras: int  # its device slots: the most distinct adapters in one batch (0: no LoRA)
    tokenizer: str | None  # digest of its tokenizer files (None: the model has no tokenizer)
    num_running: int
    num_waiting: int
    adapters_device: list[str]  # digests of adapters in device slots
    adapters_host: list[str]  # digests of adapters loaded in host memory
    stats: bytes  # its EngineStats as JSON (the gateway's type; the store does not import it)
    beat_at: float  # wall-clock time of this heartbeat
    # The largest adapter rank it serves (its --max-lora-rank; 0 with no LoRA). None: written by
    # a worker older than this field, taken to serve any rank, as gateways took every worker then.
    max_lora_rank: int | None = None

    @property
    def supports_adapters(self) -> bool:
        return self.max_loras > 0

    @property
    def rank_limit(self) -> float:
        """The largest adapter rank it serves (inf: it did not say)."""
        return math.inf if self.max_lora_rank is None else self.max_lora_rank

    def serves_rank(self, rank: int) -> bool:
        """Whether it serves adapters of this rank (0: an adapter of a rank not known)."""
        return self.supports_adapters and rank <= self.rank_limit

    @property
    def load(self) -> int:
        """Requests it holds: running plus waiting."""
        return self.num_running + self.num_waiting


class ModelSeen(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A model as its latest heartbeat left it: when that was, and what a gateway needs to serve
    it while none of its workers is up."""

    beat_at: float  # the worker's wall-clock time of the heartbeat
    max_model_len: int
    tokenizer: str | None  # digest of the worker's tokenizer files
    # The latest heartbeat of a worker of it with adapter slots; None: none ever. Kept apart in
    # Redis, where a heartbeat of a worker without them would erase it.
    adapters_beat_at: float | None = None
    # The latest heartbeat of a worker of it with adapter slots, by that worker's --max-lora-rank
    # (of the workers that say it), kept apart in Redis as well.
    rank_beats: dict[int, float] = msgspec.field(default_factory=dict)

    @classmethod
    def of(cls, record: WorkerRecord) -> "ModelSeen":
        return cls(beat_at=record.beat_at, max_model_len=record.max_model_len,
                   tokenizer=record.tokenizer)

    def widest_rank_since(self, horizon: float) -> int:
        """The highest --max-lora-rank among its workers with adapter slots whose latest heartbeat
        was at or after `horizon` (0: none was)."""
        return max((rank for rank, beat_at in self.rank_beats.items() if beat_at >= horizon),
                   default=0)


class WorkerRegistry:
    """Worker records, the internal key and tokenizer files in one Redis."""

    def __init__(self, client: aioredis.Redis, prefix: str = "sb:") -> None:
        self._redis = client  # NOTE: decode_responses=False: tokenizer files are bytes
        self._prefix = prefix
        self._workers = prefix + "workers"
        self._models = prefix + "models"
        self._models_with_adapters = prefix + "models_with_adapters"  # model -> latest beat_at
        self._rank_beats = prefix + "adapter_rank_beats"  # JSON [model, rank] -> latest beat_at
        self._records_elsewhere = prefix + "adapter_records_elsewhere"
        self._reading_tokenizers = prefix + "reading_tokenizers"  # model -> tokenizer digest
        self._read_together = ReadTogether(client)

    @classmethod
    def open(cls, url: str, prefix: str = "sb:", timeout_s: float = 2.0) -> "WorkerRegistry":
        """A registry over the Redis at `url`; it connects on first use (and reconnects after)."""
        return cls(connect(url, timeout_s), prefix)

    async def close(self) -> None:
        await self._redis.aclose()

    def _worker_key(self, worker_id: str) -> str:
        return f"{self._prefix}worker:{worker_id}"

    async def heartbeat(self, record: WorkerRecord, ttl_s: float) -> None:
        """Publish `record`; it lapses after `ttl_s` unless published again. Its model is recorded
        as seen now, which outlasts the record."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._worker_key(record.id), msgspec.json.encode(record), px=int(ttl_s * 1000))
            pipe.sadd(self._workers, record.id)
            pipe.hset(self._models, record.model, msgspec.json.encode(ModelSeen.of(record)))
            if record.supports_adapters:
                pipe.hset(self._models_with_adapters, record.model, repr(record.beat_at))
            if record.supports_adapters and record.max_lora_rank is not None:
                pipe.hset(self._rank_beats, msgspec.json.encode([record.model, record.max_lora_rank]),
                          repr(record.beat_at))
            await pipe.execute()

    async def remove(self, worker_id: str) -> None:
        """Leave the pool at once (a worker shutting down cleanly)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._worker_key(worker_id))
            pipe.srem(self._workers, worker_id)
            await pipe.execute()

    async def workers(self) -> list[WorkerRecord]:
        """The live workers, by id; ids whose record lapsed are removed from the set."""
        ids = sorted(i.decode() for i in await self._redis.smembers(self._workers))
        if not ids:
            return []
        raws = await self._redis.mget([self._worker_key(i) for i in ids])
        lapsed = [i for i, raw in zip(ids, raws) if raw is None]
        if lapsed:
            await self._redis.srem(self._workers, *lapsed)
        return [msgspec.json.decode(raw, type=WorkerRecord) for raw in raws if raw is not None]

    async def models_seen(self) -> dict[str, ModelSeen]:
        """Every model a worker ever sent a heartbeat for, as its latest heartbeat left it (and
        when a worker of it with adapter slots last did, for each --max-lora-rank)."""
        seen, with_adapters, by_rank = await self._read_together(
            ("HGETALL", self._models), ("HGETALL", self._models_with_adapters),
            ("HGETALL", self._rank_beats))
        with_adapters = {model.decode(): float(beat_at) for model, beat_at in with_adapters.items()}
        rank_beats: dict[str, dict[int, float]] = {}
        for field, beat_at in by_rank.items():
            model, rank = msgspec.json.decode(field, type=tuple[str, int])
            rank_beats.setdefault(model, {})[rank] = float(beat_at)
        return {name: msgspec.structs.replace(msgspec.json.decode(raw, type=ModelSeen),
                                              adapters_beat_at=with_adapters.get(name),
                                              rank_beats=rank_beats.get(name, {}))
                for name, raw in ((model.decode(), raw) for model, raw in seen.items())}

    async def internal_key(self) -> str:
        """The secret gateways and workers share (created here if nobody has yet)."""
        key = self._prefix + "internal_key"
        # NOTE: read first, written only when missing: a Redis out of its maxmemory refuses the
        # write, and every gateway's read of the registry, which starts here, failed with it.
        raw = await self._redis.get(key)
        if raw is None:
            await self._redis.set(key, secrets.token_urlsafe(_INTERNAL_KEY_BYTES), nx=True)
            raw = await self._redis.get(key)
        return raw.decode()

    async def put_tokenizer(self, files: Mapping[str, bytes]) -> str:
        """Publish tokenizer files (name -> contents); returns their digest."""
        digest = files_digest(files)
        key = f"{self._prefix}tokenizer:{digest}"
        if not await self._redis.exists(key):
            await self._redis.hset(key, mapping=dict(files))
        return digest

    async def get_tokenizer(self, digest: str) -> dict[str, bytes] | None:
        """The files published under `digest`, or None if there are none."""
        files = await self._redis.hgetall(f"{self._prefix}tokenizer:{digest}")
        return {name.decode(): data for name, data in files.items()} or None

    async def reading_tokenizers(self) -> dict[str, str]:
        """The digest of the tokenizer gateways read each model's prompts with: the one its
        workers up last all had (set_reading_tokenizer)."""
        return {model.decode(): digest.decode()
                for model, digest in (await self._redis.hgetall(self._reading_tokenizers)).items()}

    async def set_reading_tokenizer(self, model: str, digest: str) -> None:
        """Say that every worker of `model` up now has the tokenizer `digest`."""
        await self._redis.hset(self._reading_tokenizers, model, digest)

    async def mark_adapter_records_elsewhere(self, ttl_s: float) -> None:
        """Say that a gateway keeps adapter records in a store other than this Redis, for `ttl_s`."""
        await self._redis.set(self._records_elsewhere, b"1", px=int(ttl_s * 1000))

    async def are_adapter_records_elsewhere(self) -> bool:
        """Whether a gateway said so within its `ttl_s`: then not every adapter has a record here."""
        return bool(await self._redis.exists(self._records_elsewhere))


def files_digest(files: Mapping[str, bytes]) -> str:
    """sha256 over the files in name order, each as name, NUL, size (8 bytes), contents."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + len(files[name]).to_bytes(8, "big") + files[name])
    return h.hexdigest()


class Periodic:
    """Awaits `work()` every `period_s` in a task of its own, from its creation until `stop`. A
    streak of failures (Redis down) is logged once as it starts and once as it ends; the next
    period tries again.

    NOTE: stopped by a flag, not by cancelling alone: on Python 3.11 a cancellation that lands
    while redis-py waits on its socket (asyncio.wait_for) can be lost, and a worker that had
    left the pool went on heartbeating its record back."""

    def __init__(self, work: Callable[[], Awaitable[None]], period_s: float, what: str):
        self._is_stopping = False
        self._task = asyncio.create_task(self._run(work, period_s, what))

    async def stop(self) -> None:
        """Stop, and wait until the work in progress, if any, has ended."""
        self._is_stopping = True
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self, work: Callable[[], Awaitable[None]], period_s: float, what: str) -> None:
        is_failing = False
        while not self._is_stopping:
            await asyncio.sleep(period_s)
            if self._is_stopping:
                return
            try:
                await work()
            except Exception as error:  # redis-py raises several types; all mean "try again"
                if not is_failing:
                    logger.warning("%s failed (%s); retrying every %.1f s", what, error, period_s)
                is_failing = True
                continue
            if is_failing:
                logger.info("%s works again", what)
            is_failing = False